// The CUDA targets of the "limits ignored" variants (testing_targets.h): the production
// KVCache-layer handlers (ops/kv_write/kv_write_cuda.h, ops/attention/attention_cache_cuda.h,
// ops/kv_cache/read_lengths.h) with the table of ensured tokens left out; their initialize stages are production's.
#include <cuda_runtime_api.h>

#include "ops/attention/attention_cache_cuda.h"
#include "ops/kv_cache/read_lengths.h"
#include "ops/kv_write/kv_write_cache.h"
#include "ops/kv_write/kv_write_cuda.h"
#include "ops/kv_write/kv_write_kernels.h"
#include "testing/testing_targets.h"

namespace jax_vmm::testing {
namespace {

cudaError_t LaunchIgnoringLimits(const kv::Params& p, cudaStream_t stream) {
  kv::Params q = p;
  for (kv::Side& s : q.side) s.limits = nullptr;
  return kv::LaunchKvWrite(q, stream);
}

}  // namespace
}  // namespace jax_vmm::testing

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxVmmTestingKvCacheWriteNoLimitsCuda,
    jax_vmm::kv::CudaCacheWriteImpl<jax_vmm::testing::LaunchIgnoringLimits>,
    jax_vmm::kv::BindCacheWrite(jax_vmm::kv::BindCudaContext()),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmTestingAttentionCacheNoLimitsCuda,
                              jax_vmm::attention::CacheExecuteImpl<false>,
                              jax_vmm::attention::BindCacheCuda(xla::ffi::Ffi::Bind()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmTestingStreamCacheNoLimitsCuda,
                              jax_vmm::attention::StreamCacheExecuteImpl<false>,
                              jax_vmm::attention::BindStreamCacheCuda(xla::ffi::Ffi::Bind()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmTestingKvCacheCopyTokensNoLimitsCuda,
                              jax_vmm::attention::CacheCopyExecuteImpl<false>,
                              jax_vmm::attention::BindCacheCopyCuda(xla::ffi::Ffi::Bind()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmTestingKvCacheReadLengthsNoLimitsCuda,
                              jax_vmm::kvcache::ReadLengthsCuda<false>,
                              jax_vmm::kvcache::BindReadLengths(xla::ffi::Ffi::Bind()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

void jax_vmm::testing::AddNoLimitsCacheCudaTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_testing_kv_cache_write_no_limits", "CUDA",
               JaxVmmTestingKvCacheWriteNoLimitsCuda);
  registry.Add("jax_vmm_testing_decode_attention_cache_no_limits", "CUDA",
               FfiRegistry::Stages{DecodeAttentionCacheCudaInitialize,
                                   JaxVmmTestingAttentionCacheNoLimitsCuda});
  registry.Add("jax_vmm_testing_decode_attention_v2_cache_no_limits", "CUDA",
               FfiRegistry::Stages{DecodeAttentionStreamCacheCudaInitialize,
                                   JaxVmmTestingStreamCacheNoLimitsCuda});
  registry.Add("jax_vmm_testing_kv_cache_copy_tokens_no_limits", "CUDA",
               JaxVmmTestingKvCacheCopyTokensNoLimitsCuda);
  registry.Add("jax_vmm_testing_kv_cache_read_lengths_no_limits", "CUDA",
               JaxVmmTestingKvCacheReadLengthsNoLimitsCuda);
}
