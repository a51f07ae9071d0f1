// Shared by the arena's files (arena.cc: placement, views, queries; arena_commit.cc;
// arena_release.cc: release and reclamation; arena_transfer.cc: sleep, offload, copies).
// Private to core/.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "jax_vmm/arena.h"
#include "jax_vmm/driver.h"

namespace jax_vmm {

// One physical allocation (driver handle), given back when the last mapping of it goes:
// kv.share_prefix maps one allocation at several addresses (core/arena_share.cc), and each
// of those mappings holds it.
struct Arena::Physical {
  Physical(Driver* d, size_t n) : driver(d), handle(d->Create(n)), bytes(n) {}
  ~Physical() { driver->Release(handle); }
  Physical(const Physical&) = delete;
  Physical& operator=(const Physical&) = delete;

  Driver* driver;
  PhysicalHandle handle;
  size_t bytes;
  // Its bytes in the arena's budget, taken before Create and (as a member) given back
  // after the destructor's Release, when the last mapping of it is gone: the budget caps
  // memory that really exists, and memory mapped at several addresses counts once.
  BudgetCharge charge;
};

// A mapping of num_chunks chunks of physical memory at `va`, over the arena chunks
// [first_chunk, first_chunk + num_chunks): a new allocation mapped once (a commit), or
// (an alias, core/arena_share.cc) `bytes` of another mapping's allocation from `offset`.
// Owns its mapping and a reference to its allocation: the destructor unmaps, and the
// last reference releases, so a half-built commit unwinds itself on any exception.
//
// Life cycle (all fields under the arena's mutex):
//   live > 0                  some chunks are backed (the rest, if any, are parked);
//   live == 0, retired        no chunk backed, waiting for the device (Arena::retired_);
//   reclaiming                the reclaimer is unmapping it outside the lock;
//   pins > 0                  a transfer owns its chunks (copying them out or in): it is
//                             neither reclaimed nor taken back until the transfer is done.
// A commit that finds a chunk of a reclaiming or pinned allocation waits. A chunk of a
// shared mapping (its allocation mapped at another address too) is never taken back once
// released: the other address still holds its bytes (Arena::PlanChunk).
struct Arena::Mapping {
  Mapping(Driver* d, size_t first, size_t count, size_t chunk_bytes, uintptr_t address)
      : driver(d),
        va(address),
        first_chunk(first),
        num_chunks(count),
        bytes(count * chunk_bytes),
        physical(std::make_shared<Physical>(d, bytes)),
        handle(physical->handle) {}
  // An alias: `count` chunks of `source` from `offset`, mapped at `address`.
  Mapping(Driver* d, size_t first, size_t count, size_t chunk_bytes, uintptr_t address,
          std::shared_ptr<Physical> source, size_t source_offset)
      : driver(d),
        va(address),
        first_chunk(first),
        num_chunks(count),
        bytes(count * chunk_bytes),
        physical(std::move(source)),
        handle(physical->handle),
        offset(source_offset),
        shared(true) {}
  ~Mapping() {
    if (mapped) UnmapWhole(*driver, va, bytes);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  bool busy() const { return reclaiming || pins > 0; }

  Driver* driver;
  uintptr_t va;
  size_t first_chunk;
  size_t num_chunks;
  size_t bytes;
  std::shared_ptr<Physical> physical;
  PhysicalHandle handle = 0;
  size_t offset = 0;    // into the allocation (an alias of part of it)
  bool shared = false;  // the allocation is mapped at another address too (until the
                        // other mappings are reclaimed: Arena::UnshareIfLast)
  bool mapped = false;
  size_t live = 0;
  size_t pins = 0;
  bool retired = false;
  bool reclaiming = false;
  uint64_t retired_epoch = 0;
};

// What a commit (or a wake, or a restore) will create or take back (core/arena_commit.cc).
struct Arena::CommitPlan {
  std::vector<ChunkRun> runs;  // missing chunks (arena indexes): new allocations
  std::vector<size_t> revive;  // parked or retired chunks to back again, no driver call
  // Arena-wide [first, end) chunks of every non-empty range: what publish (and unwind)
  // copy to the device page table.
  std::vector<ChunkRun> spans;
  size_t missing_chunks = 0;
  bool must_wait = false;    // a chunk is being reclaimed or transferred: wait, plan again
  std::string buffer_names;  // "'k0', 'v0'": the buffers that get chunks (error messages)
};

struct Arena::Pending {
  std::vector<std::unique_ptr<Mapping>> mappings;  // created (mapped once m->mapped)
  BudgetCharge charge;  // the budget's bytes for the allocations still to create
};

// Contents kept in host memory (core/arena_transfer.cc).
struct Arena::HostImage {
  std::vector<std::pair<void*, size_t>> blocks;  // pointer, bytes
  size_t bytes = 0;                              // contents (blocks may hold more)
};

struct Arena::SleepImage {
  std::vector<ChunkRun> runs;  // what was backed, each run inside one allocation
  HostImage image;             // their contents, run after run (empty: discarded)
  bool kept = false;
};

struct Arena::TransferRecord {
  TransferState state = TransferState::kOffloading;
  std::vector<ChunkRun> runs;  // the chunks moved, each run inside one allocation
  HostImage image;
  uint64_t epoch = 0;         // offload: device waits begun when it was queued
  bool queued = false;        // waiting for the reclaimer
  size_t created_chunks = 0;  // restore: chunks backed by new allocations
  std::string error;
};

// Throws InvalidArgument unless 0 <= start <= stop <= info.nbytes; `op` names the call.
void CheckRange(const BufferInfo& info, size_t start, size_t stop, const char* op);

inline double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Splits [first, first + count) chunk indexes into maximal runs where `same(a, b)` holds
// for neighbours a, b; calls emit(first, count) per run.
template <typename Same, typename Emit>
void ForEachRun(const std::vector<size_t>& chunks, Same same, Emit emit) {
  size_t i = 0;
  while (i < chunks.size()) {
    size_t j = i + 1;
    while (j < chunks.size() && chunks[j] == chunks[j - 1] + 1 && same(chunks[j - 1], chunks[j])) {
      ++j;
    }
    emit(chunks[i], j - i);
    i = j;
  }
}

}  // namespace jax_vmm
