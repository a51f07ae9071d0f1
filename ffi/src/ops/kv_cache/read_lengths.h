// jax_vmm_kv_cache_read_lengths (CUDA): what an attention call over a KVCache's layers may
// read, read_lengths[b] = min(clamp(lengths[b], 0, T), ensured tokens of b), counting the
// sequences it clamps (kv.check() reports them).
//
// Its own call, not part of each layer's attention, because the answer is the same for
// every layer of a step: the call names the cache and no layer, carries no JAX effect and
// no token, so XLA merges the identical calls of all layers of a step into one (HloCSE)
// and a decode step runs one clamp instead of one per layer. The table of ensured tokens
// only changes between executions (in dispatch order on XLA's stream), never inside one.
//
// Operands: lengths s32 (B,). Result: read_lengths s32 (B,). Attribute: cache_uid (u64).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jax_vmm::kvcache {

namespace ffi = xla::ffi;

// use_limits = false (the testing layer's variant) clamps to [0, T] only and counts nothing.
ffi::Error ReadLengthsCudaExecute(bool use_limits, cudaStream_t stream, int32_t device,
                                  ffi::Buffer<ffi::S32> lengths,
                                  ffi::Result<ffi::Buffer<ffi::S32>> read_lengths,
                                  uint64_t cache_uid);

// The execute handler (production: kUseLimits true; the testing layer instantiates false).
template <bool kUseLimits>
ffi::Error ReadLengthsCuda(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::S32> lengths,
                           ffi::Result<ffi::Buffer<ffi::S32>> read_lengths, uint64_t cache_uid) {
  return ReadLengthsCudaExecute(kUseLimits, stream, device, lengths, read_lengths, cache_uid);
}

template <typename B>
auto BindReadLengths(B&& b) {
  return std::forward<B>(b)
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Arg<ffi::Buffer<ffi::S32>>()   // lengths
      .template Ret<ffi::Buffer<ffi::S32>>()   // read_lengths
      .template Attr<uint64_t>("cache_uid");
}

}  // namespace jax_vmm::kvcache
