// The kv_write_fp8 CUDA handler (kv_write_fp8.h) and its FFI target: kv_write's CUDA path
// (kv_write_cuda.h) launching the tiled kernel with the quantizing transfer
// (kv_write_kernels.h). Command-buffer compatible like kv_write: the scales are device
// arrays read by the kernel.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "ops/kv_write/kv_write_cuda.h"
#include "ops/kv_write/kv_write_fp8.h"
#include "ops/kv_write/kv_write_kernels.h"
#include "ops/kv_write/kv_write_targets.h"

namespace jax_vmm::kv {
namespace {

Fp8Quantization::Source SourceOf(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16:
      return Fp8Quantization::Source::kBF16;
    case ffi::DataType::F16:
      return Fp8Quantization::Source::kF16;
    default:  // F32 (checked)
      return Fp8Quantization::Source::kF32;
  }
}

ffi::Error CudaWriteFp8Impl(cudaStream_t stream, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::AnyBuffer new_k, ffi::AnyBuffer new_v, ffi::Buffer<ffi::S32> slots,
                            ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                            ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                            uint64_t dest_k, uint64_t dest_v, uint64_t dest_k_uid,
                            uint64_t dest_v_uid) {
  const Dest dest{dest_k, dest_v, dest_k_uid, dest_v_uid};
  ffi::DataType src = ffi::DataType::F32;
  if (std::string err = CheckFp8Write(k, v, new_k, new_v, k_scale, v_scale, &src); !err.empty()) {
    return ffi::Error::InvalidArgument(err);
  }
  const auto kd = k.dimensions();
  const int64_t head_dim = kd[kd.size() - 1], token_bytes = head_dim * kd[kd.size() - 2];
  if (head_dim % 8 != 0 || token_bytes / 8 > kMaxTiledVectorsPerToken) {
    return ffi::Error::InvalidArgument(
        std::string(kFp8Name) + " (CUDA): head_dim must be a multiple of 8 and a token at most " +
        std::to_string(8 * kMaxTiledVectorsPerToken) + " bytes; got head_dim " +
        std::to_string(head_dim) + ", " + std::to_string(token_bytes) + " bytes");
  }
  if (ffi::Error e = PrepareWriteResultsOnDevice(kFp8Name, k, v, *k_out, *v_out, stream);
      e.failure()) {
    return e;
  }
  const CallOperands in = Fp8WriteOperands(k, v, new_k, new_v, slots, k_out->untyped_data(),
                                           v_out->untyped_data(), dest, SourceBytes(src));
  Fp8Quantization q;
  q.source = SourceOf(src);
  q.head_dim = static_cast<int>(head_dim);
  q.scale[0] = static_cast<const float*>(k_scale.untyped_data());
  q.scale[1] = static_cast<const float*>(v_scale.untyped_data());
  return RunOnDevice(Op::kWrite, Handler::kWrite, stream, in, false,
                     [&](const Params& p) { return LaunchKvWriteFp8(p, q, stream); });
}

}  // namespace
}  // namespace jax_vmm::kv

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmKvWriteFp8Cuda, jax_vmm::kv::CudaWriteFp8Impl,
                              jax_vmm::kv::BindWriteFp8(jax_vmm::kv::BindCudaContext()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

namespace jax_vmm::kv {

void AddFp8CudaTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_kv_write_fp8", "CUDA", JaxVmmKvWriteFp8Cuda);
}

}  // namespace jax_vmm::kv
