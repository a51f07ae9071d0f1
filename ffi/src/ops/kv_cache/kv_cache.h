// A KV cache as the FFI handlers see it: one K and one V buffer per layer in one arena,
// and per sequence the tokens ensured so far (`ensure` in jax_vmm/kv/backing.py), in a
// device-visible table that the kernels read (so a replayed CUDA graph checks against
// today's table, not the one it was recorded with).
//
// Identity is a uid (jax_vmm/cache/pytree.py carries it as the static data of the KVCache
// pytree): the handlers find the cache through the registry below by (uid, device
// ordinal), then its buffers by their own uids. Uids are never reused; a closed cache
// answers kClosed, a destroyed one kGone, and handlers refuse both.
//
// The table (int32 per sequence), the count of attention reads clamped to it (uint64), the
// per-sequence floors of writable tokens (int32; kv.share_prefix) and the readers' copy of
// the table live in one allocation of the arena's driver metadata (device memory on CUDA).
// Two copies of the table because writes and reads want different moments: kv_write
// checks the table as it is now (a write of a step dispatched before a release is
// dropped, never landing in memory the slot's next sequence or a shared prefix took),
// while CUDA attention reads the table of its dispatch (Driver::WriteTable: a step
// dispatched before a release still reads all its tokens; the CPU handlers get the same
// from the read epochs below). A CUDA handler that may be recorded into a graph
// pins it (PinMetadataForGraphs): closing the cache then zeroes the table (a stale replay writes
// nothing and reads no token) and the allocation is kept for the life of the process.
//
// Thread-safety: every method may be called from any thread; one mutex per cache guards
// the table and its host mirror. The registry functions are thread-safe.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "jax_vmm/arena.h"

namespace jax_vmm::kvcache {

// The shape of one layer's K (and V): (max_seqs, max_tokens, heads, head_dim), or
// (max_tokens, heads, head_dim) without a per-sequence layout (max_seqs then 1).
//
// Two layouts. Per layer: each K and each V is a buffer of its own, dense. Interleaved:
// one buffer (max_seqs, max_tokens, 2 x num_layers, heads, head_dim) holds every layer,
// layer l's K at slot 2l and its V at 2l + 1 of each token's row, so that one chunk of
// the buffer holds a token range of every layer (a sequence's partial last chunk is paid
// once, not 2L times). A layer is then a strided array: its tokens are row_elems() apart.
struct Geometry {
  int64_t num_layers = 0;
  int64_t max_seqs = 1;
  int64_t max_tokens = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  bool per_sequence = true;
  bool interleaved = false;
  int dtype = 0;             // xla::ffi::DataType of the buffers
  size_t element_bytes = 0;  // bytes of one element

  int64_t rank() const { return per_sequence ? 4 : 3; }
  // One layer's dimensions, rank() of them.
  std::vector<int64_t> dims() const;
  // Bytes of one token of one layer's K (or V).
  uint64_t token_bytes() const {
    return static_cast<uint64_t>(kv_heads * head_dim) * element_bytes;
  }
  // Head rows between a layer's consecutive tokens in its buffer (attention's
  // Shapes::token_heads), and the elements and bytes they span.
  int64_t row_heads() const { return kv_heads * (interleaved ? 2 * num_layers : 1); }
  int64_t row_elems() const { return row_heads() * head_dim; }
  uint64_t row_bytes() const { return static_cast<uint64_t>(row_elems()) * element_bytes; }
  uint64_t seq_bytes() const { return row_bytes() * static_cast<uint64_t>(max_tokens); }
  int64_t num_slots() const { return max_seqs * max_tokens; }
  size_t buffer_bytes() const { return static_cast<size_t>(seq_bytes()) * max_seqs; }
  // Where layer l's K (side 0) or V (side 1) starts in its buffer.
  uint64_t layer_offset(int64_t l, int side) const {
    return interleaved ? static_cast<uint64_t>(2 * l + side) * token_bytes() : 0;
  }
};

// Where one layer lives: its K and V buffers' uids and the addresses of its first
// token (the buffers' bases plus Geometry::layer_offset).
struct LayerBuffers {
  uint64_t k_uid = 0, v_uid = 0;
  uintptr_t k_address = 0, v_address = 0;
};

class KvCache {
 public:
  // Registers a cache over buffers k_ids[l], v_ids[l] of `arena` (each of
  // geometry.buffer_bytes() bytes; interleaved: one buffer, every id the same) under a
  // new uid, for XLA device ordinal `device_ordinal`. Every sequence starts with 0 tokens
  // ensured.
  //
  // shared_uid != 0: a shard of a sharded cache (one per device) that joins the live
  // cache registered under shared_uid: the same uid, so one set of custom-call
  // attributes names every shard and each device's handler finds its own. It needs the
  // same geometry and a device ordinal no shard of that uid has yet.
  static std::shared_ptr<KvCache> Create(std::shared_ptr<Arena> arena,
                                         const std::vector<int64_t>& k_ids,
                                         const std::vector<int64_t>& v_ids, const Geometry& g,
                                         int device_ordinal, uint64_t shared_uid = 0);
  ~KvCache();  // unregisters; frees the table, or (pinned) zeroes and keeps it
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  uint64_t uid() const { return uid_; }
  int device_ordinal() const { return device_ordinal_; }
  const char* driver_kind() const { return arena_->driver().kind(); }
  const Geometry& geometry() const { return geometry_; }
  const LayerBuffers& layer(int64_t l) const { return layers_.at(static_cast<size_t>(l)); }
  // Whether uid is one of this cache's buffers.
  bool Owns(uint64_t buffer_uid) const;

  // Tokens ensured for sequence `seq` (0 <= tokens <= max_tokens): the writers' table
  // before it returns, the readers' in dispatch order (above). Raise it after the memory
  // is committed, lower it before the memory is given back.
  void SetLimit(int64_t seq, int64_t tokens);
  // Every sequence's entry at once (tokens[seq], max_seqs of them): one copy to the device.
  void SetLimits(const std::vector<int64_t>& tokens);
  // Raises each sequence's entry to tokens[seq] where that is higher (max_seqs entries);
  // one copy to the device if any entry changed. Returns whether one did.
  bool RaiseLimits(const int64_t* tokens, size_t count);
  std::vector<int32_t> Limits() const;

  // Read epochs (host driver; jax_vmm/kv/read_epochs.py). XLA:CPU runs a step after its
  // dispatch returned and the CPU handlers read this table when they run, so a release
  // that lowers it at once would clamp the reads of a step dispatched before it. A release
  // that does not wait first calls BeginEpoch: the table as it stands is kept for readers
  // of the current epoch, and the epoch advances. The cache's ordering tokens carry the
  // epoch their step was dispatched in; a reader of an older epoch whose table is still
  // kept reads that one (ReadTableOf), any other reads the live table. Writes always
  // check the live table. ForgetEpochsBefore drops the kept tables once the work
  // dispatched in those epochs has finished. Epochs are in [0, 2^31).
  int32_t BeginEpoch();
  void ForgetEpochsBefore(int32_t epoch);
  int32_t epoch() const;
  // The table readers of `epoch` see: a kept one, or null for the live table.
  std::shared_ptr<const std::vector<int32_t>> ReadTableOf(int32_t epoch) const;
  // Tokens of sequence `seq` below which kv_write drops (and counts) every write: its
  // read-only shared prefix (kv.share_prefix; 0 = all writable), published before it
  // returns. Raise it before the memory is shared, lower it after it is released.
  void SetFloor(int64_t seq, int64_t tokens);
  std::vector<int32_t> Floors() const;

  // Attention reads whose length exceeded the ensured tokens (each counted once per
  // sequence and call; the read was clamped). Reading does not wait for the device.
  uint64_t ReadClamps() const;
  void ResetReadClamps();

  // Zeroes the table and refuses further use (the registry answers kClosed). Idempotent.
  void Close();
  // Closed, or its arena closed.
  bool closed() const;

  // Device-visible pointers for kernels (and host code on the CPU).
  const int32_t* device_limits() const { return limits_; }  // for writes: changes at once
  // For CUDA reads: changes in dispatch order (the same contents on the host backend).
  const int32_t* device_read_limits() const { return read_limits_; }
  const int32_t* device_floors() const { return floors_; }
  unsigned long long* device_read_clamps() const { return read_clamps_; }
  // Called by CUDA handlers that may bake the pointers above into a graph.
  void PinMetadataForGraphs() const { pinned_ = true; }

 private:
  KvCache(std::shared_ptr<Arena> arena, const Geometry& g, int device_ordinal, uint64_t uid);
  void WriteTableLocked();  // host mirror -> device table
  // Throws unless `tokens` has one entry per sequence, each in [0, max_tokens]; `op`
  // names the caller in the message.
  void CheckTable(const char* op, const int64_t* tokens, size_t count) const;

  std::shared_ptr<Arena> arena_;  // the buffers' arena (and the driver of the metadata)
  const uint64_t uid_;
  const Geometry geometry_;
  const int device_ordinal_;
  std::vector<LayerBuffers> layers_;

  mutable std::mutex mu_;
  bool closed_ = false;
  std::vector<int32_t> host_limits_;
  int32_t epoch_ = 0;
  std::map<int32_t, std::shared_ptr<const std::vector<int32_t>>> kept_tables_;  // by epoch
  std::vector<int32_t> host_floors_;
  // limits | read clamps | floors | read limits (each table max_seqs int32, padded to 8 bytes)
  void* metadata_ = nullptr;
  int32_t* limits_ = nullptr;
  int32_t* read_limits_ = nullptr;
  int32_t* floors_ = nullptr;
  unsigned long long* read_clamps_ = nullptr;
  mutable std::atomic<bool> pinned_{false};
};

// Where a registry lookup ended (FindKvCache).
enum class CacheLookup {
  kFound,        // an open cache on this device ordinal (*out filled)
  kClosed,       // the cache was closed (*out filled)
  kGone,         // no live cache has this uid (destroyed, or never made)
  kOtherDevice,  // the cache lives on another device ordinal (*out filled)
};

// The shard of cache_uid on device_ordinal (a sharded cache has one per device); when
// there is none, any shard of that uid (kClosed or kOtherDevice).
CacheLookup FindKvCache(uint64_t cache_uid, int device_ordinal, std::shared_ptr<KvCache>* out);

// The open cache one of whose buffers has this uid, or null.
std::shared_ptr<KvCache> FindKvCacheOfBuffer(uint64_t buffer_uid);

}  // namespace jax_vmm::kvcache
