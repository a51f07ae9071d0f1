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

}  // namespace

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
