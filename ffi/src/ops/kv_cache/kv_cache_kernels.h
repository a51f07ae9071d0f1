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

// For each sequence b < batch of a per-sequence layer `src` (batch rows of `tokens` tokens
// of token_bytes bytes, src_row_bytes apart): copies its first read[b] tokens into the
// same place of the dense `dst` and writes zeros over the rest of the row, so nothing past
// read[b] is read. read: device memory (a graph replay copies what the table says then).
cudaError_t LaunchCopyLiveTokens(const void* src, void* dst, const int32_t* read, int64_t batch,
                                 int64_t tokens, int64_t token_bytes, int64_t src_row_bytes,
                                 cudaStream_t stream);

}  // namespace jax_vmm::kvcache
