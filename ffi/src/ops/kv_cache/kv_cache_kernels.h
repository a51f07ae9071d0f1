// Device code of the KVCache-layer ops as host code sees it (kv_cache_kernels.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_vmm::kvcache {

// read[b] = min(clamp(lengths[b], 0, max_tokens), limits[b]) for b < batch, counting in
// *clamped every b with lengths[b] > limits[b]; limits null: clamp to max_tokens only,
// count nothing. All pointers device memory; one small kernel on `stream` (a graph node
// when captured: it reads the table at replay time).
cudaError_t LaunchClampLengths(const int32_t* lengths, const int32_t* limits, int32_t* read,
                               int batch, int max_tokens, unsigned long long* clamped,
                               cudaStream_t stream);

}  // namespace jax_vmm::kvcache
