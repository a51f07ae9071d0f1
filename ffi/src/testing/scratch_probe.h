// Counters of the test-only scratch probe custom call (CPU and CUDA handlers).
#pragma once

#include <atomic>
#include <cstdint>

namespace jax_vmm::scratch {

struct ProbeStats {
  std::atomic<int64_t> calls{0};             // kExecute invocations on the host
  std::atomic<int64_t> captured_calls{0};    // ... made while a CUDA graph was captured
  std::atomic<int64_t> initialize_calls{0};  // kInitialize invocations (CUDA)
};

ProbeStats& ProbeCounters();

}  // namespace jax_vmm::scratch
