// The CUDA decode-attention handlers' bodies (attention_cuda.cc), shared with the
// testing layer's variants, and the host helpers of every CUDA attention handler.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <utility>

#include "ops/attention/attention_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace jax_vmm::attention {

// The initialize stage: validates, plans and grows the graph-safe scratch to the plan's
// workspace (never under capture).
xla::ffi::Error CudaInitialize(cudaStream_t stream, int32_t device, const xla::ffi::AnyBuffer& q,
                               const xla::ffi::AnyBuffer& k, const xla::ffi::AnyBuffer& v,
                               const xla::ffi::Buffer<xla::ffi::S32>& lengths,
                               const xla::ffi::AnyBuffer& out, int64_t chunk, int64_t splits,
                               int64_t impl);

// The execute stage: validates, plans, fetches the workspace (`workspace`, the XLA
// result, or the graph-safe scratch when null) and launches the kernels. token_heads:
// Shapes::token_heads of k and v (0: dense).
xla::ffi::Error CudaExecute(cudaStream_t stream, int32_t device, const xla::ffi::AnyBuffer& q,
                            const xla::ffi::AnyBuffer& k, const xla::ffi::AnyBuffer& v,
                            const xla::ffi::Buffer<xla::ffi::S32>& lengths, xla::ffi::AnyBuffer out,
                            xla::ffi::AnyBuffer* workspace, float scale, int64_t chunk,
                            int64_t splits, int64_t impl, const Semantics& sem,
                            int64_t token_heads = 0);

// What CudaExecute does before it touches memory (statistics, validation, plan).
xla::ffi::Error CudaBeginExecute(cudaStream_t stream, int32_t device, const xla::ffi::AnyBuffer& q,
                                 const xla::ffi::AnyBuffer& k, const xla::ffi::AnyBuffer& v,
                                 const xla::ffi::Buffer<xla::ffi::S32>& lengths,
                                 const xla::ffi::AnyBuffer& out, int64_t chunk, int64_t splits,
                                 int64_t impl);

// Host helpers every CUDA decode-attention handler uses (split-K and streaming).
// The SM count of device ordinal `device` (cached; a device attribute query, legal under
// stream capture). Thread-safe.
cudaError_t SmCount(int device, int* out);

// Counts an execute call, and whether `stream` is capturing, in the handler statistics.
void CountExecute(cudaStream_t stream);

// The context every CUDA target binds before its operands: stream, device ordinal.
template <typename B>
auto BindCudaContext(B&& b) {
  return std::forward<B>(b)
      .template Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<xla::ffi::DeviceOrdinal>();
}

}  // namespace jax_vmm::attention
