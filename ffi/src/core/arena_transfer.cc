// Moving contents between the arena and host memory: Sleep/Wake, Offload/Restore, CopyIn
// (contract in jax_vmm/arena.h), and the host staging memory they share.
//
// Host images. Contents kept in host memory live in blocks of kHostBlockBytes (64 MiB)
// of page-locked memory (Driver::AllocHost): every copy is a large DMA transfer at full
// bandwidth, and freed blocks stay cached for the next sleep or offload (pinning memory
// costs far more than copying it). A smaller image takes one block of its own size.
//
// Sleep waits for the device, copies every backed chunk out (run by run, each run inside
// one allocation), then gives all physical memory back; wake maps the same runs again
// (one allocation per run, so allocation boundaries survive) and copies back. Both are
// all-or-nothing: a failure leaves the arena as it was (asleep and intact for wake).
//
// Offload takes chunks out of the page table at once and pins their allocations; the
// reclaimer copies them out after its next device wait (so earlier kernels are done
// writing), then retires them. Restore maps the chunks again and copies back, inline
// (wait) or on the reclaimer's thread, which publishes the chunks when the copy landed.
// Where unmapping needs no device wait (host driver) or raw views were handed out, both
// run inline on the caller's thread.
#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "common/format.h"
#include "common/math.h"
#include "core/arena_internal.h"
#include "jax_vmm/arena.h"
#include "jax_vmm/errors.h"

namespace jax_vmm {
namespace {

constexpr size_t kHostBlockBytes = size_t{64} << 20;
constexpr size_t kHostRounding = size_t{2} << 20;

}  // namespace

// -- host images --------------------------------------------------------------------

Arena::HostImage Arena::AllocImage(size_t bytes) {
  HostImage image;
  image.bytes = bytes;
  try {
    for (size_t left = bytes; left > 0;) {
      const size_t want = left >= kHostBlockBytes ? kHostBlockBytes : RoundUp(left, kHostRounding);
      void* block = nullptr;
      auto cached = host_cache_.find(want);
      if (cached != host_cache_.end()) {
        block = cached->second;
        host_cache_.erase(cached);
      } else {
        block = driver_->AllocHost(want);
      }
      image.blocks.emplace_back(block, want);
      left -= std::min(left, want);
    }
  } catch (...) {
    FreeImage(&image);
    throw;
  }
  return image;
}

void Arena::FreeImage(HostImage* image) noexcept {
  for (const auto& [block, bytes] : image->blocks) {
    if (bytes == kHostBlockBytes) {
      try {
        host_cache_.emplace(bytes, block);
        continue;
      } catch (...) {
      }
    }
    driver_->FreeHost(block, bytes);
  }
  image->blocks.clear();
  image->bytes = 0;
}

void Arena::FreeHostCache() {
  ThrowIfForked("free_host_cache");
  std::lock_guard<std::mutex> lock(mu_);
  FreeHostCacheLocked();
}

void Arena::FreeHostCacheLocked() noexcept {
  for (const auto& [bytes, block] : host_cache_) driver_->FreeHost(block, bytes);
  host_cache_.clear();
}

std::vector<CopyRegion> Arena::ImageRegions(const HostImage& image,
                                            const std::vector<ChunkRun>& runs, bool to_host) const {
  std::vector<CopyRegion> regions;
  size_t block = 0, in_block = 0;
  for (const ChunkRun& run : runs) {
    uintptr_t dev = ChunkAddress(run.first);
    for (size_t left = run.count * chunk_bytes_; left > 0;) {
      const auto& [ptr, size] = image.blocks[block];
      const size_t n = std::min(size - in_block, left);
      void* host = static_cast<char*>(ptr) + in_block;
      void* device = reinterpret_cast<void*>(dev);
      regions.push_back(to_host ? CopyRegion{host, device, n} : CopyRegion{device, host, n});
      dev += n;
      left -= n;
      in_block += n;
      if (in_block == size) {
        ++block;
        in_block = 0;
      }
    }
  }
  return regions;
}

std::vector<Arena::ChunkRun> Arena::BackedRunsByMapping(const std::vector<ChunkRun>& within) const {
  std::vector<size_t> backed;
  for (const ChunkRun& run : within) {
    for (size_t a = run.first; a < run.first + run.count; ++a) {
      if (host_page_table_[a]) backed.push_back(a);
    }
  }
  std::vector<ChunkRun> runs;
  ForEachRun(
      backed, [&](size_t a, size_t b) { return chunk_mapping_[a] == chunk_mapping_[b]; },
      [&](size_t first, size_t count) { runs.push_back({first, count}); });
  return runs;
}

size_t Arena::SleepImageBytes() const { return sleep_ ? sleep_->image.bytes : 0; }

void Arena::DropSleepImage() noexcept {
  if (!sleep_) return;
  FreeImage(&sleep_->image);
  sleep_.reset();
}

// -- copies in ------------------------------------------------------------------------

void Arena::CopyIn(int64_t buffer_id, size_t offset, const void* src, size_t bytes) {
  ThrowIfForked("copy_in");
  std::lock_guard<std::mutex> lock(mu_);
  ThrowIfClosed("copy_in");
  ThrowIfAsleep("copy_in");
  const Placement& p = PlacementOrThrow(buffer_id, "Arena.copy_in");
  CheckRange(p.info, offset, offset + bytes, "Arena.copy_in");
  for (size_t c = offset / chunk_bytes_; c < CeilDiv(offset + bytes, chunk_bytes_); ++c) {
    if (!host_page_table_[ArenaChunk(p, c)]) {
      throw InvalidArgument("Arena.copy_in('" + p.info.name + "'): bytes [" +
                            std::to_string(offset) + ", " + std::to_string(offset + bytes) +
                            ") are not all backed; commit them first");
    }
  }
  if (bytes == 0) return;
  const CopyRegion region{reinterpret_cast<void*>(p.info.address + offset), src, bytes};
  driver_->CopyToDevice(&region, 1);
}

// -- sleep and wake -------------------------------------------------------------------

void Arena::Sleep(bool keep_contents) {
  ThrowIfForked("sleep");
  std::unique_lock<std::mutex> lock(mu_);
  ThrowIfClosed("sleep");
  ThrowIfAsleep("sleep");
  WaitWhileBusy(lock);
  ThrowIfShared({ChunkRun{0, num_chunks_}}, "Arena.sleep");
  driver_->Synchronize();  // device work that uses the arena is done
  auto image = std::make_unique<SleepImage>();
  image->runs = BackedRunsByMapping({ChunkRun{0, num_chunks_}});
  image->kept = keep_contents;
  size_t bytes = 0;
  for (const ChunkRun& run : image->runs) bytes += run.count * chunk_bytes_;
  if (keep_contents && bytes > 0) {
    image->image = AllocImage(bytes);
    try {
      const std::vector<CopyRegion> regions = ImageRegions(image->image, image->runs, true);
      driver_->CopyToHost(regions.data(), regions.size());
    } catch (...) {
      FreeImage(&image->image);
      throw;
    }
  }
  ReleaseAllMemory(lock);  // the page table first (writes now drop), then the memory
  sleep_ = std::move(image);
  cv_->notify_all();
}

void Arena::Wake() {
  ThrowIfForked("wake");
  std::unique_lock<std::mutex> lock(mu_);
  bool budget_reclaimed = false;
  Pending pending;
  for (;;) {  // again only after the budget's deferred releases were taken back
    ThrowIfClosed("wake");
    if (!sleep_) throw InvalidArgument("Arena.wake: the arena is not asleep (call sleep() first)");
    if (ChargeBudget(lock, PlanRuns(sleep_->runs), "wake", &budget_reclaimed, &pending.charge)) {
      break;
    }
  }
  const SleepImage& image = *sleep_;
  const auto t0 = std::chrono::steady_clock::now();
  const CommitPlan plan = PlanRuns(image.runs);  // all unmapped: every chunk is new
  if (!plan.runs.empty()) DrainIfViewsMayRead();
  try {
    MapRuns(plan, &pending, /*zero=*/!image.kept && zero_fill_);
    if (image.kept && image.image.bytes > 0) {
      const std::vector<CopyRegion> regions = ImageRegions(image.image, image.runs, false);
      driver_->CopyToDevice(regions.data(), regions.size());
    }
    PublishCommit(plan, &pending);
  } catch (...) {
    UnwindCommit(plan, &pending);  // still asleep, the image intact
    throw;
  }
  AccountCommit(plan, plan.missing_chunks, SecondsSince(t0));
  DropSleepImage();
  cv_->notify_all();
}

// -- offload and restore ----------------------------------------------------------------

bool Arena::TransferInFlight(const TransferRecord& t) const {
  return t.state == TransferState::kOffloading || t.state == TransferState::kRestoring;
}

size_t Arena::TransferHostBytes(const TransferRecord& t) const { return t.image.bytes; }

bool Arena::AnyTransferInFlight() const {
  for (const auto& [ticket, t] : transfers_) {
    if (TransferInFlight(*t)) return true;
  }
  return false;
}

bool Arena::HasQueuedOffloads() const {
  for (const auto& [ticket, t] : transfers_) {
    if (t->queued && t->state == TransferState::kOffloading) return true;
  }
  return false;
}

bool Arena::HasWorkerWork() const {
  if (!retired_.empty()) return true;
  for (const auto& [ticket, t] : transfers_) {
    if (t->queued) return true;
  }
  return false;
}

void Arena::DropTransferImage(TransferRecord& t) noexcept { FreeImage(&t.image); }

Arena::TransferRecord& Arena::RecordOrThrow(uint64_t ticket, const char* op) {
  auto it = transfers_.find(ticket);
  if (it == transfers_.end()) {
    throw InvalidArgument(std::string(op) + ": no transfer " + std::to_string(ticket) +
                          " in this arena (already restored and dropped, or never made)");
  }
  return *it->second;
}

uint64_t Arena::Offload(const std::vector<Range>& ranges) {
  ThrowIfForked("offload");
  std::unique_lock<std::mutex> lock(mu_);
  ThrowIfClosed("offload");
  ThrowIfAsleep("offload");
  auto record = std::make_unique<TransferRecord>();
  record->runs = BackedRunsByMapping(DecommitRuns(ranges));
  ThrowIfShared(record->runs, "Arena.offload");
  size_t bytes = 0;
  for (const ChunkRun& run : record->runs) bytes += run.count * chunk_bytes_;
  if (bytes > 0) record->image = AllocImage(bytes);
  size_t removed = 0;
  try {
    Unpublish(record->runs, &removed);
  } catch (...) {
    FreeImage(&record->image);
    throw;
  }
  for (const ChunkRun& run : record->runs) chunk_mapping_[run.first]->pins += run.count;
  const uint64_t ticket = next_ticket_++;
  TransferRecord& t = *record;
  transfers_.emplace(ticket, std::move(record));
  if (!driver_->UnmapNeedsQuiescence() || views_exported_.load()) {
    std::string error;
    try {
      driver_->Synchronize();  // earlier kernels are done writing these chunks
      const std::vector<CopyRegion> regions = ImageRegions(t.image, t.runs, true);
      driver_->CopyToHost(regions.data(), regions.size());
    } catch (const std::exception& e) {
      UndoOffload(t, e.what());
      transfers_.erase(ticket);  // nothing changed; the caller gets the error, not a ticket
      throw;
    }
    FinishOffload(lock, t, /*reclaimer_sync=*/0);
  } else {
    t.epoch = syncs_started_;
    t.queued = true;
    StartWorker();
  }
  cv_->notify_all();
  return ticket;
}

// The contents are on the host: unpin, and let allocations with nothing backed go (the
// reclaimer's round frees them with the other retired ones: its device wait covers them).
void Arena::FinishOffload(std::unique_lock<std::mutex>& lock, TransferRecord& t,
                          uint64_t reclaimer_sync) {
  std::vector<Mapping*> touched;
  for (const ChunkRun& run : t.runs) {
    Mapping* m = chunk_mapping_[run.first];
    m->pins -= run.count;
    touched.push_back(m);  // twice when a released chunk splits it: RetireUnused counts once
  }
  t.state = TransferState::kOffloaded;
  if (reclaimer_sync == 0) {
    RetireUnused(lock, touched);
    return;
  }
  for (Mapping* m : touched) {
    if (m->live == 0 && m->pins == 0 && !m->retired) {
      m->retired = true;
      m->retired_epoch = reclaimer_sync - 1;
      retired_.insert(m);
      ++stats_.deferred_releases;
    }
  }
}

// The copy failed: the chunks go back into the page table, where they were.
void Arena::UndoOffload(TransferRecord& t, const std::string& error) noexcept {
  for (const ChunkRun& run : t.runs) {
    Mapping* m = chunk_mapping_[run.first];
    m->pins -= run.count;
    m->live += run.count;
    std::fill_n(host_page_table_.begin() + run.first, run.count, 1);
    for (size_t a = run.first; a < run.first + run.count; ++a) parked_dirty_.erase(a);
    AccountBacked(run.first, run.count, +1);
  }
  try {
    PublishPageTable(t.runs);
  } catch (...) {
  }
  FreeImage(&t.image);
  t.state = TransferState::kFailed;
  t.error = "offload failed, the contents stayed in place: " + error;
}

void Arena::Restore(uint64_t ticket, bool wait) {
  ThrowIfForked("restore");
  std::unique_lock<std::mutex> lock(mu_);
  bool budget_reclaimed = false;
  for (;;) {
    ThrowIfClosed("restore");
    ThrowIfAsleep("restore");
    TransferRecord& t = RecordOrThrow(ticket, "Arena.restore");
    if (t.state == TransferState::kOffloading) {
      cv_->wait(lock);
      continue;
    }
    if (t.state == TransferState::kFailed) {
      throw InvalidArgument("Arena.restore: " + t.error + "; nothing to restore");
    }
    if (t.state == TransferState::kRestoring) {
      if (!wait) return;
      cv_->wait(lock);
      continue;
    }
    if (t.state == TransferState::kRestored) return;
    const CommitPlan plan = PlanRuns(t.runs);
    if (plan.must_wait) {
      cv_->wait(lock);
      continue;
    }
    Pending pending;
    if (!ChargeBudget(lock, plan, "restore", &budget_reclaimed, &pending.charge)) continue;
    const auto t0 = std::chrono::steady_clock::now();
    if (!plan.runs.empty()) DrainIfViewsMayRead();
    try {
      MapRuns(plan, &pending, /*zero=*/false);
    } catch (...) {
      UnwindCommit(plan, &pending);
      throw;
    }
    if (wait || !driver_->UnmapNeedsQuiescence()) {
      try {
        const std::vector<CopyRegion> regions = ImageRegions(t.image, t.runs, false);
        driver_->CopyToDevice(regions.data(), regions.size());
        PublishCommit(plan, &pending);
      } catch (...) {
        UnwindCommit(plan, &pending);  // still offloaded, the host copy intact
        throw;
      }
      AccountCommit(plan, plan.missing_chunks, SecondsSince(t0));
      FreeImage(&t.image);
      t.state = TransferState::kRestored;
      t.error.clear();
      cv_->notify_all();
      return;
    }
    // In the background: the allocations join the arena now, pinned and unpublished.
    stats_.handles_created += static_cast<int64_t>(pending.mappings.size());
    AdoptPlanned(plan, &pending, /*pinned=*/true);
    t.created_chunks = plan.missing_chunks;
    t.state = TransferState::kRestoring;
    t.queued = true;
    StartWorker();
    cv_->notify_all();
    return;
  }
}

// The copy landed: the chunks join the page table.
void Arena::FinishRestore(TransferRecord& t) {
  for (const ChunkRun& run : t.runs)
    std::fill_n(host_page_table_.begin() + run.first, run.count, 1);
  try {
    PublishPageTable(t.runs);
  } catch (...) {
    for (const ChunkRun& run : t.runs)
      std::fill_n(host_page_table_.begin() + run.first, run.count, 0);
    throw;  // the caller undoes the restore
  }
  size_t chunks = 0;
  for (const ChunkRun& run : t.runs) {
    for (size_t a = run.first; a < run.first + run.count; ++a) {
      Mapping* m = chunk_mapping_[a];
      --m->pins;
      ++m->live;
      parked_dirty_.erase(a);
    }
    AccountBacked(run.first, run.count, +1);
    chunks += run.count;
  }
  stats_.chunks_created += static_cast<int64_t>(t.created_chunks);
  stats_.chunks_revived += static_cast<int64_t>(chunks - t.created_chunks);
  stats_.commit_calls += 1;
  FreeImage(&t.image);
  t.state = TransferState::kRestored;
  t.error.clear();
}

// The copy failed: the new allocations go again (through the usual deferred release:
// a revived one may still be in use by work dispatched before its release).
void Arena::UndoRestore(std::unique_lock<std::mutex>& lock, TransferRecord& t,
                        const std::string& error) {
  std::vector<Mapping*> touched;
  for (const ChunkRun& run : t.runs) {
    for (size_t a = run.first; a < run.first + run.count; ++a) {
      Mapping* m = chunk_mapping_[a];
      --m->pins;
      if (touched.empty() || touched.back() != m) touched.push_back(m);
    }
  }
  t.state = TransferState::kOffloaded;
  t.error = "restore failed, the contents are still offloaded: " + error;
  RetireUnused(lock, touched);
}

void Arena::RunTransferJobs(std::unique_lock<std::mutex>& lock, uint64_t sync) {
  std::vector<TransferRecord*> outs, ins;
  for (auto& [ticket, t] : transfers_) {
    if (!t->queued) continue;
    if (t->state == TransferState::kOffloading && t->epoch < sync) outs.push_back(t.get());
    if (t->state == TransferState::kRestoring) ins.push_back(t.get());
  }
  // Records in flight are not erased (DropTransfer and Close wait for them), so the
  // pointers survive the unlocked copies.
  for (TransferRecord* t : outs) {
    t->queued = false;
    const std::vector<CopyRegion> regions = ImageRegions(t->image, t->runs, true);
    lock.unlock();
    std::string error;
    try {
      driver_->CopyToHost(regions.data(), regions.size());
    } catch (const std::exception& e) {
      error = e.what();
    }
    lock.lock();
    if (error.empty()) {
      FinishOffload(lock, *t, sync);
    } else {
      UndoOffload(*t, error);
    }
    cv_->notify_all();
  }
  for (TransferRecord* t : ins) {
    t->queued = false;
    const std::vector<CopyRegion> regions = ImageRegions(t->image, t->runs, false);
    lock.unlock();
    std::string error;
    try {
      driver_->CopyToDevice(regions.data(), regions.size());
    } catch (const std::exception& e) {
      error = e.what();
    }
    lock.lock();
    try {
      if (error.empty()) FinishRestore(*t);
    } catch (const std::exception& e) {
      error = e.what();
    }
    if (!error.empty()) UndoRestore(lock, *t, error);
    cv_->notify_all();
  }
}

TransferState Arena::TransferStatus(uint64_t ticket, std::string* error) const {
  std::lock_guard<std::mutex> lock(mu_);
  const TransferRecord& t = const_cast<Arena*>(this)->RecordOrThrow(ticket, "Arena.transfer");
  if (error != nullptr) *error = t.error;
  return t.state;
}

TransferState Arena::WaitTransfer(uint64_t ticket, std::string* error) const {
  ThrowIfForked("wait_transfer");  // the reclaimer that would finish it is not here
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    const TransferRecord& t = const_cast<Arena*>(this)->RecordOrThrow(ticket, "Arena.wait");
    if (!TransferInFlight(t)) {
      if (error != nullptr) *error = t.error;
      return t.state;
    }
    cv_->wait(lock);
  }
}

void Arena::DropTransfer(uint64_t ticket) {
  ThrowIfForked("drop_transfer");
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    auto it = transfers_.find(ticket);
    if (it == transfers_.end()) return;
    if (TransferInFlight(*it->second)) {
      cv_->wait(lock);
      continue;
    }
    FreeImage(&it->second->image);
    transfers_.erase(it);
    return;
  }
}

}  // namespace jax_vmm
