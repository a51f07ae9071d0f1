// Arena::CommitRanges (contract in jax_vmm/arena.h), in four named steps:
//   plan     validate every range, then work out the missing chunks as contiguous runs
//            (ranges may overlap: a chunk is planned once); no driver call yet;
//   map      create and map each run's chunks (one MapRun) and make the run writable
//            (one SetAccess: it dominates the driver cost); the chunks are pending;
//   publish  the page tables (host mirror, then the device table) say "backed";
//   account  the pending chunks move into their buffers; statistics.
// Nothing enters a page table before every driver call succeeded. On any exception in
// map or publish the commit unwinds: the device table says "unbacked" again, then the
// pending chunks unmap and release themselves (RAII), so the page tables, the driver
// state and the statistics (apart from failed_commits) are exactly as before.
#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common/format.h"
#include "common/math.h"
#include "core/arena_internal.h"
#include "jax_vmm/arena.h"
#include "jax_vmm/errors.h"

namespace jax_vmm {

struct Arena::CommitPlan {
  struct Run {
    Placement* placement;
    size_t first;  // buffer-relative index of the run's first chunk
    size_t count;
  };
  std::vector<Run> runs;
  // Arena-wide [first, end) chunks of every non-empty range: what publish (and unwind)
  // copy to the device page table.
  std::vector<std::pair<size_t, size_t>> spans;
  size_t missing_chunks = 0;
  std::string buffer_names;  // "'k0', 'v0'": the buffers that get chunks (error messages)
};

struct Arena::PendingChunk {
  Placement* placement;
  size_t index;  // buffer-relative chunk index
  std::unique_ptr<Chunk> chunk;
};

namespace {

void AppendName(std::string* names, const std::string& name) {
  if (names->find("'" + name + "'") != std::string::npos) return;
  *names += (names->empty() ? "'" : ", '") + name + "'";
}

}  // namespace

size_t Arena::CommitRanges(const std::vector<Range>& ranges) {
  std::lock_guard<std::mutex> lock(mu_);
  ThrowIfClosed("commit");
  const CommitPlan plan = PlanCommit(ranges);
  if (plan.missing_chunks == 0) return 0;
  const auto t0 = std::chrono::steady_clock::now();
  // Mapping a chunk replaces the zero mapping at its address. A kernel still reading
  // those zeros (a full-array op over the cache) would fault mid-swap, so wait for
  // in-flight device work first, but only when this call really maps something.
  driver_->Synchronize();
  std::vector<PendingChunk> pending;
  try {
    MapRuns(plan, &pending);
    PublishCommit(plan, pending);
  } catch (const OutOfMemory& e) {
    const size_t got = pending.empty() ? 0 : (pending.size() - 1) * chunk_bytes_;
    UnwindCommit(plan, &pending);
    throw CommitOutOfMemory(plan, got, e);
  } catch (...) {
    UnwindCommit(plan, &pending);
    throw;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return AccountCommit(plan, &pending, seconds);
}

Arena::CommitPlan Arena::PlanCommit(const std::vector<Range>& ranges) {
  // Validate everything before the first driver call.
  for (const Range& r : ranges) {
    CheckRange(PlacementOrThrow(r.buffer_id, "Buffer.commit").info, r.start, r.stop,
               "Buffer.commit");
  }
  CommitPlan plan;
  std::unordered_set<size_t> planned;  // arena-wide indexes of the chunks in plan.runs
  for (const Range& r : ranges) {
    if (r.start == r.stop) continue;
    Placement& p = buffers_.at(r.buffer_id);
    const size_t first = r.start / chunk_bytes_;
    const size_t end = CeilDiv(r.stop, chunk_bytes_);
    plan.spans.emplace_back(ArenaChunk(p, first), ArenaChunk(p, end));
    bool extends_run = false;  // whether chunk c continues the last run
    bool gets_chunks = false;
    for (size_t c = first; c < end; ++c) {
      if (p.chunks[c] || !planned.insert(ArenaChunk(p, c)).second) {
        extends_run = false;  // backed already, or planned by an overlapping range
        continue;
      }
      if (extends_run) {
        ++plan.runs.back().count;
      } else {
        plan.runs.push_back({&p, c, 1});
      }
      extends_run = gets_chunks = true;
    }
    if (gets_chunks) AppendName(&plan.buffer_names, p.info.name);
  }
  plan.missing_chunks = planned.size();
  return plan;
}

// Everything built is in *pending as soon as it exists, so that an exception anywhere
// leaves the caller what to unwind.
void Arena::MapRuns(const CommitPlan& plan, std::vector<PendingChunk>* pending) {
  for (const CommitPlan::Run& run : plan.runs) {
    const uintptr_t va = run.placement->info.address + run.first * chunk_bytes_;
    const size_t begin = pending->size();
    std::vector<PhysicalHandle> handles;
    for (size_t i = 0; i < run.count; ++i) {
      pending->push_back({run.placement, run.first + i, nullptr});
      pending->back().chunk = std::make_unique<Chunk>(driver_.get(), va + i * chunk_bytes_);
      handles.push_back(pending->back().chunk->handle);
    }
    driver_->MapRun(va, handles.data(), handles.size());  // all-or-nothing
    for (size_t i = begin; i < pending->size(); ++i) (*pending)[i].chunk->mapped = true;
    driver_->SetAccess(va, run.count * chunk_bytes_);
  }
}

void Arena::PublishCommit(const CommitPlan& plan, const std::vector<PendingChunk>& pending) {
  for (const PendingChunk& q : pending) host_page_table_[ArenaChunk(*q.placement, q.index)] = 1;
  for (const auto& [first, end] : plan.spans) PublishPageTable(first, end - first);
}

// The device page table must say "unbacked" again *before* the chunks are unmapped (a
// kernel must never see 1 for a chunk that is gone).
void Arena::UnwindCommit(const CommitPlan& plan, std::vector<PendingChunk>* pending) noexcept {
  for (const PendingChunk& q : *pending) host_page_table_[ArenaChunk(*q.placement, q.index)] = 0;
  for (const auto& [first, end] : plan.spans) {
    try {
      PublishPageTable(first, end - first);
    } catch (...) {
      // The table copy only fails when the device is already broken.
    }
  }
  pending->clear();  // Chunk destructors unmap and release
  ++stats_.failed_commits;
}

size_t Arena::AccountCommit(const CommitPlan& plan, std::vector<PendingChunk>* pending,
                            double seconds) {
  for (PendingChunk& q : *pending) {
    q.placement->chunks[q.index] = std::move(q.chunk);
    q.placement->info.backed_bytes += chunk_bytes_;
  }
  const size_t added = pending->size() * chunk_bytes_;
  stats_.backed_bytes += added;
  stats_.peak_backed_bytes = std::max(stats_.peak_backed_bytes, stats_.backed_bytes);
  stats_.chunks_created += static_cast<int64_t>(pending->size());
  stats_.set_access_calls += static_cast<int64_t>(plan.runs.size());
  stats_.commit_calls += 1;
  stats_.commit_seconds += seconds;
  return added;
}

OutOfMemory Arena::CommitOutOfMemory(const CommitPlan& plan, size_t got,
                                     const OutOfMemory& e) const {
  const size_t asked = plan.missing_chunks * chunk_bytes_;
  const size_t free_bytes = driver_->mem_info().free_bytes;
  return OutOfMemory("commit of buffer(s) " + plan.buffer_names + ": out of physical memory on " +
                         driver_->kind() + " device " + std::to_string(driver_->device_ordinal()) +
                         ": asked for " + Bytes(asked) + " (chunks of " + Bytes(chunk_bytes_) +
                         "), failed after " + Bytes(got) + "; " + Bytes(free_bytes) +
                         " free. Nothing was committed. Driver said: " + e.what(),
                     asked, free_bytes);
}

}  // namespace jax_vmm
