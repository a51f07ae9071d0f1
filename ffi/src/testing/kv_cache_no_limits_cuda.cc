// The CUDA targets of the "limits ignored" variants (testing_targets.h): the production
// KVCache-layer handlers (ops/kv_write/kv_write_cuda.h, ops/attention/attention_cache_cuda.h)
// with the table of ensured tokens left out.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <utility>

#include "ops/attention/attention_cache.h"
#include "ops/attention/attention_cache_cuda.h"
#include "ops/attention/attention_cuda.h"
#include "ops/attention/attention_ffi.h"
#include "ops/attention/stream_ffi.h"
#include "ops/kv_write/kv_write_cache.h"
#include "ops/kv_write/kv_write_cuda.h"
#include "ops/kv_write/kv_write_kernels.h"
#include "testing/testing_targets.h"

namespace jax_vmm::testing {
namespace {

namespace ffi = xla::ffi;

cudaError_t LaunchIgnoringLimits(const kv::Params& p, cudaStream_t stream) {
  kv::Params q = p;
  for (kv::Side& s : q.side) s.limits = nullptr;
  return kv::LaunchKvWrite(q, stream);
}

ffi::Error Write(cudaStream_t stream, int32_t device, ffi::AnyBuffer new_k, ffi::AnyBuffer new_v,
                 ffi::Buffer<ffi::S32> slots, ffi::AnyBuffer token,
                 ffi::Result<ffi::AnyBuffer> token_out, uint64_t cache_uid, int64_t layer) {
  return kv::CudaCacheWrite(LaunchIgnoringLimits, stream, device, new_k, new_v, slots, token,
                            token_out, cache_uid, layer);
}

ffi::Error Initialize(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                      ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer token,
                      ffi::Result<ffi::AnyBuffer> out,
                      ffi::Result<ffi::Buffer<ffi::S32>> read_lengths, uint64_t cache_uid,
                      int64_t layer, float scale, int64_t chunk, int64_t splits, int64_t impl) {
  (void)token;
  (void)scale;
  return attention::CacheCudaInitialize(stream, device, q, lengths, *out, *read_lengths,
                                        cache_uid, layer, chunk, splits, impl);
}

ffi::Error Execute(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                   ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer token,
                   ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::S32>> read_lengths,
                   uint64_t cache_uid, int64_t layer, float scale, int64_t chunk, int64_t splits,
                   int64_t impl) {
  (void)token;
  return attention::CacheCudaExecute(false, stream, device, q, lengths, *out, *read_lengths,
                                     cache_uid, layer, scale, chunk, splits, impl);
}

ffi::Error StreamInitialize(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                            ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer token,
                            ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                            ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::Buffer<ffi::S32>> read_lengths, uint64_t cache_uid,
                            int64_t layer, float scale, int64_t ctas, int64_t stages,
                            int64_t min_tiles, int64_t combine, int64_t bulk) {
  (void)token;
  return attention::StreamCacheCudaInitialize(
      stream, device, q, lengths, k_scale, v_scale, *out, *read_lengths, cache_uid, layer,
      attention::stream::StreamAttrs{scale, ctas, stages, min_tiles, combine, bulk});
}

ffi::Error StreamExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                         ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer token,
                         ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                         ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::Buffer<ffi::S32>> read_lengths, uint64_t cache_uid,
                         int64_t layer, float scale, int64_t ctas, int64_t stages,
                         int64_t min_tiles, int64_t combine, int64_t bulk) {
  (void)token;
  return attention::StreamCacheCudaExecute(
      false, stream, device, q, lengths, k_scale, v_scale, *out, *read_lengths, cache_uid, layer,
      attention::stream::StreamAttrs{scale, ctas, stages, min_tiles, combine, bulk});
}

template <typename B>
auto CacheCudaInputs(B&& b) {
  return attention::BindCacheInputs(attention::BindCudaContext(std::forward<B>(b)));
}

}  // namespace
}  // namespace jax_vmm::testing

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmTestingKvCacheWriteNoLimitsCuda, jax_vmm::testing::Write,
                              jax_vmm::kv::BindCacheWrite(jax_vmm::kv::BindCudaContext()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmTestingAttentionCacheNoLimitsCudaInit,
                              jax_vmm::testing::Initialize,
                              jax_vmm::attention::BindAttrs(jax_vmm::attention::BindCacheResults(
                                  jax_vmm::testing::CacheCudaInputs(
                                      xla::ffi::Ffi::BindInitialize()))));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmTestingAttentionCacheNoLimitsCuda, jax_vmm::testing::Execute,
                              jax_vmm::attention::BindAttrs(jax_vmm::attention::BindCacheResults(
                                  jax_vmm::testing::CacheCudaInputs(xla::ffi::Ffi::Bind()))),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxVmmTestingStreamCacheNoLimitsCudaInit, jax_vmm::testing::StreamInitialize,
    jax_vmm::attention::stream::BindStreamAttrs(jax_vmm::attention::BindCacheResults(
        jax_vmm::testing::CacheCudaInputs(xla::ffi::Ffi::BindInitialize())
            .Arg<xla::ffi::AnyBuffer>()     // k_scale
            .Arg<xla::ffi::AnyBuffer>())));  // v_scale

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxVmmTestingStreamCacheNoLimitsCuda, jax_vmm::testing::StreamExecute,
    jax_vmm::attention::stream::BindStreamAttrs(jax_vmm::attention::BindCacheResults(
        jax_vmm::testing::CacheCudaInputs(xla::ffi::Ffi::Bind())
            .Arg<xla::ffi::AnyBuffer>()    // k_scale
            .Arg<xla::ffi::AnyBuffer>())),  // v_scale
    {xla::ffi::Traits::kCmdBufferCompatible});

void jax_vmm::testing::AddNoLimitsCacheCudaTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_testing_kv_cache_write_no_limits", "CUDA",
               JaxVmmTestingKvCacheWriteNoLimitsCuda);
  registry.Add("jax_vmm_testing_decode_attention_cache_no_limits", "CUDA",
               FfiRegistry::Stages{JaxVmmTestingAttentionCacheNoLimitsCudaInit,
                                   JaxVmmTestingAttentionCacheNoLimitsCuda});
  registry.Add("jax_vmm_testing_decode_attention_v2_cache_no_limits", "CUDA",
               FfiRegistry::Stages{JaxVmmTestingStreamCacheNoLimitsCudaInit,
                                   JaxVmmTestingStreamCacheNoLimitsCuda});
}
