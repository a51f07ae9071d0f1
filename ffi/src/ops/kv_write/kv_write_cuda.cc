// The kv_write CUDA handlers (see kv_write_cuda.h) and their FFI targets.
#include "ops/kv_write/kv_write_cuda.h"

#include <string>

#include "common/cuda_error.h"
#include "ops/kv_write/kv_write_call.h"
#include "ops/kv_write/kv_write_kernels.h"
#include "ops/kv_write/kv_write_stats.h"
#include "ops/kv_write/kv_write_targets.h"

namespace jax_vmm::kv {
namespace {

// Counts the call and whether the stream is capturing; remembers the device.
ffi::Error CountCall(Handler h, cudaStream_t stream, const char* op) {
  Counters& c = GetCounters(h);
  c.calls.fetch_add(1);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaError_t e = cudaStreamIsCapturing(stream, &capture); e != cudaSuccess) {
    return CudaFfiError(op, "cudaStreamIsCapturing", e);
  }
  if (capture != cudaStreamCaptureStatusNone) c.captured_calls.fetch_add(1);
  int device = 0;
  if (cudaGetDevice(&device) == cudaSuccess) NoteDevice(device);
  return ffi::Error::Success();
}

// XLA aliases the output with its operand; if it ever did not, keep the op's meaning.
ffi::Error CopyUnaliased(const char* op, const ffi::AnyBuffer& in, void* out, cudaStream_t stream) {
  if (out == in.untyped_data()) return ffi::Error::Success();
  if (cudaError_t e = cudaMemcpyAsync(out, in.untyped_data(), in.size_bytes(),
                                      cudaMemcpyDeviceToDevice, stream);
      e != cudaSuccess) {
    return CudaFfiError(op, "cudaMemcpyAsync", e);
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error RunOnDevice(Op op, Handler h, cudaStream_t stream, const CallOperands& in,
                       bool require_arena,
                       const std::function<cudaError_t(const Params&)>& launch) {
  const char* name = op == Op::kWrite ? "jax_vmm_kv_write" : "jax_vmm_kv_write_through";
  if (ffi::Error e = CountCall(h, stream, name); e.failure()) return e;
  Params p;
  Resolution r;
  std::string err = PrepareCall(op, "cuda", require_arena, in, &p, &r);
  if (!err.empty()) return ffi::Error::InvalidArgument(err);
  CountResolution(h, r);
  if (cudaError_t e = launch(p); e != cudaSuccess) {
    return CudaFfiError(name, "kernel launch", e);
  }
  return ffi::Error::Success();
}

ffi::Error PrepareWriteResultsOnDevice(const char* op, const ffi::AnyBuffer& k,
                                       const ffi::AnyBuffer& v, ffi::AnyBuffer& k_out,
                                       ffi::AnyBuffer& v_out, cudaStream_t stream) {
  if (ffi::Error e = CheckWriteResults(op, k, v, k_out, v_out); e.failure()) return e;
  if (ffi::Error e = CopyUnaliased(op, k, k_out.untyped_data(), stream); e.failure()) return e;
  return CopyUnaliased(op, v, v_out.untyped_data(), stream);
}

ffi::Error CudaWrite(KernelLauncher launch, cudaStream_t stream, ffi::AnyBuffer k, ffi::AnyBuffer v,
                     ffi::AnyBuffer new_k, ffi::AnyBuffer new_v, ffi::Buffer<ffi::S32> slots,
                     ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                     const Dest& dest) {
  if (ffi::Error e = PrepareWriteResultsOnDevice("jax_vmm_kv_write", k, v, *k_out, *v_out, stream);
      e.failure()) {
    return e;
  }
  const CallOperands in =
      WriteOperands(k, v, new_k, new_v, slots, k_out->untyped_data(), v_out->untyped_data(), dest);
  return RunOnDevice(Op::kWrite, Handler::kWrite, stream, in, false,
                     [&](const Params& p) { return launch(p, stream); });
}

ffi::Error CudaWriteThrough(KernelLauncher launch, cudaStream_t stream, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::AnyBuffer new_k, ffi::AnyBuffer new_v,
                            ffi::Buffer<ffi::S32> slots, ffi::Result<ffi::Buffer<ffi::S32>> status,
                            bool require_arena, const Dest& dest) {
  const Dims status_dims = DimsOfS32(*status);
  if (ffi::Error e = CheckStatusResult(status_dims); e.failure()) return e;
  const CallOperands in =
      WriteThroughOperands(k, v, new_k, new_v, slots, *status, status_dims, dest);
  return RunOnDevice(Op::kWriteThrough, Handler::kWriteThrough, stream, in, require_arena,
                     [&](const Params& p) { return launch(p, stream); });
}

}  // namespace jax_vmm::kv

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmKvWriteThroughCuda,
                              jax_vmm::kv::CudaWriteThroughImpl<jax_vmm::kv::LaunchKvWrite>,
                              jax_vmm::kv::BindWriteThrough(jax_vmm::kv::BindCudaContext()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmKvWriteCuda,
                              jax_vmm::kv::CudaWriteImpl<jax_vmm::kv::LaunchKvWrite>,
                              jax_vmm::kv::BindWrite(jax_vmm::kv::BindCudaContext()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

namespace jax_vmm::kv {

void AddCudaTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_kv_write_through", "CUDA", JaxVmmKvWriteThroughCuda);
  registry.Add("jax_vmm_kv_write", "CUDA", JaxVmmKvWriteCuda);
}

}  // namespace jax_vmm::kv
