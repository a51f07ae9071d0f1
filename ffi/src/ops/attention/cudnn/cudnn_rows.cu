#include <cstdint>

#include "ops/attention/cudnn/cudnn_rows.h"

namespace jax_vmm::cudnn {
namespace {

__device__ void ZeroRow(void* out, int64_t row, int64_t row_vecs) {
  uint4* p = static_cast<uint4*>(out) + row * row_vecs;
  for (int64_t i = threadIdx.x; i < row_vecs; i += blockDim.x) p[i] = make_uint4(0, 0, 0, 0);
}

// One block per (query row, sequence); block (0, b) publishes sequence b's numbers.
__global__ void PrepareRowsKernel(RowsPlan p, int64_t row_vecs) {
  const int64_t s = blockIdx.x;
  const int64_t b = blockIdx.y;
  const int32_t len = p.lengths[b];
  int32_t n = min(max(len, 0), p.max_tokens);
  if (p.limits != nullptr) n = min(n, p.limits[b]);
  if (s == 0 && threadIdx.x == 0) {
    p.read[b] = n;
    p.read[p.batch + b] = min(min(max(p.q_lengths[b], 0), static_cast<int32_t>(p.q_tokens)), n);
    if (p.limits != nullptr && len > p.limits[b]) atomicAdd(p.clamped, 1ULL);
  }
  if (p.out != nullptr && n == 0) ZeroRow(p.out, b * p.q_tokens + s, row_vecs);
}

// One block per (query row, sequence); rows that cuDNN computed return at once.
__global__ void ZeroRowsKernel(void* out, const int32_t* q_lengths, const int32_t* lengths,
                               int64_t q_tokens, int64_t row_vecs) {
  const int64_t s = blockIdx.x;
  const int64_t b = blockIdx.y;
  if (s < min(q_lengths[b], lengths[b])) return;
  ZeroRow(out, b * q_tokens + s, row_vecs);
}

}  // namespace

cudaError_t LaunchPrepareRows(const RowsPlan& plan, cudaStream_t stream) {
  if (plan.batch == 0 || plan.q_tokens == 0) return cudaSuccess;
  const unsigned rows = plan.out == nullptr ? 1u : static_cast<unsigned>(plan.q_tokens);
  const dim3 grid(rows, static_cast<unsigned>(plan.batch));
  PrepareRowsKernel<<<grid, 128, 0, stream>>>(plan, plan.row_bytes / 16);
  return cudaGetLastError();
}

cudaError_t LaunchZeroRows(void* out, const int32_t* q_lengths, const int32_t* lengths,
                           int64_t batch, int64_t q_tokens, int64_t row_bytes,
                           cudaStream_t stream) {
  if (batch == 0 || q_tokens == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(q_tokens), static_cast<unsigned>(batch));
  ZeroRowsKernel<<<grid, 128, 0, stream>>>(out, q_lengths, lengths, q_tokens, row_bytes / 16);
  return cudaGetLastError();
}

}  // namespace jax_vmm::cudnn
