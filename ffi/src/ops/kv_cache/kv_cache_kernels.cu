// Device code of the KVCache-layer ops (kv_cache_kernels.h).
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/kv_cache/kv_cache_kernels.h"

namespace jax_vmm::kvcache {
namespace {

constexpr int kThreads = 256;

__global__ void ClampLengthsKernel(const int32_t* lengths, const int32_t* limits, int32_t* read,
                                   int batch, int max_tokens, unsigned long long* clamped) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  const int32_t len = lengths[b];
  int32_t n = len < 0 ? 0 : (len > max_tokens ? max_tokens : len);
  if (limits != nullptr) {
    const int32_t ensured = limits[b];
    if (len > ensured) atomicAdd(clamped, 1ULL);
    n = n < ensured ? n : ensured;
  }
  read[b] = n;
}

// Row b (blockIdx.y) of `tokens * token_units` units of dst: the first read[b] tokens
// copied from src (whose tokens are src_units apart), the rest zeroed; a grid-stride loop
// over the row.
template <typename Unit>
__global__ void CopyLiveTokensKernel(const Unit* src, Unit* dst, const int32_t* read,
                                     int64_t tokens, int64_t token_units, int64_t src_units) {
  const int64_t b = blockIdx.y;
  const int64_t row = tokens * token_units;
  const int64_t live = static_cast<int64_t>(min(max(read[b], 0), static_cast<int32_t>(tokens))) *
                       token_units;
  const Unit* s = src + b * tokens * src_units;
  Unit* d = dst + b * row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < row;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / token_units;
    d[i] = i < live ? s[t * src_units + (i - t * token_units)] : Unit{};
  }
}

}  // namespace

cudaError_t LaunchCopyLiveTokens(const void* src, void* dst, const int32_t* read, int64_t batch,
                                 int64_t tokens, int64_t token_bytes, int64_t src_row_bytes,
                                 cudaStream_t stream) {
  if (batch <= 0 || tokens <= 0 || token_bytes <= 0) return cudaSuccess;
  const bool wide = token_bytes % sizeof(uint4) == 0 && src_row_bytes % sizeof(uint4) == 0 &&
                    reinterpret_cast<uintptr_t>(src) % sizeof(uint4) == 0 &&
                    reinterpret_cast<uintptr_t>(dst) % sizeof(uint4) == 0;
  const int64_t unit = wide ? static_cast<int64_t>(sizeof(uint4)) : 1;
  const int64_t units = token_bytes / unit, src_units = src_row_bytes / unit;
  const int64_t row_blocks = (tokens * units + kThreads - 1) / kThreads;
  const dim3 grid(static_cast<unsigned>(row_blocks < 1024 ? row_blocks : 1024),
                  static_cast<unsigned>(batch));
  if (wide) {
    CopyLiveTokensKernel<<<grid, kThreads, 0, stream>>>(
        static_cast<const uint4*>(src), static_cast<uint4*>(dst), read, tokens, units, src_units);
  } else {
    CopyLiveTokensKernel<<<grid, kThreads, 0, stream>>>(
        static_cast<const unsigned char*>(src), static_cast<unsigned char*>(dst), read, tokens,
        units, src_units);
  }
  return cudaGetLastError();
}

cudaError_t LaunchClampLengths(const int32_t* lengths, const int32_t* limits, int32_t* read,
                               int batch, int max_tokens, unsigned long long* clamped,
                               cudaStream_t stream) {
  if (batch <= 0) return cudaSuccess;
  const int blocks = (batch + kThreads - 1) / kThreads;
  ClampLengthsKernel<<<blocks, kThreads, 0, stream>>>(lengths, limits, read, batch, max_tokens,
                                                      clamped);
  return cudaGetLastError();
}

}  // namespace jax_vmm::kvcache
