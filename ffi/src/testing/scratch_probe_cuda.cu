// Test-only custom call "jax_vmm_scratch_probe" (CUDA): y = x copied through a
// graph-safe scratch workspace (two kernels: x -> workspace, workspace -> y), plus the
// workspace address. Two stages:
//   kInitialize  (never under capture) reserves `workspace_bytes` on (device, stream)
//                unless reserve_at_initialize is false (then jax_vmm.ops.scratch.reserve()
//                must have sized the device default workspace);
//   kExecute     gets the workspace; under capture it can only use what is there.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <utility>

#include "common/cuda_error.h"
#include "jax_vmm/scratch.h"
#include "testing/scratch_probe.h"
#include "testing/testing_targets.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_vmm::testing {
namespace {

__global__ void CopyKernel(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst, size_t bytes,
                           uint32_t* addr, uint64_t ws) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < bytes;
       i += stride) {
    dst[i] = src[i];
  }
  if (addr != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    addr[0] = static_cast<uint32_t>(ws & 0xffffffffu);
    addr[1] = static_cast<uint32_t>(ws >> 32);
  }
}

constexpr const char* kName = "jax_vmm_scratch_probe";

ffi::Error ProbeInitialize(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                           ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::S32>> addr,
                           int64_t workspace_bytes, bool reserve_at_initialize) {
  ProbeCounters().initialize_calls.fetch_add(1);
  if (ffi::Error e = CheckProbeArgs(x, *y, addr->element_count(), workspace_bytes); e.failure())
    return e;
  if (!reserve_at_initialize) return ffi::Error::Success();
  std::string err = scratch::Reserve(device, stream, static_cast<size_t>(workspace_bytes));
  if (!err.empty()) return ffi::Error::Internal(err);
  return ffi::Error::Success();
}

ffi::Error ProbeExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                        ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::S32>> addr,
                        int64_t workspace_bytes, bool /*reserve_at_initialize*/) {
  ProbeCounters().calls.fetch_add(1);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaError_t e = cudaStreamIsCapturing(stream, &capture); e != cudaSuccess) {
    return CudaFfiError(kName, "cudaStreamIsCapturing", e);
  }
  if (capture != cudaStreamCaptureStatusNone) ProbeCounters().captured_calls.fetch_add(1);
  if (ffi::Error e = CheckProbeArgs(x, *y, addr->element_count(), workspace_bytes); e.failure())
    return e;
  void* ws = nullptr;
  std::string err = scratch::Get(device, stream, static_cast<size_t>(workspace_bytes), &ws);
  if (!err.empty()) return ffi::Error::Internal(err);
  const size_t bytes = x.size_bytes();
  if (bytes > 0) {
    const int threads = 256;
    const int blocks = static_cast<int>(std::min<size_t>((bytes + threads - 1) / threads, 1024));
    auto* ws8 = static_cast<uint8_t*>(ws);
    CopyKernel<<<blocks, threads, 0, stream>>>(static_cast<const uint8_t*>(x.untyped_data()), ws8,
                                               bytes, nullptr, 0);
    CopyKernel<<<blocks, threads, 0, stream>>>(ws8, static_cast<uint8_t*>(y->untyped_data()), bytes,
                                               reinterpret_cast<uint32_t*>(addr->typed_data()),
                                               reinterpret_cast<uintptr_t>(ws));
  }
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    return CudaFfiError(kName, "kernel launch", e);
  return ffi::Error::Success();
}

// Context, operand, results and attributes of both stages, after `b` (the stage).
template <typename B>
auto BindProbe(B&& b) {
  return std::forward<B>(b)
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Arg<ffi::AnyBuffer>()         // x
      .template Ret<ffi::AnyBuffer>()         // y = x, through scratch
      .template Ret<ffi::Buffer<ffi::S32>>()  // workspace address (lo, hi)
      .template Attr<int64_t>("workspace_bytes")
      .template Attr<bool>("reserve_at_initialize");
}

}  // namespace
}  // namespace jax_vmm::testing

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmScratchProbeCudaInitialize, jax_vmm::testing::ProbeInitialize,
                              jax_vmm::testing::BindProbe(ffi::Ffi::BindInitialize()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmScratchProbeCudaExecute, jax_vmm::testing::ProbeExecute,
                              jax_vmm::testing::BindProbe(ffi::Ffi::Bind()),
                              {ffi::Traits::kCmdBufferCompatible});

void jax_vmm::testing::AddProbeCudaTargets(FfiRegistry& registry) {
  registry.Add(
      "jax_vmm_scratch_probe", "CUDA",
      FfiRegistry::Stages{JaxVmmScratchProbeCudaInitialize, JaxVmmScratchProbeCudaExecute});
}
