// Process-wide counters of the decode-attention handlers, read by
// jax_vmm._core.attention_stats(). Relaxed atomics: statistics only. Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>

namespace jax_vmm::attention {

struct Counters {
  std::atomic<int64_t> cpu_calls{0};
  std::atomic<int64_t> cuda_initialize_calls{0};
  std::atomic<int64_t> cuda_execute_calls{0};
  std::atomic<int64_t> cuda_captured_calls{0};  // execute calls made under stream capture
  std::atomic<int64_t> cuda_tensor_core_launches{0};
  std::atomic<int64_t> cuda_simple_launches{0};
};

Counters& GetCounters();

}  // namespace jax_vmm::attention
