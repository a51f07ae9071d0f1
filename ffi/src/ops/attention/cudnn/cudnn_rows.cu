#include <cstdint>

#include "ops/attention/cudnn/cudnn_rows.h"

namespace jax_vmm::cudnn {
namespace {

// One block per (query row, sequence); every block derives its sequence's numbers, block
// (0, b) publishes them, and only blocks of rows the graph will not compute write zeros.
__global__ void PrepareRowsKernel(RowsPlan p, int64_t row_vecs) {
  const int64_t s = blockIdx.x;
  const int64_t b = blockIdx.y;
  const int32_t len = p.lengths[b];
  int32_t n = min(max(len, 0), p.max_tokens);
  if (p.limits != nullptr) n = min(n, p.limits[b]);
  const int32_t qn = min(min(max(p.q_lengths[b], 0), static_cast<int32_t>(p.q_tokens)), n);
  if (s == 0 && threadIdx.x == 0) {
    p.read[b] = n;
    p.read[p.batch + b] = qn;
    if (p.limits != nullptr && len > p.limits[b]) atomicAdd(p.clamped, 1ULL);
  }
  if (p.out == nullptr || s < qn) return;
  uint4* row = static_cast<uint4*>(p.out) + (b * p.q_tokens + s) * row_vecs;
  for (int64_t i = threadIdx.x; i < row_vecs; i += blockDim.x) row[i] = make_uint4(0, 0, 0, 0);
}

}  // namespace

cudaError_t LaunchPrepareRows(const RowsPlan& plan, cudaStream_t stream) {
  if (plan.batch == 0 || plan.q_tokens == 0) return cudaSuccess;
  const unsigned rows = plan.out == nullptr ? 1u : static_cast<unsigned>(plan.q_tokens);
  const dim3 grid(rows, static_cast<unsigned>(plan.batch));
  PrepareRowsKernel<<<grid, 128, 0, stream>>>(plan, plan.row_bytes / 16);
  return cudaGetLastError();
}

}  // namespace jax_vmm::cudnn
