// The CPU targets of the "limits ignored" variants (testing_targets.h): the production
// KVCache-layer handlers (ops/kv_write/kv_write_cpu.h, ops/attention/attention_cache.h)
// with the table of ensured tokens left out, as before it existed: a write past a
// sequence's ensured tokens lands wherever its chunk happens to be backed, and attention
// reads every length up to T.
#include "ops/attention/attention_cache.h"
#include "ops/kv_write/kv_write_cache.h"
#include "ops/kv_write/kv_write_cpu.h"
#include "testing/testing_targets.h"

namespace jax_vmm::testing {
namespace {

void WriteIgnoringLimits(const kv::Params& p, kv::Counters& c) {
  kv::Params q = p;
  for (kv::Side& s : q.side) s.limits = nullptr;
  kv::WriteTokensOnHost<kv::CheckedTokens>(q, c);
}

}  // namespace
}  // namespace jax_vmm::testing

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmTestingKvCacheWriteNoLimitsCpu,
                              jax_vmm::kv::CpuCacheWriteImpl<jax_vmm::testing::WriteIgnoringLimits>,
                              jax_vmm::kv::BindCacheWrite(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxVmmTestingDecodeAttentionCacheNoLimitsCpu, jax_vmm::attention::CacheCpuImpl<false>,
    jax_vmm::attention::BindCacheTarget(xla::ffi::Ffi::Bind().Ctx<xla::ffi::DeviceOrdinal>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmTestingDecodeAttentionV2CacheNoLimitsCpu,
                              jax_vmm::attention::StreamCacheCpuImpl<false>,
                              jax_vmm::attention::BindStreamCacheTarget(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::DeviceOrdinal>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmTestingKvCacheCopyTokensNoLimitsCpu,
                              jax_vmm::attention::CacheCopyCpuImpl<false>,
                              jax_vmm::attention::BindCacheCopy(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::DeviceOrdinal>()));

void jax_vmm::testing::AddNoLimitsCacheCpuTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_testing_kv_cache_write_no_limits", "cpu",
               JaxVmmTestingKvCacheWriteNoLimitsCpu);
  registry.Add("jax_vmm_testing_decode_attention_cache_no_limits", "cpu",
               JaxVmmTestingDecodeAttentionCacheNoLimitsCpu);
  registry.Add("jax_vmm_testing_decode_attention_v2_cache_no_limits", "cpu",
               JaxVmmTestingDecodeAttentionV2CacheNoLimitsCpu);
  registry.Add("jax_vmm_testing_kv_cache_copy_tokens_no_limits", "cpu",
               JaxVmmTestingKvCacheCopyTokensNoLimitsCpu);
}
