// The FFI targets of kv_write and what the module must install for them; called from
// python/module.cc at module initialisation.
#pragma once

#include "common/ffi_registry.h"

namespace jax_vmm::kv {

// jax_vmm_kv_write and jax_vmm_kv_write_through on "cpu" (kv_write_cpu.cc).
void AddCpuTargets(FfiRegistry& registry);

// jax_vmm_kv_write_fp8 on "cpu" (kv_write_fp8_cpu.cc).
void AddFp8CpuTargets(FfiRegistry& registry);

#ifdef JAX_VMM_HAVE_CUDA_KERNELS
// The same two targets on "CUDA" (kv_write_cuda.cc).
void AddCudaTargets(FfiRegistry& registry);
// jax_vmm_kv_write_fp8 on "CUDA" (kv_write_fp8_cuda.cc).
void AddFp8CudaTargets(FfiRegistry& registry);
// Makes kv_write_stats() count the dropped writes the CUDA kernels counted on devices.
void InstallCudaDropHooks();
#endif

}  // namespace jax_vmm::kv
