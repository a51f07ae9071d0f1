// The test-only custom call jax_vmm_scratch_probe: y = x copied through a graph-safe
// scratch workspace of `workspace_bytes`, plus the workspace address (int32 lo, hi). It
// exercises the scratch API independently of any real consumer (decode attention).
// Handlers: scratch_probe_cpu.cc, scratch_probe_cuda.cu; counters below.
#pragma once

#include <atomic>
#include <cstdint>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_vmm::testing {

struct ProbeStats {
  std::atomic<int64_t> calls{0};             // kExecute invocations on the host
  std::atomic<int64_t> captured_calls{0};    // ... made while a CUDA graph was captured
  std::atomic<int64_t> initialize_calls{0};  // kInitialize invocations (CUDA)
};

ProbeStats& ProbeCounters();

// The operands of both handlers: y like x, a 2-element address, workspace >= x.
inline xla::ffi::Error CheckProbeArgs(const xla::ffi::AnyBuffer& x, const xla::ffi::AnyBuffer& y,
                                      size_t addr_elements, int64_t workspace_bytes) {
  if (workspace_bytes >= static_cast<int64_t>(x.size_bytes()) && y.size_bytes() == x.size_bytes() &&
      addr_elements == 2) {
    return xla::ffi::Error::Success();
  }
  return xla::ffi::Error::InvalidArgument(
      "jax_vmm_scratch_probe: workspace_bytes=" + std::to_string(workspace_bytes) +
      " must be >= the input's " + std::to_string(x.size_bytes()) +
      " bytes, y must match x and addr must have 2 int32 elements");
}

}  // namespace jax_vmm::testing
