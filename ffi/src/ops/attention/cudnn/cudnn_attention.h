// The cuDNN attention backend's FFI targets and counters (built only with
// JAX_VMM_HAVE_CUDNN; see cudnn_sdpa.h for the semantics).
#pragma once

#include <cstdint>

#include "common/ffi_registry.h"

namespace jax_vmm::cudnn {

// jax_vmm_cudnn_attention and jax_vmm_cudnn_attention_into (the output aliased to a 6th
// operand) on "CUDA", each with an initialize stage that builds the graph and grows the
// graph-safe scratch.
void AddCudnnTargets(FfiRegistry& registry);

struct HandlerStats {
  int64_t initialize_calls = 0;
  int64_t execute_calls = 0;
  int64_t captured_calls = 0;  // execute calls on a capturing stream
};
HandlerStats GetHandlerStats();

}  // namespace jax_vmm::cudnn
