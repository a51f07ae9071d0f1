// Device code of jax_vmm_decode_attention (declared in attention_kernels.h): the split
// kernels, the combine kernel and their launch functions.
//
//   SplitKernelTensorCore  bf16/fp16, head_dim 64/128/256 (attention_tensor_core.cuh).
//   SplitKernelSimple      any dtype/head_dim, CUDA cores, one query head per block:
//       obviously correct, used as the fallback and as the GPU oracle of the fast path.
//   CombineKernel          merges the live splits of each (sequence, head); length 0
//       gives zeros.
// Each has a kRows instantiation for jax_vmm.attention's options (Semantics in
// attention_ffi.h: S query rows, q_lengths, window, softcap); plain decode runs the
// kRows = false ones, unchanged.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/attention/attention_device.cuh"
#include "ops/attention/attention_kernels.h"
#include "ops/attention/attention_plan.h"
#include "ops/attention/attention_tensor_core.cuh"

namespace jax_vmm::attention {
namespace kernels {
namespace {

// Simple split kernel: one query head per block, CUDA cores, any head_dim. Shared memory:
// q and the accumulator [D] each, the chunk's logits [chunk], the softmax state m, l,
// alpha.
struct SimpleShared {
  float* qs;
  float* acc;
  float* logits;
  float* st;
};

// Logits of tokens [t0, t0 + n) (warp w takes tokens w, w + 4, ...), in log2 units.
// kRows: tokens outside [lo, hi) are -inf (not read), the others take the softcap.
template <typename T, bool kRows = false>
__device__ __forceinline__ void SimpleLogits(const ParamsOf<kRows>& p, const T* kseq,
                                             int64_t tstride, int t0, int n, const SimpleShared& sh,
                                             int lo = 0, int hi = 0) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int i = warp; i < n; i += kWarps) {
    if (kRows && (t0 + i < lo || t0 + i >= hi)) {  // warp-uniform
      if (lane == 0) sh.logits[i] = -INFINITY;
      continue;
    }
    const T* krow = kseq + static_cast<int64_t>(t0 + i) * tstride;
    float dot = 0.f;
    for (int d = lane; d < p.head_dim; d += 32) dot += sh.qs[d] * ToFloat(krow[d]);
    dot = WarpSum(dot);
    if (lane == 0) {
      if constexpr (kRows) {
        sh.logits[i] = RowLogit(dot, p.scale_log2, p.scale, p.softcap);
      } else {
        sh.logits[i] = dot * p.scale_log2;
      }
    }
  }
}

// acc = alpha * acc + P V over tokens [t0, t0 + n) (thread d takes dims d, d + 128, ...).
// kRows: tokens outside [lo, hi) (p = 0) are not read.
template <typename T, bool kRows = false>
__device__ __forceinline__ void SimpleAccumulate(const KernelParams& p, const T* vseq,
                                                 int64_t tstride, int t0, int n,
                                                 const SimpleShared& sh, int lo = 0, int hi = 0) {
  const float alpha = sh.st[2];
  const int i0 = kRows ? max(0, lo - t0) : 0, i1 = kRows ? min(n, hi - t0) : n;
  for (int d = threadIdx.x; d < p.head_dim; d += kThreads) {
    float a = sh.acc[d] * alpha;
    for (int i = i0; i < i1; ++i)
      a += sh.logits[i] * ToFloat(vseq[static_cast<int64_t>(t0 + i) * tstride + d]);
    sh.acc[d] = a;
  }
}

// One query row per block: plain decode grid.y = head; kRows grid.y = i * Hq + head (row
// of query i), partial and output rows (b * S + i) * Hq + head.
template <typename T, bool kRows = false>
__global__ void __launch_bounds__(kThreads) SplitKernelSimple(const ParamsOf<kRows> p) {
  const int s = blockIdx.x, row = blockIdx.y, b = blockIdx.z;
  const int len = LiveLength(p.lengths, b, p.max_tokens);
  const int nchunks = (len + p.chunk - 1) / p.chunk;
  if (s >= nchunks) return;
  const int D = p.head_dim;
  const int h = kRows ? row % p.q_heads : row;
  const int kvh = h / p.group;
  int lo = 0, hi = len;
  if constexpr (kRows) {
    RowRange(p.q_lengths, b, p.q_len, len, p.window, row / p.q_heads, &lo, &hi);
  }

  extern __shared__ float smem[];
  const SimpleShared sh{smem, smem + D, smem + 2 * D, smem + 2 * D + p.chunk};
  const int64_t tstride = static_cast<int64_t>(p.token_heads) * D;
  const T* kseq = static_cast<const T*>(p.k) + static_cast<int64_t>(b) * p.max_tokens * tstride +
                  static_cast<int64_t>(kvh) * D;
  const T* vseq = static_cast<const T*>(p.v) + static_cast<int64_t>(b) * p.max_tokens * tstride +
                  static_cast<int64_t>(kvh) * D;
  const int rows = RowsPerSequence<kRows>(p);
  const T* qrow = static_cast<const T*>(p.q) + (static_cast<int64_t>(b) * rows + row) * D;
  for (int d = threadIdx.x; d < D; d += kThreads) {
    sh.qs[d] = ToFloat(qrow[d]);
    sh.acc[d] = 0.f;
  }
  if (threadIdx.x == 0) {
    sh.st[0] = -INFINITY;
    sh.st[1] = 0.f;
    sh.st[2] = 0.f;
  }
  __syncthreads();

  for (int c = s; c < nchunks; c += p.splits) {
    const int t0 = c * p.chunk;
    const int n = min(p.chunk, len - t0);
    if (kRows && (t0 + n <= lo || t0 >= hi)) continue;  // block-uniform
    SimpleLogits<T, kRows>(p, kseq, tstride, t0, n, sh, lo, hi);
    __syncthreads();
    if (threadIdx.x < 32) {
      ChunkSoftmax<kRows>(sh.logits, n, n, sh.st, sh.st + 1, sh.st + 2, threadIdx.x);
    }
    __syncthreads();
    SimpleAccumulate<T, kRows>(p, vseq, tstride, t0, n, sh, lo, hi);
    __syncthreads();
  }

  const int64_t pi = (static_cast<int64_t>(b) * rows + row) * p.splits + s;
  for (int d = threadIdx.x; d < D; d += kThreads) p.ws_acc[pi * D + d] = sh.acc[d];
  if (threadIdx.x == 0) {
    p.ws_m[pi] = sh.st[0];
    p.ws_l[pi] = sh.st[1];
  }
}

// ---------------------------------------------------------------------------------
// Combine: out = sum_s acc_s * 2^(m_s - M) / sum_s l_s * 2^(m_s - M) over live splits.
// Long contexts at small batch give hundreds of splits per (sequence, head); a loop over
// them per thread is a chain of dependent L2 round trips, so every sum runs over the whole
// block: the max and the total as block reductions, the accumulators with the threads as
// `groups` rows of D / 4 lanes, row g summing splits g, g + groups, ... (float4 loads, many
// splits in flight), the rows then added in a fixed order (deterministic).

// Shared floats of the combine: row sums [kThreads * 4], reduction [kWarps], weights [splits].
constexpr size_t CombineSharedBytes(int64_t splits) {
  return sizeof(float) * (static_cast<size_t>(splits) + 4 * kThreads + kWarps);
}
static_assert(CombineSharedBytes(kMaxSplits) <= 48 * 1024, "kMaxSplits past the combine's smem");

// Block-wide max / sum of every thread's x (red: kWarps floats); all threads get the result.
template <bool kMax>
__device__ __forceinline__ float BlockReduce(float x, float* red) {
  x = kMax ? WarpMax(x) : WarpSum(x);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) red[warp] = x;
  __syncthreads();
  float r = red[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) r = kMax ? fmaxf(r, red[w]) : r + red[w];
  __syncthreads();  // red is reused by the next reduction
  return r;
}

// kRows: blockIdx.x is the row (query i, head) i * Hq + head; a split without a live
// token of the row (m = -inf) weighs nothing, and a row without any gets zeros. A row
// whose live logits are all NaN also has m = -inf (fmaxf skips NaN) but l = NaN: it runs
// the weighted sum, which gives NaN, as softmax's (a diverged sequence never looks empty).
template <typename T, bool kRows = false>
__global__ void __launch_bounds__(kThreads) CombineKernel(const ParamsOf<kRows> p) {
  const int h = blockIdx.x, b = blockIdx.y;
  const int D = p.head_dim;
  const int rows = RowsPerSequence<kRows>(p);
  const int len = LiveLength(p.lengths, b, p.max_tokens);
  const int live = min((len + p.chunk - 1) / p.chunk, p.splits);
  T* o = static_cast<T*>(p.out) + (static_cast<int64_t>(b) * rows + h) * D;
  extern __shared__ float4 combine_shared[];  // float4: the row sums are stored as vectors
  float* part = reinterpret_cast<float*>(combine_shared);  // [groups][D]
  float* red = part + 4 * kThreads;                         // [kWarps]
  float* weight = red + kWarps;                             // [splits]
  const int64_t base = (static_cast<int64_t>(b) * rows + h) * p.splits;
  float mx = -INFINITY;
  for (int i = threadIdx.x; i < live; i += kThreads) mx = fmaxf(mx, p.ws_m[base + i]);
  mx = BlockReduce<true>(mx, red);
  bool zeros = live == 0;  // block-uniform, as mx is
  if (kRows && !zeros && mx == -INFINITY) {
    int nan = 0;
    for (int i = threadIdx.x; i < live; i += kThreads) nan |= isnan(p.ws_l[base + i]);
    zeros = !__syncthreads_or(nan);
  }
  if (zeros) {
    for (int d = threadIdx.x; d < D; d += kThreads) o[d] = FromFloat<T>(0.f);
    return;
  }
  float total = 0.f;
  for (int i = threadIdx.x; i < live; i += kThreads) {
    const float w = exp2f(p.ws_m[base + i] - mx);
    weight[i] = w;
    total += p.ws_l[base + i] * w;
  }
  total = BlockReduce<false>(total, red);  // its barrier also publishes weight[]
  const float inv = 1.f / total;           // total >= 1: a live split has a token with p = 1
  // kRows: a split without a live token has weight 0 and acc 0 (never NaN: its masked
  // tokens were not multiplied in).
  if (D % 4 == 0 && D / 4 <= kThreads && (reinterpret_cast<uintptr_t>(p.ws_acc) & 15) == 0) {
    const int cols = D / 4, groups = kThreads / cols;
    const int g = threadIdx.x / cols, c = threadIdx.x - g * cols;
    if (g < groups) {
      const float4* acc = reinterpret_cast<const float4*>(p.ws_acc + base * D) + c;
      float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
      for (int i = g; i < live; i += groups) {
        const float4 v = acc[static_cast<int64_t>(i) * cols];
        const float w = weight[i];
        a.x += v.x * w;
        a.y += v.y * w;
        a.z += v.z * w;
        a.w += v.w * w;
      }
      reinterpret_cast<float4*>(part + g * D)[c] = a;
    }
    __syncthreads();
    for (int d = threadIdx.x; d < D; d += kThreads) {
      float s = 0.f;
      for (int r = 0; r < groups; ++r) s += part[r * D + d];
      o[d] = FromFloat<T>(s * inv);
    }
    return;
  }
  for (int d = threadIdx.x; d < D; d += kThreads) {  // head sizes the rows do not fit
    float a = 0.f;
    for (int i = 0; i < live; ++i) a += p.ws_acc[(base + i) * D + d] * weight[i];
    o[d] = FromFloat<T>(a * inv);
  }
}

template <typename T, int D, int NQT, int U>
cudaError_t LaunchTensorCore(const RowKernelParams& p, cudaStream_t stream) {
  if (p.rows) {
    const dim3 grid(p.splits, p.kv_heads * p.row_blocks, p.batch);
    SplitKernelTensorCore<T, D, NQT, U, true>
        <<<grid, kThreads, SharedBytes<D, NQT, true>(p.chunk), stream>>>(p);
    return cudaGetLastError();
  }
  const KernelParams& plain = p;
  const dim3 grid(p.splits, p.q_heads / p.head_group, p.batch);
  SplitKernelTensorCore<T, D, NQT, U>
      <<<grid, kThreads, SharedBytes<D, NQT>(p.chunk), stream>>>(plain);
  return cudaGetLastError();
}

template <typename T, int D, int U>
cudaError_t LaunchTensorCoreHeads(const RowKernelParams& p, cudaStream_t stream) {
  return p.head_group > 8 ? LaunchTensorCore<T, D, 2, U>(p, stream)
                          : LaunchTensorCore<T, D, 1, U>(p, stream);
}

// Tiles in flight per warp: 2 where registers allow it without spilling (head_dim
// <= 128), 1 for head_dim 256 or when asked for (impl tensor_core_u1, for comparison).
template <typename T>
cudaError_t LaunchTensorCoreDispatch(const RowKernelParams& p, bool one_tile, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64:
      return one_tile ? LaunchTensorCoreHeads<T, 64, 1>(p, stream)
                      : LaunchTensorCoreHeads<T, 64, 2>(p, stream);
    case 128:
      return one_tile ? LaunchTensorCoreHeads<T, 128, 1>(p, stream)
                      : LaunchTensorCoreHeads<T, 128, 2>(p, stream);
    default:
      return LaunchTensorCoreHeads<T, 256, 1>(p, stream);
  }
}

template <typename T>
cudaError_t LaunchSimple(const RowKernelParams& p, cudaStream_t stream) {
  const size_t smem = sizeof(float) * (2 * p.head_dim + p.chunk + 4);
  if (p.rows) {
    SplitKernelSimple<T, true>
        <<<dim3(p.splits, p.q_len * p.q_heads, p.batch), kThreads, smem, stream>>>(p);
  } else {
    const KernelParams& plain = p;
    SplitKernelSimple<T><<<dim3(p.splits, p.q_heads, p.batch), kThreads, smem, stream>>>(plain);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchSplit(const RowKernelParams& p, SplitKernel kernel, cudaStream_t stream) {
  if (kernel == SplitKernel::kSimple) return LaunchSimple<T>(p, stream);
  return LaunchTensorCoreDispatch<T>(p, kernel == SplitKernel::kTensorCoreOneTile, stream);
}

template <typename T>
cudaError_t LaunchCombine(const RowKernelParams& p, cudaStream_t stream) {
  const size_t smem = CombineSharedBytes(p.splits);
  if (p.rows) {
    CombineKernel<T, true><<<dim3(p.q_len * p.q_heads, p.batch), kThreads, smem, stream>>>(p);
  } else {
    const KernelParams& plain = p;
    CombineKernel<T><<<dim3(p.q_heads, p.batch), kThreads, smem, stream>>>(plain);
  }
  return cudaGetLastError();
}

}  // namespace
}  // namespace kernels

cudaError_t LaunchSplitKernel(const RowKernelParams& p, ElementType type, SplitKernel kernel,
                              cudaStream_t stream) {
  switch (type) {
    case ElementType::kBF16:
      return kernels::LaunchSplit<__nv_bfloat16>(p, kernel, stream);
    case ElementType::kF16:
      return kernels::LaunchSplit<__half>(p, kernel, stream);
    default:  // no float32 tensor-core kernel (the host never asks for one)
      return kernels::LaunchSimple<float>(p, stream);
  }
}

cudaError_t LaunchCombineKernel(const RowKernelParams& p, ElementType type, cudaStream_t stream) {
  switch (type) {
    case ElementType::kBF16:
      return kernels::LaunchCombine<__nv_bfloat16>(p, stream);
    case ElementType::kF16:
      return kernels::LaunchCombine<__half>(p, stream);
    default:
      return kernels::LaunchCombine<float>(p, stream);
  }
}

}  // namespace jax_vmm::attention
