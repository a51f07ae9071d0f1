// Release and reclamation: Arena::Decommit, Reclaim, Free's memory, Close's memory, and
// the background reclaimer (contract in jax_vmm/arena.h).
//
// Releasing never unmaps memory that device work may still touch (the failure mode of
// kvcached #465 and vLLM #28714):
//   1. the page table says "unbacked" (host mirror, then the device table): kernels
//      launched from now on drop writes to those chunks, and jax_vmm's readers never
//      read past what is backed;
//   2. an allocation with no backed chunk left is retired with the number of device
//      waits begun so far (its epoch);
//   3. the reclaimer thread begins a device wait (driver.h Synchronize, from its own
//      thread: only it blocks, the thread that dispatches work does not), then unmaps and
//      releases every allocation retired before that wait began.
// Work dispatched before a release is finished by the time its memory is unmapped, and
// work dispatched after it never touches it -- unless a raw view lets XLA read anywhere.
// So once the arena handed out a view a release waits for the device itself and unmaps at
// once (no reader can be dispatched from the releasing thread meanwhile), and the first
// view finishes every deferred release (Arena::LeaseView).
// The host driver swaps mappings atomically (driver.h, UnmapNeedsQuiescence): there the
// same steps run at once, inline.
//
// A retired allocation that a commit needs again is taken back without a driver call
// (Arena::PlanCommit). A commit that runs out of memory first reclaims everything retired
// (waiting for the device) and tries again.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "common/math.h"
#include "core/arena_internal.h"
#include "jax_vmm/arena.h"
#include "jax_vmm/errors.h"

namespace jax_vmm {

std::vector<Arena::ChunkRun> Arena::DecommitRuns(const std::vector<Range>& ranges) {
  for (const Range& r : ranges) {
    CheckRange(PlacementOrThrow(r.buffer_id, "Buffer.decommit").info, r.start, r.stop,
               "Buffer.decommit");
  }
  std::vector<ChunkRun> runs;
  for (const Range& r : ranges) {
    if (r.start == r.stop) continue;
    const Placement& p = buffers_.at(r.buffer_id);
    // Inward rounding: never drop a chunk that still holds bytes outside [start, stop),
    // except the buffer's own tail, which belongs to no one else.
    const size_t first = CeilDiv(r.start, chunk_bytes_);
    const size_t end = r.stop == p.info.nbytes ? p.num_chunks : r.stop / chunk_bytes_;
    if (first < end) runs.push_back({ArenaChunk(p, first), end - first});
  }
  // In address order, each chunk once: the callers count and unpin chunk by chunk, and
  // list each allocation once only when its runs come in order.
  std::sort(runs.begin(), runs.end(),
            [](const ChunkRun& a, const ChunkRun& b) { return a.first < b.first; });
  std::vector<ChunkRun> merged;
  for (const ChunkRun& run : runs) {
    if (!merged.empty() && run.first <= merged.back().first + merged.back().count) {
      ChunkRun& last = merged.back();
      last.count = std::max(last.first + last.count, run.first + run.count) - last.first;
    } else {
      merged.push_back(run);
    }
  }
  return merged;
}

size_t Arena::Decommit(int64_t buffer_id, size_t start, size_t stop, bool wait) {
  return DecommitRanges({Range{buffer_id, start, stop}}, wait);
}

size_t Arena::DecommitRanges(const std::vector<Range>& ranges, bool wait, bool defer_unmap) {
  ThrowIfForked("decommit");
  std::unique_lock<std::mutex> lock(mu_);
  ThrowIfClosed("decommit");
  ThrowIfAsleep("decommit");
  return DecommitLocked(lock, DecommitRuns(ranges), wait, defer_unmap && !wait);
}

size_t Arena::DecommitLocked(std::unique_lock<std::mutex>& lock, const std::vector<ChunkRun>& runs,
                             bool wait, bool defer_unmap) {
  const auto t0 = std::chrono::steady_clock::now();
  size_t removed = 0;
  const std::vector<Mapping*> touched = Unpublish(runs, &removed);
  if (removed > 0) {
    RetireUnused(lock, touched, defer_unmap);
    stats_.decommit_calls += 1;
    stats_.decommit_seconds += SecondsSince(t0);
  }
  if (wait) ReclaimAllLocked(lock);
  return removed * chunk_bytes_;
}

std::vector<Arena::Mapping*> Arena::Unpublish(const std::vector<ChunkRun>& runs, size_t* removed) {
  std::vector<size_t> gone;
  for (const ChunkRun& run : runs) {
    for (size_t a = run.first; a < run.first + run.count; ++a) {
      if (host_page_table_[a]) gone.push_back(a);
    }
  }
  *removed = gone.size();
  if (gone.empty()) return {};
  for (size_t a : gone) host_page_table_[a] = 0;
  // Order matters for device code: first tell kernels the chunks are gone (a kernel
  // launched after this drops its writes instead of faulting), only later unmap.
  try {
    PublishPageTable(runs);
  } catch (...) {
    for (size_t a : gone) host_page_table_[a] = 1;
    try {
      PublishPageTable(runs);
    } catch (...) {
    }
    throw;
  }
  std::vector<Mapping*> touched;
  for (size_t a : gone) {
    Mapping* m = chunk_mapping_[a];
    --m->live;
    if (touched.empty() || touched.back() != m) touched.push_back(m);
  }
  ForEachRun(
      gone, [](size_t, size_t) { return true; },
      [&](size_t first, size_t count) { AccountBacked(first, count, -1); });
  if (zero_fill_) {
    for (size_t a : gone) {
      if (chunk_mapping_[a]->live > 0) parked_dirty_.insert(a);
    }
  }
  std::sort(touched.begin(), touched.end());
  touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
  return touched;
}

void Arena::RetireUnused(std::unique_lock<std::mutex>& lock, std::vector<Mapping*> touched,
                         bool defer_unmap) {
  // An allocation met more than once (several runs of it) is retired or released once.
  std::sort(touched.begin(), touched.end());
  touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
  const bool views = views_exported_.load();
  const bool quiesce = driver_->UnmapNeedsQuiescence();
  // The caller reclaims what it defers (host driver, see DecommitRanges).
  const bool caller_reclaims = defer_unmap && !quiesce && !views;
  std::vector<Mapping*> now;
  for (Mapping* m : touched) {
    if (m->live > 0 || m->pins > 0 || m->retired || m->reclaiming) continue;
    if ((quiesce && !views) || caller_reclaims) {
      m->retired = true;
      m->retired_epoch = syncs_started_;
      retired_.insert(m);
      ++stats_.deferred_releases;
    } else {
      now.push_back(m);
    }
  }
  if (!retired_.empty() && quiesce && !views) {
    StartWorker();
    cv_->notify_all();
  }
  const bool zero_parked = views && zero_fill_ && !parked_dirty_.empty();
  if (now.empty() && !zero_parked) return;
  if (quiesce) {
    // Raw views: a reader may be in flight over these chunks. Wait here, on the
    // releasing thread, so that none is dispatched between the wait and the unmap.
    driver_->Synchronize();
    ++stats_.reclaim_syncs;
  }
  ReclaimNow(now);
  if (zero_parked) ZeroParked();
  (void)lock;
}

void Arena::WaitWhileBusy(std::unique_lock<std::mutex>& lock) {
  cv_->wait(lock, [&] { return reclaiming_ == 0 && !AnyTransferInFlight(); });
}

size_t Arena::Reclaim() {
  ThrowIfForked("reclaim");
  std::unique_lock<std::mutex> lock(mu_);
  return ReclaimAllLocked(lock);
}

uint64_t Arena::BeginHostWait() {
  ThrowIfForked("reclaim");
  std::lock_guard<std::mutex> lock(mu_);
  return ++syncs_started_;
}

size_t Arena::ReclaimRetiredBefore(uint64_t sync) {
  ThrowIfForked("reclaim");
  std::unique_lock<std::mutex> lock(mu_);
  if (closed_) return 0;
  return ReclaimRetiredBefore(lock, sync);
}

size_t Arena::ReclaimAllLocked(std::unique_lock<std::mutex>& lock, bool zero_parked,
                               bool host_work_waited) {
  WaitWhileBusy(lock);
  zero_parked = zero_parked && zero_fill_ && !parked_dirty_.empty();
  if (!driver_->UnmapNeedsQuiescence() && !host_work_waited) return 0;  // the caller's
  if (retired_.empty() && !zero_parked) return 0;
  if (driver_->UnmapNeedsQuiescence()) {
    ++syncs_started_;
    driver_->Synchronize();
    ++stats_.reclaim_syncs;
  }
  std::vector<Mapping*> batch(retired_.begin(), retired_.end());
  for (Mapping* m : batch) m->retired = false;
  retired_.clear();
  const size_t bytes = ReclaimNow(batch);
  if (zero_parked) ZeroParked();
  return bytes;
}

size_t Arena::ReclaimNow(const std::vector<Mapping*>& batch) {
  size_t bytes = 0;
  for (const Mapping* m : batch) bytes += m->bytes;
  UnmapGroups(batch);
  for (std::unique_ptr<Mapping>& m : DetachMappings(batch)) m.reset();  // releases
  return bytes;
}

void Arena::UnmapGroups(std::vector<Mapping*> batch) {
  std::sort(batch.begin(), batch.end(),
            [](const Mapping* a, const Mapping* b) { return a->va < b->va; });
  size_t i = 0;
  while (i < batch.size()) {
    std::vector<size_t> sizes{batch[i]->bytes};
    size_t j = i + 1;
    while (j < batch.size() && batch[j]->va == batch[j - 1]->va + batch[j - 1]->bytes) {
      sizes.push_back(batch[j++]->bytes);
    }
    driver_->UnmapRun(batch[i]->va, sizes.data(), sizes.size());
    i = j;
  }
}

std::vector<std::unique_ptr<Arena::Mapping>> Arena::DetachMappings(
    const std::vector<Mapping*>& batch) {
  std::vector<std::unique_ptr<Mapping>> out;
  for (Mapping* m : batch) {
    m->mapped = false;  // UnmapGroups did it
    std::fill_n(chunk_mapping_.begin() + m->first_chunk, m->num_chunks, nullptr);
    for (size_t a = m->first_chunk; a < m->first_chunk + m->num_chunks; ++a) parked_dirty_.erase(a);
    stats_.chunks_released += static_cast<int64_t>(m->num_chunks);
    stats_.handles_released += 1;
    auto it = mappings_.find(m->first_chunk);
    out.push_back(std::move(it->second));
    mappings_.erase(it);
  }
  for (const std::unique_ptr<Mapping>& m : out) {
    if (m->shared) UnshareIfLast(m->physical.get());
  }
  return out;
}

void Arena::UnshareIfLast(const Physical* physical) {
  // A share that failed after mapping, or a sharer released before its source, leaves
  // the source the allocation's only address: without this it would stay marked shared
  // for as long as it lives, and refuse sleep, offload and releases by part.
  Mapping* last = nullptr;
  for (const auto& [first, m] : mappings_) {
    if (m->physical.get() != physical) continue;
    if (last != nullptr) return;  // still mapped at two addresses
    last = m.get();
  }
  if (last != nullptr) last->shared = false;  // aliases map allocations whole: so does it
}

void Arena::ZeroParked() {
  std::vector<size_t> chunks;
  for (size_t a : parked_dirty_) {
    // A shared chunk's bytes are another address's too: never zeroed (nor taken back).
    const Mapping* m = chunk_mapping_[a];
    if (m != nullptr && !m->shared && !host_page_table_[a]) chunks.push_back(a);
  }
  parked_dirty_.clear();
  ForEachRun(
      chunks, [](size_t, size_t) { return true; },
      [&](size_t first, size_t count) {
        driver_->ZeroFill(ChunkAddress(first), count * chunk_bytes_);
      });
}

void Arena::ReleaseAllMemory(std::unique_lock<std::mutex>& lock) {
  std::vector<size_t> backed;
  for (size_t a = 0; a < num_chunks_; ++a) {
    if (host_page_table_[a]) backed.push_back(a);
  }
  std::vector<ChunkRun> runs;
  ForEachRun(
      backed, [](size_t, size_t) { return true; },
      [&](size_t first, size_t count) { runs.push_back({first, count}); });
  size_t removed = 0;
  Unpublish(runs, &removed);
  std::vector<Mapping*> all;
  for (auto& [first, m] : mappings_) all.push_back(m.get());
  retired_.clear();
  ReclaimNow(all);
  parked_dirty_.clear();
  (void)lock;
}

void Arena::StartWorker() {
  if (!worker_.joinable()) worker_ = std::thread([this] { WorkerLoop(); });
}

// The reclaimer: one device wait per round, then the transfers and the allocations that
// were queued before the wait began. Driver calls and waits run without the lock.
void Arena::WorkerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_worker_) {
    if (!HasWorkerWork()) {
      cv_->wait(lock);
      continue;
    }
    uint64_t sync = syncs_started_;
    if (!retired_.empty() || HasQueuedOffloads()) {
      sync = ++syncs_started_;
      lock.unlock();
      std::string error;
      try {
        driver_->Synchronize();
      } catch (const std::exception& e) {
        error = e.what();
      }
      lock.lock();
      if (!error.empty()) {
        // A broken device: keep the memory mapped (safe) and try again later.
        std::fprintf(stderr, "jax_vmm: the arena's reclaimer could not wait for the device: %s\n",
                     error.c_str());
        cv_->wait_for(lock, std::chrono::seconds(1));
        continue;
      }
      ++stats_.reclaim_syncs;
    }
    RunTransferJobs(lock, sync);
    ReclaimRetiredBefore(lock, sync);
    cv_->notify_all();
  }
}

size_t Arena::ReclaimRetiredBefore(std::unique_lock<std::mutex>& lock, uint64_t sync) {
  std::vector<Mapping*> batch;
  size_t bytes = 0;
  for (Mapping* m : retired_) {
    if (m->retired_epoch < sync) {
      batch.push_back(m);
      bytes += m->bytes;
    }
  }
  if (batch.empty()) return 0;
  for (Mapping* m : batch) {
    retired_.erase(m);
    m->retired = false;
    m->reclaiming = true;
  }
  reclaiming_ += static_cast<int>(batch.size());
  lock.unlock();
  UnmapGroups(batch);  // driver calls only: the batch is this thread's
  lock.lock();
  std::vector<std::unique_ptr<Mapping>> gone = DetachMappings(batch);
  lock.unlock();
  gone.clear();  // cuMemRelease, outside the lock
  lock.lock();
  reclaiming_ -= static_cast<int>(batch.size());
  cv_->notify_all();
  return bytes;
}

}  // namespace jax_vmm
