// The FFI targets of decode attention; called from python/module.cc at module
// initialisation.
#pragma once

#include "common/ffi_registry.h"

namespace jax_vmm::attention {

// jax_vmm_decode_attention and jax_vmm_decode_attention_xla_workspace on "cpu".
void AddCpuTargets(FfiRegistry& registry);

#ifdef JAX_VMM_HAVE_CUDA_KERNELS
// The same targets on "CUDA": the scratch ones with an initialize stage.
void AddCudaTargets(FfiRegistry& registry);
#endif

}  // namespace jax_vmm::attention
