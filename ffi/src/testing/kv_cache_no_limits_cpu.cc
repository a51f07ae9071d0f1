// The CPU targets of the "limits ignored" variants (testing_targets.h): the production
// KVCache-layer handlers (ops/kv_write/kv_write_cpu.h, ops/attention/attention_cache.h)
// with the table of ensured tokens left out, as before it existed: a write past a
// sequence's ensured tokens lands wherever its chunk happens to be backed, and attention
// reads every length up to T.
#include <cstdint>

#include "ops/attention/attention_cache.h"
#include "ops/attention/attention_ffi.h"
#include "ops/attention/stream_ffi.h"
#include "ops/kv_write/kv_write_cache.h"
#include "ops/kv_write/kv_write_cpu.h"
#include "testing/testing_targets.h"

namespace jax_vmm::testing {
namespace {

namespace ffi = xla::ffi;

void WriteIgnoringLimits(const kv::Params& p, kv::Counters& c) {
  kv::Params q = p;
  for (kv::Side& s : q.side) s.limits = nullptr;
  kv::WriteTokensOnHost<kv::CheckedTokens>(q, c);
}

ffi::Error Write(int32_t device, ffi::AnyBuffer new_k, ffi::AnyBuffer new_v,
                 ffi::Buffer<ffi::S32> slots, ffi::AnyBuffer token,
                 ffi::Result<ffi::AnyBuffer> token_out, uint64_t cache_uid, int64_t layer) {
  return kv::CpuCacheWrite(WriteIgnoringLimits, device, new_k, new_v, slots, token, token_out,
                           cache_uid, layer);
}

ffi::Error Attention(int32_t device, ffi::AnyBuffer q, ffi::Buffer<ffi::S32> lengths,
                     ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> out,
                     ffi::Result<ffi::Buffer<ffi::S32>> read_lengths, uint64_t cache_uid,
                     int64_t layer, float scale, int64_t chunk, int64_t splits, int64_t impl) {
  (void)token;
  (void)impl;
  return attention::CacheCpu(false, device, q, lengths, *out, *read_lengths, cache_uid, layer,
                             scale, chunk, splits);
}

ffi::Error StreamAttention(int32_t device, ffi::AnyBuffer q, ffi::Buffer<ffi::S32> lengths,
                           ffi::AnyBuffer token, ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                           ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::Buffer<ffi::S32>> read_lengths, uint64_t cache_uid,
                           int64_t layer, float scale, int64_t ctas, int64_t stages,
                           int64_t min_tiles, int64_t combine, int64_t bulk) {
  (void)token;
  return attention::StreamCacheCpu(
      false, device, q, lengths, k_scale, v_scale, *out, *read_lengths, cache_uid, layer,
      attention::stream::StreamAttrs{scale, ctas, stages, min_tiles, combine, bulk});
}

}  // namespace
}  // namespace jax_vmm::testing

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmTestingKvCacheWriteNoLimitsCpu, jax_vmm::testing::Write,
                              jax_vmm::kv::BindCacheWrite(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxVmmTestingDecodeAttentionCacheNoLimitsCpu, jax_vmm::testing::Attention,
    jax_vmm::attention::BindAttrs(jax_vmm::attention::BindCacheResults(
        jax_vmm::attention::BindCacheInputs(xla::ffi::Ffi::Bind().Ctx<xla::ffi::DeviceOrdinal>()))));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxVmmTestingDecodeAttentionV2CacheNoLimitsCpu, jax_vmm::testing::StreamAttention,
    jax_vmm::attention::stream::BindStreamAttrs(jax_vmm::attention::BindCacheResults(
        jax_vmm::attention::BindCacheInputs(xla::ffi::Ffi::Bind().Ctx<xla::ffi::DeviceOrdinal>())
            .Arg<xla::ffi::AnyBuffer>()     // k_scale
            .Arg<xla::ffi::AnyBuffer>())));  // v_scale

void jax_vmm::testing::AddNoLimitsCacheCpuTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_testing_kv_cache_write_no_limits", "cpu",
               JaxVmmTestingKvCacheWriteNoLimitsCpu);
  registry.Add("jax_vmm_testing_decode_attention_cache_no_limits", "cpu",
               JaxVmmTestingDecodeAttentionCacheNoLimitsCpu);
  registry.Add("jax_vmm_testing_decode_attention_v2_cache_no_limits", "cpu",
               JaxVmmTestingDecodeAttentionV2CacheNoLimitsCpu);
}
