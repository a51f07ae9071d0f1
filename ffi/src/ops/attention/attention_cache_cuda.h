// The CUDA handlers' bodies of decode attention over a KVCache layer (attention_cache.h,
// attention_cache_cuda.cc), shared with the testing layer's variants. Each stage resolves
// the layer and runs the kernel's own stage (attention_cuda.h, stream_cuda.h) on the
// layer's buffers; execute first launches the clamp of the lengths (use_limits: false
// only in the testing layer).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <utility>

#include "ops/attention/attention_cache.h"
#include "ops/attention/attention_cuda.h"
#include "ops/attention/stream_ffi.h"
#include "xla/ffi/api/api.h"
#include "xla/ffi/api/ffi.h"

namespace jax_vmm::attention {

ffi::Error CacheCudaInitialize(cudaStream_t stream, int32_t device, const ffi::AnyBuffer& q,
                               const ffi::Buffer<ffi::S32>& lengths, const ffi::AnyBuffer& out,
                               const ffi::Buffer<ffi::S32>& read_lengths, uint64_t cache_uid,
                               int64_t layer, int64_t chunk, int64_t splits, int64_t impl);

ffi::Error CacheCudaExecute(bool use_limits, cudaStream_t stream, int32_t device,
                            const ffi::AnyBuffer& q, const ffi::Buffer<ffi::S32>& lengths,
                            ffi::AnyBuffer out, ffi::Buffer<ffi::S32> read_lengths,
                            uint64_t cache_uid, int64_t layer, float scale, int64_t chunk,
                            int64_t splits, int64_t impl, const Semantics& sem);

ffi::Error StreamCacheCudaInitialize(cudaStream_t stream, int32_t device, const ffi::AnyBuffer& q,
                                     const ffi::Buffer<ffi::S32>& lengths,
                                     const ffi::AnyBuffer& k_scale, const ffi::AnyBuffer& v_scale,
                                     const ffi::AnyBuffer& out,
                                     const ffi::Buffer<ffi::S32>& read_lengths, uint64_t cache_uid,
                                     int64_t layer, const stream::StreamAttrs& attrs);

ffi::Error StreamCacheCudaExecute(bool use_limits, cudaStream_t stream, int32_t device,
                                  const ffi::AnyBuffer& q, const ffi::Buffer<ffi::S32>& lengths,
                                  const ffi::AnyBuffer& k_scale, const ffi::AnyBuffer& v_scale,
                                  ffi::AnyBuffer out, ffi::Buffer<ffi::S32> read_lengths,
                                  uint64_t cache_uid, int64_t layer,
                                  const stream::StreamAttrs& attrs);

// The execute-stage handler functions (production: kUseLimits true; the testing layer
// instantiates false) and the targets' bindings after `b` (Ffi::Bind() or
// Ffi::BindInitialize()).
template <bool kUseLimits>
ffi::Error CacheExecuteImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                            ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer token,
                            ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::Buffer<ffi::S32>> read_lengths, uint64_t cache_uid,
                            int64_t layer, float scale, int64_t chunk, int64_t splits, int64_t impl,
                            OptionalLengths q_lengths, int64_t window, float softcap) {
  (void)token;  // orders the call after the layer's writes; not read
  Semantics sem;
  if (ffi::Error e = MakeSemantics("jax_vmm.attention (KVCache layer, CUDA)", q.dimensions()[0],
                                   q_lengths, window, softcap, &sem);
      e.failure()) {
    return e;
  }
  return CacheCudaExecute(kUseLimits, stream, device, q, lengths, *out, *read_lengths, cache_uid,
                          layer, scale, chunk, splits, impl, sem);
}

template <bool kUseLimits>
ffi::Error StreamCacheExecuteImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                                  ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer token,
                                  ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                                  ffi::Result<ffi::AnyBuffer> out,
                                  ffi::Result<ffi::Buffer<ffi::S32>> read_lengths,
                                  uint64_t cache_uid, int64_t layer, float scale, int64_t ctas,
                                  int64_t stages, int64_t min_tiles, int64_t combine,
                                  int64_t bulk) {
  (void)token;
  return StreamCacheCudaExecute(kUseLimits, stream, device, q, lengths, k_scale, v_scale, *out,
                                *read_lengths, cache_uid, layer,
                                stream::StreamAttrs{scale, ctas, stages, min_tiles, combine, bulk});
}

// jax_vmm_kv_cache_copy_tokens (attention_cache.h): the clamp kernel, then one copy kernel
// per side. No initialize stage: nothing to reserve.
ffi::Error CacheCopyCudaExecute(bool use_limits, cudaStream_t stream, int32_t device,
                                ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer k_out,
                                ffi::AnyBuffer v_out, ffi::Buffer<ffi::S32> read_lengths,
                                uint64_t cache_uid, int64_t layer);

template <bool kUseLimits>
ffi::Error CacheCopyExecuteImpl(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::S32> lengths,
                                ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> k_out,
                                ffi::Result<ffi::AnyBuffer> v_out,
                                ffi::Result<ffi::Buffer<ffi::S32>> read_lengths,
                                uint64_t cache_uid, int64_t layer) {
  (void)token;  // orders the call after the layer's writes; not read
  return CacheCopyCudaExecute(kUseLimits, stream, device, lengths, *k_out, *v_out, *read_lengths,
                              cache_uid, layer);
}

template <typename B>
auto BindCacheCopyCuda(B&& b) {
  return BindCacheCopy(BindCudaContext(std::forward<B>(b)));
}

template <typename B>
auto BindCacheCuda(B&& b) {
  return BindCacheTarget(BindCudaContext(std::forward<B>(b)));
}

template <typename B>
auto BindStreamCacheCuda(B&& b) {
  return BindStreamCacheTarget(BindCudaContext(std::forward<B>(b)));
}

}  // namespace jax_vmm::attention

// The initialize stages (no table involved), shared with the testing layer's targets.
XLA_FFI_DECLARE_HANDLER_SYMBOL(DecodeAttentionCacheCudaInitialize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DecodeAttentionStreamCacheCudaInitialize);
