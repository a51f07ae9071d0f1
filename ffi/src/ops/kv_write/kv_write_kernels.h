// Device code of the kv_write CUDA handlers as host code sees it (the header of the host /
// device-code pair kv_write_cuda.cc, kv_write_fp8_cuda.cc / kv_write_kernels.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "ops/kv_write/kv_write.h"

namespace jax_vmm::kv {

// Largest vectors per token the tiled kernel indexes (int): 32 tokens of 2^24 vectors.
inline constexpr int64_t kMaxTiledVectorsPerToken = int64_t{1} << 24;

// Launches the production kernel (CheckedTokens) for `p` on `stream`: the tiled kernel,
// or the token kernel for tokens larger than it indexes (kv_write_kernel.cuh).
cudaError_t LaunchKvWrite(const Params& p, cudaStream_t stream);

// The same with the token kernel whatever the token size: the fallback LaunchKvWrite
// picks for huge tokens, launchable on its own so that tests can reach it.
cudaError_t LaunchKvWriteTokenKernel(const Params& p, cudaStream_t stream);

// kv_write_fp8's quantization (kv_write_fp8.h): the new tokens' element type, the cache's
// head_dim (a multiple of 8) and the per-head scales of each side.
struct Fp8Quantization {
  enum class Source { kF32, kBF16, kF16 } source = Source::kF32;
  int head_dim = 0;
  const float* scale[2] = {nullptr, nullptr};  // (heads,) for k and v, device memory
};

// Launches the tiled kernel quantizing `p`'s tokens (p.token_bytes: fp8 bytes per token,
// at most 8 * kMaxTiledVectorsPerToken; the host checks).
cudaError_t LaunchKvWriteFp8(const Params& p, const Fp8Quantization& q, cudaStream_t stream);

// Remembers that a handler ran on `device`: its drop counter is then part of
// kv_write_stats(). Thread-safe.
void NoteDevice(int device);

}  // namespace jax_vmm::kv
