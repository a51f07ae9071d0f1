// CUDA handlers of jax_vmm_decode_attention: split-K ("flash-decoding") decode attention
// that reads only each sequence's live tokens, with its split partials in jax_vmm's
// graph-safe scratch.
//
// Launch shape depends on static shapes only (attention_plan.h): grid = (splits, head
// groups, batch). Each block reads its sequence's length from device memory and returns
// at once when it has no chunk, so a CUDA graph captured once stays correct while the
// sequences grow (host code does not run on graph replay).
//
// Kernels
//   SplitKernelTensorCore  bf16/fp16, head_dim 64/128/256. One block = one split of one
//       sequence for up to 16 query heads that share a KV head (GQA), so every K/V byte
//       is loaded once per block. 4 warps; each warp takes 16-token tiles of a chunk.
//       QK^T and PV run on tensor cores (mma.sync m16n8k16, fp32 accumulation); K/V are
//       read straight from global memory with coalesced 16-byte loads (a permutation of
//       the reduction dimension lets the natural row-major layout feed the fragments).
//       Logits of a chunk go through shared memory for an exact chunk softmax.
//   SplitKernelSimple      any dtype/head_dim, CUDA cores, one query head per block:
//       obviously correct, used as the fallback and as the GPU oracle of the fast path.
//   CombineKernel          merges the live splits of each (sequence, head); length 0
//       gives zeros.
//
// Handlers
//   jax_vmm_decode_attention               {initialize: grow the scratch to the plan's
//       size (never under capture); execute: fetch it and launch}, kCmdBufferCompatible.
//   jax_vmm_decode_attention_xla_workspace {execute}: partials in a second XLA output.
//   jax_vmm_decode_attention_prefilled     as the first, plus an ignored fifth operand
//       that Python aliases to the output (tests: a NaN-filled output buffer).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>

#include "common/cuda_error.h"
#include "jax_vmm/scratch.h"
#include "ops/attention/attention_check.h"
#include "ops/attention/attention_plan.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_vmm::attention {
namespace {

constexpr const char* kName = "jax_vmm_decode_attention (CUDA)";
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kStatRows = 16;  // per-head softmax state slots (>= kMaxHeadGroup)

struct Params {
  const void* q;  // (B, Hq, D)
  const void* k;  // (B, T, Hkv, D)
  const void* v;
  const int32_t* lengths;  // (B,)
  void* out;               // (B, Hq, D)
  float* ws_acc;           // [P][D], P = B * Hq * splits
  float* ws_m;             // [P]
  float* ws_l;             // [P]
  int batch, max_tokens, q_heads, kv_heads, head_dim;
  int group;       // q_heads / kv_heads
  int head_group;  // query heads per tensor-core block
  int chunk, splits;
  float scale_log2;  // softmax scale * log2(e): logits are kept in log2 units
};

// ---------------------------------------------------------------------------------
// Device helpers

__device__ __forceinline__ int LiveLength(const int32_t* lengths, int b, int max_tokens) {
  const int n = __ldg(lengths + b);
  return n < 0 ? 0 : (n > max_tokens ? max_tokens : n);
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

// Folds one chunk's logits row (n valid entries, log2 units) into the running softmax
// state of its head: rewrites the row as p = exp2(logit - m_new), zero-fills the row up
// to `padded` (the tile tail that PV reads), and updates m, l and the accumulator
// rescale factor alpha. Called by a whole warp.
__device__ __forceinline__ void ChunkSoftmax(float* row, int n, int padded, float* m, float* l,
                                             float* alpha, int lane) {
  float mx = -INFINITY;
  for (int i = lane; i < n; i += 32) mx = fmaxf(mx, row[i]);
  mx = WarpMax(mx);
  const float m_old = *m;  // every lane reads before lane 0 writes (after WarpSum below)
  const float m_new = fmaxf(m_old, mx);
  float sum = 0.f;
  for (int i = lane; i < n; i += 32) {
    const float e = exp2f(row[i] - m_new);
    row[i] = e;
    sum += e;
  }
  for (int i = n + lane; i < padded; i += 32) row[i] = 0.f;
  sum = WarpSum(sum);
  if (lane == 0) {
    const float a = exp2f(m_old - m_new);  // m_old = -inf on the first chunk: a = 0
    *alpha = a;
    *l = *l * a + sum;
    *m = m_new;
  }
}

// ---------------------------------------------------------------------------------
// Tensor-core split kernel. NQT = QK n-tiles of 8 heads (1: head_group <= 8, 2: <= 16).
// U = 16-token tiles a warp loads before it computes (more bytes in flight per warp,
// more registers).

template <typename T, int D, int NQT, int U>
__global__ void __launch_bounds__(kThreads) SplitKernelTensorCore(const Params p) {
  using TC = TensorCore<T>;
  constexpr int kRows = 8 * NQT;    // heads held per block
  constexpr int kKBlocks = D / 32;  // QK: 32-dim blocks per K row
  constexpr int kVChunks = D / 64;  // PV: 64-dim chunks per V row
  constexpr int kMTiles = D / 16;   // PV: output m-tiles of 16 dims
  constexpr int kRedStride = D + 4;
  static_assert(D % 64 == 0, "head_dim must be a multiple of 64");

  const int s = blockIdx.x, hg = blockIdx.y, b = blockIdx.z;
  const int len = LiveLength(p.lengths, b, p.max_tokens);
  const int nchunks = (len + p.chunk - 1) / p.chunk;
  if (s >= nchunks) return;  // no live chunk: nothing to read, nothing to write

  const int GB = p.head_group;
  const int h0 = hg * GB;  // first query head of this block
  const int kvh = h0 / p.group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int grp = lane >> 2, tig = lane & 3;
  const int ls = p.chunk + 4;  // logits row stride: +4 makes the C-fragment stores conflict-free

  extern __shared__ float smem[];
  float* logits = smem;                   // [kRows][ls]
  float* red = logits + kRows * ls;       // [kRows][kRedStride]
  float* m_s = red + kRows * kRedStride;  // [kStatRows]
  float* l_s = m_s + kStatRows;
  float* alpha_s = l_s + kStatRows;

  const int64_t tstride = static_cast<int64_t>(p.kv_heads) * D;  // elements between tokens
  const T* kseq =
      static_cast<const T*>(p.k) + static_cast<int64_t>(b) * p.max_tokens * tstride + kvh * D;
  const T* vseq =
      static_cast<const T*>(p.v) + static_cast<int64_t>(b) * p.max_tokens * tstride + kvh * D;

  // Q as the B operand of QK (k = head dim, n = head). The reduction dimension is
  // permuted: for 32-dim block j the lane (grp, tig) holds dims [32j + 8tig, +8) of head
  // grp as words w0..w3; mma step 2j uses (w0, w1), step 2j+1 uses (w2, w3). The K
  // fragments below use the same permutation, so the dot products are exact.
  uint32_t qf[NQT][kKBlocks][4];
#pragma unroll
  for (int nt = 0; nt < NQT; ++nt) {
    const int head = nt * 8 + grp;
    const T* qrow =
        static_cast<const T*>(p.q) + (static_cast<int64_t>(b) * p.q_heads + h0 + head) * D;
#pragma unroll
    for (int j = 0; j < kKBlocks; ++j) {
      const uint4 w = head < GB ? Load16(qrow + 32 * j + 8 * tig) : make_uint4(0, 0, 0, 0);
      qf[nt][j][0] = w.x;
      qf[nt][j][1] = w.y;
      qf[nt][j][2] = w.z;
      qf[nt][j][3] = w.w;
    }
  }
  if (threadIdx.x < kStatRows) {
    m_s[threadIdx.x] = -INFINITY;
    l_s[threadIdx.x] = 0.f;
    alpha_s[threadIdx.x] = 0.f;  // rows >= GB keep 0: their (all-zero) accumulators stay 0
  }
  // acc[nt][mt]: O^T tile (16 dims x 8 heads) of head n-tile nt and dim m-tile
  // mt = 4 x + i2. Lane (grp, tig) holds heads 8 nt + 2 tig + {0, 1} (c0/c2, c1/c3) at
  // dims 64 x + 8 grp + 2 i2 (c0, c1) and that + 1 (c2, c3).
  float acc[NQT][kMTiles][4];
#pragma unroll
  for (int nt = 0; nt < NQT; ++nt) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
      acc[nt][mt][0] = acc[nt][mt][1] = acc[nt][mt][2] = acc[nt][mt][3] = 0.f;
  }
  __syncthreads();

  for (int c = s; c < nchunks; c += p.splits) {
    const int t0 = c * p.chunk;
    const int n = min(p.chunk, len - t0);  // >= 1
    const int ntiles = (n + 15) >> 4;
    const T* kc = kseq + static_cast<int64_t>(t0) * tstride;
    const T* vc = vseq + static_cast<int64_t>(t0) * tstride;

    // Phase 1: logits = scale * K Q^T (m = 16 tokens, n = 8 heads, k = head dim). Warp w
    // takes tiles [U w, U w + U), then the next 4 U, ...; rows >= n are neither loaded
    // nor stored.
    for (int tile0 = warp * U; tile0 < ntiles; tile0 += kWarps * U) {
      uint4 ka[U][kKBlocks], kb[U][kKBlocks];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int r0 = (tile0 + u) * 16 + grp, r1 = r0 + 8;  // A rows grp, grp + 8
#pragma unroll
        for (int j = 0; j < kKBlocks; ++j) {
          ka[u][j] = r0 < n ? Load16(kc + r0 * tstride + 32 * j + 8 * tig) : make_uint4(0, 0, 0, 0);
          kb[u][j] = r1 < n ? Load16(kc + r1 * tstride + 32 * j + 8 * tig) : make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int r0 = (tile0 + u) * 16 + grp, r1 = r0 + 8;
        float sc[NQT][4];
#pragma unroll
        for (int nt = 0; nt < NQT; ++nt) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
#pragma unroll
        for (int j = 0; j < kKBlocks; ++j) {
#pragma unroll
          for (int nt = 0; nt < NQT; ++nt) {
            TC::Mma(sc[nt], ka[u][j].x, kb[u][j].x, ka[u][j].y, kb[u][j].y, qf[nt][j][0],
                    qf[nt][j][1]);
            TC::Mma(sc[nt], ka[u][j].z, kb[u][j].z, ka[u][j].w, kb[u][j].w, qf[nt][j][2],
                    qf[nt][j][3]);
          }
        }
#pragma unroll
        for (int nt = 0; nt < NQT; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int head = nt * 8 + 2 * tig + e;
            if (head < GB) {
              if (r0 < n) logits[head * ls + r0] = sc[nt][e] * p.scale_log2;
              if (r1 < n) logits[head * ls + r1] = sc[nt][2 + e] * p.scale_log2;
            }
          }
        }
      }
    }
    __syncthreads();

    // Phase 2: exact softmax of this chunk per head, folded into the running state.
    for (int h = warp; h < GB; h += kWarps) {
      ChunkSoftmax(logits + h * ls, n, ntiles * 16, m_s + h, l_s + h, alpha_s + h, lane);
    }
    __syncthreads();

    // Phase 3: O^T = alpha * O^T + V^T P^T (m = 16 dims, n = 8 heads, k = 16 tokens).
#pragma unroll
    for (int nt = 0; nt < NQT; ++nt) {
      const float al0 = alpha_s[nt * 8 + 2 * tig], al1 = alpha_s[nt * 8 + 2 * tig + 1];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        acc[nt][mt][0] *= al0;
        acc[nt][mt][1] *= al1;
        acc[nt][mt][2] *= al0;
        acc[nt][mt][3] *= al1;
      }
    }
    for (int tile0 = warp * U; tile0 < ntiles; tile0 += kWarps * U) {
      // B = P^T (k = tokens, n = heads): b0 = P[head grp][2tig, 2tig+1], b1 = the same
      // at tokens 2tig+8, 2tig+9. Heads >= GB are zero; P of tokens >= n is 0 (phase 2
      // zero-filled the last tile's tail); tiles >= ntiles are skipped whole.
      // A = V^T (m = dims, k = tokens). Lane (grp, tig) loads tokens 2tig, 2tig+1,
      // 2tig+8, 2tig+9 of the tile at dims [64 x + 8 grp, +8): 8 lanes cover 128
      // contiguous bytes of a row. Word i2 of each vector holds dims 64 x + 8 grp + 2 i2
      // (low half: A row grp of m-tile 4 x + i2) and + 1 (high half: row grp + 8); byte
      // permutes pair the two tokens that share an A register.
      uint32_t pb[U][NQT][2];
      uint4 vr[U][4][kVChunks];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int rb = (tile0 + u) * 16;
        const bool live = tile0 + u < ntiles;  // warp-uniform
#pragma unroll
        for (int nt = 0; nt < NQT; ++nt) {
          const int head = nt * 8 + grp;
          pb[u][nt][0] = pb[u][nt][1] = 0;
          if (live && head < GB) {
            const float* pr = logits + head * ls + rb + 2 * tig;
            const float2 lo = *reinterpret_cast<const float2*>(pr);
            const float2 hi = *reinterpret_cast<const float2*>(pr + 8);
            pb[u][nt][0] = TC::Pack(lo.x, lo.y);
            pb[u][nt][1] = TC::Pack(hi.x, hi.y);
          }
        }
#pragma unroll
        for (int t4 = 0; t4 < 4; ++t4) {
          const int row = rb + 2 * tig + (t4 & 1) + (t4 >> 1) * 8;
#pragma unroll
          for (int x = 0; x < kVChunks; ++x) {
            vr[u][t4][x] =
                row < n ? Load16(vc + row * tstride + 64 * x + 8 * grp) : make_uint4(0, 0, 0, 0);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (tile0 + u >= ntiles) break;  // warp-uniform
#pragma unroll
        for (int x = 0; x < kVChunks; ++x) {
          const uint32_t w0[4] = {vr[u][0][x].x, vr[u][0][x].y, vr[u][0][x].z,
                                  vr[u][0][x].w};  // token 2tig
          const uint32_t w1[4] = {vr[u][1][x].x, vr[u][1][x].y, vr[u][1][x].z,
                                  vr[u][1][x].w};  // 2tig + 1
          const uint32_t w2[4] = {vr[u][2][x].x, vr[u][2][x].y, vr[u][2][x].z,
                                  vr[u][2][x].w};  // 2tig + 8
          const uint32_t w3[4] = {vr[u][3][x].x, vr[u][3][x].y, vr[u][3][x].z,
                                  vr[u][3][x].w};  // 2tig + 9
#pragma unroll
          for (int i2 = 0; i2 < 4; ++i2) {
            const uint32_t a0 = __byte_perm(w0[i2], w1[i2], 0x5410u);  // low halves: dim d
            const uint32_t a1 = __byte_perm(w0[i2], w1[i2], 0x7632u);  // high halves: dim d + 1
            const uint32_t a2 = __byte_perm(w2[i2], w3[i2], 0x5410u);
            const uint32_t a3 = __byte_perm(w2[i2], w3[i2], 0x7632u);
#pragma unroll
            for (int nt = 0; nt < NQT; ++nt) {
              TC::Mma(acc[nt][4 * x + i2], a0, a1, a2, a3, pb[u][nt][0], pb[u][nt][1]);
            }
          }
        }
      }
    }
    __syncthreads();  // the next chunk overwrites the logits
  }

  // Sum the four warps' accumulators in a fixed order (deterministic).
  for (int w = 0; w < kWarps; ++w) {
    if (warp == w) {
#pragma unroll
      for (int nt = 0; nt < NQT; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int head = nt * 8 + 2 * tig + e;
          if (head < GB) {
            float* r = red + head * kRedStride;
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
              const int d = 64 * (mt / 4) + 8 * grp + 2 * (mt % 4);
              r[d] = (w ? r[d] : 0.f) + acc[nt][mt][e];
              r[d + 1] = (w ? r[d + 1] : 0.f) + acc[nt][mt][2 + e];
            }
          }
        }
      }
    }
    __syncthreads();
  }

  // Partial (m, l, acc) of head h0 + row: index ((b * Hq + h0 + row) * splits + s).
  const int64_t pbase = (static_cast<int64_t>(b) * p.q_heads + h0) * p.splits + s;
  for (int idx = threadIdx.x; idx < GB * D; idx += kThreads) {
    const int row = idx / D, d = idx - row * D;
    p.ws_acc[(pbase + static_cast<int64_t>(row) * p.splits) * D + d] = red[row * kRedStride + d];
  }
  if (threadIdx.x < GB) {
    const int64_t pi = pbase + static_cast<int64_t>(threadIdx.x) * p.splits;
    p.ws_m[pi] = m_s[threadIdx.x];
    p.ws_l[pi] = l_s[threadIdx.x];
  }
}

// ---------------------------------------------------------------------------------
// Simple split kernel: one query head per block, CUDA cores, any head_dim.

template <typename T>
__global__ void __launch_bounds__(kThreads) SplitKernelSimple(const Params p) {
  const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int len = LiveLength(p.lengths, b, p.max_tokens);
  const int nchunks = (len + p.chunk - 1) / p.chunk;
  if (s >= nchunks) return;
  const int D = p.head_dim;
  const int kvh = h / p.group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  extern __shared__ float smem[];
  float* qs = smem;              // [D]
  float* acc = qs + D;           // [D]
  float* logits = acc + D;       // [chunk]
  float* st = logits + p.chunk;  // m, l, alpha

  const int64_t tstride = static_cast<int64_t>(p.kv_heads) * D;
  const T* kseq = static_cast<const T*>(p.k) + static_cast<int64_t>(b) * p.max_tokens * tstride +
                  static_cast<int64_t>(kvh) * D;
  const T* vseq = static_cast<const T*>(p.v) + static_cast<int64_t>(b) * p.max_tokens * tstride +
                  static_cast<int64_t>(kvh) * D;
  const T* qrow = static_cast<const T*>(p.q) + (static_cast<int64_t>(b) * p.q_heads + h) * D;
  for (int d = threadIdx.x; d < D; d += kThreads) {
    qs[d] = ToFloat(qrow[d]);
    acc[d] = 0.f;
  }
  if (threadIdx.x == 0) {
    st[0] = -INFINITY;
    st[1] = 0.f;
    st[2] = 0.f;
  }
  __syncthreads();

  for (int c = s; c < nchunks; c += p.splits) {
    const int t0 = c * p.chunk;
    const int n = min(p.chunk, len - t0);
    for (int i = warp; i < n; i += kWarps) {
      const T* krow = kseq + static_cast<int64_t>(t0 + i) * tstride;
      float dot = 0.f;
      for (int d = lane; d < D; d += 32) dot += qs[d] * ToFloat(krow[d]);
      dot = WarpSum(dot);
      if (lane == 0) logits[i] = dot * p.scale_log2;
    }
    __syncthreads();
    if (warp == 0) ChunkSoftmax(logits, n, n, st, st + 1, st + 2, lane);
    __syncthreads();
    const float alpha = st[2];
    for (int d = threadIdx.x; d < D; d += kThreads) {
      float a = acc[d] * alpha;
      for (int i = 0; i < n; ++i)
        a += logits[i] * ToFloat(vseq[static_cast<int64_t>(t0 + i) * tstride + d]);
      acc[d] = a;
    }
    __syncthreads();
  }

  const int64_t pi = (static_cast<int64_t>(b) * p.q_heads + h) * p.splits + s;
  for (int d = threadIdx.x; d < D; d += kThreads) p.ws_acc[pi * D + d] = acc[d];
  if (threadIdx.x == 0) {
    p.ws_m[pi] = st[0];
    p.ws_l[pi] = st[1];
  }
}

// ---------------------------------------------------------------------------------
// Combine: out = sum_s acc_s * 2^(m_s - M) / sum_s l_s * 2^(m_s - M) over live splits.

template <typename T>
__global__ void __launch_bounds__(kThreads) CombineKernel(const Params p) {
  const int h = blockIdx.x, b = blockIdx.y;
  const int D = p.head_dim;
  const int len = LiveLength(p.lengths, b, p.max_tokens);
  const int live = min((len + p.chunk - 1) / p.chunk, p.splits);
  T* o = static_cast<T*>(p.out) + (static_cast<int64_t>(b) * p.q_heads + h) * D;
  if (live == 0) {
    for (int d = threadIdx.x; d < D; d += kThreads) o[d] = FromFloat<T>(0.f);
    return;
  }
  extern __shared__ float weight[];  // [splits]
  const int64_t base = (static_cast<int64_t>(b) * p.q_heads + h) * p.splits;
  float mx = -INFINITY;
  for (int i = 0; i < live; ++i) mx = fmaxf(mx, p.ws_m[base + i]);
  for (int i = threadIdx.x; i < live; i += kThreads) weight[i] = exp2f(p.ws_m[base + i] - mx);
  __syncthreads();
  float total = 0.f;
  for (int i = 0; i < live; ++i) total += p.ws_l[base + i] * weight[i];
  const float inv = 1.f / total;  // total >= 1: each live split has a token with p = 1
  for (int d = threadIdx.x; d < D; d += kThreads) {
    float a = 0.f;
    for (int i = 0; i < live; ++i) a += p.ws_acc[(base + i) * D + d] * weight[i];
    o[d] = FromFloat<T>(a * inv);
  }
}

// ---------------------------------------------------------------------------------
// Host side

ffi::Error CudaFailure(const char* what, cudaError_t e) { return CudaFfiError(kName, what, e); }

// SM count per device ordinal (cached; a device attribute query, legal under capture).
int SmCount(int device, int* out) {
  static std::mutex mu;
  static std::map<int, int> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device);
  if (it != cache.end()) {
    *out = it->second;
    return 0;
  }
  int n = 0;
  const cudaError_t e = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) return static_cast<int>(e);
  cache[device] = n;
  *out = n;
  return 0;
}

bool TensorCoreSupported(ffi::DataType t, int64_t head_dim) {
  return (t == ffi::DataType::BF16 || t == ffi::DataType::F16) &&
         (head_dim == 64 || head_dim == 128 || head_dim == 256);
}

// Validated operands + plan + kernel choice of one call.
struct Call {
  Shapes shapes;
  Plan plan;
  ffi::DataType dtype = ffi::DataType::INVALID;
  bool tensor_core = false;
  bool one_tile = false;  // tensor-core kernel with one tile in flight per warp
};

ffi::Error Prepare(int device, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                   const ffi::AnyBuffer& v, const ffi::Buffer<ffi::S32>& lengths,
                   const ffi::AnyBuffer& out, int64_t chunk, int64_t splits, int64_t impl,
                   Call* call) {
  if (ffi::Error err = CheckOperands(kName, q, k, v, lengths, out, &call->shapes); err.failure())
    return err;
  const Shapes& sh = call->shapes;
  call->dtype = q.element_type();
  const bool tc_ok = TensorCoreSupported(call->dtype, sh.head_dim);
  switch (static_cast<Impl>(impl)) {
    case Impl::kAuto:
      call->tensor_core = tc_ok;
      break;
    case Impl::kSimple:
      call->tensor_core = false;
      break;
    case Impl::kTensorCore:
    case Impl::kTensorCoreOneTile:
      if (!tc_ok) {
        return ffi::Error::InvalidArgument(
            std::string(kName) +
            ": impl=tensor_core needs bfloat16/float16 and head_dim 64, "
            "128 or 256; got head_dim=" +
            std::to_string(sh.head_dim));
      }
      call->tensor_core = true;
      call->one_tile = static_cast<Impl>(impl) == Impl::kTensorCoreOneTile;
      break;
    default:
      return ffi::Error::InvalidArgument(std::string(kName) + ": unknown impl " +
                                         std::to_string(impl) +
                                         " (expected 0 auto, 1 tensor_core, 2 simple)");
  }
  int sms = 0;
  if (chunk <= 0 || splits <= 0) {
    if (int e = SmCount(device, &sms); e != 0) {
      return CudaFailure("cudaDeviceGetAttribute(MultiProcessorCount)",
                         static_cast<cudaError_t>(e));
    }
  }
  call->plan = MakePlan(sh, sms, chunk, splits);
  const Plan& pl = call->plan;
  const int64_t blocks_y = call->tensor_core ? sh.q_heads / pl.head_group : sh.q_heads;
  if (sh.batch > 65535 || blocks_y > 65535) {
    return ffi::Error::InvalidArgument(std::string(kName) + ": batch " + std::to_string(sh.batch) +
                                       " or head blocks " + std::to_string(blocks_y) +
                                       " exceed the CUDA grid limit of 65535");
  }
  if (sh.max_tokens > INT32_MAX || sh.head_dim > 4096) {
    return ffi::Error::InvalidArgument(
        std::string(kName) + ": max_tokens must be < 2^31 and head_dim <= 4096; got " +
        std::to_string(sh.max_tokens) + ", " + std::to_string(sh.head_dim));
  }
  return ffi::Error::Success();
}

template <typename T, int D, int NQT, int U>
cudaError_t LaunchTensorCore(const Params& p, cudaStream_t stream) {
  constexpr int kRows = 8 * NQT;
  const size_t smem = sizeof(float) * (kRows * (p.chunk + 4) + kRows * (D + 4) + 3 * kStatRows);
  const dim3 grid(p.splits, p.q_heads / p.head_group, p.batch);
  SplitKernelTensorCore<T, D, NQT, U><<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int D, int U>
cudaError_t LaunchTensorCoreHeads(const Params& p, cudaStream_t stream) {
  return p.head_group > 8 ? LaunchTensorCore<T, D, 2, U>(p, stream)
                          : LaunchTensorCore<T, D, 1, U>(p, stream);
}

// Tiles in flight per warp: 2 where registers allow it without spilling (head_dim
// <= 128), 1 for head_dim 256 or when asked for (impl tensor_core_u1, for comparison).
template <typename T>
cudaError_t LaunchTensorCoreDispatch(const Params& p, bool one_tile, cudaStream_t stream) {
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
ffi::Error LaunchAll(const Params& p, bool tensor_core, bool one_tile, cudaStream_t stream) {
  cudaError_t e = cudaSuccess;
  if constexpr (std::is_same_v<T, float>) {
    tensor_core = false;  // no float32 tensor-core path (Prepare never selects one)
  }
  if (tensor_core) {
    if constexpr (!std::is_same_v<T, float>) e = LaunchTensorCoreDispatch<T>(p, one_tile, stream);
    GetCounters().cuda_tensor_core_launches.fetch_add(1, std::memory_order_relaxed);
  } else {
    const size_t smem = sizeof(float) * (2 * p.head_dim + p.chunk + 4);
    SplitKernelSimple<T><<<dim3(p.splits, p.q_heads, p.batch), kThreads, smem, stream>>>(p);
    e = cudaGetLastError();
    GetCounters().cuda_simple_launches.fetch_add(1, std::memory_order_relaxed);
  }
  if (e != cudaSuccess) return CudaFailure("split kernel launch", e);
  CombineKernel<T><<<dim3(p.q_heads, p.batch), kThreads, sizeof(float) * p.splits, stream>>>(p);
  e = cudaGetLastError();
  if (e != cudaSuccess) return CudaFailure("combine kernel launch", e);
  return ffi::Error::Success();
}

ffi::Error Execute(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                   ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer out,
                   ffi::AnyBuffer* workspace, float scale, int64_t chunk, int64_t splits,
                   int64_t impl, int64_t debug) {
  Counters& counters = GetCounters();
  counters.cuda_execute_calls.fetch_add(1, std::memory_order_relaxed);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) == cudaSuccess &&
      capture == cudaStreamCaptureStatusActive) {
    counters.cuda_captured_calls.fetch_add(1, std::memory_order_relaxed);
  }
  Call call;
  if (ffi::Error err = Prepare(device, q, k, v, lengths, out, chunk, splits, impl, &call);
      err.failure())
    return err;
  const Shapes& sh = call.shapes;
  const Plan& pl = call.plan;
  if (sh.batch == 0 || (debug & kDebugSkipOutput)) return ffi::Error::Success();

  void* ws = nullptr;
  if (workspace != nullptr) {
    if (static_cast<int64_t>(workspace->size_bytes()) < pl.workspace_bytes) {
      return ffi::Error::InvalidArgument(
          std::string(kName) + ": workspace result has " + std::to_string(workspace->size_bytes()) +
          " bytes, the plan needs " + std::to_string(pl.workspace_bytes) +
          " (Python and C++ plans disagree: rebuild jax_vmm)");
    }
    ws = workspace->untyped_data();
  } else {
    // Grown at the initialize stage; Get() only grows when the stream is not capturing
    // and refuses (with a message) when a capture would need more than is mapped.
    std::string err = scratch::Get(device, stream, static_cast<size_t>(pl.workspace_bytes), &ws);
    if (!err.empty())
      return ffi::Error::Internal(std::string(kName) + ": graph-safe scratch: " + err);
  }

  Params p;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.lengths = lengths.typed_data();
  p.out = out.untyped_data();
  const int64_t partials = sh.batch * sh.q_heads * pl.splits;
  p.ws_acc = static_cast<float*>(ws);
  p.ws_m = p.ws_acc + partials * sh.head_dim;
  p.ws_l = p.ws_m + partials;
  p.batch = static_cast<int>(sh.batch);
  p.max_tokens = static_cast<int>(sh.max_tokens);
  p.q_heads = static_cast<int>(sh.q_heads);
  p.kv_heads = static_cast<int>(sh.kv_heads);
  p.head_dim = static_cast<int>(sh.head_dim);
  p.group = static_cast<int>(sh.q_heads / sh.kv_heads);
  p.head_group = static_cast<int>(pl.head_group);
  p.chunk = static_cast<int>(pl.chunk);
  p.splits = static_cast<int>(pl.splits);
  p.scale_log2 = scale * 1.4426950408889634f;

  switch (call.dtype) {
    case ffi::DataType::BF16:
      return LaunchAll<__nv_bfloat16>(p, call.tensor_core, call.one_tile, stream);
    case ffi::DataType::F16:
      return LaunchAll<__half>(p, call.tensor_core, call.one_tile, stream);
    default:
      return LaunchAll<float>(p, false, false, stream);
  }
}

ffi::Error InitializeImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lengths,
                          ffi::Result<ffi::AnyBuffer> out, float scale, int64_t chunk,
                          int64_t splits, int64_t impl, int64_t debug) {
  (void)scale;
  (void)debug;
  GetCounters().cuda_initialize_calls.fetch_add(1, std::memory_order_relaxed);
  Call call;
  if (ffi::Error err = Prepare(device, q, k, v, lengths, *out, chunk, splits, impl, &call);
      err.failure()) {
    return err;
  }
  if (call.shapes.batch == 0) return ffi::Error::Success();
  // Never under capture (XLA initializes thunks before it records command buffers): the
  // one place where the workspace may grow for a graph that will bake its address.
  std::string err =
      scratch::Reserve(device, stream, static_cast<size_t>(call.plan.workspace_bytes));
  if (!err.empty())
    return ffi::Error::Internal(std::string(kName) + ": growing the graph-safe scratch: " + err);
  return ffi::Error::Success();
}

ffi::Error ExecuteImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                       ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lengths,
                       ffi::Result<ffi::AnyBuffer> out, float scale, int64_t chunk, int64_t splits,
                       int64_t impl, int64_t debug) {
  return Execute(stream, device, q, k, v, lengths, *out, nullptr, scale, chunk, splits, impl,
                 debug);
}

ffi::Error InitializePrefilledImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                                   ffi::AnyBuffer k, ffi::AnyBuffer v,
                                   ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer out_init,
                                   ffi::Result<ffi::AnyBuffer> out, float scale, int64_t chunk,
                                   int64_t splits, int64_t impl, int64_t debug) {
  (void)out_init;
  return InitializeImpl(stream, device, q, k, v, lengths, out, scale, chunk, splits, impl, debug);
}

ffi::Error ExecutePrefilledImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                                ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lengths,
                                ffi::AnyBuffer out_init, ffi::Result<ffi::AnyBuffer> out,
                                float scale, int64_t chunk, int64_t splits, int64_t impl,
                                int64_t debug) {
  (void)out_init;  // aliased to `out` by XLA; never read
  return Execute(stream, device, q, k, v, lengths, *out, nullptr, scale, chunk, splits, impl,
                 debug);
}

ffi::Error ExecuteXlaWorkspaceImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                                   ffi::AnyBuffer k, ffi::AnyBuffer v,
                                   ffi::Buffer<ffi::S32> lengths, ffi::Result<ffi::AnyBuffer> out,
                                   ffi::Result<ffi::AnyBuffer> workspace, float scale,
                                   int64_t chunk, int64_t splits, int64_t impl, int64_t debug) {
  ffi::AnyBuffer ws = *workspace;
  return Execute(stream, device, q, k, v, lengths, *out, &ws, scale, chunk, splits, impl, debug);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionCudaInitialize, InitializeImpl,
                              ffi::Ffi::BindInitialize()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // k
                                  .Arg<ffi::AnyBuffer>()         // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("chunk")
                                  .Attr<int64_t>("splits")
                                  .Attr<int64_t>("impl")
                                  .Attr<int64_t>("debug"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionCudaExecute, ExecuteImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("chunk")
                                  .Attr<int64_t>("splits")
                                  .Attr<int64_t>("impl")
                                  .Attr<int64_t>("debug"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionCudaXlaWorkspaceExecute, ExecuteXlaWorkspaceImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::AnyBuffer>()  // workspace (uint8)
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("chunk")
                                  .Attr<int64_t>("splits")
                                  .Attr<int64_t>("impl")
                                  .Attr<int64_t>("debug"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionCudaPrefilledInitialize, InitializePrefilledImpl,
                              ffi::Ffi::BindInitialize()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()  // out_init
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("chunk")
                                  .Attr<int64_t>("splits")
                                  .Attr<int64_t>("impl")
                                  .Attr<int64_t>("debug"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionCudaPrefilledExecute, ExecutePrefilledImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()  // out_init
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("chunk")
                                  .Attr<int64_t>("splits")
                                  .Attr<int64_t>("impl")
                                  .Attr<int64_t>("debug"),
                              {ffi::Traits::kCmdBufferCompatible});

void* CudaPrefilledInitializeHandler() {
  return reinterpret_cast<void*>(DecodeAttentionCudaPrefilledInitialize);
}
void* CudaPrefilledExecuteHandler() {
  return reinterpret_cast<void*>(DecodeAttentionCudaPrefilledExecute);
}
void* CudaInitializeHandler() { return reinterpret_cast<void*>(DecodeAttentionCudaInitialize); }
void* CudaExecuteHandler() { return reinterpret_cast<void*>(DecodeAttentionCudaExecute); }
void* CudaXlaWorkspaceExecuteHandler() {
  return reinterpret_cast<void*>(DecodeAttentionCudaXlaWorkspaceExecute);
}

}  // namespace jax_vmm::attention
