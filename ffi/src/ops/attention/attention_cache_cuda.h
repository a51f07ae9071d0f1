// The CUDA handlers' bodies of decode attention over a KVCache layer (attention_cache.h,
// attention_cache_cuda.cc), shared with the testing layer's variants. Each stage resolves
// the layer and runs the kernel's own stage (attention_cuda.h, stream_cuda.h) on the
// layer's buffers; execute first launches the clamp of the lengths (use_limits: false
// only in the testing layer).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "ops/attention/stream_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace jax_vmm::attention {

ffi::Error CacheCudaInitialize(cudaStream_t stream, int32_t device, const ffi::AnyBuffer& q,
                               const ffi::Buffer<ffi::S32>& lengths, const ffi::AnyBuffer& out,
                               const ffi::Buffer<ffi::S32>& read_lengths, uint64_t cache_uid,
                               int64_t layer, int64_t chunk, int64_t splits, int64_t impl);

ffi::Error CacheCudaExecute(bool use_limits, cudaStream_t stream, int32_t device,
                            const ffi::AnyBuffer& q, const ffi::Buffer<ffi::S32>& lengths,
                            ffi::AnyBuffer out, ffi::Buffer<ffi::S32> read_lengths,
                            uint64_t cache_uid, int64_t layer, float scale, int64_t chunk,
                            int64_t splits, int64_t impl);

ffi::Error StreamCacheCudaInitialize(cudaStream_t stream, int32_t device,
                                     const ffi::AnyBuffer& q,
                                     const ffi::Buffer<ffi::S32>& lengths,
                                     const ffi::AnyBuffer& k_scale, const ffi::AnyBuffer& v_scale,
                                     const ffi::AnyBuffer& out,
                                     const ffi::Buffer<ffi::S32>& read_lengths,
                                     uint64_t cache_uid, int64_t layer,
                                     const stream::StreamAttrs& attrs);

ffi::Error StreamCacheCudaExecute(bool use_limits, cudaStream_t stream, int32_t device,
                                  const ffi::AnyBuffer& q, const ffi::Buffer<ffi::S32>& lengths,
                                  const ffi::AnyBuffer& k_scale, const ffi::AnyBuffer& v_scale,
                                  ffi::AnyBuffer out, ffi::Buffer<ffi::S32> read_lengths,
                                  uint64_t cache_uid, int64_t layer,
                                  const stream::StreamAttrs& attrs);

}  // namespace jax_vmm::attention
