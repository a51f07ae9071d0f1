// Counters of the test-only scratch probe custom call (CPU and CUDA handlers).
#pragma once

#include <atomic>
#include <cstdint>

#include "common/ffi_registry.h"

namespace jax_vmm::scratch {

struct ProbeStats {
  std::atomic<int64_t> calls{0};             // kExecute invocations on the host
  std::atomic<int64_t> captured_calls{0};    // ... made while a CUDA graph was captured
  std::atomic<int64_t> initialize_calls{0};  // kInitialize invocations (CUDA)
};

ProbeStats& ProbeCounters();

// jax_vmm_scratch_probe on "cpu" and (CUDA builds) "CUDA", with an initialize stage.
void AddProbeCpuTargets(FfiRegistry& registry);
#ifdef JAX_VMM_HAVE_CUDA_KERNELS
void AddProbeCudaTargets(FfiRegistry& registry);
#endif

}  // namespace jax_vmm::scratch
