// The kv_write custom calls: their contract, and the per-token check shared by host and
// device code.
//
// Two custom calls (Python wrappers and the user contract: jax_vmm/ops/array_writes.py):
//   jax_vmm_kv_write(k, v, new_k, new_v, slots) -> (k, v), outputs aliased {0:0, 1:1}
//   jax_vmm_kv_write_through(k, v, new_k, new_v, slots) -> status s32[2, n]
// Attributes dest_k / dest_v (u64 addresses, 0 = none) with dest_k_uid / dest_v_uid (the
// buffers' uids) name the arena buffers to write: the static destination. The uid is the
// identity (an address may belong to a newer arena by now); the address must match it.
// Each side's *target* is that buffer, or without one the buffer XLA handed over
// (kv_write: its output; write-through: its operand) when it is arena memory.
// Tokens are validated against the target (slot range; page table), written into the
// target, and kv_write also writes them into its output when that is not the target (an
// "alias miss": XLA copied the cache, so the returned arrays hold the tokens too).
// Per token and side the status is 0 padding (slot < 0), 1 written,
// 2 dropped: slot out of range, 3 dropped: slot on an unbacked chunk, 4 dropped: the
// target is a KV cache buffer and the token lies past its sequence's ensured tokens
// (backed only because a chunk is shared or rounded up: such memory may vanish when a
// neighbouring sequence is released), 5 dropped: the token lies in its sequence's
// read-only shared prefix (kv.share_prefix: the memory is another sequence's too).
#pragma once

#include <cstddef>
#include <cstdint>

#ifdef __CUDACC__
#define JAX_VMM_HD __host__ __device__
#else
#define JAX_VMM_HD
#endif

namespace jax_vmm::kv {

enum TokenStatus : int32_t {
  kPadding = 0,
  kValid = 1,
  kDroppedOutOfRange = 2,
  kDroppedUnbacked = 3,
  kDroppedNotEnsured = 4,
  kDroppedShared = 5,
};

// Where one side (k or v) of a call reads and writes. Plain data: passed to kernels.
struct Side {
  uint8_t* dst = nullptr;               // the target: arena buffer, or a plain output; null: none
  uint8_t* dst2 = nullptr;              // kv_write's output when it is not the target, else null
  // Bytes between consecutive slots in dst (and dst2): the token size, except in an
  // interleaved KV cache (kvcache::Geometry), whose writes have no dst2.
  uint64_t slot_bytes = 0;
  const uint8_t* src = nullptr;         // new tokens, n * token_bytes
  const uint8_t* page_table = nullptr;  // arena page table, null when dst is not arena
  uintptr_t arena_base = 0;
  uint64_t chunk_bytes = 1;
  unsigned long long* drop_counter = nullptr;  // the arena buffer's, or null
  int32_t* status = nullptr;                   // n entries (write-through), or null
  // When the target is a buffer of a KV cache (ops/kv_cache/kv_cache.h): its table of
  // tokens ensured per sequence, where dst lies in the buffer, and the cache's sequence
  // and row sizes (Geometry::row_bytes). A token is written only inside its sequence's
  // ensured prefix.
  const int32_t* limits = nullptr;  // null: not a KV cache buffer
  const int32_t* floors = nullptr;  // per sequence: tokens below are read-only (shared)
  uint64_t limit_offset = 0;        // dst - buffer base
  uint64_t seq_bytes = 1;
  uint64_t cache_row_bytes = 0;
};

struct Params {
  Side side[2];
  const int32_t* slots = nullptr;
  int64_t n = 0;
  int64_t num_slots = 0;
  uint64_t token_bytes = 0;
};

inline constexpr JAX_VMM_HD bool IsDropped(int32_t status) {
  return status == kDroppedOutOfRange || status == kDroppedUnbacked ||
         status == kDroppedNotEnsured || status == kDroppedShared;
}

// The check every production handler runs per token and side, on the host (CPU) or in
// the kernel (CUDA): the token's status (TokenStatus). The handlers take the check as a
// template argument (Tokens::Check) so that the testing layer can build its unchecked
// variant without a branch in production code.
struct CheckedTokens {
  static JAX_VMM_HD int32_t Check(int32_t slot, const Params& p, const Side& s) {
    if (slot < 0) return kPadding;
    if (slot >= p.num_slots) return kDroppedOutOfRange;
    // Every table read depends on the slot only, so all are issued before the first
    // branch on one: a kernel waits for one memory round trip, not one per table (a
    // decode-size write is latency-bound).
    uint64_t first = 0, last = 0;
    uint8_t first_backed = 1;
    if (s.page_table != nullptr) {
      const uint64_t start = reinterpret_cast<uintptr_t>(s.dst) - s.arena_base +
                             static_cast<uint64_t>(slot) * s.slot_bytes;
      first = start / s.chunk_bytes;
      last = (start + p.token_bytes - 1) / s.chunk_bytes;
      first_backed = s.page_table[first];
    }
    // Byte offsets in the buffer: any view geometry of it is checked the same way.
    const uint64_t off = s.limit_offset + static_cast<uint64_t>(slot) * s.slot_bytes;
    const uint64_t seq = off / s.seq_bytes;
    const int32_t limit = s.limits != nullptr ? s.limits[seq] : 0;
    const int32_t floor = s.limits != nullptr && s.floors != nullptr ? s.floors[seq] : 0;
    // The ensured tokens first: whether a token past them is backed depends on the chunk
    // size (64 KiB on the host, 2 MiB on a GPU), and its status must not.
    if (s.limits != nullptr) {
      const uint64_t seq_start = seq * s.seq_bytes;
      const uint64_t ensured_end = seq_start + static_cast<uint64_t>(limit) * s.cache_row_bytes;
      if (off + p.token_bytes > ensured_end) return kDroppedNotEnsured;
      if (off < seq_start + static_cast<uint64_t>(floor) * s.cache_row_bytes) {
        return kDroppedShared;
      }
    }
    if (first_backed != 1) return kDroppedUnbacked;
    for (uint64_t c = first + 1; c <= last; ++c) {
      if (s.page_table[c] != 1) return kDroppedUnbacked;
    }
    return kValid;
  }
};

}  // namespace jax_vmm::kv
