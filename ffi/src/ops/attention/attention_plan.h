// Split-K ("flash-decoding") plan for jax_vmm_decode_attention, shared by the CPU and
// CUDA handlers so that both split the work identically: CI exercises the chunking and
// combine arithmetic of the GPU path on the CPU.
//
// Work decomposition. Each sequence's live tokens [0, length) are cut into chunks of
// `chunk` tokens; chunk c goes to split c % splits, so a split handles chunks
// s, s + splits, s + 2*splits, ... and keeps one partial result (running max m, running
// sum l, unnormalised accumulator acc[D]) per query head. Splits with no chunk (s >=
// ceil(length / chunk)) write nothing; the combine step reads only the live ones.
// Everything here depends on static shapes only (never on the lengths), so a CUDA graph
// captured once launches the right grid for every later step.
//
// Workspace layout (float32), P = batch * S * q_heads * splits partials (S query rows per
// sequence), partial index (((b * S + i) * q_heads + h) * splits + s):
// acc[P][D] | m[P] | l[P].
//
// Header-only; no CUDA types, usable from .cc and .cu host code.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/math.h"

namespace jax_vmm::attention {

inline constexpr int64_t kTile = 16;             // tokens per tensor-core tile (chunk multiple)
// Smallest chunk the automatic plan picks. Short chunks give more blocks but each block
// then carries one tile per warp between its barriers, and latency, not bandwidth, sets the
// time: on the H200 (docs/benchmarks.md, bench/kernels_probe.py) 256-token chunks beat the
// 64-token ones the block-count target asked for by 1.2-1.9x at B1-B32 with 1k-32k tokens.
inline constexpr int64_t kMinAutoChunk = 256;
inline constexpr int64_t kMaxHeadGroup = 16;     // query heads one CUDA block serves
inline constexpr int64_t kBlocksPerUnit = 16;    // target blocks per SM (CPU: per "unit")
inline constexpr int64_t kCpuParallelUnits = 8;  // fixed, so CPU plans are machine independent
// Most splits the CUDA combine kernel takes: one float each in its 48 KiB of shared memory
// beside 516 of its own (attention_kernels.cu); an override past it is clamped everywhere.
inline constexpr int64_t kMaxSplits = 48 * 1024 / 4 - 516;

struct Shapes {
  int64_t batch = 0;
  int64_t max_tokens = 0;  // T: capacity of each sequence in the K/V buffers
  int64_t q_heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t q_len = 1;  // S: query rows per sequence (decode: 1)
  // Head rows between a sequence's consecutive tokens in K and V: kv_heads (dense), or
  // more in a buffer that interleaves layers (kvcache::Geometry). 0 means kv_heads.
  int64_t token_heads = 0;
};

// Head rows, and elements, between consecutive tokens of one sequence in K and V.
inline int64_t TokenHeads(const Shapes& s) {
  return s.token_heads > 0 ? s.token_heads : s.kv_heads;
}
inline int64_t TokenStride(const Shapes& s) { return TokenHeads(s) * s.head_dim; }

struct Plan {
  int64_t chunk = 0;       // tokens per chunk, a multiple of kTile
  int64_t splits = 0;      // partial results per (sequence, query head), >= 1
  int64_t head_group = 0;  // query rows per CUDA block (S = 1: heads, dividing q_heads / kv_heads)
  int64_t row_blocks = 0;  // tensor-core blocks per (sequence, KV head): ceil(S * G / head_group)
  int64_t max_chunks = 0;  // ceil(max_tokens / chunk)
  int64_t workspace_bytes = 0;
};

// Empty string when the shapes are usable, else what is wrong.
inline std::string ValidateShapes(const Shapes& s) {
  if (s.batch < 0 || s.max_tokens < 0 || s.q_heads <= 0 || s.kv_heads <= 0 || s.head_dim <= 0) {
    return "sizes must be positive (batch=" + std::to_string(s.batch) +
           ", max_tokens=" + std::to_string(s.max_tokens) +
           ", q_heads=" + std::to_string(s.q_heads) + ", kv_heads=" + std::to_string(s.kv_heads) +
           ", head_dim=" + std::to_string(s.head_dim) + ")";
  }
  if (s.q_len <= 0) {
    return "the query length S must be positive, got " + std::to_string(s.q_len);
  }
  if (s.q_heads % s.kv_heads != 0) {
    return "q_heads=" + std::to_string(s.q_heads) +
           " is not a multiple of kv_heads=" + std::to_string(s.kv_heads) +
           " (grouped-query attention needs H_q % H_kv == 0)";
  }
  return {};
}

// Largest divisor of the GQA group size that is <= kMaxHeadGroup: every block's heads
// then share one K/V head, so each K/V byte is loaded once per block.
inline int64_t HeadGroup(int64_t q_heads, int64_t kv_heads) {
  const int64_t group = q_heads / kv_heads;
  for (int64_t g = std::min(group, kMaxHeadGroup); g > 1; --g) {
    if (group % g == 0) return g;
  }
  return 1;
}

// Largest chunk a block may use (bounded by its shared memory: logits[heads][chunk]).
inline int64_t MaxChunk(int64_t head_group) { return head_group > 8 ? 256 : 512; }

// Rows one tensor-core block serves: with S = 1 the heads of HeadGroup (today's decode
// grid); with S > 1 the (query, head) rows of one KV head, S * G of them, in blocks of
// up to kMaxHeadGroup.
inline int64_t RowGroup(const Shapes& s) {
  if (s.q_len == 1) return HeadGroup(s.q_heads, s.kv_heads);
  const int64_t rows = s.q_len * (s.q_heads / s.kv_heads);
  return rows <= 8 ? rows : kMaxHeadGroup;
}

inline int64_t WorkspaceBytes(const Shapes& s, int64_t splits) {
  const int64_t partials = s.batch * s.q_len * s.q_heads * splits;
  const int64_t bytes = partials * (s.head_dim + 2) * static_cast<int64_t>(sizeof(float));
  return RoundUp(bytes, 256);
}

// parallel_units: SM count on CUDA (kCpuParallelUnits on the CPU). chunk_override /
// splits_override > 0 force those values (tests and tuning); 0 = automatic.
inline Plan MakePlan(const Shapes& s, int64_t parallel_units, int64_t chunk_override = 0,
                     int64_t splits_override = 0) {
  Plan p;
  p.head_group = RowGroup(s);
  p.row_blocks = CeilDiv(s.q_len * (s.q_heads / s.kv_heads), p.head_group);
  const int64_t chunk_cap = MaxChunk(p.head_group);
  const int64_t blocks_per_split = std::max<int64_t>(1, s.batch * s.kv_heads * p.row_blocks);
  const int64_t target_blocks = kBlocksPerUnit * std::max<int64_t>(1, parallel_units);
  const int64_t tokens = std::max<int64_t>(1, s.max_tokens);
  if (chunk_override > 0) {
    p.chunk = std::min(chunk_cap, CeilDiv(chunk_override, kTile) * kTile);
  } else {
    // Largest chunk that still gives enough blocks to fill the device: big chunks keep
    // the partials (an extra write + read) small; small ones give short sequences
    // and small batches enough parallelism.
    p.chunk = chunk_cap;
    while (p.chunk > kMinAutoChunk && blocks_per_split * CeilDiv(tokens, p.chunk) < target_blocks) {
      p.chunk /= 2;
    }
  }
  p.max_chunks = CeilDiv(tokens, p.chunk);
  if (splits_override > 0) {
    p.splits = std::min({splits_override, p.max_chunks, kMaxSplits});
  } else {
    // Enough splits to fill the device twice over, at least 64 so that long contexts
    // keep their parallelism; never more than there are chunks.
    const int64_t cap = std::max<int64_t>(64, CeilDiv(2 * target_blocks, blocks_per_split));
    p.splits = std::min(p.max_chunks, cap);
  }
  p.splits = std::max<int64_t>(1, p.splits);
  p.workspace_bytes = WorkspaceBytes(s, p.splits);
  return p;
}

// Values of the `impl` attribute.
// kTensorCoreOneTile: the tensor-core kernel with one tile in flight per warp (the
// default loads two where registers allow); kept for benchmarking the choice.
enum class Impl : int64_t { kAuto = 0, kTensorCore = 1, kSimple = 2, kTensorCoreOneTile = 3 };

}  // namespace jax_vmm::attention
