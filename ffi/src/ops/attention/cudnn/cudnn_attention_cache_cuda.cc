// jax_vmm_cudnn_attention_cache: the cuDNN attention backend over a KVCache layer
// (jax_vmm/ops/cudnn_attention.py with a KVLayer of a kv_arena). As
// jax_vmm_decode_attention_cache does, the K/V buffers are not operands: the handler finds
// the layer's arena buffers by the cache's identity (attributes cache_uid, layer). The
// lengths it reads come clamped to the ensured tokens by jax_vmm_kv_cache_read_lengths
// (ops/kv_cache/read_lengths.h: one clamp per step, shared by the layers). `token` orders
// the call after the layer's writes; it is not read.
//
// Operands: q (B, S, H_q, D), read_lengths s32 (B,), q_lengths s32 (B,), token. Result:
// out. Attributes: cache_uid (u64), layer (i64), then scale, softcap, window, zero_rows as
// in cudnn_attention_cuda.cc.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <utility>

#include "ops/attention/cudnn/cudnn_attention.h"
#include "ops/kv_cache/kv_cache.h"
#include "ops/kv_cache/kv_cache_call.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_vmm::cudnn {
namespace {

constexpr const char* kName = "jax_vmm_cudnn_attention (KVCache layer, CUDA)";

// One call's layer, with its buffers as FFI buffers for the array form's bodies.
struct Layer {
  kvcache::CacheLayer layer;
  XLA_FFI_Buffer k{}, v{};
  // SdpaKey::kv_token_heads: the layer's tokens are this many heads apart.
  int64_t token_heads() const { return layer.cache->geometry().row_heads(); }
};

ffi::Error Resolve(int32_t device, uint64_t cache_uid, int64_t layer, const ffi::AnyBuffer& q,
                   Layer* out) {
  if (std::string err = kvcache::ResolveCacheLayer(kName, "cuda", device, cache_uid, layer,
                                                   /*pin=*/true, &out->layer);
      !err.empty()) {
    return ffi::Error::InvalidArgument(err);
  }
  const kvcache::Geometry& g = out->layer.cache->geometry();
  if (!g.per_sequence) {
    return ffi::Error::InvalidArgument(std::string(kName) +
                                       ": attention needs a KV arena with one buffer row per "
                                       "sequence (kv_arena(..., max_seqs=batch))");
  }
  if (q.dimensions().size() != 4 || q.dimensions()[0] != g.max_seqs) {
    return ffi::Error::InvalidArgument(std::string(kName) + ": q must be (" +
                                       std::to_string(g.max_seqs) +
                                       ", S, H_q, D): one row per sequence of the KV cache");
  }
  out->k = kvcache::LayerBuffer(reinterpret_cast<void*>(out->layer.buffers.k_address), g.dtype,
                                out->layer.dims);
  out->v = kvcache::LayerBuffer(reinterpret_cast<void*>(out->layer.buffers.v_address), g.dtype,
                                out->layer.dims);
  return ffi::Error::Success();
}

ffi::Error InitializeImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                          ffi::Buffer<ffi::S32> read_lengths, ffi::Buffer<ffi::S32> q_lengths,
                          ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> out,
                          uint64_t cache_uid, int64_t layer, float scale, float softcap,
                          int64_t window, int64_t zero_rows) {
  (void)token;
  (void)zero_rows;
  InitializeTimer timer;
  Layer call;
  if (ffi::Error err = Resolve(device, cache_uid, layer, q, &call); err.failure()) return err;
  return Initialize(stream, device, q, ffi::AnyBuffer(&call.k), ffi::AnyBuffer(&call.v),
                    read_lengths, q_lengths, *out, scale, softcap, window, call.token_heads());
}

ffi::Error ExecuteImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                       ffi::Buffer<ffi::S32> read_lengths, ffi::Buffer<ffi::S32> q_lengths,
                       ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> out, uint64_t cache_uid,
                       int64_t layer, float scale, float softcap, int64_t window,
                       int64_t zero_rows) {
  (void)token;  // orders the call after the layer's writes; not read
  Layer call;
  if (ffi::Error err = Resolve(device, cache_uid, layer, q, &call); err.failure()) return err;
  return Execute(stream, device, q, ffi::AnyBuffer(&call.k), ffi::AnyBuffer(&call.v),
                 read_lengths, q_lengths, *out, scale, softcap, window, zero_rows,
                 call.token_heads(), /*kv_owned=*/true);
}

template <typename B>
auto BindCache(B&& b) {
  return std::forward<B>(b)
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Arg<ffi::AnyBuffer>()          // q
      .template Arg<ffi::Buffer<ffi::S32>>()   // read_lengths
      .template Arg<ffi::Buffer<ffi::S32>>()   // q_lengths
      .template Arg<ffi::AnyBuffer>()          // token
      .template Ret<ffi::AnyBuffer>()          // out
      .template Attr<uint64_t>("cache_uid")
      .template Attr<int64_t>("layer")
      .template Attr<float>("scale")
      .template Attr<float>("softcap")
      .template Attr<int64_t>("window")
      .template Attr<int64_t>("zero_rows");
}

}  // namespace
}  // namespace jax_vmm::cudnn

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnAttentionCacheInitialize, jax_vmm::cudnn::InitializeImpl,
                              jax_vmm::cudnn::BindCache(xla::ffi::Ffi::BindInitialize()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnAttentionCacheExecute, jax_vmm::cudnn::ExecuteImpl,
                              jax_vmm::cudnn::BindCache(xla::ffi::Ffi::Bind()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

namespace jax_vmm::cudnn {

void AddCudnnCacheTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_cudnn_attention_cache", "CUDA",
               FfiRegistry::Stages{CudnnAttentionCacheInitialize, CudnnAttentionCacheExecute});
}

}  // namespace jax_vmm::cudnn
