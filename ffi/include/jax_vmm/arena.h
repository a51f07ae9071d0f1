// Arena: one reserved virtual range, buffers placed at chunk-aligned offsets in it,
// physical memory committed and released chunk by chunk underneath.
//
// Invariants
//  * A buffer's address never changes while the arena lives (views and captured CUDA
//    graphs stay valid across every commit, release, sleep and wake).
//  * Every byte of the reservation is readable and never faults: unbacked chunks read as
//    zeros (with zero_fill; without it, a released chunk may read its old bytes until the
//    allocation holding it is given back).
//  * Commit/Decommit/Wake are all-or-nothing: when they throw, the page table, the driver
//    state and the statistics are exactly as before the call.
//  * A device-visible page table (one byte per chunk of the whole reservation, 1 =
//    backed and writable) mirrors the host page table, so device code can check a write
//    target without host code running (CUDA graph replay).
//  * Identity is a uid, not an address: every arena and every buffer gets a 64-bit uid
//    that no other arena or buffer of the process ever gets (addresses are reused: a new
//    arena often lands where a destroyed one was).
//  * A buffer range is placed again only when the buffer is freed and no view lease of
//    it is alive, so a view never sees a newer buffer (it reads zeros once freed).
//  * An arena belongs to the process that created it. In a child made by fork() every
//    call that would reach the driver raises ForkedProcess (the child shares the
//    parent's physical pages, or cannot use its CUDA context), and destroying the arena
//    in the child gives nothing back: no driver call, no lock, no thread join.
//  * Memory that device work may still touch is never unmapped: a release first clears
//    the page table (kernels launched later skip those chunks), then hands the memory to a
//    reclaimer that unmaps it once the device has finished everything dispatched before
//    the release (core/arena_release.cc).
//
// Physical memory. A commit backs each contiguous run of missing chunks with allocations
// of up to handle_bytes, each mapped once. Releasing some chunks of an allocation leaves
// them "parked" (unbacked in the page table, still mapped, memory held) until every chunk
// of it is released; a later commit of a parked chunk takes it back without a driver call.
// handle_bytes == chunk_bytes (the Arena default) gives every chunk its own allocation.
// An arena in a MemoryBudget (JoinBudget) takes each allocation's bytes from it before the
// driver creates it, and gives them back after the release (jax_vmm/memory_budget.h).
//
// Raw views. A view (DLPack export, counted by a ViewLease) lets XLA read arena memory
// anywhere, unbacked chunks included, where a kernel would fault while a zero mapping is
// swapped for real memory. Once an arena has handed out a view, JAX may keep arrays over
// its memory for good (the output of a donated view aliases the arena after the view and
// its lease are gone), so from the first view on a commit that maps new memory first
// waits for the device, and a release waits and unmaps at once. An arena that never
// handed out a view (reached only by jax_vmm's ops, which never touch unbacked chunks)
// never waits on commit or release.
//
// Thread-safety: all public methods may be called concurrently from any thread; one
// mutex per arena serialises them (released while waiting for the device or a transfer),
// and a second one (never held across driver calls) guards the live-view counts, so a
// view lease can be released from any thread without waiting for device work. A
// background thread per arena (started on first need) reclaims released memory and runs
// asynchronous transfers. The registry functions at the bottom are thread-safe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_set>
#include <vector>

#include "jax_vmm/driver.h"
#include "jax_vmm/errors.h"
#include "jax_vmm/memory_budget.h"

namespace jax_vmm {

struct ArenaOptions {
  // Largest physical allocation a commit makes: a multiple of chunk_bytes, 0 = chunk_bytes.
  size_t handle_bytes = 0;
  // Newly backed memory reads zeros (else it holds whatever the device memory held).
  bool zero_fill = true;
  // Unbacked memory is given its read-only zero mapping only when the first raw view is
  // handed out (no reader touches unbacked chunks before: docs/design.md, "Zero reads").
  // Unset: JAX_VMM_DEFER_ZERO_READS at creation (1 defers, 0 does not), else
  // deferred. Drivers without deferred reservations (the host's) never defer.
  std::optional<bool> defer_zero_reads;
};

struct ArenaStats {
  std::string driver_kind;
  int device_ordinal = 0;
  size_t granularity = 0;
  size_t chunk_bytes = 0;
  size_t handle_bytes = 0;
  bool zero_fill = true;
  size_t reserved_bytes = 0;
  size_t placed_bytes = 0;  // sum of live buffers' (chunk-rounded) sizes
  size_t backed_bytes = 0;  // chunks in the page table
  size_t peak_backed_bytes = 0;
  size_t held_bytes = 0;      // physical memory the arena holds: backed + parked + retired
  size_t parked_bytes = 0;    // unbacked chunks inside allocations that are still in use
  size_t retired_bytes = 0;   // allocations released, waiting for the device to be given back
  size_t alias_bytes = 0;     // backed bytes whose physical memory is backed at another address
  size_t shared_bytes = 0;    // physical memory backed at two or more addresses (counted once)
  int64_t chunks_shared = 0;  // chunks mapped as a second address of memory (ShareRanges)
  int64_t num_buffers = 0;
  int64_t commit_calls = 0;
  int64_t decommit_calls = 0;
  double commit_seconds = 0;
  double decommit_seconds = 0;
  int64_t chunks_created = 0;   // chunks backed by new physical memory
  int64_t chunks_released = 0;  // chunks whose physical memory went back to the driver
  int64_t chunks_revived = 0;   // parked or retired chunks backed again without a driver call
  int64_t handles_created = 0;
  int64_t handles_released = 0;
  int64_t set_access_calls = 0;
  int64_t failed_commits = 0;     // commits that threw and were rolled back
  int64_t commit_drains = 0;      // device waits before mapping (rolled-back commits too)
  int64_t commits_ahead = 0;      // background commits (CommitAhead) that backed something
  int64_t deferred_releases = 0;  // allocations handed to the reclaimer
  int64_t reclaim_syncs = 0;      // device waits made to reclaim memory
  int64_t live_views = 0;         // view leases alive (all buffers)
  size_t held_range_bytes = 0;    // address ranges of freed buffers held back by live views
  bool views_exported = false;    // a raw view was handed out: commits and releases wait
  // An unbacked byte reads zeros; false while zeros are deferred (no view yet), when a
  // raw read of one faults.
  bool unbacked_reads_zero = true;
  bool asleep = false;
  size_t sleep_image_bytes = 0;  // contents kept on the host while asleep
  size_t offloaded_bytes = 0;    // contents of offloaded ranges on the host
  size_t host_cached_bytes = 0;  // host staging memory kept for the next sleep/offload
  int64_t pending_transfers = 0;
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

// State of an offload (Arena::Offload) and of its restore.
enum class TransferState : int {
  kOffloading = 0,  // waiting for the device, or copying to the host
  kOffloaded = 1,   // contents on the host, device memory given back
  kRestoring = 2,   // copying back
  kRestored = 3,    // contents back at their addresses; the ticket is spent
  kFailed = 4,      // the offload failed and was undone: the contents never left
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
  static std::shared_ptr<Arena> Create(std::unique_ptr<Driver> driver, size_t reserve_bytes,
                                       const ArenaOptions& options = {});
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // Places a buffer of nbytes (> 0) at a chunk-aligned offset. Nothing is backed.
  BufferInfo Allocate(size_t nbytes, const std::string& name);
  // Releases the buffer's memory and frees its placement for reuse, once no view lease of
  // it is left (until then the range stays out of the free list and reads zeros).
  void Free(int64_t buffer_id);

  // A lease for one new view of a buffer (see ViewLease). Throws for a freed buffer.
  // Finishes any deferred release first (waiting for the device if some is pending), so
  // that nothing is unmapped behind a view later, and marks the arena as exported.
  std::shared_ptr<ViewLease> LeaseView(int64_t buffer_id);
  // Whether a raw view was ever handed out (sticky): releases then unmap at once.
  bool views_exported() const { return views_exported_.load(); }
  // Whether an unbacked byte reads zeros now (false while zeros are deferred: no view
  // yet). Lock-free, unlike Stats(), which waits for a commit in progress.
  bool unbacked_reads_zero() const { return !zeros_deferred_.load(); }
  // View leases alive: of every buffer (freed ones included), or of one live buffer.
  int64_t LiveViews() const;
  int64_t LiveViews(int64_t buffer_id) const;

  struct Range {
    int64_t buffer_id;
    size_t start;
    size_t stop;
  };

  // Back [start, stop) bytes of a buffer, rounded out to whole chunks. Idempotent; ranges
  // may overlap what is already backed. stop <= nbytes. Returns bytes newly backed. Never
  // waits for the device unless raw views are alive (or were, since the last wait); on
  // out-of-memory it first takes back released memory (waiting for the device) and tries
  // again.
  size_t Commit(int64_t buffer_id, size_t start, size_t stop);
  // Several byte ranges (of one or more buffers) all-or-nothing: when it throws, none of
  // them changed. Runs of new chunks never cross a range boundary, so each allocation
  // lies inside one range (the KV arena gives chunks shared by two sequences their own).
  size_t CommitRanges(const std::vector<Range>& ranges);
  // CommitRanges from a thread other than the one that dispatches device work (commit
  // ahead of need): skipped (returns false) once raw views were handed out, since a reader
  // dispatched meanwhile could run over the zero mappings being swapped. Else *added gets
  // the bytes newly backed.
  bool CommitAhead(const std::vector<Range>& ranges, size_t* added);

  // Unback [start, stop) bytes, rounded inwards to chunks fully inside the range, except
  // that a range reaching the buffer's end also frees its last, partial chunk. Returns
  // bytes no longer backed. The page table changes at once (kernels launched after the
  // call skip those chunks); the memory goes back to the driver once the device has
  // finished the work dispatched before the call (wait: before returning).
  size_t Decommit(int64_t buffer_id, size_t start, size_t stop, bool wait = false);
  // defer_unmap (host driver, whose unmapping needs no device wait): the allocations that
  // lose their last backed chunk are retired as on a GPU instead of unmapped at once, and
  // the caller gives them back with ReclaimRetiredBefore once the work that may read
  // them has finished (jax_vmm/memory/host_reclaim.py). Ignored once raw views were
  // handed out (those releases unmap at once, after the caller waited).
  size_t DecommitRanges(const std::vector<Range>& ranges, bool wait = false,
                        bool defer_unmap = false);
  // Waits for the device and gives every released allocation back. Returns its bytes.
  size_t Reclaim();
  // Host driver, deferred unmapping: marks the start of a wait for the work in flight
  // (what the reclaimer's device wait is on a GPU). Allocations retired before the call
  // are covered by it. Returns the wait's number for ReclaimRetiredBefore.
  uint64_t BeginHostWait();
  // Unmaps and releases the allocations retired before host wait `sync` began (that wait
  // has ended), unless a commit took them back meanwhile. Returns their bytes; 0 once
  // closed.
  size_t ReclaimRetiredBefore(uint64_t sync);

  // Shared memory (core/arena_share.cc). Chunk-aligned byte spans of two buffers (or of
  // one buffer, not overlapping) of equal size.
  struct SpanPair {
    int64_t src_buffer;
    size_t src_start;
    int64_t dst_buffer;
    size_t dst_start;
    size_t bytes;
  };
  // Maps the physical memory under every src span at its dst span too (no copy): both
  // addresses then read and write the same bytes, and the memory goes back to the driver
  // once the last address holding it is released. Every src chunk must be backed; every
  // dst chunk must hold nothing (not backed, parked or retired). A src chunk whose
  // allocation also backs chunks outside its span is mapped only where the driver maps
  // parts of allocations (host); elsewhere (cuda maps allocations whole) it is left out
  // and its dst bytes are appended to *not_shared (dst buffer, start, stop) for the caller
  // to commit and copy. Waits for the device first (work dispatched before may still
  // write the source). Released shared chunks are never taken back by a commit (their
  // bytes live on at the other address): a commit of one waits for its reclamation.
  // All-or-nothing. Returns the bytes mapped.
  size_t ShareSpans(const std::vector<SpanPair>& spans, std::vector<Range>* not_shared);
  // Bytes of the chunks in `ranges` whose memory is still mapped at another address too
  // (a share's source or destination, until the other addresses are reclaimed).
  size_t SharedBytes(const std::vector<Range>& ranges) const;
  // Copies every src span's bytes to its dst span (both backed; dst not shared memory)
  // after the device finished the work dispatched before (which may write src).
  void CopySpans(const std::vector<SpanPair>& spans);
  // Writes zeros over the backed, unshared bytes of `ranges` (the rest reads zeros already
  // or is a shared prefix, read-only) after the device finished the work dispatched
  // before (which may still write them). Returns the bytes zeroed.
  size_t ZeroRanges(const std::vector<Range>& ranges);

  // Bytes backed contiguously from `start` (stopping at `stop` or the first hole).
  size_t BackedPrefix(int64_t buffer_id, size_t start, size_t stop) const;

  BufferInfo Buffer(int64_t buffer_id) const;
  std::vector<BufferInfo> Buffers() const;
  ArenaStats Stats() const;

  // Copies host or device memory into [offset, offset + bytes) of a buffer, which must
  // be backed. Returns when the bytes are there.
  void CopyIn(int64_t buffer_id, size_t offset, const void* src, size_t bytes);

  // Sleep: waits for the device, copies every backed chunk to host memory (keep) or
  // drops it, and gives all physical memory back; the page table reads all-unbacked
  // (writes are dropped and counted, reads see zeros). Wake: backs exactly the chunks
  // that were backed, at the same addresses, and restores their contents (keep) or
  // leaves them zero-filled / undefined (discard, by zero_fill). Both all-or-nothing.
  // While asleep, commits and releases raise ArenaAsleep.
  void Sleep(bool keep_contents);
  void Wake();
  bool asleep() const;

  // Offload: the backed chunks of the ranges (rounded as Decommit) leave the page table
  // now; once the device has finished earlier work their contents are copied to host
  // memory and their physical memory is given back. Restore: backs the same chunks again
  // and copies the contents back (wait=false: the copy runs in the background; the chunks
  // join the page table when it lands). Tickets identify transfers.
  uint64_t Offload(const std::vector<Range>& ranges);
  void Restore(uint64_t ticket, bool wait);
  TransferState TransferStatus(uint64_t ticket, std::string* error) const;
  // Blocks until the transfer is no longer in flight; returns its state.
  TransferState WaitTransfer(uint64_t ticket, std::string* error) const;
  // Forgets an offloaded transfer (its host copy is freed).
  void DropTransfer(uint64_t ticket);
  // Frees the host staging memory kept for the next sleep or offload.
  void FreeHostCache();

  // Makes every later physical allocation of this arena come from `budget` (see
  // jax_vmm/memory_budget.h); `label` names the arena in its stats and errors. Only for an
  // open arena on the budget's device that holds no physical memory yet and has no budget;
  // the budget must fit at least one chunk. Else InvalidArgument, nothing changed.
  void JoinBudget(std::shared_ptr<MemoryBudget> budget, const std::string& label);
  std::shared_ptr<MemoryBudget> budget() const;
  // For another member of the budget that hit its cap: waits for this arena's deferred
  // releases (the device, and the reclaimer if it is unmapping) and gives them back.
  // Returns the bytes. Never throws ForkedProcess or ArenaClosed (nothing to give then).
  size_t ReclaimForBudget();

  // Releases all physical memory and refuses further work (ArenaClosed). The address
  // range stays reserved, reading zeros, until the Arena object is destroyed, so views
  // that outlive close() read zeros instead of faulting. Idempotent.
  void Close();
  bool closed() const;

  // Dropped-write counter of a buffer (written by device code through BufferRef).
  uint64_t DropCount(int64_t buffer_id) const;
  void ResetDropCount(int64_t buffer_id);

  // Registry lookups (see FindArenaBuffer, FindArenaBufferByUid); take this arena's
  // placement lock (never held across a driver call).
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
  size_t handle_bytes() const { return handle_bytes_; }
  bool zero_fill() const { return zero_fill_; }
  Driver& driver() { return *driver_; }
  const Driver& driver() const { return *driver_; }

 private:
  struct Physical;   // one driver allocation, released with its last mapping
  struct Mapping;    // physical memory mapped once at one address (core/arena_internal.h)
  struct HostImage;  // contents kept in host memory (core/arena_transfer.cc)
  struct TransferRecord;
  struct SleepImage;
  struct Placement {
    BufferInfo info;
    size_t num_chunks = 0;     // chunk slots of the placement
    int64_t counter_slot = 0;  // index into the drop counters
  };
  // A run of arena chunks [first, first + count).
  struct ChunkRun {
    size_t first;
    size_t count;
  };
  Arena(std::unique_ptr<Driver> driver, size_t reserve_bytes, const ArenaOptions& options);

  Placement& PlacementOrThrow(int64_t buffer_id, const char* op);
  const Placement& PlacementOrThrow(int64_t buffer_id, const char* op) const;
  void ThrowIfClosed(const char* op) const;
  void ThrowIfAsleep(const char* op) const;
  // Throws ForkedProcess in a process forked from the creator. Called before taking mu_
  // (another thread of the parent may have held it at the fork).
  void ThrowIfForked(const char* op) const;
  bool InForkedChild() const;
  void AbandonInForkedChild() noexcept;  // ~Arena in a child: leak, release nothing
  // Copies the host page table to the device over the hull of `runs`: one copy per
  // operation (the host mirror is authoritative between the runs too).
  void PublishPageTable(const std::vector<ChunkRun>& runs);
  int64_t FreeCounterSlot() const;
  friend class ViewLease;
  void ReleaseView(uint64_t buffer_uid) noexcept;  // ~ViewLease
  void ReturnUnleasedRanges();                     // under mu_: ranges whose last view died
  void FillRef(const Placement& p, BufferRef* out) const;
  // Arena-wide index of chunk `buffer_chunk` of a buffer (into the page tables).
  size_t ArenaChunk(const Placement& p, size_t buffer_chunk) const;
  uintptr_t ChunkAddress(size_t arena_chunk) const { return base_ + arena_chunk * chunk_bytes_; }
  // Adds `sign` * the backed bytes of arena chunks [first, first + count) to the buffers
  // placed over them.
  void AccountBacked(size_t first, size_t count, int sign);

  // Sharing (core/arena_share.cc), under mu_: InvalidArgument when a backed chunk of
  // `runs` is shared memory (sleep and offload move chunks by allocation and would
  // split what two addresses share).
  void ThrowIfShared(const std::vector<ChunkRun>& runs, const char* op) const;

  // Commit (core/arena_commit.cc), all under mu_.
  struct CommitPlan;  // what a commit will create or take back, before any driver call
  struct Pending;     // allocations a commit built, not yet in the page table
  // background: give up (return kSkipped) whenever raw views are alive.
  static constexpr size_t kSkipped = ~size_t{0};
  size_t CommitLocked(std::unique_lock<std::mutex>& lock, const std::vector<Range>& ranges,
                      bool background = false);
  CommitPlan PlanCommit(const std::vector<Range>& ranges);
  CommitPlan PlanRuns(const std::vector<ChunkRun>& runs) const;
  void PlanChunk(size_t arena_chunk, CommitPlan* plan, bool* extends_run) const;
  // The plan's new allocations join the arena and its parked chunks are taken back: as
  // backed (live), or pinned for a transfer that publishes them later.
  void AdoptPlanned(const CommitPlan& plan, Pending* pending, bool pinned);
  void DrainIfViewsMayRead();
  // Takes the plan's new memory from the budget (if any) into *out, before any driver
  // call. On a full budget the first time (*reclaimed false): gives back the deferred
  // releases of this arena and the other members, and returns false (plan again; mu_ was
  // released meanwhile). The second time: throws BudgetExceeded.
  bool ChargeBudget(std::unique_lock<std::mutex>& lock, const CommitPlan& plan, const char* op,
                    bool* reclaimed, BudgetCharge* out);
  void MapRuns(const CommitPlan& plan, Pending* pending, bool zero);
  void ZeroFillRevived(const CommitPlan& plan);
  void PublishCommit(const CommitPlan& plan, Pending* pending);
  void UnwindCommit(const CommitPlan& plan, Pending* pending) noexcept;
  size_t AccountCommit(const CommitPlan& plan, size_t created, double seconds);
  OutOfMemory CommitOutOfMemory(const CommitPlan& plan, size_t got, const OutOfMemory& e) const;

  // Release (core/arena_release.cc), under mu_ (the reclaimer drops it around driver
  // calls and device waits; so do the waits here).
  // The whole chunks of `ranges` (validated), sorted and merged: each chunk once.
  std::vector<ChunkRun> DecommitRuns(const std::vector<Range>& ranges);
  size_t DecommitLocked(std::unique_lock<std::mutex>& lock, const std::vector<ChunkRun>& runs,
                        bool wait, bool defer_unmap = false);
  // Takes the backed chunks of `runs` out of the page table (publishing it); returns the
  // allocations touched and the number of chunks in *removed.
  std::vector<Mapping*> Unpublish(const std::vector<ChunkRun>& runs, size_t* removed);
  // Allocations with no backed chunk left go to the reclaimer, or at once where no device
  // wait is needed (host driver) or raw views are alive (after a wait, on this thread).
  // An allocation listed twice in `touched` counts once.
  void RetireUnused(std::unique_lock<std::mutex>& lock, std::vector<Mapping*> touched,
                    bool defer_unmap = false);
  void WaitWhileBusy(std::unique_lock<std::mutex>& lock);  // no reclaim or transfer running
  // Waits for the device, then gives every retired allocation back. On the host driver
  // its retired allocations are the caller's (DecommitRanges' defer_unmap): XLA:CPU work
  // in flight may still read them and only the Python layer can wait for that work, so
  // they are taken only when `host_work_waited` says the caller did (else left to the
  // host reclaim thread, and a commit that needed them fails: the caller waits, retries).
  size_t ReclaimAllLocked(std::unique_lock<std::mutex>& lock, bool zero_parked = false,
                          bool host_work_waited = true);
  size_t ReclaimNow(const std::vector<Mapping*>& batch);  // unmap + release, on this thread
  void UnmapGroups(std::vector<Mapping*> batch);          // driver calls only
  std::vector<std::unique_ptr<Mapping>> DetachMappings(const std::vector<Mapping*>& batch);
  // After a shared mapping of `physical` was detached: the one mapping of it left is no
  // longer shared (it can sleep, move and be released by part again). Caller holds mu_.
  void UnshareIfLast(const Physical* physical);
  void ZeroParked();
  void ReleaseAllMemory(std::unique_lock<std::mutex>& lock);  // the device must be idle
  void StartWorker();
  void WorkerLoop();
  size_t ReclaimRetiredBefore(std::unique_lock<std::mutex>& lock, uint64_t sync);

  // Host images, sleep and transfers (core/arena_transfer.cc), under mu_.
  HostImage AllocImage(size_t bytes);
  void FreeImage(HostImage* image) noexcept;
  void FreeHostCacheLocked() noexcept;
  std::vector<CopyRegion> ImageRegions(const HostImage& image, const std::vector<ChunkRun>& runs,
                                       bool to_host) const;
  // The backed chunks within `within`, as runs that each lie inside one allocation.
  std::vector<ChunkRun> BackedRunsByMapping(const std::vector<ChunkRun>& within) const;
  size_t SleepImageBytes() const;
  void DropSleepImage() noexcept;
  bool TransferInFlight(const TransferRecord& t) const;
  size_t TransferHostBytes(const TransferRecord& t) const;
  bool AnyTransferInFlight() const;
  bool HasQueuedOffloads() const;
  bool HasWorkerWork() const;
  void DropTransferImage(TransferRecord& t) noexcept;
  TransferRecord& RecordOrThrow(uint64_t ticket, const char* op);
  void FinishOffload(std::unique_lock<std::mutex>& lock, TransferRecord& t,
                     uint64_t reclaimer_sync);
  void UndoOffload(TransferRecord& t, const std::string& error) noexcept;
  void FinishRestore(TransferRecord& t);
  void UndoRestore(std::unique_lock<std::mutex>& lock, TransferRecord& t, const std::string& error);
  void RunTransferJobs(std::unique_lock<std::mutex>& lock, uint64_t sync);

  std::unique_ptr<Driver> driver_;
  const uint64_t uid_;
  const long creator_pid_;  // getpid() at creation (see ThrowIfForked)
  uintptr_t base_ = 0;
  size_t reserved_bytes_ = 0;
  size_t chunk_bytes_ = 0;
  size_t num_chunks_ = 0;
  size_t handle_bytes_ = 0;
  bool zero_fill_ = true;
  // The reservation's zero mapping waits for the first view. Atomic: read without mu_
  // (unbacked_reads_zero()); written under it.
  std::atomic<bool> zeros_deferred_{false};

  mutable std::mutex mu_;
  // Any change a waiter or the worker may need. Not a plain member: a forked child must
  // not destroy it (glibc's pthread_cond_destroy waits for the waiters, and the parent's
  // reclaimer, waiting at the fork, never leaves in the child).
  class AbandonableCondition {
   public:
    AbandonableCondition() { new (&storage_) std::condition_variable(); }
    ~AbandonableCondition() {
      if (!abandoned_) get()->~condition_variable();
    }
    AbandonableCondition(const AbandonableCondition&) = delete;
    AbandonableCondition& operator=(const AbandonableCondition&) = delete;
    std::condition_variable* operator->() const { return get(); }
    void Abandon() { abandoned_ = true; }

   private:
    std::condition_variable* get() const {
      return std::launder(reinterpret_cast<std::condition_variable*>(&storage_));
    }
    mutable std::aligned_storage_t<sizeof(std::condition_variable),
                                   alignof(std::condition_variable)>
        storage_;
    bool abandoned_ = false;
  };
  mutable AbandonableCondition cv_;
  mutable std::atomic<bool> metadata_pinned_{false};
  std::atomic<bool> closed_{false};  // written under mu_; read by lookups without it
  int64_t next_id_ = 0;
  // Written under mu_ and placement_mu_; read under either. The registry lookups of FFI
  // handlers take only placement_mu_, so they never wait for a commit's driver calls
  // (a commit ahead of need runs on another thread while steps are dispatched).
  std::map<int64_t, Placement> buffers_;
  mutable std::mutex placement_mu_;
  std::map<uint64_t, uint64_t> free_ranges_;  // offset -> bytes not placed (common/free_ranges.h)
  std::vector<uint8_t> host_page_table_;      // mirror of the device table
  // Under mu_: 1 for the chunks a commit being planned has planned already (ranges may
  // overlap, and neighbouring buffers share boundary chunks); all 0 between plans.
  std::vector<uint8_t> planned_chunks_;
  uint8_t* device_page_table_ = nullptr;
  unsigned long long* device_drop_counters_ = nullptr;  // kMaxBuffers entries
  ArenaStats stats_;
  std::shared_ptr<MemoryBudget> budget_;  // under mu_; set once (JoinBudget)

  // Physical memory: every allocation by its first chunk, and the allocation under each
  // chunk (nullptr: zero-mapped).
  std::map<size_t, std::unique_ptr<Mapping>> mappings_;
  std::vector<Mapping*> chunk_mapping_;
  std::unordered_set<Mapping*> retired_;  // no chunk backed; waiting for the device
  std::set<size_t> parked_dirty_;         // parked chunks not zeroed yet (zero_fill only)
  uint64_t syncs_started_ = 0;            // device waits begun by the reclaimer
  int reclaiming_ = 0;                    // allocations the worker is unmapping now

  // Once a view was handed out, JAX may hold arrays over arena memory for good: a donated
  // view's output aliases the arena while the view itself (and its lease) is gone. So the
  // lease counts are for Free and the statistics; the waits use views_exported_.
  std::atomic<bool> views_exported_{false};

  // Sleep, transfers, host staging memory.
  std::unique_ptr<SleepImage> sleep_;
  std::map<uint64_t, std::unique_ptr<TransferRecord>> transfers_;
  uint64_t next_ticket_ = 1;
  std::multimap<size_t, void*> host_cache_;  // bytes -> block

  bool stop_worker_ = false;
  std::thread worker_;

  // View leases, under views_mu_ (taken after mu_ when both are needed, never held across
  // a driver call): live leases per buffer uid; freed buffers whose range waits for its
  // last lease (uid -> offset, bytes); ranges whose last lease died, for the free list.
  struct HeldRange {
    size_t offset;
    size_t bytes;
  };
  mutable std::mutex views_mu_;
  std::map<uint64_t, int64_t> live_views_;
  std::map<uint64_t, HeldRange> held_ranges_;
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
// no live arena holds it (destroyed arena, freed buffer, or a uid never handed out). `name`
// may be null.
UidLookup FindArenaBufferByUid(uint64_t buffer_uid, BufferRef* out, std::string* name,
                               bool pin_metadata = false);

// Registry: whether [ptr, ptr + bytes) lies in the reservation of any live arena (open or
// closed), whatever it holds there (a buffer, a freed range, nothing).
bool InArenaReservation(uintptr_t ptr, size_t bytes);

// A uid no arena or buffer of this process had before (never 0, never reused).
uint64_t NewUid();

}  // namespace jax_vmm
