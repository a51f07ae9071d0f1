// The CUDA target jax_vmm_testing_decode_attention (testing_targets.h): the production
// CUDA stages (ops/attention/attention_cuda.h) with an aliased out_init operand;
// skip_output validates and writes nothing. read_all_tokens is the CPU handler's only
// (the Python wrapper refuses it on a GPU).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <utility>

#include "ops/attention/attention_cuda.h"
#include "ops/attention/attention_ffi.h"
#include "testing/testing_targets.h"

namespace jax_vmm::testing {
namespace {

namespace ffi = xla::ffi;

ffi::Error DebugAttentionInitializeImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                                        ffi::AnyBuffer k, ffi::AnyBuffer v,
                                        ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer out_init,
                                        ffi::Result<ffi::AnyBuffer> out, float scale, int64_t chunk,
                                        int64_t splits, int64_t impl,
                                        attention::OptionalLengths q_lengths, int64_t window,
                                        float softcap, bool read_all_tokens, bool skip_output) {
  (void)out_init;
  (void)scale;
  (void)q_lengths;
  (void)window;
  (void)softcap;
  (void)read_all_tokens;
  (void)skip_output;
  return attention::CudaInitialize(stream, device, q, k, v, lengths, *out, chunk, splits, impl);
}

ffi::Error DebugAttentionExecuteImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                                     ffi::AnyBuffer k, ffi::AnyBuffer v,
                                     ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer out_init,
                                     ffi::Result<ffi::AnyBuffer> out, float scale, int64_t chunk,
                                     int64_t splits, int64_t impl,
                                     attention::OptionalLengths q_lengths, int64_t window,
                                     float softcap, bool read_all_tokens, bool skip_output) {
  (void)out_init;  // aliased to `out` by XLA; never read
  (void)read_all_tokens;
  attention::Semantics sem;
  if (ffi::Error e = attention::MakeSemantics("jax_vmm_testing_decode_attention (CUDA)",
                                              q.dimensions()[0], q_lengths, window, softcap, &sem);
      e.failure()) {
    return e;
  }
  if (skip_output) {
    return attention::CudaBeginExecute(stream, device, q, k, v, lengths, *out, chunk, splits, impl);
  }
  return attention::CudaExecute(stream, device, q, k, v, lengths, *out, nullptr, scale, chunk,
                                splits, impl, sem);
}

// Operands, results and attributes after the stage's context arguments in `b`.
template <typename B>
auto BindDebugAttention(B&& b) {
  return attention::BindAttrs(attention::BindInputs(attention::BindCudaContext(std::forward<B>(b)))
                                  .template Arg<ffi::AnyBuffer>()   // out_init (aliased)
                                  .template Ret<ffi::AnyBuffer>())  // out
      .template Attr<bool>("read_all_tokens")
      .template Attr<bool>("skip_output");
}

}  // namespace
}  // namespace jax_vmm::testing

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxVmmTestingDecodeAttentionCudaInitialize, jax_vmm::testing::DebugAttentionInitializeImpl,
    jax_vmm::testing::BindDebugAttention(xla::ffi::Ffi::BindInitialize()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmTestingDecodeAttentionCudaExecute,
                              jax_vmm::testing::DebugAttentionExecuteImpl,
                              jax_vmm::testing::BindDebugAttention(xla::ffi::Ffi::Bind()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

void jax_vmm::testing::AddDebugAttentionCudaTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_testing_decode_attention", "CUDA",
               FfiRegistry::Stages{JaxVmmTestingDecodeAttentionCudaInitialize,
                                   JaxVmmTestingDecodeAttentionCudaExecute});
}
