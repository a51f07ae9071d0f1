// Device code of jax_vmm_decode_attention_v2 (declared in stream_kernels.h): the
// instantiations of StreamKernel (stream_kernel.cuh), the combine kernel, and the launch
// functions that pick them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>

#include "ops/attention/attention_device.cuh"
#include "ops/attention/stream_kernel.cuh"
#include "ops/attention/stream_kernels.h"
#include "ops/attention/stream_plan.h"

namespace jax_vmm::attention::stream {
namespace {

// Merges the split units after StreamKernel (combine = kCombineKernel): one block per
// unit (grid (unit_groups, batch)); units finished inside one CTA (and empty sequences)
// were written already. `grid`: the StreamKernel's grid size.
template <typename QT, int D, int kTile>
__global__ void __launch_bounds__(kThreads) CombineKernel(const StreamParams p, int grid) {
  const int hg = blockIdx.x, b = blockIdx.y;
  __shared__ int sums[2][kThreads];
  __shared__ float tot[2 * 16];
  int before = 0, all = 0;
  for (int i = threadIdx.x; i < p.batch; i += kThreads) {
    const int t = TilesOf(kernels::LiveLength(p.lengths, i, p.max_tokens), kTile);
    all += t;
    if (i < b) before += t;
  }
  sums[0][threadIdx.x] = before;
  sums[1][threadIdx.x] = all;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int t = 1; t < kThreads; ++t) {
      sums[0][0] += sums[0][t];
      sums[1][0] += sums[1][t];
    }
  }
  __syncthreads();
  const int tiles = TilesOf(kernels::LiveLength(p.lengths, b, p.max_tokens), kTile);
  if (tiles == 0) return;
  const int total = p.unit_groups * sums[1][0];
  const int C = EffectiveCtas(grid, total, p.min_tiles);
  const int unit_start = p.unit_groups * sums[0][0] + hg * tiles;
  const int first = OwnerOf(unit_start, total, C);
  const int last = OwnerOf(unit_start + tiles - 1, total, C);
  if (first == last) return;
  CombineUnit<QT, D>(p, b, hg, first, last, tot);
}

// launch = false only raises the kernel's shared-memory limit.
template <typename S, typename QT, int D, int NQT, bool kBulk>
cudaError_t RunKernel(const StreamParams* p, const KernelChoice& k, cudaStream_t stream) {
  static std::once_flag once;
  static cudaError_t attr = cudaSuccess;
  std::call_once(once, [] {
    attr = cudaFuncSetAttribute(StreamKernel<S, QT, D, NQT, kBulk>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(kMaxSmemPerCta));
  });
  if (attr != cudaSuccess || p == nullptr) return attr;
  StreamKernel<S, QT, D, NQT, kBulk><<<k.ctas, kThreads, k.smem, stream>>>(*p);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess || p->fused) return e;
  CombineKernel<QT, D, TileTokens(D * Storage<S>::kBytes)>
      <<<dim3(static_cast<unsigned>(p->unit_groups), static_cast<unsigned>(p->batch)), kThreads, 0,
         stream>>>(*p, static_cast<int>(k.ctas));
  return cudaGetLastError();
}

// The instantiation `k` names; p == nullptr: only its shared-memory limit.
template <typename S, typename QT, int D>
cudaError_t RunHeads(const StreamParams* p, const KernelChoice& k, cudaStream_t stream) {
  if (k.two_head_tiles) {
    return k.bulk ? RunKernel<S, QT, D, 2, true>(p, k, stream)
                  : RunKernel<S, QT, D, 2, false>(p, k, stream);
  }
  return k.bulk ? RunKernel<S, QT, D, 1, true>(p, k, stream)
                : RunKernel<S, QT, D, 1, false>(p, k, stream);
}

template <typename S, typename QT>
cudaError_t RunDims(const StreamParams* p, const KernelChoice& k, cudaStream_t stream) {
  switch (k.head_dim) {
    case 64:
      return RunHeads<S, QT, 64>(p, k, stream);
    case 128:
      return RunHeads<S, QT, 128>(p, k, stream);
    default:  // 256 (the host checks)
      return RunHeads<S, QT, 256>(p, k, stream);
  }
}

cudaError_t Run(const StreamParams* p, const KernelChoice& k, cudaStream_t stream) {
  switch (k.kv) {
    case KvStorage::kBf16:
      return RunDims<__nv_bfloat16, __nv_bfloat16>(p, k, stream);
    case KvStorage::kF16:
      return RunDims<__half, __half>(p, k, stream);
    default:
      return k.q_bf16 ? RunDims<Fp8E4M3, __nv_bfloat16>(p, k, stream)
                      : RunDims<Fp8E4M3, __half>(p, k, stream);
  }
}

}  // namespace

cudaError_t PrepareStreamKernel(const KernelChoice& choice) {
  return Run(nullptr, choice, nullptr);
}

cudaError_t LaunchStreamKernels(const StreamParams& p, const KernelChoice& choice,
                                cudaStream_t stream) {
  return Run(&p, choice, stream);
}

}  // namespace jax_vmm::attention::stream
