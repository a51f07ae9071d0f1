// Zeroes the output rows cuDNN leaves unwritten: query rows s >= min(q_lengths[b],
// lengths[b]) of out (B, S, row_bytes), so that padded query rows and sequences of
// length 0 give zeros as jax_vmm.attention promises.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_vmm::cudnn {

// row_bytes must be a multiple of 16 (H_q * D * 2 with D % 8 == 0).
cudaError_t LaunchZeroRows(void* out, const int32_t* q_lengths, const int32_t* lengths,
                           int64_t batch, int64_t q_tokens, int64_t row_bytes,
                           cudaStream_t stream);

}  // namespace jax_vmm::cudnn
