// Device helpers shared by the decode-attention kernels (the split-K kernels of
// attention_kernels.cu / attention_tensor_core.cuh and the streaming kernel of
// stream_kernel.cuh): the split kernels' block shape, length clamping, warp reductions,
// dtype conversion, the 16-byte load, the tensor-core ops, the fixed-order sum of the
// warps' PV accumulators and the chunk softmax. Device code only; include from .cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ops/attention/attention_kernels.h"

namespace jax_vmm::attention::kernels {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kStatRows = 16;  // per-head softmax state slots (>= kMaxHeadGroup)

// A kernel's parameter struct: RowKernelParams for the kRows (general attention)
// instantiations, KernelParams for plain decode.
template <bool kRows>
using ParamsOf = std::conditional_t<kRows, RowKernelParams, KernelParams>;

// Query rows per sequence in the output and the partials: S * H_q (kRows), else H_q.
template <bool kRows>
__device__ __forceinline__ int RowsPerSequence(const ParamsOf<kRows>& p) {
  if constexpr (kRows) {
    return p.q_len * p.q_heads;
  } else {
    return p.q_heads;
  }
}

// lengths[b] clamped to [0, max_tokens].
__device__ __forceinline__ int LiveLength(const int32_t* lengths, int b, int max_tokens) {
  const int n = __ldg(lengths + b);
  return n < 0 ? 0 : (n > max_tokens ? max_tokens : n);
}

// The token range [*lo, *hi) query row i (< S) of a sequence of `len` tokens attends to
// (Semantics in attention_ffi.h): the last qn = clamp(q_lengths[b] or S, 0, min(S, len))
// rows sit at positions len - qn + i; other rows get an empty range.
__device__ __forceinline__ void RowRange(const int32_t* q_lengths, int b, int S, int len,
                                         int window, int i, int* lo, int* hi) {
  int qn = q_lengths != nullptr ? __ldg(q_lengths + b) : S;
  qn = qn < 0 ? 0 : qn;
  qn = min(qn, min(S, len));
  if (i >= qn) {
    *lo = *hi = 0;
    return;
  }
  const int p = len - qn + i;
  *hi = p + 1;
  *lo = window > 0 ? max(0, p - window + 1) : 0;
}

// A logit in log2 units from a raw dot product: scale, then the optional softcap.
__device__ __forceinline__ float RowLogit(float dot, float scale_log2, float scale, float softcap) {
  if (softcap == 0.f) return dot * scale_log2;
  return softcap * tanhf(dot * scale / softcap) * 1.4426950408889634f;
}

__device__ __forceinline__ float WarpMax(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// 16-byte read-only load (ld.global.nc.v4). Callers guard it: it is never issued for a
// token at or past the sequence length.
__device__ __forceinline__ uint4 Load16(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// Tensor-core ops per element type: D(16x8, f32) += A(16x16, row) * B(16x8, col).
// Fragment layout (PTX ISA, mma.m16n8k16, 16-bit inputs), lane = 4 * grp + tig:
//   A regs: a0 = (row grp,   k 2tig..2tig+1), a1 = (row grp+8, k 2tig..+1),
//           a2 = (row grp,   k 2tig+8..+9),   a3 = (row grp+8, k 2tig+8..+9)
//   B regs: b0 = (k 2tig..2tig+1, col grp),  b1 = (k 2tig+8..+9, col grp)
//   C/D:    c0, c1 = (row grp, col 2tig, 2tig+1), c2, c3 = (row grp+8, same cols)
// In each 32-bit register the lower k index sits in the low 16 bits.
template <typename T>
struct TensorCore;

template <>
struct TensorCore<__nv_bfloat16> {
  static __device__ __forceinline__ void Mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t Pack(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
    uint32_t r;
    memcpy(&r, &v, 4);
    return r;
  }
};

template <>
struct TensorCore<__half> {
  static __device__ __forceinline__ void Mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t Pack(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    uint32_t r;
    memcpy(&r, &v, 4);
    return r;
  }
};

// Sums the warps' PV accumulators (O^T tiles in the tensor-core layout: lane (grp, tig)
// of warp w holds heads 8 nt + 2 tig + e at dims 64 (mt / 4) + 8 grp + 2 (mt % 4), + 1 in
// c[e], c[2 + e]), each scaled by its column factor f[nt][e], into red[head][dim] (row
// stride `stride`, heads < GB) in warp order 0 .. W - 1, so that the sum is deterministic;
// warp 0 overwrites. Called by all W warps of the block (it has barriers).
template <int W, int NQT, int MT>
__device__ __forceinline__ void AccumulateWarpsInOrder(float* red, int stride, int GB,
                                                       const float (&acc)[NQT][MT][4],
                                                       const float (&f)[NQT][2]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, grp = lane >> 2, tig = lane & 3;
  for (int w = 0; w < W; ++w) {
    if (warp == w) {
#pragma unroll
      for (int nt = 0; nt < NQT; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int head = nt * 8 + 2 * tig + e;
          if (head < GB) {
            float* r = red + head * stride;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              const int d = 64 * (mt / 4) + 8 * grp + 2 * (mt % 4);
              r[d] = (w ? r[d] : 0.f) + f[nt][e] * acc[nt][mt][e];
              r[d + 1] = (w ? r[d + 1] : 0.f) + f[nt][e] * acc[nt][mt][2 + e];
            }
          }
        }
      }
    }
    __syncthreads();
  }
}

// Folds one chunk's logits row (n valid entries, log2 units) into the running softmax
// state of its head: rewrites the row as p = exp2(logit - m_new), zero-fills the row up
// to `padded` (the tile tail that PV reads), and updates m, l and the accumulator
// rescale factor alpha. Called by a whole warp. kMasked: logits may be -inf (masked
// tokens), all of them for a row with no live token so far: then p = alpha = 0.
template <bool kMasked = false>
__device__ __forceinline__ void ChunkSoftmax(float* row, int n, int padded, float* m, float* l,
                                             float* alpha, int lane) {
  float mx = -INFINITY;
  for (int i = lane; i < n; i += 32) mx = fmaxf(mx, row[i]);
  mx = WarpMax(mx);
  const float m_old = *m;  // every lane reads before lane 0 writes (after WarpSum below)
  const float m_new = fmaxf(m_old, mx);
  const float ref = kMasked && m_new == -INFINITY ? 0.f : m_new;
  float sum = 0.f;
  for (int i = lane; i < n; i += 32) {
    const float e = exp2f(row[i] - ref);
    row[i] = e;
    sum += e;
  }
  for (int i = n + lane; i < padded; i += 32) row[i] = 0.f;
  sum = WarpSum(sum);
  if (lane == 0) {
    const float a = exp2f(m_old - ref);  // m_old = -inf on the first chunk: a = 0
    *alpha = a;
    *l = *l * a + sum;
    *m = m_new;
  }
}

}  // namespace jax_vmm::attention::kernels
