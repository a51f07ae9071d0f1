// The CUDA target jax_vmm_testing_decode_attention_v2 (testing_targets.h): the production
// CUDA stages of the streaming kernel (ops/attention/stream_cuda.h) with an aliased
// out_init operand; skip_output validates and writes nothing.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <utility>

#include "ops/attention/attention_cuda.h"
#include "ops/attention/stream_cuda.h"
#include "ops/attention/stream_ffi.h"
#include "testing/testing_targets.h"

namespace jax_vmm::testing {
namespace {

namespace ffi = xla::ffi;
namespace stream = attention::stream;

ffi::Error DebugStreamInitializeImpl(cudaStream_t cuda_stream, int32_t device, ffi::AnyBuffer q,
                                     ffi::AnyBuffer k, ffi::AnyBuffer v,
                                     ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer k_scale,
                                     ffi::AnyBuffer v_scale, ffi::AnyBuffer out_init,
                                     ffi::Result<ffi::AnyBuffer> out, float scale, int64_t ctas,
                                     int64_t stages, int64_t min_tiles, int64_t combine,
                                     int64_t bulk, bool skip_output) {
  (void)out_init;
  (void)skip_output;
  return stream::CudaInitialize(cuda_stream, device, q, k, v, lengths, k_scale, v_scale, *out,
                                {scale, ctas, stages, min_tiles, combine, bulk});
}

ffi::Error DebugStreamExecuteImpl(cudaStream_t cuda_stream, int32_t device, ffi::AnyBuffer q,
                                  ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lengths,
                                  ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                                  ffi::AnyBuffer out_init, ffi::Result<ffi::AnyBuffer> out,
                                  float scale, int64_t ctas, int64_t stages, int64_t min_tiles,
                                  int64_t combine, int64_t bulk, bool skip_output) {
  (void)out_init;  // aliased to `out` by XLA; never read
  const stream::StreamAttrs attrs{scale, ctas, stages, min_tiles, combine, bulk};
  if (skip_output) {
    return stream::CudaBeginExecute(cuda_stream, device, q, k, v, lengths, k_scale, v_scale, *out,
                                    attrs);
  }
  return stream::CudaExecute(cuda_stream, device, q, k, v, lengths, k_scale, v_scale, *out, attrs);
}

// Operands, results and attributes after the stage's context arguments in `b`.
template <typename B>
auto BindDebugStream(B&& b) {
  return stream::BindStreamAttrs(
             stream::BindStreamInputs(attention::BindCudaContext(std::forward<B>(b)))
                 .template Arg<ffi::AnyBuffer>()   // out_init (aliased)
                 .template Ret<ffi::AnyBuffer>())  // out
      .template Attr<bool>("skip_output");
}

}  // namespace
}  // namespace jax_vmm::testing

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmTestingDecodeAttentionV2CudaInitialize,
                              jax_vmm::testing::DebugStreamInitializeImpl,
                              jax_vmm::testing::BindDebugStream(xla::ffi::Ffi::BindInitialize()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmTestingDecodeAttentionV2CudaExecute,
                              jax_vmm::testing::DebugStreamExecuteImpl,
                              jax_vmm::testing::BindDebugStream(xla::ffi::Ffi::Bind()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

void jax_vmm::testing::AddDebugStreamCudaTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_testing_decode_attention_v2", "CUDA",
               FfiRegistry::Stages{JaxVmmTestingDecodeAttentionV2CudaInitialize,
                                   JaxVmmTestingDecodeAttentionV2CudaExecute});
}
