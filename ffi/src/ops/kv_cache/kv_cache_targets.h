// The FFI targets of the KV cache folder itself; called from python/module.cc at module
// initialisation. (kv_write and decode attention over a KVCache layer are registered by
// their own folders.)
#pragma once

#include <cstdint>

#include "common/ffi_registry.h"

namespace jax_vmm::kvcache {

// jax_vmm_kv_cache_check_views on "cpu" (ordered_views.cc).
void AddCpuTargets(FfiRegistry& registry);

#ifdef JAX_VMM_HAVE_CUDA_KERNELS
// jax_vmm_kv_cache_check_views on "CUDA" (ordered_views_cuda.cc) and
// jax_vmm_kv_cache_read_lengths (read_lengths_cuda.cc, through the next function).
void AddCudaTargets(FfiRegistry& registry);
void AddReadLengthsCudaTarget(FfiRegistry& registry);

// Record-stage runs of jax_vmm_kv_cache_check_views_recorded so far (tests: the check ran
// where XLA records, not only at execute).
int64_t CheckViewsRecordCalls();
#endif

}  // namespace jax_vmm::kvcache
