// Arena::CommitRanges (contract in jax_vmm/arena.h), in four named steps:
//   plan     validate every range, then work out the missing chunks as contiguous runs
//            (never crossing a range boundary; a chunk is planned once) and the parked
//            chunks to take back; no driver call yet;
//   map      create each run's allocations (up to handle_bytes each), map them (one
//            MapRun) and make the run writable (one SetAccess); zero-fill where asked;
//   publish  the page tables (host mirror, then the device table) say "backed";
//   account  the new allocations join the arena; statistics.
// Nothing enters a page table before every driver call succeeded. On any exception in
// map or publish the commit unwinds: the device table says "unbacked" again, then the
// new allocations unmap and release themselves (RAII), so the page tables, the driver
// state and the statistics (apart from failed_commits) are exactly as before.
//
// A commit waits for the device only when raw views may be reading (the arena handed one
// out): mapping a chunk replaces the zero mapping at its address, and a kernel reading
// those zeros through a view would fault mid-swap. jax_vmm's own kernels never touch
// unbacked chunks. A zero-filling commit that takes back released chunks waits too.
#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/format.h"
#include "common/math.h"
#include "core/arena_internal.h"
#include "jax_vmm/arena.h"
#include "jax_vmm/errors.h"

namespace jax_vmm {

namespace {

void AppendName(std::string* names, const std::string& name) {
  if (names->find("'" + name + "'") != std::string::npos) return;
  *names += (names->empty() ? "'" : ", '") + name + "'";
}

}  // namespace

size_t Arena::Commit(int64_t buffer_id, size_t start, size_t stop) {
  return CommitRanges({Range{buffer_id, start, stop}});
}

size_t Arena::CommitRanges(const std::vector<Range>& ranges) {
  ThrowIfForked("commit");
  std::unique_lock<std::mutex> lock(mu_);
  return CommitLocked(lock, ranges);
}

bool Arena::CommitAhead(const std::vector<Range>& ranges, size_t* added) {
  ThrowIfForked("commit_ahead");
  std::unique_lock<std::mutex> lock(mu_);
  const size_t bytes = CommitLocked(lock, ranges, /*background=*/true);
  if (bytes == kSkipped) return false;
  *added = bytes;
  if (bytes > 0) ++stats_.commits_ahead;
  return true;
}

size_t Arena::CommitLocked(std::unique_lock<std::mutex>& lock, const std::vector<Range>& ranges,
                           bool background) {
  bool budget_reclaimed = false;
  for (int attempt = 0;; ++attempt) {
    ThrowIfClosed("commit");
    ThrowIfAsleep("commit");
    // Rechecked after every wait: a view may have been made meanwhile.
    if (background && views_exported_.load()) return kSkipped;
    const CommitPlan plan = PlanCommit(ranges);
    if (plan.must_wait) {
      cv_->wait(lock);
      continue;
    }
    if (plan.missing_chunks == 0 && plan.revive.empty()) return 0;
    Pending pending;
    if (!ChargeBudget(lock, plan, "commit", &budget_reclaimed, &pending.charge)) continue;
    const auto t0 = std::chrono::steady_clock::now();
    if (zero_fill_ && !plan.revive.empty()) {
      // Work launched before the release may still read the chunks taken back: the
      // zeros must not land under it.
      driver_->Synchronize();
      ++stats_.commit_drains;
    } else if (!plan.runs.empty()) {
      DrainIfViewsMayRead();
    }
    try {
      MapRuns(plan, &pending, zero_fill_);
      ZeroFillRevived(plan);
      PublishCommit(plan, &pending);
    } catch (const OutOfMemory& e) {
      size_t got = 0;
      for (const auto& m : pending.mappings) got += m->bytes;
      UnwindCommit(plan, &pending);
      // Memory pressure: released memory waiting for the device comes back first.
      const bool reclaimable = !retired_.empty() || reclaiming_ > 0 || AnyTransferInFlight();
      if (attempt == 0 && reclaimable) {
        ReclaimAllLocked(lock, /*zero_parked=*/false, /*host_work_waited=*/false);
        continue;
      }
      throw CommitOutOfMemory(plan, got, e);
    } catch (...) {
      UnwindCommit(plan, &pending);
      throw;
    }
    return AccountCommit(plan, plan.missing_chunks, SecondsSince(t0));
  }
}

Arena::CommitPlan Arena::PlanCommit(const std::vector<Range>& ranges) {
  // Validate everything before the first driver call.
  for (const Range& r : ranges) {
    CheckRange(PlacementOrThrow(r.buffer_id, "Buffer.commit").info, r.start, r.stop,
               "Buffer.commit");
  }
  CommitPlan plan;
  {
    // planned_chunks_ marks what this plan holds, inside its spans; the guard clears
    // them when the block ends, however it ends. A byte per chunk, not a set: a large
    // commit plans thousands of chunks.
    struct ClearMarks {
      std::vector<uint8_t>& marks;
      const std::vector<ChunkRun>& spans;
      ~ClearMarks() {
        for (const ChunkRun& s : spans) std::fill_n(marks.begin() + s.first, s.count, 0);
      }
    } clear_marks{planned_chunks_, plan.spans};
    for (const Range& r : ranges) {
      if (r.start == r.stop) continue;
      const Placement& p = buffers_.at(r.buffer_id);
      const size_t first = r.start / chunk_bytes_;
      const size_t end = CeilDiv(r.stop, chunk_bytes_);
      plan.spans.push_back({ArenaChunk(p, first), end - first});
      bool extends_run = false;  // whether the next missing chunk continues the last run
      bool gets_chunks = false;
      for (size_t c = first; c < end; ++c) {
        const size_t a = ArenaChunk(p, c);
        if (host_page_table_[a] || planned_chunks_[a]) {
          extends_run = false;  // backed already, or planned by an overlapping range
          continue;
        }
        planned_chunks_[a] = 1;
        gets_chunks = true;
        PlanChunk(a, &plan, &extends_run);
      }
      if (gets_chunks) AppendName(&plan.buffer_names, p.info.name);
    }
  }
  return plan;
}

// Chunk a needs backing: take its parked allocation back, or extend (or start) a run of
// new allocations.
void Arena::PlanChunk(size_t a, CommitPlan* plan, bool* extends_run) const {
  if (Mapping* m = chunk_mapping_[a]) {
    if (m->shared) {
      // Its bytes live on at another address (core/arena_share.cc): new memory goes here
      // once the released mapping is reclaimed (the reclaimer wakes the waiting commit).
      if (m->live > 0) {
        throw InvalidArgument("Arena: chunk " + std::to_string(a) +
                              " lies in memory shared with another address and was released "
                              "by part; release the rest of it (every sharer) first");
      }
      plan->must_wait = true;
      *extends_run = false;
      return;
    }
    plan->must_wait |= m->busy();
    plan->revive.push_back(a);
    *extends_run = false;
    return;
  }
  if (*extends_run) {
    ++plan->runs.back().count;
  } else {
    plan->runs.push_back({a, 1});
  }
  *extends_run = true;
  ++plan->missing_chunks;
}

Arena::CommitPlan Arena::PlanRuns(const std::vector<ChunkRun>& runs) const {
  CommitPlan plan;
  for (const ChunkRun& run : runs) {
    plan.spans.push_back(run);
    bool extends_run = false;
    for (size_t a = run.first; a < run.first + run.count; ++a) {
      if (host_page_table_[a]) {
        throw InvalidArgument("Arena: chunk " + std::to_string(a) +
                              " was committed while its contents were away; release it first");
      }
      PlanChunk(a, &plan, &extends_run);
    }
  }
  // Named like a commit's buffers: an out-of-memory error says what the restore needed.
  for (const auto& [id, p] : buffers_) {
    const size_t first = ArenaChunk(p, 0);
    for (const ChunkRun& run : runs) {
      if (run.first < first + p.num_chunks && first < run.first + run.count) {
        AppendName(&plan.buffer_names, p.info.name);
        break;
      }
    }
  }
  return plan;
}

bool Arena::ChargeBudget(std::unique_lock<std::mutex>& lock, const CommitPlan& plan, const char* op,
                         bool* reclaimed, BudgetCharge* out) {
  if (!budget_ || plan.missing_chunks == 0) return true;
  const std::string what =
      std::string(op) + (plan.buffer_names.empty() ? "" : " of buffer(s) " + plan.buffer_names);
  try {
    *out = budget_->Charge(uid_, plan.missing_chunks * chunk_bytes_, what);
    return true;
  } catch (const BudgetExceeded&) {
    if (*reclaimed) throw;
  }
  // Released memory still held (waiting for the device) counts against the cap: take it
  // back, ours under the lock, the other members' without it (they may be doing the same).
  *reclaimed = true;
  ReclaimAllLocked(lock, /*zero_parked=*/false, /*host_work_waited=*/false);
  const std::shared_ptr<MemoryBudget> budget = budget_;
  lock.unlock();
  try {
    budget->ReclaimOthers(uid_);
  } catch (...) {
    lock.lock();
    throw;
  }
  lock.lock();
  return false;
}

void Arena::DrainIfViewsMayRead() {
  if (!views_exported_.load()) return;
  driver_->Synchronize();
  ++stats_.commit_drains;
}

// Everything built is in pending as soon as it exists, so that an exception anywhere
// leaves the caller what to unwind.
void Arena::MapRuns(const CommitPlan& plan, Pending* pending, bool zero) {
  if (plan.missing_chunks != 0) driver_->CheckRoomFor(plan.missing_chunks * chunk_bytes_);
  const size_t per_handle = handle_bytes_ / chunk_bytes_;
  const bool fill = zero && !driver_->FreshMemoryIsZero();
  for (const ChunkRun& run : plan.runs) {
    const size_t begin = pending->mappings.size();
    std::vector<MapPiece> pieces;
    for (size_t done = 0; done < run.count;) {
      const size_t n = std::min(per_handle, run.count - done);
      const size_t first = run.first + done;
      pending->mappings.push_back(
          std::make_unique<Mapping>(driver_.get(), first, n, chunk_bytes_, ChunkAddress(first)));
      pending->mappings.back()->physical->charge = pending->charge.Split(n * chunk_bytes_);
      pieces.push_back({pending->mappings.back()->handle, 0, n * chunk_bytes_});
      done += n;
    }
    const uintptr_t va = ChunkAddress(run.first);
    driver_->MapRun(va, pieces.data(), pieces.size());  // all-or-nothing
    for (size_t i = begin; i < pending->mappings.size(); ++i) pending->mappings[i]->mapped = true;
    driver_->SetAccess(va, run.count * chunk_bytes_);
    if (fill) driver_->ZeroFill(va, run.count * chunk_bytes_);
  }
}

void Arena::ZeroFillRevived(const CommitPlan& plan) {
  if (!zero_fill_) return;
  ForEachRun(
      plan.revive, [](size_t, size_t) { return true; },
      [&](size_t first, size_t count) {
        driver_->ZeroFill(ChunkAddress(first), count * chunk_bytes_);
      });
}

void Arena::PublishCommit(const CommitPlan& plan, Pending* pending) {
  for (const auto& m : pending->mappings) {
    std::fill_n(host_page_table_.begin() + m->first_chunk, m->num_chunks, 1);
  }
  for (size_t a : plan.revive) host_page_table_[a] = 1;
  PublishPageTable(plan.spans);
  // Every call succeeded: the allocations join the arena, the parked chunks come back.
  AdoptPlanned(plan, pending, /*pinned=*/false);
}

void Arena::AdoptPlanned(const CommitPlan& plan, Pending* pending, bool pinned) {
  for (auto& m : pending->mappings) {
    std::fill_n(chunk_mapping_.begin() + m->first_chunk, m->num_chunks, m.get());
    (pinned ? m->pins : m->live) = m->num_chunks;
    const size_t key = m->first_chunk;
    mappings_.emplace(key, std::move(m));
  }
  pending->mappings.clear();
  for (size_t a : plan.revive) {
    Mapping* m = chunk_mapping_[a];
    if (m->retired) {
      retired_.erase(m);
      m->retired = false;
    }
    if (pinned) {
      ++m->pins;
    } else {
      ++m->live;
      parked_dirty_.erase(a);
    }
  }
}

// The device page table must say "unbacked" again *before* the chunks are unmapped (a
// kernel must never see 1 for a chunk that is gone).
void Arena::UnwindCommit(const CommitPlan& plan, Pending* pending) noexcept {
  for (const auto& m : pending->mappings) {
    if (m) std::fill_n(host_page_table_.begin() + m->first_chunk, m->num_chunks, 0);
  }
  for (size_t a : plan.revive) host_page_table_[a] = 0;
  try {
    PublishPageTable(plan.spans);
  } catch (...) {
    // The table copy only fails when the device is already broken.
  }
  pending->mappings.clear();  // Mapping destructors unmap and release
  ++stats_.failed_commits;
}

size_t Arena::AccountCommit(const CommitPlan& plan, size_t created, double seconds) {
  for (const ChunkRun& run : plan.runs) AccountBacked(run.first, run.count, +1);
  ForEachRun(
      plan.revive, [](size_t, size_t) { return true; },
      [&](size_t first, size_t count) { AccountBacked(first, count, +1); });
  const size_t per_handle = handle_bytes_ / chunk_bytes_;
  for (const ChunkRun& run : plan.runs) {
    stats_.handles_created += static_cast<int64_t>(CeilDiv(run.count, per_handle));
  }
  stats_.chunks_created += static_cast<int64_t>(created);
  stats_.chunks_revived += static_cast<int64_t>(plan.revive.size());
  stats_.set_access_calls += static_cast<int64_t>(plan.runs.size());
  stats_.commit_calls += 1;
  stats_.commit_seconds += seconds;
  return (created + plan.revive.size()) * chunk_bytes_;
}

OutOfMemory Arena::CommitOutOfMemory(const CommitPlan& plan, size_t got,
                                     const OutOfMemory& e) const {
  const size_t asked = plan.missing_chunks * chunk_bytes_;
  const size_t free_bytes = driver_->mem_info().free_bytes;
  size_t parked = 0;
  for (const auto& [first, m] : mappings_) parked += (m->num_chunks - m->live) * chunk_bytes_;
  const std::string held =
      parked == 0 ? std::string()
                  : " This arena holds " + Bytes(parked) +
                        " of released chunks inside allocations still in use (handle_bytes=" +
                        Bytes(handle_bytes_) +
                        "); release their neighbours or use smaller "
                        "handles to get it back.";
  return OutOfMemory("commit of buffer(s) " + plan.buffer_names + ": out of physical memory on " +
                         driver_->kind() + " device " + std::to_string(driver_->device_ordinal()) +
                         ": asked for " + Bytes(asked) + " (chunks of " + Bytes(chunk_bytes_) +
                         "), failed after " + Bytes(got) + "; " + Bytes(free_bytes) +
                         " free. Nothing was committed." + held + " Driver said: " + e.what(),
                     asked, free_bytes);
}

}  // namespace jax_vmm
