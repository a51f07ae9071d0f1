// The CPU target jax_vmm_testing_decode_attention (testing_targets.h): the production CPU
// handler (ops/attention/attention_cpu.h) with an aliased out_init operand and two
// protections that can be removed: read_all_tokens also touches every token of every
// sequence up to T (the "tail never read" oracle must see this crash), skip_output
// writes nothing (the NaN-filled output must come back untouched).
#include <cstddef>
#include <cstdint>

#include "ops/attention/attention_check.h"
#include "ops/attention/attention_cpu.h"
#include "ops/attention/attention_ffi.h"
#include "testing/testing_targets.h"

namespace jax_vmm::testing {
namespace {

namespace ffi = xla::ffi;

// Touches every 64th byte of every sequence of k and v, as a kernel that ignored the
// lengths would.
void ReadEveryToken(const ffi::AnyBuffer& k, const ffi::AnyBuffer& v, const attention::Shapes& sh) {
  volatile uint8_t sink = 0;
  const size_t seq_bytes = static_cast<size_t>(sh.max_tokens * sh.kv_heads * sh.head_dim) *
                           ffi::ByteWidth(k.element_type());
  for (int64_t b = 0; b < sh.batch; ++b) {
    const uint8_t* kb = static_cast<const uint8_t*>(k.untyped_data()) + b * seq_bytes;
    const uint8_t* vb = static_cast<const uint8_t*>(v.untyped_data()) + b * seq_bytes;
    for (size_t i = 0; i < seq_bytes; i += 64) sink = static_cast<uint8_t>(sink + kb[i] + vb[i]);
  }
}

ffi::Error DebugAttentionCpuImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                 ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer out_init,
                                 ffi::Result<ffi::AnyBuffer> out, float scale, int64_t chunk,
                                 int64_t splits, int64_t impl, attention::OptionalLengths q_lengths,
                                 int64_t window, float softcap, bool read_all_tokens,
                                 bool skip_output) {
  (void)out_init;  // aliased to `out` by XLA; never read
  (void)impl;
  attention::Semantics sem;
  if (ffi::Error e = attention::MakeSemantics(attention::kCpuName, q.dimensions()[0], q_lengths,
                                              window, softcap, &sem);
      e.failure()) {
    return e;
  }
  attention::Shapes sh;
  if (ffi::Error err = attention::CheckOperands(attention::kCpuName, q, k, v, lengths, *out, &sh);
      err.failure()) {
    return err;
  }
  if (read_all_tokens) ReadEveryToken(k, v, sh);
  if (skip_output) return ffi::Error::Success();
  return attention::RunCpu(q, k, v, lengths, *out, nullptr, scale, chunk, splits, sem);
}

}  // namespace
}  // namespace jax_vmm::testing

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxVmmTestingDecodeAttentionCpu, jax_vmm::testing::DebugAttentionCpuImpl,
    jax_vmm::attention::BindAttrs(jax_vmm::attention::BindInputs(xla::ffi::Ffi::Bind())
                                      .Arg<xla::ffi::AnyBuffer>()   // out_init (aliased)
                                      .Ret<xla::ffi::AnyBuffer>())  // out
        .Attr<bool>("read_all_tokens")
        .Attr<bool>("skip_output"));

void jax_vmm::testing::AddDebugAttentionCpuTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_testing_decode_attention", "cpu", JaxVmmTestingDecodeAttentionCpu);
}
