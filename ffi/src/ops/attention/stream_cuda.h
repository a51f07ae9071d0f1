// The CUDA handlers' bodies of jax_vmm_decode_attention_v2 (stream_cuda.cc), shared with
// the testing layer's variant.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "ops/attention/stream_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace jax_vmm::attention::stream {

inline constexpr const char* kCudaName = "jax_vmm_decode_attention_v2 (CUDA)";

// The initialize stage: validates, plans, raises the kernel's shared-memory limit and
// grows the graph-safe scratch to the plan's workspace (never under capture).
ffi::Error CudaInitialize(cudaStream_t stream, int32_t device, const ffi::AnyBuffer& q,
                          const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                          const ffi::Buffer<ffi::S32>& lengths, const ffi::AnyBuffer& k_scale,
                          const ffi::AnyBuffer& v_scale, const ffi::AnyBuffer& out,
                          const StreamAttrs& attrs);

// What CudaExecute does before it touches memory (statistics, validation, plan).
ffi::Error CudaBeginExecute(cudaStream_t stream, int32_t device, const ffi::AnyBuffer& q,
                            const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                            const ffi::Buffer<ffi::S32>& lengths, const ffi::AnyBuffer& k_scale,
                            const ffi::AnyBuffer& v_scale, const ffi::AnyBuffer& out,
                            const StreamAttrs& attrs);

// The execute stage: validates, plans, fetches the scratch workspace, clears the
// combine counters and launches the kernels.
ffi::Error CudaExecute(cudaStream_t stream, int32_t device, const ffi::AnyBuffer& q,
                       const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                       const ffi::Buffer<ffi::S32>& lengths, const ffi::AnyBuffer& k_scale,
                       const ffi::AnyBuffer& v_scale, ffi::AnyBuffer out, const StreamAttrs& attrs);

}  // namespace jax_vmm::attention::stream
