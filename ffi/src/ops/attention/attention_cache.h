// Decode attention over a KVCache layer (jax_vmm/ops/layer_ops.py): the custom calls
//   jax_vmm_decode_attention_cache(q, lengths, token) -> (out, read_lengths)
//   jax_vmm_decode_attention_v2_cache(q, lengths, token, k_scale, v_scale)
//       -> (out, read_lengths)
// with attributes cache_uid (u64), layer (s64), then those of the split-K kernel
// (attention_ffi.h BindAttrs) or of the streaming kernel (stream_ffi.h BindStreamAttrs).
// The K/V cache is not an operand: the handlers find the layer's buffers through the KV
// cache registry (ops/kv_cache/kv_cache_call.h) and run the unchanged handler bodies of
// the two kernels on them. `token` is the layer's ordering token (the kv_writes of the
// layer that produced it ran before this call); it is not read.
//
// read_lengths (s32 (B,), a discarded result XLA allocates) is what the kernels read:
// min(clamp(lengths[b], 0, T), ensured[b]), ensured = the cache's table of tokens ensured
// per sequence. A sequence whose length exceeds its ensured tokens is counted in the
// cache's read-clamp counter (kv.check() reports it): past the ensured tokens the memory
// may be unbacked (zeros) or hold a neighbour's chunk. On CUDA a small kernel computes
// read_lengths from device memory, so a replayed graph clamps against today's table.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "ops/attention/attention_ffi.h"
#include "ops/attention/stream_ffi.h"
#include "ops/kv_cache/kv_cache_call.h"
#include "xla/ffi/api/ffi.h"

namespace jax_vmm::attention {

namespace ffi = xla::ffi;

// One call's resolved layer, with its buffers as FFI buffers for the handler bodies.
struct CacheAttention {
  kvcache::CacheLayer layer;
  XLA_FFI_Buffer k{}, v{};
  ffi::AnyBuffer K() const { return ffi::AnyBuffer(&k); }
  ffi::AnyBuffer V() const { return ffi::AnyBuffer(&v); }
  int64_t batch() const { return layer.cache->geometry().max_seqs; }
  int64_t max_tokens() const { return layer.cache->geometry().max_tokens; }
  // Shapes::token_heads of the layer's K and V.
  int64_t token_heads() const { return layer.cache->geometry().row_heads(); }
  // The streaming kernel's attributes with the layer's token stride.
  stream::StreamAttrs Strided(stream::StreamAttrs attrs) const {
    attrs.token_heads = token_heads();
    return attrs;
  }
};

// Resolves the layer for `op` and checks what the kernels' own checks cannot see: a cache
// with a per-sequence layout whose max_seqs is q's batch, and lengths / read_lengths of
// shape (B,). An error message, or "".
std::string PrepareCacheAttention(const char* op, const char* driver_kind, int device,
                                  uint64_t cache_uid, int64_t layer, const ffi::AnyBuffer& q,
                                  const ffi::Buffer<ffi::S32>& lengths,
                                  const ffi::Buffer<ffi::S32>& read_lengths, CacheAttention* out);

// jax_vmm_kv_cache_copy_tokens(lengths, token) -> (k, v, read_lengths), attributes
// cache_uid and layer: the layer's tokens [0, read_lengths[b]) of every sequence b copied
// into k and v (the layer's shape and dtype) and zeros past them, read_lengths clamped and
// counted as for attention. What jax_vmm.attention runs over an fp8 layer with several
// query rows: the split-K kernels then read the copy, dequantized by XLA (correct, not
// fast; the kernels read 16-bit or float32 caches only).
//
// Resolves the layer and checks the outputs' shapes and dtype and lengths / read_lengths
// (B,). An error message, or "".
std::string PrepareCacheCopy(const char* op, const char* driver_kind, int device,
                             uint64_t cache_uid, int64_t layer,
                             const ffi::Buffer<ffi::S32>& lengths, const ffi::AnyBuffer& k_out,
                             const ffi::AnyBuffer& v_out,
                             const ffi::Buffer<ffi::S32>& read_lengths, CacheAttention* out);

// The CPU handler body of jax_vmm_kv_cache_copy_tokens (attention_cache_cpu.cc), shared
// with the testing layer's variant (use_limits: see ClampLengthsOnHost).
ffi::Error CacheCopyCpu(bool use_limits, int32_t device, ffi::Buffer<ffi::S32> lengths,
                        int32_t epoch, ffi::AnyBuffer k_out, ffi::AnyBuffer v_out,
                        ffi::Buffer<ffi::S32> read_lengths, uint64_t cache_uid, int64_t layer);

// The read epoch a host handler's ordering token carries (kv_cache.h, BeginEpoch): its
// int32 value, which the host reads directly; -1 (the live table) for another shape.
int32_t TokenEpochOnHost(const ffi::AnyBuffer& token);

// read_lengths on the host (the CPU handlers); clamped sequences counted. use_limits:
// false only in the testing layer (the clamp to T remains, nothing is counted). The
// table is the one readers of `epoch` see (the live one, or one a release kept).
void ClampLengthsOnHost(const CacheAttention& call, const int32_t* lengths, int32_t* read,
                        bool use_limits, int32_t epoch);

// The CPU handler bodies (attention_cache_cpu.cc) of the split-K and the streaming
// target, shared with the testing layer's variants (use_limits: see ClampLengthsOnHost).
ffi::Error CacheCpu(bool use_limits, int32_t device, ffi::AnyBuffer q,
                    ffi::Buffer<ffi::S32> lengths, int32_t epoch, ffi::AnyBuffer out,
                    ffi::Buffer<ffi::S32> read_lengths, uint64_t cache_uid, int64_t layer,
                    float scale, int64_t chunk, int64_t splits, const Semantics& sem,
                    int64_t impl);
ffi::Error StreamCacheCpu(bool use_limits, int32_t device, ffi::AnyBuffer q,
                          ffi::Buffer<ffi::S32> lengths, int32_t epoch, ffi::AnyBuffer k_scale,
                          ffi::AnyBuffer v_scale, ffi::AnyBuffer out,
                          ffi::Buffer<ffi::S32> read_lengths, uint64_t cache_uid, int64_t layer,
                          const stream::StreamAttrs& attrs);

// The operands both targets start with, after the platform's context arguments in `b`
// (CPU: the device ordinal; CUDA: stream and device ordinal). The streaming target's
// k_scale and v_scale follow.
template <typename B>
auto BindCacheInputs(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::AnyBuffer>()         // q
      .template Arg<ffi::Buffer<ffi::S32>>()  // lengths
      .template Arg<ffi::AnyBuffer>();        // token
}

// The results of both targets and the cache's attributes (the kernel's attributes follow).
template <typename B>
auto BindCacheResults(B&& b) {
  return std::forward<B>(b)
      .template Ret<ffi::AnyBuffer>()         // out
      .template Ret<ffi::Buffer<ffi::S32>>()  // read_lengths
      .template Attr<uint64_t>("cache_uid")
      .template Attr<int64_t>("layer");
}

// The CPU handler functions XLA_FFI_DEFINE_HANDLER_SYMBOL binds (production: kUseLimits
// true, attention_cache_cpu.cc; the testing layer instantiates false), and their bindings.
template <bool kUseLimits>
ffi::Error CacheCpuImpl(int32_t device, ffi::AnyBuffer q, ffi::Buffer<ffi::S32> lengths,
                        ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::Buffer<ffi::S32>> read_lengths, uint64_t cache_uid,
                        int64_t layer, float scale, int64_t chunk, int64_t splits, int64_t impl,
                        OptionalLengths q_lengths, int64_t window, float softcap) {
  Semantics sem;
  if (ffi::Error e = MakeSemantics("jax_vmm.attention (KVCache layer, cpu)", q.dimensions()[0],
                                   q_lengths, window, softcap, &sem);
      e.failure()) {
    return e;
  }
  // The token orders the call after the layer's writes and names its read epoch.
  return CacheCpu(kUseLimits, device, q, lengths, TokenEpochOnHost(token), *out, *read_lengths, cache_uid, layer, scale,
                  chunk, splits, sem, impl);
}

template <bool kUseLimits>
ffi::Error StreamCacheCpuImpl(int32_t device, ffi::AnyBuffer q, ffi::Buffer<ffi::S32> lengths,
                              ffi::AnyBuffer token, ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                              ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::Buffer<ffi::S32>> read_lengths, uint64_t cache_uid,
                              int64_t layer, float scale, int64_t ctas, int64_t stages,
                              int64_t min_tiles, int64_t combine, int64_t bulk) {
  return StreamCacheCpu(kUseLimits, device, q, lengths, TokenEpochOnHost(token), k_scale, v_scale, *out, *read_lengths,
                        cache_uid, layer,
                        stream::StreamAttrs{scale, ctas, stages, min_tiles, combine, bulk});
}

template <bool kUseLimits>
ffi::Error CacheCopyCpuImpl(int32_t device, ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer token,
                            ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                            ffi::Result<ffi::Buffer<ffi::S32>> read_lengths, uint64_t cache_uid,
                            int64_t layer) {
  return CacheCopyCpu(kUseLimits, device, lengths, TokenEpochOnHost(token), *k_out, *v_out,
                      *read_lengths, cache_uid, layer);
}

// jax_vmm_kv_cache_copy_tokens after the platform's context in `b`.
template <typename B>
auto BindCacheCopy(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::Buffer<ffi::S32>>()  // lengths
      .template Arg<ffi::AnyBuffer>()         // token
      .template Ret<ffi::AnyBuffer>()         // k
      .template Ret<ffi::AnyBuffer>()         // v
      .template Ret<ffi::Buffer<ffi::S32>>()  // read_lengths
      .template Attr<uint64_t>("cache_uid")
      .template Attr<int64_t>("layer");
}

// The full signatures of the two targets after the platform's context in `b`.
template <typename B>
auto BindCacheTarget(B&& b) {
  return BindAttrs(BindCacheResults(BindCacheInputs(std::forward<B>(b))));
}

template <typename B>
auto BindStreamCacheTarget(B&& b) {
  return stream::BindStreamAttrs(BindCacheResults(BindCacheInputs(std::forward<B>(b))
                                                      .template Arg<ffi::AnyBuffer>()     // k_scale
                                                      .template Arg<ffi::AnyBuffer>()));  // v_scale
}

}  // namespace jax_vmm::attention
