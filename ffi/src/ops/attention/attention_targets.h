// The FFI targets of decode attention; called from python/module.cc at module
// initialisation.
#pragma once

#include "common/ffi_registry.h"

namespace jax_vmm::attention {

// jax_vmm_decode_attention and jax_vmm_decode_attention_xla_workspace on "cpu"
// (attention_cpu.cc).
void AddCpuTargets(FfiRegistry& registry);

// jax_vmm_decode_attention_v2, the streaming kernel's CPU model, on "cpu" (stream_cpu.cc).
void AddStreamCpuTargets(FfiRegistry& registry);

#ifdef JAX_VMM_HAVE_CUDA_KERNELS
// The split-K targets on "CUDA": the scratch ones with an initialize stage
// (attention_cuda.cc).
void AddCudaTargets(FfiRegistry& registry);

// jax_vmm_decode_attention_v2 on "CUDA", with an initialize stage (stream_cuda.cc).
void AddStreamCudaTargets(FfiRegistry& registry);
#endif

}  // namespace jax_vmm::attention
