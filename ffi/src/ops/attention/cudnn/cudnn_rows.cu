#include <algorithm>
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

// One block per (tile row, sequence, K or V); rows outside the tail return at once.
__global__ void ZeroNonFiniteTailKernel(uint16_t* k, uint16_t* v, const int32_t* lengths,
                                        int64_t max_tokens, int64_t token_stride,
                                        int64_t row_elems, uint16_t exponent_mask) {
  const int64_t b = blockIdx.y;
  const int64_t n = min(max(static_cast<int64_t>(lengths[b]), int64_t{0}), max_tokens);
  const int64_t end = min((n + kReadTileTokens - 1) / kReadTileTokens * kReadTileTokens,
                          max_tokens);
  const int64_t t = n + blockIdx.x;
  if (t >= end) return;
  uint16_t* row = (blockIdx.z == 0 ? k : v) + (b * max_tokens + t) * token_stride;
  for (int64_t i = threadIdx.x; i < row_elems; i += blockDim.x) {
    // All exponent bits set: an infinity or a NaN, in bfloat16 and in float16. Only those
    // are written, so a tile row in the read-only zero mapping is never stored to.
    if ((row[i] & exponent_mask) == exponent_mask) row[i] = 0;
  }
}

}  // namespace

cudaError_t LaunchZeroNonFiniteTail(void* k, void* v, const int32_t* lengths, int64_t batch,
                                    int64_t max_tokens, int64_t token_stride, int64_t row_elems,
                                    bool fp16, cudaStream_t stream) {
  if (batch == 0 || max_tokens == 0 || row_elems == 0) return cudaSuccess;
  const unsigned tail_rows = static_cast<unsigned>(std::min(kReadTileTokens - 1, max_tokens));
  const dim3 grid(tail_rows, static_cast<unsigned>(batch), 2);
  ZeroNonFiniteTailKernel<<<grid, 128, 0, stream>>>(
      static_cast<uint16_t*>(k), static_cast<uint16_t*>(v), lengths, max_tokens, token_stride,
      row_elems, static_cast<uint16_t>(fp16 ? 0x7C00 : 0x7F80));
  return cudaGetLastError();
}

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
