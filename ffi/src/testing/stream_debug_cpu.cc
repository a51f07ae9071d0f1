// The CPU target jax_vmm_testing_decode_attention_v2 (testing_targets.h): the production
// CPU model of the streaming kernel (ops/attention/stream_cpu.h) with an aliased out_init
// operand, and skip_output, which validates and writes nothing (the NaN-filled output
// must come back untouched).
#include <cstdint>

#include "ops/attention/stream_cpu.h"
#include "ops/attention/stream_ffi.h"
#include "testing/testing_targets.h"

namespace jax_vmm::testing {
namespace {

namespace ffi = xla::ffi;
namespace stream = attention::stream;

ffi::Error DebugStreamCpuImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                              ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer k_scale,
                              ffi::AnyBuffer v_scale, ffi::AnyBuffer out_init,
                              ffi::Result<ffi::AnyBuffer> out, float scale, int64_t ctas,
                              int64_t stages, int64_t min_tiles, int64_t combine, int64_t bulk,
                              bool skip_output) {
  (void)out_init;  // aliased to `out` by XLA; never read
  const stream::StreamAttrs attrs{scale, ctas, stages, min_tiles, combine, bulk};
  if (skip_output) {
    attention::Shapes sh;
    stream::KvStorage kv;
    return stream::ValidateCpu(q, k, v, lengths, k_scale, v_scale, *out, attrs, &sh, &kv);
  }
  return stream::RunCpu(q, k, v, lengths, k_scale, v_scale, *out, attrs);
}

}  // namespace
}  // namespace jax_vmm::testing

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxVmmTestingDecodeAttentionV2Cpu, jax_vmm::testing::DebugStreamCpuImpl,
    jax_vmm::attention::stream::BindStreamAttrs(
        jax_vmm::attention::stream::BindStreamInputs(xla::ffi::Ffi::Bind())
            .Arg<xla::ffi::AnyBuffer>()   // out_init (aliased)
            .Ret<xla::ffi::AnyBuffer>())  // out
        .Attr<bool>("skip_output"));

void jax_vmm::testing::AddDebugStreamCpuTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_testing_decode_attention_v2", "cpu", JaxVmmTestingDecodeAttentionV2Cpu);
}
