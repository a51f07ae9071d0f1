#include <cstdint>

#include "ops/attention/cudnn/cudnn_rows.h"

namespace jax_vmm::cudnn {
namespace {

// One block per (query row, sequence); rows that cuDNN computed return at once.
__global__ void ZeroRowsKernel(uint4* out, const int32_t* q_lengths, const int32_t* lengths,
                               int64_t q_tokens, int64_t row_vecs) {
  const int64_t s = blockIdx.x;
  const int64_t b = blockIdx.y;
  const int32_t valid = min(q_lengths[b], lengths[b]);
  if (s < valid) return;
  uint4* row = out + (b * q_tokens + s) * row_vecs;
  for (int64_t i = threadIdx.x; i < row_vecs; i += blockDim.x) row[i] = make_uint4(0, 0, 0, 0);
}

}  // namespace

cudaError_t LaunchZeroRows(void* out, const int32_t* q_lengths, const int32_t* lengths,
                           int64_t batch, int64_t q_tokens, int64_t row_bytes,
                           cudaStream_t stream) {
  if (batch == 0 || q_tokens == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(q_tokens), static_cast<unsigned>(batch));
  ZeroRowsKernel<<<grid, 128, 0, stream>>>(static_cast<uint4*>(out), q_lengths, lengths, q_tokens,
                                          row_bytes / 16);
  return cudaGetLastError();
}

}  // namespace jax_vmm::cudnn
