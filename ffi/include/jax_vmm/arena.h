// Arena: one reserved virtual range, buffers placed at chunk-aligned offsets in it,
// physical memory committed and decommitted chunk by chunk underneath.
//
// Invariants
//  * A buffer's address never changes while the arena lives (views and captured CUDA
//    graphs stay valid across every commit/decommit).
//  * Every byte of the reservation is readable: unbacked chunks read as zeros.
//  * Commit/Decommit are all-or-nothing: when they throw, the page table, the driver
//    state and the statistics are exactly as before the call.
//  * A device-visible page table (one byte per chunk of the whole reservation, 1 =
//    backed and writable) mirrors the host page table, so device code can check a write
//    target without host code running (CUDA graph replay).
//  * Identity is a uid, not an address: every arena and every buffer gets a 64-bit uid
//    that no other arena or buffer of the process ever gets (addresses are reused: a new
//    arena often lands where a destroyed one was).
//  * A buffer range is placed again only when the buffer is freed and no view lease of
//    it is alive, so a view never sees a newer buffer (it reads zeros once freed).
//
// Thread-safety: all public methods may be called concurrently from any thread; one
// mutex per arena serialises them, and a second one (never held across driver calls)
// guards the live-view counts, so a view lease can be released from any thread without
// waiting for device work. The registry functions at the bottom are thread-safe.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "jax_vmm/driver.h"
#include "jax_vmm/errors.h"

namespace jax_vmm {

struct ArenaStats {
  std::string driver_kind;
  int device_ordinal = 0;
  size_t granularity = 0;
  size_t chunk_bytes = 0;
  size_t reserved_bytes = 0;
  size_t placed_bytes = 0;  // sum of live buffers' (chunk-rounded) sizes
  size_t backed_bytes = 0;
  size_t peak_backed_bytes = 0;
  int64_t num_buffers = 0;
  int64_t commit_calls = 0;
  int64_t decommit_calls = 0;
  double commit_seconds = 0;
  double decommit_seconds = 0;
  int64_t chunks_created = 0;
  int64_t chunks_released = 0;
  int64_t set_access_calls = 0;
  int64_t failed_commits = 0;  // commits that threw and were rolled back
  int64_t live_views = 0;      // view leases alive (all buffers)
  size_t retired_bytes = 0;    // ranges of freed buffers held back by live views
  bool closed = false;
};

struct BufferInfo {
  int64_t id = -1;   // index within its arena (reused after free)
  uint64_t uid = 0;  // process-unique, never reused
  std::string name;
  size_t offset = 0;  // from the arena base, chunk-aligned
  size_t nbytes = 0;  // as requested
  size_t backed_bytes = 0;
  uintptr_t address = 0;
};

// What an FFI handler needs to know about the arena buffer that holds an address.
// Pointers are device-visible (cuda: device memory; host: host memory).
struct BufferRef {
  uintptr_t buffer_base = 0;
  size_t buffer_bytes = 0;
  uintptr_t arena_base = 0;
  size_t chunk_bytes = 0;
  const uint8_t* page_table = nullptr;         // indexed by (addr - arena_base) / chunk_bytes
  unsigned long long* drop_counter = nullptr;  // this buffer's dropped-write counter
  int64_t buffer_id = -1;
  uint64_t buffer_uid = 0;
  uint64_t arena_uid = 0;
  int device_ordinal = 0;
  const char* driver_kind = "";
};

// Where a registry lookup by uid ended (FindArenaBufferByUid).
enum class UidLookup {
  kFound,   // a buffer of an open arena
  kClosed,  // the buffer's arena was closed (the BufferRef and name are filled in)
  kGone,    // no live arena has it: the arena was destroyed, or the buffer freed
};

class Arena;

// A live zero-copy view of one buffer (a DLPack import, say). While it exists the arena
// object (and so its reservation, which reads zeros where unbacked) stays alive and the
// buffer counts a live view: Arena::Free of the buffer keeps its range out of reuse until
// the last lease is gone. Destruction takes only the arena's view lock: no driver call,
// no device wait, no Python. Thread-safe: create and destroy from any thread.
class ViewLease {
 public:
  ~ViewLease();
  ViewLease(const ViewLease&) = delete;
  ViewLease& operator=(const ViewLease&) = delete;
  uint64_t buffer_uid() const { return buffer_uid_; }

 private:
  friend class Arena;
  ViewLease(std::shared_ptr<Arena> arena, uint64_t buffer_uid)
      : arena_(std::move(arena)), buffer_uid_(buffer_uid) {}
  std::shared_ptr<Arena> arena_;
  uint64_t buffer_uid_;
};

class Arena : public std::enable_shared_from_this<Arena> {
 public:
  static constexpr int64_t kMaxBuffers = 4096;

  // Reserves round_up(reserve_bytes, chunk) bytes of address space. Registers itself in
  // the process-wide registry (see FindArenaBuffer) until destruction.
  static std::shared_ptr<Arena> Create(std::unique_ptr<Driver> driver, size_t reserve_bytes);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // Places a buffer of nbytes (> 0) at a chunk-aligned offset. Nothing is backed.
  BufferInfo Allocate(size_t nbytes, const std::string& name);
  // Decommits the buffer and frees its placement for reuse, once no view lease of it is
  // left (until then the range stays out of the free list and reads zeros).
  void Free(int64_t buffer_id);

  // A lease for one new view of a buffer (see ViewLease). Throws for a freed buffer.
  std::shared_ptr<ViewLease> LeaseView(int64_t buffer_id);
  // View leases alive: of every buffer (freed ones included), or of one live buffer.
  int64_t LiveViews() const;
  int64_t LiveViews(int64_t buffer_id) const;

  // Back / unback [start, stop) bytes of a buffer, rounded out to whole chunks
  // (decommit rounds inwards to chunks fully inside the range, except that a range
  // reaching the buffer's end also frees the last partial chunk). Idempotent; ranges may
  // overlap what is already (un)backed. stop <= nbytes. Returns bytes newly (un)backed.
  size_t Commit(int64_t buffer_id, size_t start, size_t stop);
  size_t Decommit(int64_t buffer_id, size_t start, size_t stop);

  // Commit several byte ranges (of one or more buffers) all-or-nothing: when it throws,
  // none of them changed. Used by the KV arena to grow all layers of a sequence at once.
  struct Range {
    int64_t buffer_id;
    size_t start;
    size_t stop;
  };
  size_t CommitRanges(const std::vector<Range>& ranges);

  // Bytes backed contiguously from `start` (stopping at `stop` or the first hole).
  size_t BackedPrefix(int64_t buffer_id, size_t start, size_t stop) const;

  BufferInfo Buffer(int64_t buffer_id) const;
  std::vector<BufferInfo> Buffers() const;
  ArenaStats Stats() const;

  // Releases all physical memory and refuses further work (ArenaClosed). The address
  // range stays reserved, reading zeros, until the Arena object is destroyed, so views
  // that outlive close() read zeros instead of faulting. Idempotent.
  void Close();
  bool closed() const;

  // Dropped-write counter of a buffer (written by device code through BufferRef).
  uint64_t DropCount(int64_t buffer_id) const;
  void ResetDropCount(int64_t buffer_id);

  // Registry lookups (see FindArenaBuffer, FindArenaBufferByUid); take this arena's lock.
  // A closed arena finds nothing by address; by uid it answers kClosed (and fills *out
  // and *name), so errors can say what happened.
  bool FindBufferLocked(uintptr_t ptr, size_t bytes, BufferRef* out) const;
  bool FindBufferByUidLocked(uint64_t buffer_uid, BufferRef* out, std::string* name,
                             bool* closed) const;
  // Whether [ptr, ptr + bytes) lies inside this arena's reservation (any state). No lock:
  // the reservation never changes.
  bool Holds(uintptr_t ptr, size_t bytes) const {
    return ptr >= base_ && bytes <= reserved_bytes_ && ptr - base_ <= reserved_bytes_ - bytes;
  }

  // Called when a handler may bake this arena's addresses into a CUDA graph (any CUDA
  // kv_write on arena memory, static `dest` or not): the graph may then replay with this arena's
  // page table and drop-counter addresses after the arena is gone. From now on the destructor
  // zeroes the page table (so such a replay drops every write) and keeps both allocations
  // (num_chunks bytes + 32 KiB) for the life of the process instead of freeing them. Thread-safe.
  void PinMetadataForGraphs() const { metadata_pinned_ = true; }

  uint64_t uid() const { return uid_; }
  uintptr_t base() const { return base_; }
  size_t reserved_bytes() const { return reserved_bytes_; }
  size_t chunk_bytes() const { return chunk_bytes_; }
  Driver& driver() { return *driver_; }
  const Driver& driver() const { return *driver_; }

 private:
  struct Chunk;  // RAII: physical handle + its mapping
  struct Placement {
    BufferInfo info;
    std::vector<std::unique_ptr<Chunk>> chunks;  // one slot per chunk of the buffer
    int64_t counter_slot = 0;                    // index into the drop counters
  };
  Arena(std::unique_ptr<Driver> driver, size_t reserve_bytes);

  Placement& PlacementOrThrow(int64_t buffer_id, const char* op);
  const Placement& PlacementOrThrow(int64_t buffer_id, const char* op) const;
  void ThrowIfClosed(const char* op) const;
  size_t DecommitLocked(Placement& p, size_t first_chunk, size_t end_chunk);
  void PublishPageTable(size_t first_chunk_index, size_t count);
  size_t TakeFreeRange(size_t placed, const std::string& name);
  void ReturnFreeRange(size_t offset, size_t bytes);
  int64_t FreeCounterSlot() const;
  friend class ViewLease;
  void ReleaseView(uint64_t buffer_uid) noexcept;  // ~ViewLease
  void ReturnUnleasedRanges();                     // under mu_: ranges whose last view died
  void FillRef(const Placement& p, BufferRef* out) const;
  // Arena-wide index of chunk `buffer_chunk` of a buffer (into the page tables).
  size_t ArenaChunk(const Placement& p, size_t buffer_chunk) const;

  // The steps of CommitRanges (core/arena_commit.cc), all under mu_.
  struct CommitPlan;    // what a commit will create, worked out before any driver call
  struct PendingChunk;  // a chunk built by a commit, not yet in its buffer
  CommitPlan PlanCommit(const std::vector<Range>& ranges);
  void MapRuns(const CommitPlan& plan, std::vector<PendingChunk>* pending);
  void PublishCommit(const CommitPlan& plan, const std::vector<PendingChunk>& pending);
  void UnwindCommit(const CommitPlan& plan, std::vector<PendingChunk>* pending) noexcept;
  size_t AccountCommit(const CommitPlan& plan, std::vector<PendingChunk>* pending, double seconds);
  OutOfMemory CommitOutOfMemory(const CommitPlan& plan, size_t got, const OutOfMemory& e) const;

  std::unique_ptr<Driver> driver_;
  const uint64_t uid_;
  uintptr_t base_ = 0;
  size_t reserved_bytes_ = 0;
  size_t chunk_bytes_ = 0;
  size_t num_chunks_ = 0;

  mutable std::mutex mu_;
  mutable std::atomic<bool> metadata_pinned_{false};
  bool closed_ = false;
  int64_t next_id_ = 0;
  std::map<int64_t, Placement> buffers_;
  std::map<size_t, size_t> free_ranges_;  // offset -> bytes, coalesced
  std::vector<uint8_t> host_page_table_;  // mirror of the device table
  uint8_t* device_page_table_ = nullptr;
  unsigned long long* device_drop_counters_ = nullptr;  // kMaxBuffers entries
  ArenaStats stats_;

  // View leases, under views_mu_ (taken after mu_ when both are needed, never held across
  // a driver call): live leases per buffer uid; freed buffers whose range waits for its
  // last lease (uid -> offset, bytes); ranges whose last lease died, for the free list.
  struct HeldRange {
    size_t offset;
    size_t bytes;
  };
  mutable std::mutex views_mu_;
  std::map<uint64_t, int64_t> live_views_;
  std::map<uint64_t, HeldRange> retired_;
  std::vector<HeldRange> unleased_;
};

// Registry: finds the arena buffer that contains [ptr, ptr + bytes). Returns false when
// no live arena buffer holds the whole range. Used by FFI handlers to learn whether
// their output aliases arena memory and where its page table lives.
// pin_metadata: also PinMetadataForGraphs() on the arena found (CUDA handlers, which may
// be recorded into graphs).
bool FindArenaBuffer(uintptr_t ptr, size_t bytes, BufferRef* out, bool pin_metadata = false);

// Registry: the buffer with this uid. kFound: an open arena's buffer (*out filled, and
// pin_metadata as above); kClosed: its arena was closed (*out and *name filled); kGone:
// no live arena holds it (destroyed arena, freed buffer, or a uid never handed out).
UidLookup FindArenaBufferByUid(uint64_t buffer_uid, BufferRef* out, std::string* name,
                               bool pin_metadata = false);

// Registry: whether [ptr, ptr + bytes) lies in the reservation of any live arena (open or
// closed), whatever it holds there (a buffer, a freed range, nothing).
bool InArenaReservation(uintptr_t ptr, size_t bytes);

// A uid no arena or buffer of this process had before (never 0, never reused).
uint64_t NewUid();

}  // namespace jax_vmm
