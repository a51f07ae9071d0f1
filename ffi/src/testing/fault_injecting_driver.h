// Fault injection for tests: a Driver that wraps another one and fails its calls on
// request (the adaptor pattern of rmm's failure_callback_resource_adaptor), so production
// drivers carry no test hooks.
//
// Arms per operation: the nth (1-based) future call of an op fails with InjectedFault, or
// with OutOfMemory to test the MemoryError path. Ops: create (one allocation), map (one
// piece of a MapRun: when piece k of a run is the armed one, the pieces before it are
// really mapped and then unmapped again before the fault is thrown, as a real mid-run
// failure of the all-or-nothing MapRun would leave it), set_access, zero_fill, host_alloc,
// copy_to_host and copy_to_device (one region of a batch: the regions before it are
// really copied).
//
// Switches that remove one protection each, so tests can show their checks catch it:
//   BreakRelease   release and unmap do nothing: a rollback (or a release) keeps its
//                  memory.
//   SkipDeviceWaits  Synchronize does nothing and unmapping claims to need no device wait:
//                  commits never drain and releases unmap at once, under running kernels.
//   UnorderTableWrites  table changes land at once (CopyToMetadata), not in dispatch order:
//                  a step queued before a release reads the lowered table.
// And two that change timing, so the deferred paths run on the host driver too:
//   DeferReclaim   unmapping claims to need a device wait (the host then defers like CUDA).
//   HoldDevice     Synchronize blocks until the hold is lifted (a device that is still busy).
//
// Thread-safety: every method may be called from any thread (the arming state is atomic,
// the hold is a mutex + condition variable); the inner driver's own guarantees hold for the
// forwarded calls.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include "jax_vmm/arena.h"
#include "jax_vmm/driver.h"

namespace jax_vmm::testing {

// A driver call failed because a test armed it. -> jax_vmm.testing.InjectedFault
class InjectedFault : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class DriverOp : int {
  kCreate = 0,
  kMap,
  kSetAccess,
  kZeroFill,
  kHostAlloc,
  kCopyToHost,
  kCopyToDevice,
  kCount
};

// "create", "map", "set_access", "zero_fill", "host_alloc", "copy_to_host",
// "copy_to_device"; InvalidArgument for another name.
DriverOp ParseDriverOp(const std::string& name);
const char* DriverOpName(DriverOp op);

class FaultInjectingDriver final : public Driver {
 public:
  explicit FaultInjectingDriver(std::unique_ptr<Driver> inner) : inner_(std::move(inner)) {}

  // Fail the `nth` (1-based) call of `op` from now on; nth <= 0 disarms `op`.
  void Arm(DriverOp op, int64_t nth, bool as_out_of_memory);
  // Disarms every operation, repairs Release/Unmap, lifts every switch and the hold.
  void Disarm();
  void BreakRelease(bool broken) { release_broken_.store(broken); }
  void SkipDeviceWaits(bool skip) { skip_waits_.store(skip); }
  void DeferReclaim(bool defer) { defer_reclaim_.store(defer); }
  void UnorderTableWrites(bool unordered) { tables_unordered_.store(unordered); }
  void HoldDevice(bool hold);
  // Faults thrown so far; Synchronize calls so far (held or not).
  int64_t injected() const { return injected_.load(); }
  int64_t syncs() const { return syncs_.load(); }

  const char* kind() const override { return inner_->kind(); }
  int device_ordinal() const override { return inner_->device_ordinal(); }
  size_t granularity() const override { return inner_->granularity(); }
  size_t chunk_bytes() const override { return inner_->chunk_bytes(); }
  MemInfo mem_info() const override { return inner_->mem_info(); }
  bool FreshMemoryIsZero() const override { return inner_->FreshMemoryIsZero(); }
  bool UnmapNeedsQuiescence() const override;
  uintptr_t Reserve(size_t bytes) override { return inner_->Reserve(bytes); }
  bool CanDeferZeroReads() const override { return inner_->CanDeferZeroReads(); }
  uintptr_t ReserveDeferringZeros(size_t bytes) override {
    return inner_->ReserveDeferringZeros(bytes);
  }
  void EnableZeroReads(uintptr_t base) override { inner_->EnableZeroReads(base); }
  void Unreserve(uintptr_t va, size_t bytes) noexcept override { inner_->Unreserve(va, bytes); }

  void CheckRoomFor(size_t bytes) override { inner_->CheckRoomFor(bytes); }
  PhysicalHandle Create(size_t bytes) override;
  void Release(PhysicalHandle handle) noexcept override;
  void MapRun(uintptr_t va, const MapPiece* pieces, size_t count) override;
  void UnmapRun(uintptr_t va, const size_t* piece_bytes, size_t count) noexcept override;
  void SetAccess(uintptr_t va, size_t bytes) override;
  void ZeroFill(uintptr_t va, size_t bytes) override;

  void* AllocMetadata(size_t bytes) override { return inner_->AllocMetadata(bytes); }
  void FreeMetadata(void* ptr) noexcept override { inner_->FreeMetadata(ptr); }
  void CopyToMetadata(void* dst, const void* src, size_t bytes) override {
    inner_->CopyToMetadata(dst, src, bytes);
  }
  void CopyFromMetadata(void* dst, const void* src, size_t bytes) override {
    inner_->CopyFromMetadata(dst, src, bytes);
  }
  void WriteTable(void* dst, const void* src, size_t bytes) override {
    if (tables_unordered_.load()) {
      inner_->CopyToMetadata(dst, src, bytes);
    } else {
      inner_->WriteTable(dst, src, bytes);
    }
  }
  void Synchronize() override;

  void* AllocHost(size_t bytes) override;
  void FreeHost(void* ptr, size_t bytes) noexcept override { inner_->FreeHost(ptr, bytes); }
  void CopyToHost(const CopyRegion* regions, size_t count) override;
  void CopyToDevice(const CopyRegion* regions, size_t count) override;

 private:
  static constexpr int kOps = static_cast<int>(DriverOp::kCount);
  // Counts one call of `op`; true when it is the armed one (then counted as injected).
  bool Fires(DriverOp op);
  [[noreturn]] void Throw(DriverOp op, size_t bytes) const;
  void Check(DriverOp op, size_t bytes) {
    if (Fires(op)) Throw(op, bytes);
  }
  // Copies the regions before the armed one (really), then throws; or all of them.
  void CopyWithFaults(DriverOp op, const CopyRegion* regions, size_t count, bool to_host);

  std::unique_ptr<Driver> inner_;
  std::atomic<int64_t> countdown_[kOps] = {};
  std::atomic<bool> as_oom_[kOps] = {};
  std::atomic<int64_t> injected_{0};
  std::atomic<int64_t> syncs_{0};
  std::atomic<bool> release_broken_{false};
  std::atomic<bool> skip_waits_{false};
  std::atomic<bool> defer_reclaim_{false};
  std::atomic<bool> tables_unordered_{false};
  std::mutex hold_mu_;
  std::condition_variable hold_cv_;
  bool held_ = false;
};

// An arena whose driver (MakeDriver(kind, device, chunk_bytes)) is wrapped in a
// FaultInjectingDriver.
std::shared_ptr<Arena> CreateFaultInjectingArena(const std::string& kind, int device,
                                                 size_t reserve_bytes, size_t chunk_bytes,
                                                 const ArenaOptions& options);

// The fault-injecting driver of an arena made by CreateFaultInjectingArena; InvalidArgument
// for any other arena.
FaultInjectingDriver& FaultsOf(Arena& arena);

}  // namespace jax_vmm::testing
