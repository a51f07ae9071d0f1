// The streaming ("stream-K") decode-attention kernel. Host view: stream_kernels.h.
//
// StreamKernel<S, QT, D, NQT, kBulk> (S: storage type of K/V, QT: type of q and the
// output, NQT: head tiles of 8 query heads, kBulk: tiles by bulk copies), in phases:
//   1. lengths and tile prefix: each CTA reads the lengths and builds the prefix of
//      tiles per sequence in shared memory (Tables, stream_tables.cuh); a tile is
//      TileTokens(row bytes) tokens, 16 or 32 (stream_plan.h), so every ring tile carries
//      the same bytes and short rows pay the per-tile work once per 32 tokens;
//   2. zeros for empty sequences, spread over the grid;
//   3. this CTA's equal share of all live tiles, whatever the lengths (stream_plan.h):
//      each of the 4 warps streams its own tiles (w, w + 4, ... of the CTA's range)
//      through a private ring of `stages` shared-memory slots (stream_ring.cuh: 16-byte
//      cp.async into a swizzled ring, or bulk copies on mbarriers; nothing past a length
//      is read), with no block barrier in the steady state. Per 16 tokens of a tile, QK^T
//      and PV on tensor cores (mma.sync m16n8k16, fp32 accumulation) with the split kernel's
//      fragment layout (attention_tensor_core.cuh: permuted reduction dimension for QK,
//      byte-permuted token pairs for PV); online softmax in registers: the QK accumulator
//      (tokens x heads) becomes the PV B operand with movmatrix.trans, so logits never go
//      through shared memory;
//   4. at the end of each piece of a unit the 4 warps merge in a fixed order
//      (deterministic); a whole unit is written out, a piece goes to its workspace slot;
//      with the fused combine the piece that arrives last (per-unit counter) merges the
//      unit's pieces and writes the output (CombineUnit, stream_unit.cuh), else CombineKernel does
//      it afterwards (stream_kernels.cu).
// fp8 (e4m3fn) caches are converted to fp16 in registers (exact); bf16 queries are rounded
// to fp16 after a power-of-two scale that puts each head's largest |q| in [2^14, 2^15)
// (undone in the logit scale, LoadQuery in stream_unit.cuh); the per-KV-head k_scale folds into the
// logit scale and v_scale into the output.
//
// Why the phases stay in one function body (the query load, the piece combine, the
// ring layout and copies, the tables and the partition are helpers): moved into
// __device__ __forceinline__ helpers, each phase changed nvcc's register allocation. The
// piece merge or write-out as helpers, or the shared-memory carve as a struct, spilled
// 8-60 bytes more in the head_dim 256 instantiations with two head tiles and made head_dim
// 128 ones spill; the prefix build, the zero fill and the tile copy as helpers spilled no
// more but moved register counts by up to +5 (and -28) per instantiation (ptxas -v,
// sm_90, 48 instantiations). As one body every instantiation has the registers and spills
// of the kernel before the split into files.
// Device code only; included by stream_kernels.cu.
#pragma once

#include <cstdint>

#include "ops/attention/attention_device.cuh"
#include "ops/attention/stream_kernels.h"
#include "ops/attention/stream_plan.h"
#include "ops/attention/stream_ring.cuh"
#include "ops/attention/stream_tables.cuh"
#include "ops/attention/stream_unit.cuh"

namespace jax_vmm::attention::stream {

using kernels::AccumulateWarpsInOrder;
using kernels::FromFloat;
using kernels::TensorCore;

template <typename S, typename QT, int D, int NQT, bool kBulk>
__global__ void __launch_bounds__(kThreads) StreamKernel(const StreamParams p) {
  using St = Storage<S>;
  using T = typename St::Compute;
  using TC = TensorCore<T>;
  constexpr int kRows = 8 * NQT;
  constexpr int kKBlocks = D / 32;
  constexpr int kVChunks = D / 64;
  constexpr int kMTiles = D / 16;
  constexpr int RB = D * St::kBytes;  // bytes of one token row of one KV head
  constexpr int kTile = TileTokens(RB);  // tokens per ring tile
  constexpr int kSub = kTile / 16;       // 16-token tensor-core tiles per ring tile
  constexpr int kRowStride = kBulk ? RB + 16 : RB;
  constexpr int kTileBytes = kTile * kRowStride;  // one K (or V) tile
  constexpr int kChunksPerRow = RB / 16;
  constexpr int kRedStride = D + 4;
  static_assert(D % 64 == 0 && RB % 64 == 0, "head_dim must be a multiple of 64");
  static_assert(kTile * RB % 512 == 0, "tile chunks must split evenly over a warp");

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, grp = lane >> 2, tig = lane & 3;
  const int B = p.batch, HG = p.unit_groups, GB = p.head_group;
  const int stages = p.stages;

  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* ring = smem + static_cast<size_t>(warp) * stages * 2 * kTileBytes;
  uint64_t* bars =
      reinterpret_cast<uint64_t*>(smem + static_cast<size_t>(kWarps) * stages * 2 * kTileBytes) +
      warp * kMaxStages;  // this warp's slot barriers (kBulk)
  int* lens = reinterpret_cast<int*>(smem + static_cast<size_t>(kWarps) * stages * 2 * kTileBytes +
                                     sizeof(uint64_t) * kWarps * kMaxStages);
  int* prefix = lens + B;                                  // [B + 1]
  int* scan = prefix + B + 1;                              // [kThreads]
  float* red = reinterpret_cast<float*>(scan + kThreads);  // [kRows][kRedStride]
  float* mw = red + kRows * kRedStride;                    // [kWarps][kRows]
  float* lw = mw + kWarps * kRows;                         // [kWarps][kRows]
  float* tot = lw + kWarps * kRows;                        // [2][kRows]
  int* flag = reinterpret_cast<int*>(tot + 2 * kRows);

  // 1. Lengths and the exclusive prefix of tiles per sequence (thread t owns sequences
  // [t per, (t + 1) per); warp scans with shuffles, then the 4 warp totals).
  const int per = (B + kThreads - 1) / kThreads;
  int mine = 0;
  for (int i = 0; i < per; ++i) {
    const int b = threadIdx.x * per + i;
    if (b < B) {
      lens[b] = kernels::LiveLength(p.lengths, b, p.max_tokens);
      mine += TilesOf(lens[b], kTile);
    }
  }
  int incl = mine;  // inclusive scan over the warp
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int x = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += x;
  }
  if (lane == 31) scan[warp] = incl;
  __syncthreads();
  {
    int run = incl - mine;  // exclusive within the warp, plus the earlier warps' totals
    for (int w = 0; w < warp; ++w) run += scan[w];
    for (int i = 0; i < per; ++i) {
      const int b = threadIdx.x * per + i;
      if (b < B) {
        prefix[b] = run;
        run += TilesOf(lens[b], kTile);
      }
    }
    if (threadIdx.x == kThreads - 1) prefix[B] = run;
  }
  __syncthreads();
  const Tables tab{lens, prefix, B, HG};
  const int total = HG * prefix[B];

  // 2. Empty sequences get zeros (spread over the whole grid).
  for (int b = blockIdx.x; b < B; b += gridDim.x) {
    if (lens[b] != 0) continue;
    QT* o = static_cast<QT*>(p.out) + static_cast<int64_t>(b) * p.q_heads * D;
    for (int i = threadIdx.x; i < p.q_heads * D; i += kThreads) o[i] = FromFloat<QT>(0.f);
  }

  // 3. This CTA's tiles.
  const int C = EffectiveCtas(gridDim.x, total, p.min_tiles);
  const int cta = blockIdx.x;
  if (cta >= C || total == 0) return;
  const int g0 = RangeStart(cta, total, C), g1 = RangeStart(cta + 1, total, C);
  if (g0 >= g1) return;

  const int64_t tstride = static_cast<int64_t>(p.token_heads) * RB;  // bytes between tokens
  const uint8_t* kbytes = static_cast<const uint8_t*>(p.k);
  const uint8_t* vbytes = static_cast<const uint8_t*>(p.v);

  // Copies tile c (or, past the end, nothing) into ring slot `slot` (cp.async: one commit
  // group each; bulk: one copy per live row, lanes 0-15 K rows and 16-31 V rows, each lane
  // every 16th row, rows past the length zeroed, the slot's barrier expecting the bytes).
  auto issue = [&](const Cursor& c, bool valid, int slot) {
    if (valid) {
      const int t0 = c.tile * kTile;
      const int n = min(kTile, lens[c.b] - t0);
      const int kvh = c.hg * GB / p.group;
      const int64_t base = (static_cast<int64_t>(c.b) * p.max_tokens + t0) * tstride +
                           static_cast<int64_t>(kvh) * RB;
      uint8_t* dst = ring + slot * 2 * kTileBytes;
      if constexpr (kBulk) {
        if (lane == 0) MbarArriveExpectTx(bars + slot, 2u * n * RB);
        __syncwarp();
        const bool is_v = lane >= 16;
#pragma unroll
        for (int h = 0; h < kSub; ++h) {
          const int row = 16 * h + (lane & 15);
          uint8_t* d = dst + (is_v ? kTileBytes : 0) + row * kRowStride;
          if (row < n) {
            BulkCopy(d, (is_v ? vbytes : kbytes) + base + row * tstride, RB, bars + slot);
          } else {
#pragma unroll
            for (int i = 0; i < RB / 16; ++i) {
              reinterpret_cast<uint4*>(d)[i] = make_uint4(0, 0, 0, 0);
            }
            FenceProxyAsync();
          }
        }
      } else {
#pragma unroll
        for (int i = 0; i < kTile * RB / 512; ++i) {
          const int q = lane + 32 * i;  // chunk q of the tile: consecutive lanes, consecutive bytes
          const int row = q / kChunksPerRow, col = q % kChunksPerRow;
          const bool live = row < n;
          const int64_t off = base + (live ? row : 0) * tstride + col * 16;
          const uint32_t d = SharedAddress(dst + RingOffset<RB>(row, col * 16));
          CpAsync16(d, kbytes + off, live ? 16 : 0);
          CpAsync16(d + kTileBytes, vbytes + off, live ? 16 : 0);
        }
      }
    }
    if constexpr (!kBulk) CpAsyncCommit();
  };
  if constexpr (kBulk) {
    if (lane == 0) {
      for (int i = 0; i < stages; ++i) MbarInit(bars + i, 1);
      MbarFenceInit();
    }
    __syncwarp();
  }
  unsigned phase = 0;  // kBulk: parity of each slot's barrier, one bit per slot

  Cursor lc{}, cc{};
  bool lvalid = g0 + warp < g1, cvalid = lvalid;
  if (lvalid) lc = cc = tab.Locate(g0 + warp);
  int lslot = 0, cslot = 0;
  for (int i = 0; i < stages - 1; ++i) {
    issue(lc, lvalid, lslot);
    lslot = lslot + 1 == stages ? 0 : lslot + 1;
    tab.Advance(lc, lvalid, kWarps, g1);
  }

  Cursor seg = tab.Locate(g0);
  for (int g = g0; g < g1;) {
    const int b = seg.b, hg = seg.hg;
    const int unit_tiles = tab.Tiles(b);
    const int unit_start = g - seg.tile, unit_end = unit_start + unit_tiles;
    const int seg_end = min(g1, unit_end);
    const int kvh = hg * GB / p.group;
    const float kscale = p.k_scale != nullptr ? __ldg(p.k_scale + kvh) : 1.f;
    const float vscale = p.v_scale != nullptr ? __ldg(p.v_scale + kvh) : 1.f;

    uint32_t qf[NQT][kKBlocks][4];
    float lscale[NQT][2];
    LoadQuery<QT, T, D, NQT>(p, b, hg, kscale, qf, lscale);
    float mrun[NQT][2], lrun[NQT][2], acc[NQT][kMTiles][4];
#pragma unroll
    for (int nt = 0; nt < NQT; ++nt) {
      mrun[nt][0] = mrun[nt][1] = -INFINITY;
      lrun[nt][0] = lrun[nt][1] = 0.f;
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
        acc[nt][mt][0] = acc[nt][mt][1] = acc[nt][mt][2] = acc[nt][mt][3] = 0.f;
    }

    while (cvalid && cc.g < seg_end) {
      issue(lc, lvalid, lslot);
      lslot = lslot + 1 == stages ? 0 : lslot + 1;
      tab.Advance(lc, lvalid, kWarps, g1);
      if constexpr (kBulk) {
        MbarWait(bars + cslot, (phase >> cslot) & 1u);
        phase ^= 1u << cslot;
      } else {
        CpAsyncWait(stages - 1);
      }
      __syncwarp();

      const uint8_t* ks = ring + cslot * 2 * kTileBytes;
      const uint8_t* vs = ks + kTileBytes;
      const int n = min(kTile, lens[b] - cc.tile * kTile);

      // QK: logits (16 tokens x 8 heads per sub-tile and n-tile).
      float sc[kSub][NQT][4];
#pragma unroll
      for (int s = 0; s < kSub; ++s) {
#pragma unroll
        for (int nt = 0; nt < NQT; ++nt) {
          sc[s][nt][0] = sc[s][nt][1] = sc[s][nt][2] = sc[s][nt][3] = 0.f;
        }
#pragma unroll
        for (int j = 0; j < kKBlocks; ++j) {
          const int byte = (32 * j + 8 * tig) * St::kBytes;
          const uint4 ka = St::Load8(ks + TileOffset<RB, kBulk>(16 * s + grp, byte));
          const uint4 kb = St::Load8(ks + TileOffset<RB, kBulk>(16 * s + grp + 8, byte));
#pragma unroll
          for (int nt = 0; nt < NQT; ++nt) {
            TC::Mma(sc[s][nt], ka.x, kb.x, ka.y, kb.y, qf[nt][j][0], qf[nt][j][1]);
            TC::Mma(sc[s][nt], ka.z, kb.z, ka.w, kb.w, qf[nt][j][2], qf[nt][j][3]);
          }
        }
      }

      // Online softmax in registers, one rescale per ring tile; rows at or past n are
      // masked (their K/V are zeros).
      uint32_t pb[kSub][NQT][2];
#pragma unroll
      for (int nt = 0; nt < NQT; ++nt) {
        float pr[kSub][4], alpha[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float sv[kSub][2];
          float mx = -INFINITY;
#pragma unroll
          for (int s = 0; s < kSub; ++s) {
            sv[s][0] = 16 * s + grp < n ? sc[s][nt][e] * lscale[nt][e] : -INFINITY;
            sv[s][1] = 16 * s + grp + 8 < n ? sc[s][nt][2 + e] * lscale[nt][e] : -INFINITY;
            mx = fmaxf(mx, fmaxf(sv[s][0], sv[s][1]));
          }
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
          const float m_new = fmaxf(mrun[nt][e], mx);  // finite: row 0 of a tile is live
          alpha[e] = exp2f(mrun[nt][e] - m_new);       // 0 on the first tile
          mrun[nt][e] = m_new;
          float sum = 0.f;
#pragma unroll
          for (int s = 0; s < kSub; ++s) {
            pr[s][e] = exp2f(sv[s][0] - m_new);
            pr[s][2 + e] = exp2f(sv[s][1] - m_new);
            sum += pr[s][e] + pr[s][2 + e];
          }
          lrun[nt][e] = lrun[nt][e] * alpha[e] + sum;
        }
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          acc[nt][mt][0] *= alpha[0];
          acc[nt][mt][1] *= alpha[1];
          acc[nt][mt][2] *= alpha[0];
          acc[nt][mt][3] *= alpha[1];
        }
        // (token grp, heads 2tig..) -> (head grp, tokens 2tig..): the PV B fragment.
#pragma unroll
        for (int s = 0; s < kSub; ++s) {
          pb[s][nt][0] = MoveTransposed(TC::Pack(pr[s][0], pr[s][1]));
          pb[s][nt][1] = MoveTransposed(TC::Pack(pr[s][2], pr[s][3]));
        }
      }

      // PV: O^T += V^T P^T (m = 16 dims, n = 8 heads, k = 16 tokens per sub-tile).
#pragma unroll
      for (int s = 0; s < kSub; ++s) {
        const int r = 16 * s + 2 * tig;
#pragma unroll
        for (int x = 0; x < kVChunks; ++x) {
          const int byte = (64 * x + 8 * grp) * St::kBytes;
          const uint4 w0 = St::Load8(vs + TileOffset<RB, kBulk>(r, byte));      // token 2tig
          const uint4 w1 = St::Load8(vs + TileOffset<RB, kBulk>(r + 1, byte));  // 2tig + 1
          const uint4 w2 = St::Load8(vs + TileOffset<RB, kBulk>(r + 8, byte));  // 2tig + 8
          const uint4 w3 = St::Load8(vs + TileOffset<RB, kBulk>(r + 9, byte));  // 2tig + 9
#pragma unroll
          for (int i2 = 0; i2 < 4; ++i2) {
            const uint32_t a0 = __byte_perm(Word(w0, i2), Word(w1, i2), 0x5410u);  // dim d
            const uint32_t a1 = __byte_perm(Word(w0, i2), Word(w1, i2), 0x7632u);  // dim d + 1
            const uint32_t a2 = __byte_perm(Word(w2, i2), Word(w3, i2), 0x5410u);
            const uint32_t a3 = __byte_perm(Word(w2, i2), Word(w3, i2), 0x7632u);
#pragma unroll
            for (int nt = 0; nt < NQT; ++nt)
              TC::Mma(acc[nt][4 * x + i2], a0, a1, a2, a3, pb[s][nt][0], pb[s][nt][1]);
          }
        }
      }
      __syncwarp();  // every lane is done with this slot before it is refilled
      cslot = cslot + 1 == stages ? 0 : cslot + 1;
      tab.Advance(cc, cvalid, kWarps, g1);
    }

    // 4. Merge the warps' states of this piece (fixed order: deterministic).
#pragma unroll
    for (int nt = 0; nt < NQT; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float l = lrun[nt][e];
        l += __shfl_xor_sync(0xffffffffu, l, 4);
        l += __shfl_xor_sync(0xffffffffu, l, 8);
        l += __shfl_xor_sync(0xffffffffu, l, 16);
        if (grp == 0) {
          mw[warp * kRows + nt * 8 + 2 * tig + e] = mrun[nt][e];
          lw[warp * kRows + nt * 8 + 2 * tig + e] = l;
        }
      }
    }
    __syncthreads();
    float f[NQT][2];
#pragma unroll
    for (int nt = 0; nt < NQT; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int head = nt * 8 + 2 * tig + e;
        float M = -INFINITY;
        for (int w = 0; w < kWarps; ++w) M = fmaxf(M, mw[w * kRows + head]);
        f[nt][e] = exp2f(mrun[nt][e] - M) * vscale;  // a warp without tiles here: 0
      }
    }
    AccumulateWarpsInOrder<kWarps, NQT, kMTiles>(red, kRedStride, GB, acc, f);
    if (threadIdx.x < GB) {
      const int h = threadIdx.x;
      float M = -INFINITY;
      for (int w = 0; w < kWarps; ++w) M = fmaxf(M, mw[w * kRows + h]);
      float L = 0.f;
      for (int w = 0; w < kWarps; ++w) L += lw[w * kRows + h] * exp2f(mw[w * kRows + h] - M);
      tot[h] = M;
      tot[kRows + h] = L;
    }
    __syncthreads();

    const bool starts_unit = g == unit_start, ends_unit = seg_end == unit_end;
    if (starts_unit && ends_unit) {
      QT* o = static_cast<QT*>(p.out) + (static_cast<int64_t>(b) * p.q_heads + hg * GB) * D;
      for (int idx = threadIdx.x; idx < GB * D; idx += kThreads) {
        const int h = idx / D, d = idx - h * D;
        o[idx] = FromFloat<QT>(red[h * kRedStride + d] / tot[kRows + h]);  // L >= 1
      }
    } else {
      const int slot = SlotOf(starts_unit);
      for (int idx = threadIdx.x; idx < GB * D; idx += kThreads) {
        const int h = idx / D, d = idx - h * D;
        p.ws_acc[PartialRow(cta, slot, GB, h) * D + d] = red[h * kRedStride + d];
      }
      if (threadIdx.x < GB) {
        p.ws_m[PartialRow(cta, slot, GB, threadIdx.x)] = tot[threadIdx.x];
        p.ws_l[PartialRow(cta, slot, GB, threadIdx.x)] = tot[kRows + threadIdx.x];
      }
      if (p.fused) {
        __syncthreads();
        const int first = OwnerOf(unit_start, total, C), last = OwnerOf(unit_end - 1, total, C);
        if (threadIdx.x == 0) {
          __threadfence();  // this piece is visible before it is counted
          unsigned* counter = p.counters + b * HG + hg;
          const unsigned arrived = atomicAdd(counter, 1u) + 1;
          const bool is_last = arrived == static_cast<unsigned>(last - first + 1);
          if (is_last) *counter = 0;  // leave it as found (the handler clears it anyway)
          *flag = is_last;
        }
        __syncthreads();
        if (*flag) {
          __threadfence();
          CombineUnit<QT, D>(p, b, hg, first, last, tot);
        }
      }
    }
    __syncthreads();  // red, mw, lw, tot are reused by the next piece

    g = seg_end;
    if (g < g1) {  // the next unit with tiles
      seg.tile = 0;
      do {
        if (++seg.hg == HG) {
          seg.hg = 0;
          ++seg.b;
        }
      } while (tab.Tiles(seg.b) == 0);
    }
  }
  if constexpr (!kBulk) CpAsyncWait(0);
}

}  // namespace jax_vmm::attention::stream
