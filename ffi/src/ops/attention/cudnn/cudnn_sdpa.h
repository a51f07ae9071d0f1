// cuDNN SDPA graphs for jax_vmm's attention semantics, built with the cuDNN frontend and
// cached per (device, shapes, dtype, options).
//
// Semantics (the same as jax_vmm.attention): q (B, S, H_q, D) holds, for sequence b, the
// last q_lengths[b] of its lengths[b] cached tokens; query row i sits at position
// lengths[b] - q_lengths[b] + i and attends to cached positions <= its own (causal mask
// aligned bottom-right, per sequence) and, with a window W, > its own - W. Logits are
// scale * q.k, then softcap * tanh(logits / softcap) when softcap > 0. k, v are
// (B, T, H_kv, D) with H_q % H_kv == 0. All tensors are dense BSHD.
//
// cuDNN's values are right for rows i < q_lengths[b] only. Rows past it, and every row of a
// sequence of length 0, are the caller's to zero, after the graph: measured on the H200
// (cuDNN 9.19), the S > 1 graph leaves a length-0 sequence's rows unwritten but writes
// rows past q_lengths of the others, and the S = 1 graph writes every row, +0 for a
// sequence of length 0 (so decode needs no zeroing; cudnn_rows.h).
//
// Building needs no stream and must not run under stream capture (it may allocate and
// compile kernels); Execute() only records cudnnBackendExecute on the stream, which is
// capture-safe with a fixed workspace pointer.
//
// Thread-safety: all functions are thread-safe. One cuDNN handle per device, used under
// that device's mutex.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

namespace jax_vmm::cudnn {

enum class IoType : int { kBF16 = 0, kF16 = 1 };

struct SdpaKey {
  int device = 0;
  IoType io = IoType::kBF16;
  int64_t batch = 0, q_tokens = 0, max_tokens = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  // Head rows between a sequence's consecutive tokens in K and V (0: kv_heads, dense;
  // more in a KV cache that interleaves layers).
  int64_t kv_token_heads = 0;
  int64_t window = 0;    // 0: none
  float softcap = 0.0f;  // 0: none
  float scale = 1.0f;
  bool operator<(const SdpaKey& o) const;
};

class SdpaGraph;  // a built graph (opaque; lives in the cache for the process)

// One query token, no window, no soft-cap: the graph without a causal mask or score
// modifier (Build), on cuDNN's decode path, which lets no key or value past a length
// reach the output (tests/ops/test_cudnn_attention.py, NaN and inf there).
inline bool IsPlainDecode(const SdpaKey& k) {
  return k.q_tokens == 1 && k.window == 0 && k.softcap == 0.0f;
}

struct SdpaPointers {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const int32_t* q_lengths = nullptr;  // (B,) device
  const int32_t* lengths = nullptr;    // (B,) device
  void* out = nullptr;
  void* workspace = nullptr;
};

// The cached graph of `key`, building it when `may_build` (never under capture). On
// failure returns the reason (cuDNN's message included); failures are cached too, so a
// graph cuDNN does not support fails fast on every later call.
std::string GetGraph(const SdpaKey& key, bool may_build, const SdpaGraph** graph);

// The cached graph of `key`, or null when none was tried yet (never builds). A cached
// failure returns null with its reason in *error.
const SdpaGraph* FindGraph(const SdpaKey& key, std::string* error);

// Bytes of workspace `graph` needs at Execute().
int64_t WorkspaceBytes(const SdpaGraph& graph);

// Records the graph's execution on `stream`; the empty string on success.
std::string Execute(const SdpaGraph& graph, int device, cudaStream_t stream,
                    const SdpaPointers& ptrs);

// Counters for tests and benchmarks.
struct SdpaStats {
  int64_t graphs_built = 0;
  int64_t build_failures = 0;
  int64_t cache_hits = 0;
  int64_t executions = 0;
  int64_t execute_failures = 0;
};
SdpaStats Stats();

}  // namespace jax_vmm::cudnn
