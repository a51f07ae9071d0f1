// CPU handlers of decode attention over a KVCache layer (attention_cache.h): the split-K
// and streaming CPU bodies (attention_cpu.h, stream_cpu.h) run on the layer's buffers
// with the lengths clamped to the tokens each sequence has ensured.
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "ops/attention/attention_cache.h"
#include "ops/attention/attention_cpu.h"
#include "ops/attention/attention_targets.h"
#include "ops/attention/stream_cpu.h"

namespace jax_vmm::attention {
namespace {

constexpr const char* kCacheName = "jax_vmm attention (decode_attention or attention over a KVCache layer, cpu)";

// Resolves the layer and fills read_lengths; an error, or success.
ffi::Error PrepareOnHost(bool use_limits, int32_t device, uint64_t cache_uid, int64_t layer,
                         int32_t epoch, const ffi::AnyBuffer& q,
                         const ffi::Buffer<ffi::S32>& lengths,
                         ffi::Buffer<ffi::S32>& read_lengths, CacheAttention* call) {
  if (std::string err = PrepareCacheAttention(kCacheName, "host", device, cache_uid, layer, q,
                                              lengths, read_lengths, call);
      !err.empty()) {
    return ffi::Error::InvalidArgument(err);
  }
  ClampLengthsOnHost(*call, lengths.typed_data(), read_lengths.typed_data(), use_limits, epoch);
  return ffi::Error::Success();
}

}  // namespace

ffi::Error CacheCpu(bool use_limits, int32_t device, ffi::AnyBuffer q,
                    ffi::Buffer<ffi::S32> lengths, int32_t epoch, ffi::AnyBuffer out,
                    ffi::Buffer<ffi::S32> read_lengths, uint64_t cache_uid, int64_t layer,
                    float scale, int64_t chunk, int64_t splits, const Semantics& sem,
                    int64_t impl) {
  CacheAttention call;
  if (ffi::Error e =
          PrepareOnHost(use_limits, device, cache_uid, layer, epoch, q, lengths, read_lengths,
                        &call);
      e.failure()) {
    return e;
  }
  return RunCpu(q, call.K(), call.V(), read_lengths, out, nullptr, scale, chunk, splits, sem,
                impl, call.token_heads());
}

ffi::Error StreamCacheCpu(bool use_limits, int32_t device, ffi::AnyBuffer q,
                          ffi::Buffer<ffi::S32> lengths, int32_t epoch, ffi::AnyBuffer k_scale,
                          ffi::AnyBuffer v_scale, ffi::AnyBuffer out,
                          ffi::Buffer<ffi::S32> read_lengths, uint64_t cache_uid, int64_t layer,
                          const stream::StreamAttrs& attrs) {
  CacheAttention call;
  if (ffi::Error e =
          PrepareOnHost(use_limits, device, cache_uid, layer, epoch, q, lengths, read_lengths,
                        &call);
      e.failure()) {
    return e;
  }
  return stream::RunCpu(q, call.K(), call.V(), read_lengths, k_scale, v_scale, out,
                        call.Strided(attrs));
}

ffi::Error CacheCopyCpu(bool use_limits, int32_t device, ffi::Buffer<ffi::S32> lengths,
                        int32_t epoch, ffi::AnyBuffer k_out, ffi::AnyBuffer v_out,
                        ffi::Buffer<ffi::S32> read_lengths, uint64_t cache_uid, int64_t layer) {
  constexpr const char* kCopyName = "jax_vmm.attention (copy of an fp8 KVCache layer, cpu)";
  CacheAttention call;
  if (std::string err = PrepareCacheCopy(kCopyName, "host", device, cache_uid, layer, lengths,
                                         k_out, v_out, read_lengths, &call);
      !err.empty()) {
    return ffi::Error::InvalidArgument(err);
  }
  ClampLengthsOnHost(call, lengths.typed_data(), read_lengths.typed_data(), use_limits, epoch);
  const kvcache::Geometry& g = call.layer.cache->geometry();
  const size_t token_bytes = g.token_bytes(), src_row = g.row_bytes();
  const auto T = static_cast<size_t>(call.max_tokens());
  for (int64_t b = 0; b < call.batch(); ++b) {
    const auto live = static_cast<size_t>(read_lengths.typed_data()[b]);
    for (auto [src, dst] : {std::pair{call.k.data, k_out.untyped_data()},
                            std::pair{call.v.data, v_out.untyped_data()}}) {
      char* d = static_cast<char*>(dst) + b * T * token_bytes;
      const char* s = static_cast<const char*>(src) + b * T * src_row;
      for (size_t t = 0; t < live; ++t) std::memcpy(d + t * token_bytes, s + t * src_row, token_bytes);
      std::memset(d + live * token_bytes, 0, (T - live) * token_bytes);
    }
  }
  return ffi::Error::Success();
}

}  // namespace jax_vmm::attention

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvCacheCopyTokensCpu, jax_vmm::attention::CacheCopyCpuImpl<true>,
                              jax_vmm::attention::BindCacheCopy(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::DeviceOrdinal>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    DecodeAttentionCacheCpu, jax_vmm::attention::CacheCpuImpl<true>,
    jax_vmm::attention::BindCacheTarget(xla::ffi::Ffi::Bind().Ctx<xla::ffi::DeviceOrdinal>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionStreamCacheCpu,
                              jax_vmm::attention::StreamCacheCpuImpl<true>,
                              jax_vmm::attention::BindStreamCacheTarget(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::DeviceOrdinal>()));

namespace jax_vmm::attention {

void AddCacheCpuTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_decode_attention_cache", "cpu", DecodeAttentionCacheCpu);
  registry.Add("jax_vmm_decode_attention_v2_cache", "cpu", DecodeAttentionStreamCacheCpu);
  registry.Add("jax_vmm_kv_cache_copy_tokens", "cpu", KvCacheCopyTokensCpu);
}

}  // namespace jax_vmm::attention
