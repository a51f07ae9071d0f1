// The CPU handler of the test-only jax_vmm_scratch_probe (see scratch_probe.h): copies x
// into a host workspace and back out into y.
#include <cstdint>
#include <cstring>
#include <string>

#include "jax_vmm/scratch.h"
#include "testing/scratch_probe.h"
#include "testing/testing_targets.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_vmm::testing {
namespace {

// Host workspaces are per thread: XLA:CPU may run custom calls on several threads.
void* ThreadStreamKey() {
  thread_local char key;
  return &key;
}

ffi::Error ProbeCpu(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                    ffi::Result<ffi::Buffer<ffi::S32>> addr, int64_t workspace_bytes,
                    bool /*reserve_at_initialize: CUDA only*/) {
  ProbeCounters().calls.fetch_add(1);
  if (ffi::Error e = CheckProbeArgs(x, *y, addr->element_count(), workspace_bytes); e.failure()) {
    return e;
  }
  const size_t bytes = x.size_bytes();
  void* ws = nullptr;
  std::string err = scratch::Get(scratch::kHostDevice, ThreadStreamKey(),
                                 static_cast<size_t>(workspace_bytes), &ws);
  if (!err.empty()) return ffi::Error::Internal(err);
  std::memcpy(ws, x.untyped_data(), bytes);
  std::memcpy(y->untyped_data(), ws, bytes);
  const uint64_t a = reinterpret_cast<uintptr_t>(ws);
  addr->typed_data()[0] = static_cast<int32_t>(a & 0xffffffffu);
  addr->typed_data()[1] = static_cast<int32_t>(a >> 32);
  return ffi::Error::Success();
}

}  // namespace

ProbeStats& ProbeCounters() {
  static ProbeStats stats;
  return stats;
}

}  // namespace jax_vmm::testing

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmScratchProbeCpu, jax_vmm::testing::ProbeCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // x
                                  .Ret<ffi::AnyBuffer>()         // y = x, through scratch
                                  .Ret<ffi::Buffer<ffi::S32>>()  // workspace address (lo, hi)
                                  .Attr<int64_t>("workspace_bytes")
                                  .Attr<bool>("reserve_at_initialize"));

void jax_vmm::testing::AddProbeCpuTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_scratch_probe", "cpu", JaxVmmScratchProbeCpu);
}
