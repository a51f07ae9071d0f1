// Test-only custom call "jax_vmm_scratch_probe" (CPU): copies x into a graph-safe scratch
// workspace of `workspace_bytes` and back out into y, and reports the workspace address.
// It exercises the scratch API independently of any real consumer (decode attention).
#include <cstdint>
#include <cstring>
#include <string>

#include "jax_vmm/scratch.h"
#include "testing/scratch_probe.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_vmm::scratch {
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
  const size_t bytes = x.size_bytes();
  if (workspace_bytes < static_cast<int64_t>(bytes) || y->size_bytes() != bytes ||
      addr->element_count() != 2) {
    return ffi::Error::InvalidArgument(
        "jax_vmm_scratch_probe: workspace_bytes=" + std::to_string(workspace_bytes) +
        " must be >= the input's " + std::to_string(bytes) +
        " bytes, y must match x and addr must have 2 int32 elements");
  }
  void* ws = nullptr;
  std::string err = Get(kHostDevice, ThreadStreamKey(), static_cast<size_t>(workspace_bytes), &ws);
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

}  // namespace jax_vmm::scratch

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmScratchProbeCpu, jax_vmm::scratch::ProbeCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // x
                                  .Ret<ffi::AnyBuffer>()         // y = x, through scratch
                                  .Ret<ffi::Buffer<ffi::S32>>()  // workspace address (lo, hi)
                                  .Attr<int64_t>("workspace_bytes")
                                  .Attr<bool>("reserve_at_initialize"));

void jax_vmm::scratch::AddProbeCpuTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_scratch_probe", "cpu", JaxVmmScratchProbeCpu);
}
