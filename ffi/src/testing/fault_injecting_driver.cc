#include "testing/fault_injecting_driver.h"

#include "jax_vmm/errors.h"

namespace jax_vmm::testing {

DriverOp ParseDriverOp(const std::string& name) {
  if (name == "create") return DriverOp::kCreate;
  if (name == "map") return DriverOp::kMap;
  if (name == "set_access") return DriverOp::kSetAccess;
  throw InvalidArgument("fault injection: unknown driver op '" + name +
                        "'; expected 'create', 'map' or 'set_access'");
}

const char* DriverOpName(DriverOp op) {
  switch (op) {
    case DriverOp::kCreate:
      return "create";
    case DriverOp::kMap:
      return "map";
    case DriverOp::kSetAccess:
      return "set_access";
    default:
      return "unknown";
  }
}

void FaultInjectingDriver::Arm(DriverOp op, int64_t nth, bool as_out_of_memory) {
  const int i = static_cast<int>(op);
  as_oom_[i].store(as_out_of_memory);
  countdown_[i].store(nth > 0 ? nth : 0);
}

void FaultInjectingDriver::Disarm() {
  for (auto& countdown : countdown_) countdown.store(0);
  release_broken_.store(false);
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

PhysicalHandle FaultInjectingDriver::Create() {
  Check(DriverOp::kCreate, chunk_bytes());
  return inner_->Create();
}

void FaultInjectingDriver::Release(PhysicalHandle handle) noexcept {
  if (!release_broken_.load()) inner_->Release(handle);
}

void FaultInjectingDriver::Map(uintptr_t va, PhysicalHandle handle) {
  Check(DriverOp::kMap, chunk_bytes());
  inner_->Map(va, handle);
}

void FaultInjectingDriver::Unmap(uintptr_t va) noexcept {
  if (!release_broken_.load()) inner_->Unmap(va);
}

void FaultInjectingDriver::SetAccess(uintptr_t va, size_t bytes) {
  Check(DriverOp::kSetAccess, bytes);
  inner_->SetAccess(va, bytes);
}

void FaultInjectingDriver::MapRun(uintptr_t va, const PhysicalHandle* handles, size_t count) {
  size_t before = 0;  // chunks of the run that map before the armed one
  while (before < count && !Fires(DriverOp::kMap)) ++before;
  if (before == count) return inner_->MapRun(va, handles, count);
  inner_->MapRun(va, handles, before);
  inner_->UnmapRun(va, before);
  Throw(DriverOp::kMap, chunk_bytes());
}

void FaultInjectingDriver::UnmapRun(uintptr_t va, size_t count) noexcept {
  if (!release_broken_.load()) inner_->UnmapRun(va, count);
}

std::shared_ptr<Arena> CreateFaultInjectingArena(const std::string& kind, int device,
                                                 size_t reserve_bytes, size_t chunk_bytes) {
  return Arena::Create(
      std::make_unique<FaultInjectingDriver>(MakeDriver(kind, device, chunk_bytes)), reserve_bytes);
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
