// Fault injection for tests: a Driver that wraps another one and fails its calls on
// request (the adaptor pattern of rmm's failure_callback_resource_adaptor), so production
// drivers carry no test hooks.
//
// Arms per operation: the nth (1-based) future Create, Map or SetAccess call fails with
// InjectedFault, or with OutOfMemory to test the MemoryError path. MapRun counts each
// chunk as one Map call; when chunk k of a run is the armed one, the chunks before it are
// really mapped and then unmapped again before the fault is thrown, as a real mid-run
// failure of the all-or-nothing MapRun would leave it.
// BreakRelease(true) makes Release, Unmap and UnmapRun do nothing, so a rollback (or a
// decommit) keeps its chunks: tests use it to show that their checks see a leak.
//
// Thread-safety: every method may be called from any thread (the arming state is atomic);
// the inner driver's own guarantees hold for the forwarded calls.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
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

enum class DriverOp : int { kCreate = 0, kMap = 1, kSetAccess = 2, kCount = 3 };

// "create", "map" or "set_access"; InvalidArgument for another name.
DriverOp ParseDriverOp(const std::string& name);
const char* DriverOpName(DriverOp op);

class FaultInjectingDriver final : public Driver {
 public:
  explicit FaultInjectingDriver(std::unique_ptr<Driver> inner) : inner_(std::move(inner)) {}

  // Fail the `nth` (1-based) call of `op` from now on; nth <= 0 disarms `op`.
  void Arm(DriverOp op, int64_t nth, bool as_out_of_memory);
  // Disarms every operation and repairs Release/Unmap.
  void Disarm();
  void BreakRelease(bool broken) { release_broken_.store(broken); }
  // Faults thrown so far.
  int64_t injected() const { return injected_.load(); }

  const char* kind() const override { return inner_->kind(); }
  int device_ordinal() const override { return inner_->device_ordinal(); }
  size_t granularity() const override { return inner_->granularity(); }
  size_t chunk_bytes() const override { return inner_->chunk_bytes(); }
  MemInfo mem_info() const override { return inner_->mem_info(); }
  uintptr_t Reserve(size_t bytes) override { return inner_->Reserve(bytes); }
  void Unreserve(uintptr_t va, size_t bytes) noexcept override { inner_->Unreserve(va, bytes); }

  PhysicalHandle Create() override;
  void Release(PhysicalHandle handle) noexcept override;
  void Map(uintptr_t va, PhysicalHandle handle) override;
  void Unmap(uintptr_t va) noexcept override;
  void SetAccess(uintptr_t va, size_t bytes) override;
  void MapRun(uintptr_t va, const PhysicalHandle* handles, size_t count) override;
  void UnmapRun(uintptr_t va, size_t count) noexcept override;

  void* AllocMetadata(size_t bytes) override { return inner_->AllocMetadata(bytes); }
  void FreeMetadata(void* ptr) noexcept override { inner_->FreeMetadata(ptr); }
  void CopyToMetadata(void* dst, const void* src, size_t bytes) override {
    inner_->CopyToMetadata(dst, src, bytes);
  }
  void CopyFromMetadata(void* dst, const void* src, size_t bytes) override {
    inner_->CopyFromMetadata(dst, src, bytes);
  }
  void Synchronize() override { inner_->Synchronize(); }

 private:
  static constexpr int kOps = static_cast<int>(DriverOp::kCount);
  // Counts one call of `op`; true when it is the armed one (then counted as injected).
  bool Fires(DriverOp op);
  [[noreturn]] void Throw(DriverOp op, size_t bytes) const;
  void Check(DriverOp op, size_t bytes) {
    if (Fires(op)) Throw(op, bytes);
  }

  std::unique_ptr<Driver> inner_;
  std::atomic<int64_t> countdown_[kOps] = {};
  std::atomic<bool> as_oom_[kOps] = {};
  std::atomic<int64_t> injected_{0};
  std::atomic<bool> release_broken_{false};
};

// An arena whose driver (MakeDriver(kind, device, chunk_bytes)) is wrapped in a
// FaultInjectingDriver.
std::shared_ptr<Arena> CreateFaultInjectingArena(const std::string& kind, int device,
                                                 size_t reserve_bytes, size_t chunk_bytes);

// The fault-injecting driver of an arena made by CreateFaultInjectingArena; InvalidArgument
// for any other arena.
FaultInjectingDriver& FaultsOf(Arena& arena);

}  // namespace jax_vmm::testing
