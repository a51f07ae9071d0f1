// Plan and work partition of the streaming ("stream-K") decode attention, target
// jax_vmm_decode_attention_v2, shared by the CUDA kernel (stream_kernel.cuh), its CPU
// model (stream_cpu.cc) and the Python bindings, so that CI runs the exact partition,
// slot and combine bookkeeping of the GPU path.
//
// Work. A *unit* is (sequence b, head group hg): head_group query heads that share one
// KV head. Unit u = b * unit_groups + hg holds tiles(b) = ceil(len_b / t) tiles of t
// tokens, t = TileTokens(row bytes): 16, or 32 for rows of at most 128 bytes. The units'
// tiles, laid end to end (b-major), form one global tile range
// [0, total) that is cut into C contiguous, equal pieces, one per CTA: CTA c takes
// [RangeStart(c), RangeStart(c + 1)). So every CTA reads the same number of KV bytes
// whatever the lengths (no tail wave, no idle CTA), and a unit that straddles CTA
// boundaries is computed in pieces and combined.
//
// C is static (the grid, from shapes only) but a small problem uses fewer CTAs:
// EffectiveCtas() gives each CTA at least min_tiles tiles; the rest exit at once. All of
// this is computed on the device from `lengths`, so a captured CUDA graph stays right
// while the sequences grow.
//
// Pieces. A unit inside one CTA is finished there (output written directly). A split
// unit's pieces go to workspace slots: the piece that starts at the unit's first tile
// goes to slot 1 of its CTA, every other piece to slot 0 (a CTA has at most one of
// each: its first piece may start mid-unit, its last may end mid-unit). The combine reads
// slot 1 of OwnerOf(first tile) and slot 0 of each later contributor up to
// OwnerOf(last tile).
//
// Workspace (bytes, each part 256-aligned), P = ctas * 2 * head_group partial rows:
//   acc  float[P][head_dim] | m float[P] | l float[P] | counters uint32[batch * unit_groups]
// The counters (one per unit, for the fused combine: the last piece to arrive combines)
// must be zero when the kernel starts; the CUDA handler clears them before each launch.
//
// Header-only, no CUDA types; the JAX_VMM_STREAM_HD functions compile for host and device.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/math.h"
#include "ops/attention/attention_plan.h"

#if defined(__CUDACC__)
#define JAX_VMM_STREAM_HD __host__ __device__ __forceinline__
#else
#define JAX_VMM_STREAM_HD inline
#endif

namespace jax_vmm::attention::stream {

inline constexpr int kTileTokens = 16;  // the smallest tile (rows of more than 128 bytes)
inline constexpr int kWarps = 4;  // warps per CTA (each streams its own tiles)
inline constexpr int kThreads = 32 * kWarps;
inline constexpr int64_t kMaxBatch = 1024;         // lengths and tile prefix live in shared memory
inline constexpr int64_t kDefaultMinTokens = 256;  // automatic floor of a CTA's work (min_tiles)
inline constexpr int64_t kCpuCtas = 16;            // CPU model: fixed, machine independent

// How K and V are stored: the query's 16-bit type, or float8_e4m3fn (uint8 is taken as
// float8_e4m3fn bits: the fallback where a runtime cannot import float8 DLPack views).
enum class KvStorage : int { kBf16 = 0, kF16 = 1, kFp8 = 2 };

inline int64_t StorageBytes(KvStorage kv) { return kv == KvStorage::kFp8 ? 1 : 2; }

// Values of the `combine` attribute.
enum Combine : int64_t { kCombineFused = 0, kCombineKernel = 1 };

struct Plan {
  int64_t ctas = 0;         // grid size
  int64_t head_group = 0;   // query heads per unit
  int64_t unit_groups = 0;  // units per sequence = q_heads / head_group
  int64_t min_tiles = 0;
  int64_t tile_tokens = kTileTokens;  // TileTokens(head_dim * storage bytes)
  int64_t acc_offset = 0, m_offset = 0, l_offset = 0, counter_offset = 0;  // bytes
  int64_t workspace_bytes = 0;
};

// Tokens per tile for K/V rows of `row_bytes` (head_dim x element bytes): 32 for rows of at
// most 128 bytes (fp8 head_dim <= 128, 16-bit head_dim 64), else 16. A warp's fixed work
// per tile (its wait, cursor, copy addresses, softmax reductions and accumulator rescale)
// is the same whatever the row width; doubling short rows' tiles halves that work per
// byte (the kernel runs two tensor-core tiles of 16 tokens per ring tile).
constexpr int TileTokens(int64_t row_bytes) {
  return row_bytes <= 128 ? 2 * kTileTokens : kTileTokens;
}

// The grid size of the automatic plan. On a GPU (sm_count > 0) two CTAs per SM for K/V
// rows of <= 256 bytes (so each SM streams with 8 warps), one for 16-bit head_dim 256
// (its tiles need the shared memory of a whole SM for a 3-deep ring), three for fp8
// rows of <= 128 bytes: converting fp8 to fp16 makes that kernel issue about 1.5x the
// instructions per byte of the 16-bit one (ncu, H200: 0.48 against 0.32 issued per
// scheduler cycle), so an SM needs more warps to issue from (head_dim 128: 2-4% faster
// than two, see docs/benchmarks.md); the CPU model
// (sm_count 0) uses kCpuCtas. storage_bytes: bytes per K/V element (2, or 1 for fp8).
inline int64_t DefaultCtas(int64_t sm_count, int64_t head_dim, int64_t storage_bytes) {
  if (sm_count <= 0) return kCpuCtas;
  const int64_t row_bytes = head_dim * storage_bytes;
  if (storage_bytes == 1 && row_bytes <= 128) return sm_count * 3;
  return sm_count * (row_bytes > 256 ? 1 : 2);
}

inline constexpr int kMaxStages = 8;                  // ring slots per warp
inline constexpr size_t kMaxSmemPerCta = 227 * 1024;  // sm_90 opt-in limit

// Shared memory a CTA needs besides its ring (batch sequences, `rows` = 8 or 16 query
// heads per unit tile): slot barriers, lengths and tile prefix, the scan scratch, the warp
// merge and its statistics. stream_kernel.cuh carves it in this order.
inline size_t FixedSharedBytes(int64_t batch, int rows, int64_t head_dim) {
  return sizeof(uint64_t) * kWarps * kMaxStages + sizeof(int) * (2 * batch + 1 + kThreads) +
         sizeof(float) * (rows * (head_dim + 4) + 2 * kWarps * rows + 2 * rows) + sizeof(int) + 16;
}

// Ring bytes of one slot for all warps: a K and a V tile of TileTokens rows each (bulk:
// rows padded by 16 bytes).
inline size_t StageBytes(int64_t head_dim, KvStorage kv, bool bulk) {
  const int64_t row_bytes = head_dim * StorageBytes(kv);
  const size_t row = static_cast<size_t>(row_bytes) + (bulk ? 16 : 0);
  return static_cast<size_t>(kWarps) * 2 * TileTokens(row_bytes) * row;
}

// Empty when a ring of `stages` slots fits a CTA's shared memory, else why not; checked on
// the CPU too, so that a stages= a GPU refuses is refused there.
inline std::string StagesFit(int64_t stages, int64_t batch, int rows, int64_t head_dim,
                             KvStorage kv, bool bulk) {
  const size_t stage_bytes = StageBytes(head_dim, kv, bulk);
  const size_t fixed = FixedSharedBytes(batch, rows, head_dim);
  if (stages >= 2 && stages <= kMaxStages &&
      fixed + static_cast<size_t>(stages) * stage_bytes <= kMaxSmemPerCta) {
    return {};
  }
  return "stages=" + std::to_string(stages) + " does not fit (2.." + std::to_string(kMaxStages) +
         " slots of " + std::to_string(stage_bytes) + " bytes plus " + std::to_string(fixed) +
         " within " + std::to_string(kMaxSmemPerCta) + " bytes of shared memory)";
}

// The deepest ring the automatic plan gives fp8 tiles (with 16-token tiles a 3-deep ring
// at three CTAs per SM was faster than the 4 that shared memory allowed; with 32-token
// tiles only 2 fit there, and 2 or 3 measured alike: docs/benchmarks.md).
inline constexpr int64_t kFp8AutoStages = 3;

// Empty string when the streaming kernel can serve these shapes, else why not.
inline std::string Unsupported(const Shapes& s) {
  if (s.batch > kMaxBatch) {
    return "batch " + std::to_string(s.batch) + " > " + std::to_string(kMaxBatch) +
           " (the per-CTA length table lives in shared memory)";
  }
  const int64_t groups = s.q_heads / HeadGroup(s.q_heads, s.kv_heads);
  // Counted in the smallest tiles, so the bound holds for every storage.
  const int64_t tiles = CeilDiv<int64_t>(std::max<int64_t>(s.max_tokens, 1), kTileTokens);
  if (s.batch * groups * tiles >= (int64_t{1} << 31)) {
    return "batch * head groups * ceil(max_tokens / 16) must be < 2^31";
  }
  return {};
}

// ctas_override / min_tiles_override > 0 force those values; 0 = automatic.
// default_ctas: DefaultCtas() of the device the plan is for; storage_bytes: bytes per K/V
// element (2, or 1 for fp8).
inline Plan MakeStreamPlan(const Shapes& s, int64_t storage_bytes, int64_t default_ctas,
                           int64_t ctas_override = 0, int64_t min_tiles_override = 0) {
  Plan p;
  p.tile_tokens = TileTokens(s.head_dim * storage_bytes);
  p.head_group = HeadGroup(s.q_heads, s.kv_heads);
  p.unit_groups = s.q_heads / p.head_group;
  p.ctas = std::max<int64_t>(1, ctas_override > 0 ? ctas_override : default_ctas);
  p.min_tiles = min_tiles_override > 0 ? min_tiles_override : kDefaultMinTokens / p.tile_tokens;
  const int64_t rows = p.ctas * 2 * p.head_group;
  p.acc_offset = 0;
  p.m_offset = RoundUp<int64_t>(rows * s.head_dim * 4, 256);
  p.l_offset = p.m_offset + RoundUp<int64_t>(rows * 4, 256);
  p.counter_offset = p.l_offset + RoundUp<int64_t>(rows * 4, 256);
  p.workspace_bytes = p.counter_offset + RoundUp<int64_t>(s.batch * p.unit_groups * 4, 256);
  return p;
}

// -- the partition (host and device) ---------------------------------------------------

JAX_VMM_STREAM_HD int TilesOf(int length, int tile_tokens) {
  return (length + tile_tokens - 1) / tile_tokens;
}

// CTAs that get work: each at least min_tiles tiles, at most `grid`, at least 1.
JAX_VMM_STREAM_HD int EffectiveCtas(int grid, int total, int min_tiles) {
  if (total <= 0) return 1;
  const int want = total / min_tiles;
  return want < grid ? (want < 1 ? 1 : want) : grid;
}

// First global tile of CTA c (c in [0, C]; RangeStart(C) = total).
JAX_VMM_STREAM_HD int RangeStart(int c, int total, int C) {
  return static_cast<int>(static_cast<int64_t>(c) * total / C);
}

// The CTA whose range holds global tile g (0 <= g < total): the largest c with
// RangeStart(c) <= g, i.e. c < (g + 1) * C / total.
JAX_VMM_STREAM_HD int OwnerOf(int g, int total, int C) {
  return static_cast<int>(((static_cast<int64_t>(g) + 1) * C - 1) / total);
}

// Where global tile g lies: tile `tile` of unit (b, hg).
struct UnitTile {
  int b, hg, tile;
};

// The unit tile of global tile g (0 <= g < groups * prefix[batch]); prefix[0..batch] is
// the exclusive prefix of TilesOf(length, tile_tokens) per sequence. The largest b with
// groups * prefix[b] <= g has a non-empty unit range holding g (binary search).
JAX_VMM_STREAM_HD UnitTile LocateTile(const int* prefix, int batch, int groups, int g) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (groups * prefix[mid] <= g) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int r = g - groups * prefix[lo];
  const int t = prefix[lo + 1] - prefix[lo];
  return UnitTile{lo, r / t, r % t};
}

// Workspace slot of a piece: 1 for the piece that starts at the unit's first tile.
JAX_VMM_STREAM_HD int SlotOf(bool starts_unit) { return starts_unit ? 1 : 0; }

// Workspace row of query head `row` (< head_group) of the piece in (cta, slot).
JAX_VMM_STREAM_HD int64_t PartialRow(int cta, int slot, int head_group, int row) {
  return (static_cast<int64_t>(cta) * 2 + slot) * head_group + row;
}

// Slot that contributor c of a unit owned by CTAs [first, last] wrote.
JAX_VMM_STREAM_HD int ContributorSlot(int c, int first) { return c == first ? 1 : 0; }

}  // namespace jax_vmm::attention::stream
