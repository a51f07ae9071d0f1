// CUDA handlers of decode attention over a KVCache layer (attention_cache.h): the
// split-K and streaming CUDA stages (attention_cuda.h, stream_cuda.h) on the layer's
// buffers, after a clamp kernel that computes read_lengths from the device-visible table
// of ensured tokens. Both targets are command-buffer compatible like the kernels' own:
// host code resolves pointers and launches; what changes between steps (lengths, the
// table) is read by the kernels from device memory.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <utility>

#include "common/cuda_error.h"
#include "ops/attention/attention_cache.h"
#include "ops/attention/attention_cache_cuda.h"
#include "ops/attention/attention_cuda.h"
#include "ops/attention/attention_ffi.h"
#include "ops/attention/attention_targets.h"
#include "ops/attention/stream_cuda.h"
#include "ops/attention/stream_ffi.h"
#include "ops/kv_cache/kv_cache_kernels.h"

namespace jax_vmm::attention {
namespace {

constexpr const char* kCacheName = "jax_vmm attention (decode_attention or attention over a KVCache layer, CUDA)";

ffi::Error Prepare(int32_t device, uint64_t cache_uid, int64_t layer, const ffi::AnyBuffer& q,
                   const ffi::Buffer<ffi::S32>& lengths, const ffi::Buffer<ffi::S32>& read_lengths,
                   CacheAttention* call) {
  if (std::string err = PrepareCacheAttention(kCacheName, "cuda", device, cache_uid, layer, q,
                                              lengths, read_lengths, call);
      !err.empty()) {
    return ffi::Error::InvalidArgument(err);
  }
  return ffi::Error::Success();
}

ffi::Error Clamp(bool use_limits, const CacheAttention& call, const ffi::Buffer<ffi::S32>& lengths,
                 ffi::Buffer<ffi::S32>& read_lengths, cudaStream_t stream) {
  const kvcache::KvCache& cache = *call.layer.cache;
  if (cudaError_t e = kvcache::LaunchClampLengths(
          lengths.typed_data(), use_limits ? cache.device_read_limits() : nullptr,
          read_lengths.typed_data(), static_cast<int>(call.batch()),
          static_cast<int>(call.max_tokens()), cache.device_read_clamps(), stream);
      e != cudaSuccess) {
    return CudaFfiError(kCacheName, "clamp kernel launch", e);
  }
  return ffi::Error::Success();
}

ffi::Error InitializeImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                          ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer token,
                          ffi::Result<ffi::AnyBuffer> out,
                          ffi::Result<ffi::Buffer<ffi::S32>> read_lengths, uint64_t cache_uid,
                          int64_t layer, float scale, int64_t chunk, int64_t splits, int64_t impl,
                          OptionalLengths q_lengths, int64_t window, float softcap) {
  (void)token;
  (void)scale;
  (void)q_lengths;  // the plan depends on shapes only
  (void)window;
  (void)softcap;
  return CacheCudaInitialize(stream, device, q, lengths, *out, *read_lengths, cache_uid, layer,
                             chunk, splits, impl);
}

ffi::Error StreamInitializeImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                                ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer token,
                                ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                                ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::Buffer<ffi::S32>> read_lengths, uint64_t cache_uid,
                                int64_t layer, float scale, int64_t ctas, int64_t stages,
                                int64_t min_tiles, int64_t combine, int64_t bulk) {
  (void)token;
  return StreamCacheCudaInitialize(
      stream, device, q, lengths, k_scale, v_scale, *out, *read_lengths, cache_uid, layer,
      stream::StreamAttrs{scale, ctas, stages, min_tiles, combine, bulk});
}

}  // namespace

ffi::Error CacheCudaInitialize(cudaStream_t stream, int32_t device, const ffi::AnyBuffer& q,
                               const ffi::Buffer<ffi::S32>& lengths, const ffi::AnyBuffer& out,
                               const ffi::Buffer<ffi::S32>& read_lengths, uint64_t cache_uid,
                               int64_t layer, int64_t chunk, int64_t splits, int64_t impl) {
  CacheAttention call;
  if (ffi::Error e = Prepare(device, cache_uid, layer, q, lengths, read_lengths, &call);
      e.failure()) {
    return e;
  }
  return CudaInitialize(stream, device, q, call.K(), call.V(), lengths, out, chunk, splits, impl);
}

ffi::Error CacheCudaExecute(bool use_limits, cudaStream_t stream, int32_t device,
                            const ffi::AnyBuffer& q, const ffi::Buffer<ffi::S32>& lengths,
                            ffi::AnyBuffer out, ffi::Buffer<ffi::S32> read_lengths,
                            uint64_t cache_uid, int64_t layer, float scale, int64_t chunk,
                            int64_t splits, int64_t impl, const Semantics& sem) {
  CacheAttention call;
  if (ffi::Error e = Prepare(device, cache_uid, layer, q, lengths, read_lengths, &call);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = Clamp(use_limits, call, lengths, read_lengths, stream); e.failure()) return e;
  return CudaExecute(stream, device, q, call.K(), call.V(), read_lengths, out, nullptr, scale,
                     chunk, splits, impl, sem, call.token_heads());
}

ffi::Error StreamCacheCudaInitialize(cudaStream_t stream, int32_t device, const ffi::AnyBuffer& q,
                                     const ffi::Buffer<ffi::S32>& lengths,
                                     const ffi::AnyBuffer& k_scale, const ffi::AnyBuffer& v_scale,
                                     const ffi::AnyBuffer& out,
                                     const ffi::Buffer<ffi::S32>& read_lengths, uint64_t cache_uid,
                                     int64_t layer, const stream::StreamAttrs& attrs) {
  CacheAttention call;
  if (ffi::Error e = Prepare(device, cache_uid, layer, q, lengths, read_lengths, &call);
      e.failure()) {
    return e;
  }
  return stream::CudaInitialize(stream, device, q, call.K(), call.V(), lengths, k_scale, v_scale,
                                out, call.Strided(attrs));
}

ffi::Error StreamCacheCudaExecute(bool use_limits, cudaStream_t stream, int32_t device,
                                  const ffi::AnyBuffer& q, const ffi::Buffer<ffi::S32>& lengths,
                                  const ffi::AnyBuffer& k_scale, const ffi::AnyBuffer& v_scale,
                                  ffi::AnyBuffer out, ffi::Buffer<ffi::S32> read_lengths,
                                  uint64_t cache_uid, int64_t layer,
                                  const stream::StreamAttrs& attrs) {
  CacheAttention call;
  if (ffi::Error e = Prepare(device, cache_uid, layer, q, lengths, read_lengths, &call);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = Clamp(use_limits, call, lengths, read_lengths, stream); e.failure()) return e;
  return stream::CudaExecute(stream, device, q, call.K(), call.V(), read_lengths, k_scale, v_scale,
                             out, call.Strided(attrs));
}

ffi::Error CacheCopyCudaExecute(bool use_limits, cudaStream_t stream, int32_t device,
                                ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer k_out,
                                ffi::AnyBuffer v_out, ffi::Buffer<ffi::S32> read_lengths,
                                uint64_t cache_uid, int64_t layer) {
  constexpr const char* kCopyName = "jax_vmm.attention (copy of an fp8 KVCache layer, CUDA)";
  CacheAttention call;
  if (std::string err = PrepareCacheCopy(kCopyName, "cuda", device, cache_uid, layer, lengths,
                                         k_out, v_out, read_lengths, &call);
      !err.empty()) {
    return ffi::Error::InvalidArgument(err);
  }
  if (ffi::Error e = Clamp(use_limits, call, lengths, read_lengths, stream); e.failure()) return e;
  const kvcache::Geometry& g = call.layer.cache->geometry();
  const auto token_bytes = static_cast<int64_t>(g.token_bytes());
  const auto row_bytes = static_cast<int64_t>(g.row_bytes());
  for (auto [src, dst] : {std::pair{call.k.data, k_out.untyped_data()},
                          std::pair{call.v.data, v_out.untyped_data()}}) {
    if (cudaError_t e =
            kvcache::LaunchCopyLiveTokens(src, dst, read_lengths.typed_data(), call.batch(),
                                          call.max_tokens(), token_bytes, row_bytes, stream);
        e != cudaSuccess) {
      return CudaFfiError(kCopyName, "copy kernel launch", e);
    }
  }
  return ffi::Error::Success();
}

}  // namespace jax_vmm::attention

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvCacheCopyTokensCuda, jax_vmm::attention::CacheCopyExecuteImpl<true>,
                              jax_vmm::attention::BindCacheCopyCuda(xla::ffi::Ffi::Bind()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionCacheCudaInitialize,
                              jax_vmm::attention::InitializeImpl,
                              jax_vmm::attention::BindCacheCuda(xla::ffi::Ffi::BindInitialize()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionCacheCudaExecute,
                              jax_vmm::attention::CacheExecuteImpl<true>,
                              jax_vmm::attention::BindCacheCuda(xla::ffi::Ffi::Bind()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    DecodeAttentionStreamCacheCudaInitialize, jax_vmm::attention::StreamInitializeImpl,
    jax_vmm::attention::BindStreamCacheCuda(xla::ffi::Ffi::BindInitialize()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionStreamCacheCudaExecute,
                              jax_vmm::attention::StreamCacheExecuteImpl<true>,
                              jax_vmm::attention::BindStreamCacheCuda(xla::ffi::Ffi::Bind()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

namespace jax_vmm::attention {

void AddCacheCudaTargets(FfiRegistry& registry) {
  registry.Add(
      "jax_vmm_decode_attention_cache", "CUDA",
      FfiRegistry::Stages{DecodeAttentionCacheCudaInitialize, DecodeAttentionCacheCudaExecute});
  registry.Add("jax_vmm_decode_attention_v2_cache", "CUDA",
               FfiRegistry::Stages{DecodeAttentionStreamCacheCudaInitialize,
                                   DecodeAttentionStreamCacheCudaExecute});
  registry.Add("jax_vmm_kv_cache_copy_tokens", "CUDA", KvCacheCopyTokensCuda);
}

}  // namespace jax_vmm::attention
