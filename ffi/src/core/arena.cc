// Arena: construction, placement of buffers, raw-view accounting, queries, close (see
// jax_vmm/arena.h). Commit is in arena_commit.cc, release and reclamation in
// arena_release.cc, sleep/offload/copies in arena_transfer.cc, the process-wide registry
// in arena_registry.cc.
#include "jax_vmm/arena.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#include "common/format.h"
#include "common/free_ranges.h"
#include "common/math.h"
#include "core/arena_internal.h"
#include "core/arena_registry.h"
#include "jax_vmm/errors.h"

namespace jax_vmm {

std::shared_ptr<Arena> Arena::Create(std::unique_ptr<Driver> driver, size_t reserve_bytes,
                                     const ArenaOptions& options) {
  std::shared_ptr<Arena> arena(new Arena(std::move(driver), reserve_bytes, options));
  internal::RegisterArena(arena.get());
  return arena;
}

namespace {

// JAX_VMM_DEFER_ZERO_READS: whether an arena that does not choose (ArenaOptions) defers
// its zero mapping. Unset or empty: yes (docs/design.md "Zero reads" says what deferring
// saves and why no reader can tell).
bool DeferZeroReadsFromEnv() {
  const char* env = std::getenv("JAX_VMM_DEFER_ZERO_READS");
  if (env == nullptr || *env == '\0') return true;
  const std::string value(env);
  if (value == "1") return true;
  if (value == "0") return false;
  throw InvalidArgument("jax_vmm: JAX_VMM_DEFER_ZERO_READS='" + value +
                        "': expected 1 (defer the zero mapping of unbacked memory until the "
                        "first view) or 0 (map it at once); unset it for the default (1)");
}

}  // namespace

Arena::Arena(std::unique_ptr<Driver> driver, size_t reserve_bytes, const ArenaOptions& options)
    : driver_(std::move(driver)), uid_(NewUid()), creator_pid_(static_cast<long>(getpid())) {
  if (reserve_bytes == 0) {
    throw InvalidArgument("Arena: reserve_bytes must be > 0");
  }
  chunk_bytes_ = driver_->chunk_bytes();
  handle_bytes_ = options.handle_bytes == 0 ? chunk_bytes_ : options.handle_bytes;
  if (handle_bytes_ % chunk_bytes_ != 0) {
    throw InvalidArgument("Arena: handle_bytes=" + std::to_string(options.handle_bytes) +
                          " must be a multiple of chunk_bytes (" + std::to_string(chunk_bytes_) +
                          "); leave it unset (None from Python, 0 in C++) for one allocation per chunk");
  }
  zero_fill_ = options.zero_fill;
  if (reserve_bytes > SIZE_MAX - chunk_bytes_) {
    throw InvalidArgument("Arena(reserve_bytes=" + std::to_string(reserve_bytes) +
                          "): too large for the address space; reserve less");
  }
  reserved_bytes_ = RoundUp(reserve_bytes, chunk_bytes_);
  num_chunks_ = reserved_bytes_ / chunk_bytes_;
  // Reserve first: an impossible size fails here, with the OS's answer, before the
  // 1-byte-per-chunk page tables are allocated.
  const bool defer = options.defer_zero_reads.has_value() ? *options.defer_zero_reads
                                                         : DeferZeroReadsFromEnv();
  zeros_deferred_ = defer && driver_->CanDeferZeroReads();
  try {
    base_ = zeros_deferred_ ? driver_->ReserveDeferringZeros(reserved_bytes_)
                            : driver_->Reserve(reserved_bytes_);
  } catch (const DriverError& e) {
    // A huge chunk_bytes grows a small reserve_bytes: the message says which one to cut.
    const std::string rounded =
        reserved_bytes_ == reserve_bytes
            ? std::string()
            : " (reserve_bytes rounded up to whole chunks of chunk_bytes=" +
                  std::to_string(chunk_bytes_) + ")";
    throw DriverError("Arena(reserve_bytes=" + std::to_string(reserve_bytes) +
                      "): cannot reserve " + std::to_string(reserved_bytes_) +
                      " bytes of address space" + rounded + " on " + driver_->kind() +
                      " device " + std::to_string(driver_->device_ordinal()) + ": " + e.what() +
                      (rounded.empty() ? "; create the arena with a smaller reserve_bytes"
                                       : "; create the arena with a smaller chunk_bytes"));
  }
  try {
    host_page_table_.assign(num_chunks_, 0);
    planned_chunks_.assign(num_chunks_, 0);
    chunk_mapping_.assign(num_chunks_, nullptr);
    device_page_table_ = static_cast<uint8_t*>(driver_->AllocMetadata(num_chunks_));
    driver_->CopyToMetadata(device_page_table_, host_page_table_.data(), num_chunks_);
    const size_t counters = kMaxBuffers * sizeof(unsigned long long);
    device_drop_counters_ = static_cast<unsigned long long*>(driver_->AllocMetadata(counters));
    std::vector<unsigned long long> zeros(kMaxBuffers, 0);
    driver_->CopyToMetadata(device_drop_counters_, zeros.data(), counters);
  } catch (...) {
    if (device_drop_counters_) driver_->FreeMetadata(device_drop_counters_);
    if (device_page_table_) driver_->FreeMetadata(device_page_table_);
    driver_->Unreserve(base_, reserved_bytes_);
    throw;
  }
  free_ranges_[0] = reserved_bytes_;
  stats_.driver_kind = driver_->kind();
  stats_.device_ordinal = driver_->device_ordinal();
  stats_.granularity = driver_->granularity();
  stats_.chunk_bytes = chunk_bytes_;
  stats_.handle_bytes = handle_bytes_;
  stats_.zero_fill = zero_fill_;
  stats_.reserved_bytes = reserved_bytes_;
}

Arena::~Arena() {
  internal::UnregisterArena(this);
  if (InForkedChild()) {
    AbandonInForkedChild();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_worker_ = true;
  }
  cv_->notify_all();
  if (worker_.joinable()) worker_.join();
  // A closed arena waited in Close() and holds no memory: nothing left to wait for (and its
  // device's streams may be gone by now, at exit).
  if (!closed_) {
    try {
      driver_->Synchronize();
    } catch (...) {
      // Destructors never throw; the driver already reported the failure.
    }
  }
  for (auto& [ticket, record] : transfers_) DropTransferImage(*record);
  transfers_.clear();
  DropSleepImage();
  std::vector<Mapping*> all;
  for (auto& [first, m] : mappings_) all.push_back(m.get());
  UnmapGroups(all);     // batched: few zero pieces instead of one restore per allocation
  DetachMappings(all);  // their destructors release (and give the budget its bytes back)
  if (budget_) budget_->Leave(uid_);
  FreeHostCacheLocked();
  if (metadata_pinned_) {
    // A graph may still hold these addresses (see PinMetadataForGraphs): leave them
    // allocated, with every page marked unbacked so a stale replay writes nothing.
    try {
      std::fill(host_page_table_.begin(), host_page_table_.end(), 0);
      driver_->CopyToMetadata(device_page_table_, host_page_table_.data(), num_chunks_);
    } catch (...) {
    }
  } else {
    driver_->FreeMetadata(device_drop_counters_);
    driver_->FreeMetadata(device_page_table_);
  }
  driver_->Unreserve(base_, reserved_bytes_);
}

bool Arena::InForkedChild() const { return static_cast<long>(getpid()) != creator_pid_; }

void Arena::ThrowIfForked(const char* op) const {
  if (!InForkedChild()) return;
  throw ForkedProcess(
      std::string("Arena.") + op + ": this arena (uid " + std::to_string(uid_) +
      ") belongs to process " + std::to_string(creator_pid_) + ", and this is a child (pid " +
      std::to_string(static_cast<long>(getpid())) +
      ") forked from it. The child shares the parent's physical memory (and cannot use its "
      "CUDA context), so it may not commit, release, sleep, close or free anything of it; "
      "dropping the arena in the child gives nothing back. Create a new arena in the child "
      "(or start workers with multiprocessing's 'spawn' method)");
}

// In a forked child: every allocation, mapping, memfd and device object is the parent's
// (host: punching a hole in the shared memfd frees the parent's pages; CUDA: the context
// is unusable here), the reclaimer thread did not survive the fork (its std::thread still
// says joinable: joining it is undefined, destroying it terminates; it may have been
// waiting on cv_, whose destruction would then wait forever), and mu_ may have been held
// by a parent thread that is gone. So: no lock, no driver call, no join; leak it all.
void Arena::AbandonInForkedChild() noexcept {
  cv_.Abandon();
  if (worker_.joinable()) new std::thread(std::move(worker_));        // never joined nor destroyed
  for (auto& [first, m] : mappings_) static_cast<void>(m.release());  // ~Mapping releases
  static_cast<void>(driver_.release());  // ~Driver closes the memfd / CUDA objects
}

void Arena::ThrowIfClosed(const char* op) const {
  if (closed_) {
    throw ArenaClosed(std::string("Arena.") + op +
                      ": the arena is closed (close() released its memory); create a new arena");
  }
}

void Arena::ThrowIfAsleep(const char* op) const {
  if (sleep_) {
    throw ArenaAsleep(std::string("Arena.") + op +
                      ": the arena is asleep (sleep() gave its memory back); call wake() first");
  }
}

Arena::Placement& Arena::PlacementOrThrow(int64_t buffer_id, const char* op) {
  auto it = buffers_.find(buffer_id);
  if (it == buffers_.end()) {
    throw InvalidArgument(std::string(op) + ": no buffer with id " + std::to_string(buffer_id) +
                          " in this arena (was it freed?)");
  }
  return it->second;
}

const Arena::Placement& Arena::PlacementOrThrow(int64_t buffer_id, const char* op) const {
  return const_cast<Arena*>(this)->PlacementOrThrow(buffer_id, op);
}

BufferInfo Arena::Allocate(size_t nbytes, const std::string& name) {
  ThrowIfForked("allocate");
  std::lock_guard<std::mutex> lock(mu_);
  ThrowIfClosed("allocate");
  ReturnUnleasedRanges();
  if (nbytes == 0) throw InvalidArgument("Arena.allocate: a buffer needs at least 1 byte");
  if (static_cast<int64_t>(buffers_.size()) >= kMaxBuffers) {
    throw ReservationFull("Arena.allocate: the arena already holds " + std::to_string(kMaxBuffers) +
                          " buffers, the most it can track; free() unused buffers or "
                          "use another arena");
  }
  const size_t placed = RoundUp(nbytes, chunk_bytes_);
  const uint64_t offset = TakeFirstFit(free_ranges_, placed);
  if (offset == kNoFreeRange) {
    throw ReservationFull(
        "Arena.allocate(" + (name.empty() ? std::string("unnamed buffer") : "'" + name + "'") +
        "): needs " + Bytes(placed) + " of address space but the largest free range of the " +
        Bytes(reserved_bytes_) + " reservation is " + Bytes(LargestRange(free_ranges_)) +
        "; create the arena with a larger reserve_bytes");
  }
  Placement p;
  p.info.offset = offset;
  p.info.id = next_id_++;
  p.info.uid = NewUid();
  p.info.name = name.empty() ? "buffer" + std::to_string(p.info.id) : name;
  p.info.nbytes = nbytes;
  p.info.address = base_ + p.info.offset;
  p.num_chunks = placed / chunk_bytes_;
  p.counter_slot = FreeCounterSlot();
  const unsigned long long zero = 0;
  driver_->CopyToMetadata(device_drop_counters_ + p.counter_slot, &zero, sizeof(zero));
  const BufferInfo info = p.info;
  {
    std::lock_guard<std::mutex> placements(placement_mu_);
    buffers_.emplace(info.id, std::move(p));
  }
  stats_.placed_bytes += placed;
  stats_.num_buffers = static_cast<int64_t>(buffers_.size());
  return info;
}

// Counter slots are recycled: the first one no live buffer uses (there are kMaxBuffers
// slots and Allocate refuses a buffer past kMaxBuffers).
int64_t Arena::FreeCounterSlot() const {
  std::vector<bool> used(kMaxBuffers, false);
  for (const auto& [id, q] : buffers_) used[q.counter_slot] = true;
  return static_cast<int64_t>(std::find(used.begin(), used.end(), false) - used.begin());
}

void Arena::Free(int64_t buffer_id) {
  ThrowIfForked("free");
  std::unique_lock<std::mutex> lock(mu_);
  ThrowIfAsleep("free");
  Placement& p = PlacementOrThrow(buffer_id, "Arena.free");
  const size_t first = ArenaChunk(p, 0);
  DecommitLocked(lock, {ChunkRun{first, p.num_chunks}}, /*wait=*/false);
  // The lock may have been dropped while waiting: look the buffer up again.
  Placement& q = PlacementOrThrow(buffer_id, "Arena.free");
  const size_t placed = q.num_chunks * chunk_bytes_;
  const HeldRange range{q.info.offset, placed};
  const uint64_t uid = q.info.uid;
  {
    std::lock_guard<std::mutex> placements(placement_mu_);
    buffers_.erase(buffer_id);
  }
  stats_.placed_bytes -= placed;
  stats_.num_buffers = static_cast<int64_t>(buffers_.size());
  {
    // A live view still points into the range: keep it out of the free list (it reads
    // zeros now) until ReleaseView sees the last lease go.
    std::lock_guard<std::mutex> views(views_mu_);
    if (live_views_.count(uid) != 0) {
      held_ranges_[uid] = range;
      return;
    }
  }
  GiveRange(free_ranges_, range.offset, range.bytes);
}

std::shared_ptr<ViewLease> Arena::LeaseView(int64_t buffer_id) {
  ThrowIfForked("view");
  std::unique_lock<std::mutex> lock(mu_);
  PlacementOrThrow(buffer_id, "Arena.view");
  // From now on a kernel may read any byte of the arena: nothing may be unmapped behind
  // it later, so finish every deferred release first (parked chunks of a zero-filling
  // arena are zeroed then, after the device wait).
  ReclaimAllLocked(lock, /*zero_parked=*/true);
  // (The wait may have dropped the lock: look the buffer up again.)
  const uint64_t uid = PlacementOrThrow(buffer_id, "Arena.view").info.uid;
  if (zeros_deferred_) {
    // A view's reader may touch any byte: unbacked ones must read zeros from now on.
    // Nothing maps or unmaps in the reservation meanwhile (we hold the lock, and no
    // reclaim or transfer is in flight after the reclaim above).
    WaitWhileBusy(lock);
    driver_->EnableZeroReads(base_);
    zeros_deferred_ = false;
  }
  views_exported_.store(true);
  std::lock_guard<std::mutex> views(views_mu_);
  ++live_views_[uid];
  return std::shared_ptr<ViewLease>(new ViewLease(shared_from_this(), uid));
}

ViewLease::~ViewLease() { arena_->ReleaseView(buffer_uid_); }

void Arena::ReleaseView(uint64_t buffer_uid) noexcept {
  std::lock_guard<std::mutex> views(views_mu_);
  auto it = live_views_.find(buffer_uid);
  if (it == live_views_.end() || --it->second > 0) return;
  live_views_.erase(it);
  auto held = held_ranges_.find(buffer_uid);
  if (held == held_ranges_.end()) return;
  // free_ranges_ belongs to mu_, which a lease must not wait for (it is held across
  // driver calls): hand the range over; the next Allocate puts it back.
  try {
    unleased_.push_back(held->second);
  } catch (...) {
    return;  // out of memory: the range stays held (leaked address space, no harm)
  }
  held_ranges_.erase(held);
}

void Arena::ReturnUnleasedRanges() {
  std::lock_guard<std::mutex> views(views_mu_);
  for (const HeldRange& r : unleased_) GiveRange(free_ranges_, r.offset, r.bytes);
  unleased_.clear();
}

int64_t Arena::LiveViews() const {
  std::lock_guard<std::mutex> views(views_mu_);
  int64_t n = 0;
  for (const auto& [uid, count] : live_views_) n += count;
  return n;
}

int64_t Arena::LiveViews(int64_t buffer_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t uid = PlacementOrThrow(buffer_id, "Arena.live_views").info.uid;
  std::lock_guard<std::mutex> views(views_mu_);
  auto it = live_views_.find(uid);
  return it == live_views_.end() ? 0 : it->second;
}

void CheckRange(const BufferInfo& info, size_t start, size_t stop, const char* op) {
  if (start > stop || stop > info.nbytes) {
    throw InvalidArgument(std::string(op) + "('" + info.name + "'): range [" +
                          std::to_string(start) + ", " + std::to_string(stop) +
                          ") is not inside the buffer [0, " + std::to_string(info.nbytes) +
                          "); expected 0 <= start <= stop <= nbytes");
  }
}

size_t Arena::BackedPrefix(int64_t buffer_id, size_t start, size_t stop) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Placement& p = PlacementOrThrow(buffer_id, "Arena.backed_prefix");
  CheckRange(p.info, start, stop, "Arena.backed_prefix");
  size_t pos = start;
  while (pos < stop) {
    const size_t c = pos / chunk_bytes_;
    if (!host_page_table_[ArenaChunk(p, c)]) break;
    pos = std::min(stop, (c + 1) * chunk_bytes_);
  }
  return pos - start;
}

size_t Arena::ArenaChunk(const Placement& p, size_t buffer_chunk) const {
  return p.info.offset / chunk_bytes_ + buffer_chunk;
}

void Arena::AccountBacked(size_t first, size_t count, int sign) {
  const size_t end = first + count;
  for (auto& [id, p] : buffers_) {
    const size_t p0 = p.info.offset / chunk_bytes_;
    const size_t lo = std::max(first, p0);
    const size_t hi = std::min(end, p0 + p.num_chunks);
    if (hi <= lo) continue;
    const size_t bytes = (hi - lo) * chunk_bytes_;
    p.info.backed_bytes = sign > 0 ? p.info.backed_bytes + bytes : p.info.backed_bytes - bytes;
  }
  const size_t bytes = count * chunk_bytes_;
  stats_.backed_bytes = sign > 0 ? stats_.backed_bytes + bytes : stats_.backed_bytes - bytes;
  stats_.peak_backed_bytes = std::max(stats_.peak_backed_bytes, stats_.backed_bytes);
}

void Arena::PublishPageTable(const std::vector<ChunkRun>& runs) {
  size_t first = num_chunks_, end = 0;
  for (const ChunkRun& run : runs) {
    if (run.count == 0) continue;
    first = std::min(first, run.first);
    end = std::max(end, run.first + run.count);
  }
  if (first >= end) return;
  driver_->CopyToMetadata(device_page_table_ + first, host_page_table_.data() + first, end - first);
}

BufferInfo Arena::Buffer(int64_t buffer_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return PlacementOrThrow(buffer_id, "Arena.buffer").info;
}

std::vector<BufferInfo> Arena::Buffers() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<BufferInfo> out;
  for (const auto& [id, p] : buffers_) out.push_back(p.info);
  return out;
}

ArenaStats Arena::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  ArenaStats s = stats_;
  s.held_bytes = s.retired_bytes = 0;
  // Shared allocations (core/arena_share.cc) are counted once, by their offsets in use.
  std::map<const Physical*, std::vector<const Mapping*>> shared;
  for (const auto& [first, m] : mappings_) {
    if (m->shared) {
      shared[m->physical.get()].push_back(m.get());
      continue;
    }
    s.held_bytes += m->bytes;
    if (m->live == 0 && !m->pins) s.retired_bytes += m->bytes;
  }
  size_t physical_backed = s.backed_bytes;
  s.alias_bytes = s.shared_bytes = 0;
  for (const auto& [physical, group] : shared) {
    s.held_bytes += physical->bytes;
    std::map<size_t, int> users;  // offset of a backed chunk -> addresses backing it
    bool any_live = false;
    for (const Mapping* m : group) {
      any_live |= m->live > 0 || m->pins > 0;
      for (size_t c = 0; c < m->num_chunks; ++c) {
        if (host_page_table_[m->first_chunk + c]) ++users[m->offset + c * chunk_bytes_];
      }
    }
    if (!any_live) s.retired_bytes += physical->bytes;
    for (const auto& [offset, count] : users) {
      s.alias_bytes += static_cast<size_t>(count - 1) * chunk_bytes_;
      if (count > 1) s.shared_bytes += chunk_bytes_;
    }
  }
  physical_backed -= s.alias_bytes;
  s.parked_bytes = s.held_bytes - physical_backed - s.retired_bytes;
  s.views_exported = views_exported_.load();
  s.unbacked_reads_zero = unbacked_reads_zero();
  s.asleep = sleep_ != nullptr;
  s.sleep_image_bytes = SleepImageBytes();
  s.offloaded_bytes = s.pending_transfers = 0;
  for (const auto& [ticket, t] : transfers_) {
    s.offloaded_bytes += TransferHostBytes(*t);
    s.pending_transfers += TransferInFlight(*t) ? 1 : 0;
  }
  s.host_cached_bytes = 0;
  for (const auto& [bytes, block] : host_cache_) s.host_cached_bytes += bytes;
  s.closed = closed_;
  std::lock_guard<std::mutex> views(views_mu_);
  for (const auto& [uid, count] : live_views_) s.live_views += count;
  for (const auto& [uid, range] : held_ranges_) s.held_range_bytes += range.bytes;
  return s;
}

void Arena::Close() {
  if (closed_) return;  // nothing left to release: also fine in a forked child
  ThrowIfForked("close");
  std::unique_lock<std::mutex> lock(mu_);
  if (closed_) return;
  WaitWhileBusy(lock);
  for (auto& [ticket, record] : transfers_) DropTransferImage(*record);
  transfers_.clear();
  DropSleepImage();
  if (!mappings_.empty()) driver_->Synchronize();  // nothing in flight touches what goes
  ReleaseAllMemory(lock);
  closed_ = true;
  if (budget_) budget_->Leave(uid_);
  FreeHostCacheLocked();
  cv_->notify_all();
}

void Arena::JoinBudget(std::shared_ptr<MemoryBudget> budget, const std::string& label) {
  ThrowIfForked("join_budget");
  if (!budget) throw InvalidArgument("Arena.join_budget: no budget given");
  std::unique_lock<std::mutex> lock(mu_);
  ThrowIfClosed("join_budget");
  const std::string where =
      std::string(driver_->kind()) + " device " + std::to_string(driver_->device_ordinal());
  const std::string budget_where =
      budget->driver_kind() + " device " + std::to_string(budget->device_ordinal());
  if (where != budget_where) {
    throw InvalidArgument("Arena(budget=...): the budget is on " + budget_where +
                          " and this arena on " + where +
                          "; a budget caps one device: create one per device");
  }
  if (budget_) {
    throw InvalidArgument("Arena(budget=...): the arena already has a budget");
  }
  if (!mappings_.empty() || sleep_ || !transfers_.empty()) {
    throw InvalidArgument(
        "Arena(budget=...): the arena holds memory already; give it its "
        "budget when it is created");
  }
  if (budget->cap_bytes() < chunk_bytes_) {
    throw InvalidArgument(
        "Arena(budget=...): the budget of " + std::to_string(budget->cap_bytes()) +
        " bytes is smaller than one chunk of this arena (" + std::to_string(chunk_bytes_) +
        " bytes), the least it can commit; create a larger budget or use a "
        "smaller chunk_bytes");
  }
  budget->Join(shared_from_this(), label);
  budget_ = std::move(budget);
}

std::shared_ptr<MemoryBudget> Arena::budget() const {
  std::lock_guard<std::mutex> lock(mu_);
  return budget_;
}

size_t Arena::ReclaimForBudget() {
  if (InForkedChild()) return 0;
  std::unique_lock<std::mutex> lock(mu_);
  if (closed_ || (retired_.empty() && reclaiming_ == 0)) return 0;
  return ReclaimAllLocked(lock, /*zero_parked=*/false, /*host_work_waited=*/false);
}

bool Arena::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

bool Arena::asleep() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sleep_ != nullptr;
}

uint64_t Arena::DropCount(int64_t buffer_id) const {
  ThrowIfForked("drop_count");
  std::lock_guard<std::mutex> lock(mu_);
  const Placement& p = PlacementOrThrow(buffer_id, "Arena.drop_count");
  unsigned long long value = 0;
  driver_->CopyFromMetadata(&value, device_drop_counters_ + p.counter_slot, sizeof(value));
  return value;
}

void Arena::ResetDropCount(int64_t buffer_id) {
  ThrowIfForked("reset_drop_count");
  std::lock_guard<std::mutex> lock(mu_);
  const Placement& p = PlacementOrThrow(buffer_id, "Arena.reset_drop_count");
  const unsigned long long zero = 0;
  driver_->CopyToMetadata(device_drop_counters_ + p.counter_slot, &zero, sizeof(zero));
}

void Arena::FillRef(const Placement& p, BufferRef* out) const {
  out->buffer_base = p.info.address;
  out->buffer_bytes = p.info.nbytes;
  out->arena_base = base_;
  out->chunk_bytes = chunk_bytes_;
  out->page_table = device_page_table_;
  out->drop_counter = device_drop_counters_ + p.counter_slot;
  out->buffer_id = p.info.id;
  out->buffer_uid = p.info.uid;
  out->arena_uid = uid_;
  out->device_ordinal = driver_->device_ordinal();
  out->driver_kind = driver_->kind();
}

bool Arena::FindBufferLocked(uintptr_t ptr, size_t bytes, BufferRef* out) const {
  std::lock_guard<std::mutex> lock(placement_mu_);
  if (closed_ || !Holds(ptr, bytes)) return false;
  for (const auto& [id, p] : buffers_) {
    const uintptr_t b = p.info.address;
    if (ptr >= b && ptr - b <= p.info.nbytes && bytes <= p.info.nbytes - (ptr - b)) {
      FillRef(p, out);
      return true;
    }
  }
  return false;
}

bool Arena::FindBufferByUidLocked(uint64_t buffer_uid, BufferRef* out, std::string* name,
                                  bool* closed) const {
  std::lock_guard<std::mutex> lock(placement_mu_);
  for (const auto& [id, p] : buffers_) {
    if (p.info.uid == buffer_uid) {
      FillRef(p, out);
      if (name != nullptr) *name = p.info.name;
      *closed = closed_;
      return true;
    }
  }
  return false;
}

}  // namespace jax_vmm
