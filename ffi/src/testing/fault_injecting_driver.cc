#include "testing/fault_injecting_driver.h"

#include <vector>

#include "jax_vmm/errors.h"

namespace jax_vmm::testing {
namespace {

constexpr const char* kOpNames[] = {"create",     "map",          "set_access",    "zero_fill",
                                    "host_alloc", "copy_to_host", "copy_to_device"};
static_assert(sizeof(kOpNames) / sizeof(kOpNames[0]) == static_cast<size_t>(DriverOp::kCount));

}  // namespace

DriverOp ParseDriverOp(const std::string& name) {
  for (int i = 0; i < static_cast<int>(DriverOp::kCount); ++i) {
    if (name == kOpNames[i]) return static_cast<DriverOp>(i);
  }
  throw InvalidArgument("fault injection: unknown driver op '" + name +
                        "'; expected one of create, map, set_access, zero_fill, host_alloc, "
                        "copy_to_host, copy_to_device");
}

const char* DriverOpName(DriverOp op) {
  const int i = static_cast<int>(op);
  return i >= 0 && i < static_cast<int>(DriverOp::kCount) ? kOpNames[i] : "unknown";
}

void FaultInjectingDriver::Arm(DriverOp op, int64_t nth, bool as_out_of_memory) {
  const int i = static_cast<int>(op);
  as_oom_[i].store(as_out_of_memory);
  countdown_[i].store(nth > 0 ? nth : 0);
}

void FaultInjectingDriver::Disarm() {
  for (auto& countdown : countdown_) countdown.store(0);
  release_broken_.store(false);
  skip_waits_.store(false);
  defer_reclaim_.store(false);
  tables_unordered_.store(false);
  HoldDevice(false);
}

void FaultInjectingDriver::HoldDevice(bool hold) {
  {
    std::lock_guard<std::mutex> lock(hold_mu_);
    held_ = hold;
  }
  hold_cv_.notify_all();
}

bool FaultInjectingDriver::Fires(DriverOp op) {
  std::atomic<int64_t>& countdown = countdown_[static_cast<int>(op)];
  int64_t left = countdown.load();
  // Decrement only while armed; the call that brings it from 1 to 0 fails.
  while (left > 0 && !countdown.compare_exchange_weak(left, left - 1)) {
  }
  if (left != 1) return false;
  injected_.fetch_add(1);
  return true;
}

void FaultInjectingDriver::Throw(DriverOp op, size_t bytes) const {
  if (as_oom_[static_cast<int>(op)].load()) {
    throw OutOfMemory("injected out-of-memory in driver " + std::string(DriverOpName(op)) + " of " +
                          std::to_string(bytes) + " bytes",
                      bytes, 0);
  }
  throw InjectedFault(std::string("injected fault in driver ") + DriverOpName(op) + " of " +
                      std::to_string(bytes) + " bytes (fault-injection hook)");
}

bool FaultInjectingDriver::UnmapNeedsQuiescence() const {
  if (skip_waits_.load()) return false;
  return defer_reclaim_.load() || inner_->UnmapNeedsQuiescence();
}

PhysicalHandle FaultInjectingDriver::Create(size_t bytes) {
  Check(DriverOp::kCreate, bytes);
  return inner_->Create(bytes);
}

void FaultInjectingDriver::Release(PhysicalHandle handle) noexcept {
  if (!release_broken_.load()) inner_->Release(handle);
}

void FaultInjectingDriver::MapRun(uintptr_t va, const MapPiece* pieces, size_t count) {
  size_t before = 0;  // pieces of the run that map before the armed one
  while (before < count && !Fires(DriverOp::kMap)) ++before;
  if (before == count) return inner_->MapRun(va, pieces, count);
  inner_->MapRun(va, pieces, before);
  std::vector<size_t> sizes;
  for (size_t i = 0; i < before; ++i) sizes.push_back(pieces[i].bytes);
  inner_->UnmapRun(va, sizes.data(), sizes.size());
  Throw(DriverOp::kMap, pieces[before].bytes);
}

void FaultInjectingDriver::UnmapRun(uintptr_t va, const size_t* piece_bytes,
                                    size_t count) noexcept {
  if (!release_broken_.load()) inner_->UnmapRun(va, piece_bytes, count);
}

void FaultInjectingDriver::SetAccess(uintptr_t va, size_t bytes) {
  Check(DriverOp::kSetAccess, bytes);
  inner_->SetAccess(va, bytes);
}

void FaultInjectingDriver::ZeroFill(uintptr_t va, size_t bytes) {
  Check(DriverOp::kZeroFill, bytes);
  inner_->ZeroFill(va, bytes);
}

void FaultInjectingDriver::Synchronize() {
  syncs_.fetch_add(1);
  if (skip_waits_.load()) return;
  {
    std::unique_lock<std::mutex> lock(hold_mu_);
    hold_cv_.wait(lock, [&] { return !held_; });
  }
  inner_->Synchronize();
}

void* FaultInjectingDriver::AllocHost(size_t bytes) {
  Check(DriverOp::kHostAlloc, bytes);
  return inner_->AllocHost(bytes);
}

void FaultInjectingDriver::CopyWithFaults(DriverOp op, const CopyRegion* regions, size_t count,
                                          bool to_host) {
  size_t before = 0;
  while (before < count && !Fires(op)) ++before;
  if (before > 0) {
    if (to_host) {
      inner_->CopyToHost(regions, before);
    } else {
      inner_->CopyToDevice(regions, before);
    }
  }
  if (before < count) Throw(op, regions[before].bytes);
}

void FaultInjectingDriver::CopyToHost(const CopyRegion* regions, size_t count) {
  CopyWithFaults(DriverOp::kCopyToHost, regions, count, true);
}

void FaultInjectingDriver::CopyToDevice(const CopyRegion* regions, size_t count) {
  CopyWithFaults(DriverOp::kCopyToDevice, regions, count, false);
}

std::shared_ptr<Arena> CreateFaultInjectingArena(const std::string& kind, int device,
                                                 size_t reserve_bytes, size_t chunk_bytes,
                                                 const ArenaOptions& options) {
  return Arena::Create(
      std::make_unique<FaultInjectingDriver>(MakeDriver(kind, device, chunk_bytes)), reserve_bytes,
      options);
}

FaultInjectingDriver& FaultsOf(Arena& arena) {
  auto* driver = dynamic_cast<FaultInjectingDriver*>(&arena.driver());
  if (driver == nullptr) {
    throw InvalidArgument(
        "fault injection: this arena was not created inside jax_vmm.testing.fault_injection(); "
        "create it (jax_vmm.Arena, jax_vmm.kv_arena) inside the with-block");
  }
  return *driver;
}

}  // namespace jax_vmm::testing
