// The tensor-core split kernel of decode attention, its phases as __device__ helpers.
//
// SplitKernelTensorCore<T, D, NQT, U>: bf16/fp16, head_dim D = 64/128/256. One block =
// one split of one sequence for up to 16 query heads that share a KV head (GQA), so
// every K/V byte is loaded once per block. 4 warps; each warp takes 16-token tiles of a
// chunk. QK^T and PV run on tensor cores (mma.sync m16n8k16, fp32 accumulation); K/V
// are read straight from global memory with coalesced 16-byte loads (a permutation of
// the reduction dimension lets the natural row-major layout feed the fragments).
// Logits of a chunk go through shared memory for an exact chunk softmax.
// NQT = QK n-tiles of 8 heads (1: head_group <= 8, 2: <= 16). U = 16-token tiles a warp
// loads before it computes (more bytes in flight per warp, more registers).
// kRows (jax_vmm.attention's options, Semantics in attention_ffi.h): the block's rows are
// (query i, head g) pairs of one KV head, row R = i * G + g, up to 16 per block over
// grid.y = kv_heads * row_blocks; each row masks the tokens outside its causal / window
// range to -inf, logits take the softcap, chunks outside every row's range are skipped,
// and rows without a live token leave m = -inf, l = 0, acc = 0. kRows = false is plain
// decode (S = 1, grid.y = q_heads / head_group), compiled as before.
//
// Per chunk of the split: phase 1 ChunkLogits (logits = scale * K Q^T), phase 2
// SoftmaxChunk, phase 3 RescaleAccumulators, then per tile LoadProbabilities, LoadValues
// and MmaValueWords (O^T = alpha * O^T + V^T P^T). Then ReduceWarps and WritePartials.
// Registers and spills of every instantiation are those of the earlier single-function
// kernel (checked with ptxas -v).
// Every helper is called by all threads of the block (or all lanes of a warp) and is
// force-inlined: the register arrays they take by reference stay in registers.
// Device code only; included by attention_kernels.cu.
#pragma once

#include <cstdint>

#include "ops/attention/attention_device.cuh"
#include "ops/attention/attention_kernels.h"

namespace jax_vmm::attention::kernels {

// The thread's place in its warp: mma fragment coordinates (lane = 4 * grp + tig).
struct Lane {
  int warp, lane, grp, tig;
};

__device__ __forceinline__ Lane ThisLane() {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  return Lane{warp, lane, lane >> 2, lane & 3};
}

// Shared memory of one block: logits [8 NQT][ls], the warp reduction [8 NQT][D + 4],
// and the per-head softmax state m, l, alpha [kStatRows] each.
struct BlockShared {
  float* logits;
  float* red;
  float* m;
  float* l;
  float* alpha;
  int* lo;  // kRows: each row's token range [lo, hi)
  int* hi;
  int ls;  // logits row stride: chunk + 4 makes the C-fragment stores conflict-free
};

template <int D, int NQT>
__device__ __forceinline__ BlockShared CarveShared(float* smem, int chunk) {
  constexpr int kRows = 8 * NQT;  // heads held per block
  BlockShared sh;
  sh.ls = chunk + 4;
  sh.logits = smem;
  sh.red = sh.logits + kRows * sh.ls;
  sh.m = sh.red + kRows * (D + 4);
  sh.l = sh.m + kStatRows;
  sh.alpha = sh.l + kStatRows;
  sh.lo = reinterpret_cast<int*>(sh.alpha + kStatRows);  // only kRows kernels have them
  sh.hi = sh.lo + kStatRows;
  return sh;
}

// Shared-memory bytes CarveShared lays out.
template <int D, int NQT, bool kRows = false>
constexpr size_t SharedBytes(int chunk) {
  return sizeof(float) * (8 * NQT * (chunk + 4) + 8 * NQT * (D + 4) + 3 * kStatRows) +
         (kRows ? sizeof(int) * 2 * kStatRows : 0);
}

// kRows: where the block's rows start (R0, the first (query, head) row of KV head kvh)
// and how many it has; q / partial row of block row r: (b * S + i) * Hq + kvh * G + g.
struct RowBlock {
  int kvh, r0, rows;
};

__device__ __forceinline__ int64_t RowIndex(const RowKernelParams& p, int b, const RowBlock& rb,
                                            int r) {
  const int R = rb.r0 + r, i = R / p.group, g = R - i * p.group;
  return (static_cast<int64_t>(b) * p.q_len + i) * p.q_heads + rb.kvh * p.group + g;
}

// Q as the B operand of QK (k = head dim, n = head). The reduction dimension is
// permuted: for 32-dim block j the lane (grp, tig) holds dims [32j + 8tig, +8) of head
// grp as words w0..w3; mma step 2j uses (w0, w1), step 2j+1 uses (w2, w3). The K
// fragments use the same permutation, so the dot products are exact.
template <typename T, int D, int NQT, bool kRows = false>
__device__ __forceinline__ void LoadQueryFragments(const ParamsOf<kRows>& p, int b, int h0, int GB,
                                                   Lane ln, uint32_t (&qf)[NQT][D / 32][4],
                                                   const RowBlock& rb = RowBlock{}) {
#pragma unroll
  for (int nt = 0; nt < NQT; ++nt) {
    const int head = nt * 8 + ln.grp;
    int64_t qi;
    if constexpr (kRows) {
      qi = head < GB ? RowIndex(p, b, rb, head) : 0;
    } else {
      qi = static_cast<int64_t>(b) * p.q_heads + h0 + head;
    }
    const T* qrow = static_cast<const T*>(p.q) + qi * D;
#pragma unroll
    for (int j = 0; j < D / 32; ++j) {
      const uint4 w = head < GB ? Load16(qrow + 32 * j + 8 * ln.tig) : make_uint4(0, 0, 0, 0);
      qf[nt][j][0] = w.x;
      qf[nt][j][1] = w.y;
      qf[nt][j][2] = w.z;
      qf[nt][j][3] = w.w;
    }
  }
}

// Softmax state m = -inf, l = 0, alpha = 0 for every row (rows >= GB keep alpha 0: their
// all-zero accumulators stay 0), and zero accumulators. acc[nt][mt]: the O^T tile (16
// dims x 8 heads) of head n-tile nt and dim m-tile mt = 4 x + i2. Lane (grp, tig) holds
// heads 8 nt + 2 tig + {0, 1} (c0/c2, c1/c3) at dims 64 x + 8 grp + 2 i2 (c0, c1) and
// that + 1 (c2, c3).
template <int D, int NQT>
__device__ __forceinline__ void InitBlockState(const BlockShared& sh,
                                               float (&acc)[NQT][D / 16][4]) {
  if (threadIdx.x < kStatRows) {
    sh.m[threadIdx.x] = -INFINITY;
    sh.l[threadIdx.x] = 0.f;
    sh.alpha[threadIdx.x] = 0.f;
  }
#pragma unroll
  for (int nt = 0; nt < NQT; ++nt) {
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt)
      acc[nt][mt][0] = acc[nt][mt][1] = acc[nt][mt][2] = acc[nt][mt][3] = 0.f;
  }
}

// Phase 1: logits = scale * K Q^T of the chunk at `kc` (m = 16 tokens, n = 8 heads, k =
// head dim). Warp w takes tiles [U w, U w + U), then the next 4 U, ...; rows >= n are
// neither loaded nor stored.
template <typename T, int D, int NQT, int U, bool kRows = false>
__device__ __forceinline__ void ChunkLogits(const T* kc, int64_t tstride, int n, int ntiles,
                                            const uint32_t (&qf)[NQT][D / 32][4],
                                            const BlockShared& sh, int GB, float scale_log2,
                                            Lane ln, int t0 = 0, float scale = 0.f,
                                            float softcap = 0.f) {
  using TC = TensorCore<T>;
  constexpr int kKBlocks = D / 32;  // QK: 32-dim blocks per K row
  for (int tile0 = ln.warp * U; tile0 < ntiles; tile0 += kWarps * U) {
    uint4 ka[U][kKBlocks], kb[U][kKBlocks];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int r0 = (tile0 + u) * 16 + ln.grp, r1 = r0 + 8;  // A rows grp, grp + 8
#pragma unroll
      for (int j = 0; j < kKBlocks; ++j) {
        ka[u][j] =
            r0 < n ? Load16(kc + r0 * tstride + 32 * j + 8 * ln.tig) : make_uint4(0, 0, 0, 0);
        kb[u][j] =
            r1 < n ? Load16(kc + r1 * tstride + 32 * j + 8 * ln.tig) : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int r0 = (tile0 + u) * 16 + ln.grp, r1 = r0 + 8;
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
          const int head = nt * 8 + 2 * ln.tig + e;
          if (head < GB) {
            if constexpr (kRows) {
              const int lo = sh.lo[head], hi = sh.hi[head];
              if (r0 < n) {
                const int t = t0 + r0;
                sh.logits[head * sh.ls + r0] =
                    t >= lo && t < hi ? RowLogit(sc[nt][e], scale_log2, scale, softcap) : -INFINITY;
              }
              if (r1 < n) {
                const int t = t0 + r1;
                sh.logits[head * sh.ls + r1] =
                    t >= lo && t < hi ? RowLogit(sc[nt][2 + e], scale_log2, scale, softcap)
                                      : -INFINITY;
              }
            } else {
              if (r0 < n) sh.logits[head * sh.ls + r0] = sc[nt][e] * scale_log2;
              if (r1 < n) sh.logits[head * sh.ls + r1] = sc[nt][2 + e] * scale_log2;
            }
          }
        }
      }
    }
  }
}

// acc += V^T P^T for the dims of 64-dim chunk x of one tile: w0..w3 are the V words of
// tokens 2tig, 2tig + 1, 2tig + 8, 2tig + 9. Word i2 holds dims 64 x + 8 grp + 2 i2 (low
// half: A row grp of m-tile 4 x + i2) and + 1 (high half: row grp + 8); byte permutes
// pair the two tokens that share an A register.
template <typename T, int D, int NQT>
__device__ __forceinline__ void MmaValueWords(const uint32_t (&w0)[4], const uint32_t (&w1)[4],
                                              const uint32_t (&w2)[4], const uint32_t (&w3)[4],
                                              const uint32_t (&pb)[NQT][2], int x,
                                              float (&acc)[NQT][D / 16][4]) {
#pragma unroll
  for (int i2 = 0; i2 < 4; ++i2) {
    const uint32_t a0 = __byte_perm(w0[i2], w1[i2], 0x5410u);  // low halves: dim d
    const uint32_t a1 = __byte_perm(w0[i2], w1[i2], 0x7632u);  // high halves: dim d + 1
    const uint32_t a2 = __byte_perm(w2[i2], w3[i2], 0x5410u);
    const uint32_t a3 = __byte_perm(w2[i2], w3[i2], 0x7632u);
#pragma unroll
    for (int nt = 0; nt < NQT; ++nt) {
      TensorCore<T>::Mma(acc[nt][4 * x + i2], a0, a1, a2, a3, pb[nt][0], pb[nt][1]);
    }
  }
}

// Phase 2: the exact softmax of the chunk's logits per head, folded into the running
// state (warp w takes heads w, w + 4, ...).
template <bool kRows = false>
__device__ __forceinline__ void SoftmaxChunk(const BlockShared& sh, int n, int ntiles, int GB,
                                             Lane ln) {
  for (int h = ln.warp; h < GB; h += kWarps) {
    ChunkSoftmax<kRows>(sh.logits + h * sh.ls, n, ntiles * 16, sh.m + h, sh.l + h, sh.alpha + h,
                        ln.lane);
  }
}

// Phase 3a: the accumulators of every head scaled by its alpha from phase 2.
template <int D, int NQT>
__device__ __forceinline__ void RescaleAccumulators(float (&acc)[NQT][D / 16][4],
                                                    const float* alpha, Lane ln) {
#pragma unroll
  for (int nt = 0; nt < NQT; ++nt) {
    const float al0 = alpha[nt * 8 + 2 * ln.tig], al1 = alpha[nt * 8 + 2 * ln.tig + 1];
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt) {
      acc[nt][mt][0] *= al0;
      acc[nt][mt][1] *= al1;
      acc[nt][mt][2] *= al0;
      acc[nt][mt][3] *= al1;
    }
  }
}

// B = P^T of the tile at token rb (k = tokens, n = heads): b0 = P[head grp][2tig, 2tig+1],
// b1 = the same at tokens 2tig+8, 2tig+9. Heads >= GB are zero; P of tokens >= n is 0
// (phase 2 zero-filled the last tile's tail); a tile that is not live is zero.
template <typename T, int NQT>
__device__ __forceinline__ void LoadProbabilities(const BlockShared& sh, int rb, bool live, int GB,
                                                  Lane ln, uint32_t (&pb)[NQT][2]) {
  using TC = TensorCore<T>;
#pragma unroll
  for (int nt = 0; nt < NQT; ++nt) {
    const int head = nt * 8 + ln.grp;
    pb[nt][0] = pb[nt][1] = 0;
    if (live && head < GB) {
      const float* pr = sh.logits + head * sh.ls + rb + 2 * ln.tig;
      const float2 lo = *reinterpret_cast<const float2*>(pr);
      const float2 hi = *reinterpret_cast<const float2*>(pr + 8);
      pb[nt][0] = TC::Pack(lo.x, lo.y);
      pb[nt][1] = TC::Pack(hi.x, hi.y);
    }
  }
}

// A = V^T of the tile at token rb (m = dims, k = tokens). Lane (grp, tig) loads tokens
// 2tig, 2tig+1, 2tig+8, 2tig+9 of the tile at dims [64 x + 8 grp, +8): 8 lanes cover 128
// contiguous bytes of a row. Rows >= n are not loaded.
template <typename T, int D>
__device__ __forceinline__ void LoadValues(const T* vc, int64_t tstride, int n, int rb, Lane ln,
                                           uint4 (&vr)[4][D / 64]) {
#pragma unroll
  for (int t4 = 0; t4 < 4; ++t4) {
    const int row = rb + 2 * ln.tig + (t4 & 1) + (t4 >> 1) * 8;
#pragma unroll
    for (int x = 0; x < D / 64; ++x) {
      vr[t4][x] =
          row < n ? Load16(vc + row * tstride + 64 * x + 8 * ln.grp) : make_uint4(0, 0, 0, 0);
    }
  }
}

// Sums the four warps' accumulators into sh.red in a fixed order (deterministic).
template <int D, int NQT>
__device__ __forceinline__ void ReduceWarps(const float (&acc)[NQT][D / 16][4],
                                            const BlockShared& sh, int GB) {
  float ones[NQT][2];
#pragma unroll
  for (int nt = 0; nt < NQT; ++nt) ones[nt][0] = ones[nt][1] = 1.f;
  AccumulateWarpsInOrder<kWarps, NQT, D / 16>(sh.red, D + 4, GB, acc, ones);
}

// Partial (m, l, acc) of head h0 + row: index ((b * Hq + h0 + row) * splits + s).
template <int D>
__device__ __forceinline__ void WriteRowPartials(const RowKernelParams& p, const BlockShared& sh,
                                                 int b, const RowBlock& rb, int s) {
  constexpr int kRedStride = D + 4;
  for (int idx = threadIdx.x; idx < rb.rows * D; idx += kThreads) {
    const int row = idx / D, d = idx - row * D;
    p.ws_acc[(RowIndex(p, b, rb, row) * p.splits + s) * D + d] = sh.red[row * kRedStride + d];
  }
  if (threadIdx.x < rb.rows) {
    const int64_t pi = RowIndex(p, b, rb, threadIdx.x) * p.splits + s;
    p.ws_m[pi] = sh.m[threadIdx.x];
    p.ws_l[pi] = sh.l[threadIdx.x];
  }
}

template <int D>
__device__ __forceinline__ void WritePartials(const KernelParams& p, const BlockShared& sh, int b,
                                              int h0, int s, int GB) {
  constexpr int kRedStride = D + 4;
  const int64_t pbase = (static_cast<int64_t>(b) * p.q_heads + h0) * p.splits + s;
  for (int idx = threadIdx.x; idx < GB * D; idx += kThreads) {
    const int row = idx / D, d = idx - row * D;
    p.ws_acc[(pbase + static_cast<int64_t>(row) * p.splits) * D + d] = sh.red[row * kRedStride + d];
  }
  if (threadIdx.x < GB) {
    const int64_t pi = pbase + static_cast<int64_t>(threadIdx.x) * p.splits;
    p.ws_m[pi] = sh.m[threadIdx.x];
    p.ws_l[pi] = sh.l[threadIdx.x];
  }
}

template <typename T, int D, int NQT, int U, bool kRows = false>
__global__ void __launch_bounds__(kThreads) SplitKernelTensorCore(const ParamsOf<kRows> p) {
  static_assert(D % 64 == 0, "head_dim must be a multiple of 64");
  const int s = blockIdx.x, b = blockIdx.z;
  const int len = LiveLength(p.lengths, b, p.max_tokens);
  const int nchunks = (len + p.chunk - 1) / p.chunk;
  // No live chunk: nothing to read, nothing to write (the combine reads splits < nchunks
  // only; with kRows every such split writes every row, live or not).
  if (s >= nchunks) return;

  // kRows: the block's rows (query i, head g) of KV head blk.kvh; plain: GB query heads
  // from h0. (Kept as the plain kernel's original expressions: same code, same registers.)
  RowBlock blk{};
  if constexpr (kRows) {  // (p is a RowKernelParams only here)
    blk.kvh = blockIdx.y / p.row_blocks;
    blk.r0 = (blockIdx.y - blk.kvh * p.row_blocks) * p.head_group;
    blk.rows = min(p.head_group, p.q_len * p.group - blk.r0);
  }
  const int GB = kRows ? blk.rows : p.head_group;
  const int h0 = blockIdx.y * GB;  // first query head of this block (plain)
  const int kvh = kRows ? blk.kvh : h0 / p.group;
  const Lane ln = ThisLane();
  extern __shared__ float smem[];
  const BlockShared sh = CarveShared<D, NQT>(smem, p.chunk);
  int lo_all = 0, hi_all = 0;  // kRows: the union of the rows' token ranges
  if constexpr (kRows) {
    if (threadIdx.x < GB) {
      RowRange(p.q_lengths, b, p.q_len, len, p.window, (blk.r0 + threadIdx.x) / p.group,
               sh.lo + threadIdx.x, sh.hi + threadIdx.x);
    }
    __syncthreads();
    lo_all = len;
    for (int r = 0; r < GB; ++r) {
      if (sh.hi[r] > sh.lo[r]) {
        lo_all = min(lo_all, sh.lo[r]);
        hi_all = max(hi_all, sh.hi[r]);
      }
    }
  }

  const int64_t tstride = static_cast<int64_t>(p.token_heads) * D;  // elements between tokens
  const T* kseq =
      static_cast<const T*>(p.k) + static_cast<int64_t>(b) * p.max_tokens * tstride + kvh * D;
  const T* vseq =
      static_cast<const T*>(p.v) + static_cast<int64_t>(b) * p.max_tokens * tstride + kvh * D;

  uint32_t qf[NQT][D / 32][4];
  LoadQueryFragments<T, D, NQT, kRows>(p, b, h0, GB, ln, qf, blk);
  float acc[NQT][D / 16][4];
  InitBlockState<D, NQT>(sh, acc);
  __syncthreads();

  for (int c = s; c < nchunks; c += p.splits) {
    const int t0 = c * p.chunk;
    const int n = min(p.chunk, len - t0);                       // >= 1
    if (kRows && (t0 + n <= lo_all || t0 >= hi_all)) continue;  // block-uniform
    const int ntiles = (n + 15) >> 4;
    if constexpr (kRows) {
      ChunkLogits<T, D, NQT, U, true>(kseq + static_cast<int64_t>(t0) * tstride, tstride, n, ntiles,
                                      qf, sh, GB, p.scale_log2, ln, t0, p.scale, p.softcap);
    } else {
      ChunkLogits<T, D, NQT, U>(kseq + static_cast<int64_t>(t0) * tstride, tstride, n, ntiles, qf,
                                sh, GB, p.scale_log2, ln);
    }
    __syncthreads();
    SoftmaxChunk<kRows>(sh, n, ntiles, GB, ln);
    __syncthreads();
    RescaleAccumulators<D, NQT>(acc, sh.alpha, ln);
    // Phase 3b: O^T += V^T P^T (m = 16 dims, n = 8 heads, k = 16 tokens); each warp loads
    // U tiles, then multiplies them; tiles >= ntiles are skipped whole. This loop and the
    // V words stay in the kernel body: as a helper (even force-inlined) nvcc allocates
    // registers differently and the head_dim 256 kernels spill more.
    const T* vc = vseq + static_cast<int64_t>(t0) * tstride;
    for (int tile0 = ln.warp * U; tile0 < ntiles; tile0 += kWarps * U) {
      uint32_t pb[U][NQT][2];
      uint4 vr[U][4][D / 64];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int rb = (tile0 + u) * 16;
        LoadProbabilities<T, NQT>(sh, rb, tile0 + u < ntiles, GB, ln, pb[u]);  // warp-uniform
        LoadValues<T, D>(vc, tstride, n, rb, ln, vr[u]);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (tile0 + u >= ntiles) break;  // warp-uniform
#pragma unroll
        for (int x = 0; x < D / 64; ++x) {
          const uint32_t w0[4] = {vr[u][0][x].x, vr[u][0][x].y, vr[u][0][x].z, vr[u][0][x].w};
          const uint32_t w1[4] = {vr[u][1][x].x, vr[u][1][x].y, vr[u][1][x].z, vr[u][1][x].w};
          const uint32_t w2[4] = {vr[u][2][x].x, vr[u][2][x].y, vr[u][2][x].z, vr[u][2][x].w};
          const uint32_t w3[4] = {vr[u][3][x].x, vr[u][3][x].y, vr[u][3][x].z, vr[u][3][x].w};
          MmaValueWords<T, D, NQT>(w0, w1, w2, w3, pb[u], x, acc);
        }
      }
    }
    __syncthreads();  // the next chunk overwrites the logits
  }
  ReduceWarps<D, NQT>(acc, sh, GB);
  if constexpr (kRows) {
    WriteRowPartials<D>(p, sh, b, blk, s);
  } else {
    WritePartials<D>(p, sh, b, h0, s, GB);
  }
}

}  // namespace jax_vmm::attention::kernels
