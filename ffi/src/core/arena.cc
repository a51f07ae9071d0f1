// Arena: placement of buffers, decommit, close, queries (see jax_vmm/arena.h). The
// commit path is in arena_commit.cc, the process-wide registry in arena_registry.cc.
#include "jax_vmm/arena.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>

#include "common/format.h"
#include "common/math.h"
#include "core/arena_internal.h"
#include "core/arena_registry.h"
#include "jax_vmm/errors.h"

namespace jax_vmm {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

std::shared_ptr<Arena> Arena::Create(std::unique_ptr<Driver> driver, size_t reserve_bytes) {
  std::shared_ptr<Arena> arena(new Arena(std::move(driver), reserve_bytes));
  internal::RegisterArena(arena.get());
  return arena;
}

Arena::Arena(std::unique_ptr<Driver> driver, size_t reserve_bytes)
    : driver_(std::move(driver)), uid_(NewUid()) {
  if (reserve_bytes == 0) {
    throw InvalidArgument("Arena: reserve_bytes must be > 0");
  }
  chunk_bytes_ = driver_->chunk_bytes();
  if (reserve_bytes > SIZE_MAX - chunk_bytes_) {
    throw InvalidArgument("Arena(reserve_bytes=" + std::to_string(reserve_bytes) +
                          "): too large for the address space; reserve less");
  }
  reserved_bytes_ = RoundUp(reserve_bytes, chunk_bytes_);
  num_chunks_ = reserved_bytes_ / chunk_bytes_;
  // Reserve first: an impossible size fails here, with the OS's answer, before the
  // 1-byte-per-chunk page tables are allocated.
  try {
    base_ = driver_->Reserve(reserved_bytes_);
  } catch (const DriverError& e) {
    throw DriverError("Arena(reserve_bytes=" + std::to_string(reserve_bytes) +
                      "): cannot reserve " + std::to_string(reserved_bytes_) +
                      " bytes of address space on " + driver_->kind() + " device " +
                      std::to_string(driver_->device_ordinal()) + ": " + e.what() +
                      "; create the arena with a smaller reserve_bytes");
  }
  try {
    host_page_table_.assign(num_chunks_, 0);
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
  stats_.reserved_bytes = reserved_bytes_;
}

Arena::~Arena() {
  internal::UnregisterArena(this);
  try {
    driver_->Synchronize();
  } catch (...) {
    // Destructors never throw; the driver already reported the failure.
  }
  buffers_.clear();  // Chunk destructors unmap and release
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

void Arena::ThrowIfClosed(const char* op) const {
  if (closed_) {
    throw ArenaClosed(std::string("Arena.") + op +
                      ": the arena is closed (close() released its memory); create a new arena");
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
  Placement p;
  p.info.offset = TakeFreeRange(placed, name);
  p.info.id = next_id_++;
  p.info.uid = NewUid();
  p.info.name = name.empty() ? "buffer" + std::to_string(p.info.id) : name;
  p.info.nbytes = nbytes;
  p.info.address = base_ + p.info.offset;
  p.chunks.resize(placed / chunk_bytes_);
  p.counter_slot = FreeCounterSlot();
  const unsigned long long zero = 0;
  driver_->CopyToMetadata(device_drop_counters_ + p.counter_slot, &zero, sizeof(zero));
  const BufferInfo info = p.info;
  buffers_.emplace(info.id, std::move(p));
  stats_.placed_bytes += placed;
  stats_.num_buffers = static_cast<int64_t>(buffers_.size());
  return info;
}

// First fit: the offset of a free range of `placed` bytes, now taken.
size_t Arena::TakeFreeRange(size_t placed, const std::string& name) {
  auto fit = std::find_if(free_ranges_.begin(), free_ranges_.end(),
                          [&](const auto& r) { return r.second >= placed; });
  if (fit == free_ranges_.end()) {
    size_t largest = 0;
    for (const auto& r : free_ranges_) largest = std::max(largest, r.second);
    throw ReservationFull(
        "Arena.allocate(" + (name.empty() ? std::string("unnamed buffer") : "'" + name + "'") +
        "): needs " + Bytes(placed) + " of address space but the largest free range of the " +
        Bytes(reserved_bytes_) + " reservation is " + Bytes(largest) +
        "; create the arena with a larger reserve_bytes");
  }
  const size_t offset = fit->first;
  const size_t left = fit->second - placed;
  free_ranges_.erase(fit);
  if (left > 0) free_ranges_[offset + placed] = left;
  return offset;
}

// Gives [offset, offset + bytes) back, coalesced with its neighbours so that large
// buffers can be placed again.
void Arena::ReturnFreeRange(size_t offset, size_t bytes) {
  auto next = free_ranges_.lower_bound(offset);
  if (next != free_ranges_.end() && next->first == offset + bytes) {
    bytes += next->second;
    next = free_ranges_.erase(next);
  }
  if (next != free_ranges_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      bytes += prev->second;
      free_ranges_.erase(prev);
    }
  }
  free_ranges_[offset] = bytes;
}

// Counter slots are recycled: the first one no live buffer uses (there are kMaxBuffers
// slots and Allocate refuses a buffer past kMaxBuffers).
int64_t Arena::FreeCounterSlot() const {
  std::vector<bool> used(kMaxBuffers, false);
  for (const auto& [id, q] : buffers_) used[q.counter_slot] = true;
  return static_cast<int64_t>(std::find(used.begin(), used.end(), false) - used.begin());
}

void Arena::Free(int64_t buffer_id) {
  std::lock_guard<std::mutex> lock(mu_);
  Placement& p = PlacementOrThrow(buffer_id, "Arena.free");
  DecommitLocked(p, 0, p.chunks.size());
  const size_t placed = p.chunks.size() * chunk_bytes_;
  const HeldRange range{p.info.offset, placed};
  const uint64_t uid = p.info.uid;
  buffers_.erase(buffer_id);
  stats_.placed_bytes -= placed;
  stats_.num_buffers = static_cast<int64_t>(buffers_.size());
  {
    // A live view still points into the range: keep it out of the free list (it reads
    // zeros now) until ReleaseView sees the last lease go.
    std::lock_guard<std::mutex> views(views_mu_);
    if (live_views_.count(uid) != 0) {
      retired_[uid] = range;
      return;
    }
  }
  ReturnFreeRange(range.offset, range.bytes);
}

std::shared_ptr<ViewLease> Arena::LeaseView(int64_t buffer_id) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t uid = PlacementOrThrow(buffer_id, "Arena.view").info.uid;
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
  auto retired = retired_.find(buffer_uid);
  if (retired == retired_.end()) return;
  // free_ranges_ belongs to mu_, which a lease must not wait for (it is held across
  // driver calls): hand the range over; the next Allocate puts it back.
  try {
    unleased_.push_back(retired->second);
  } catch (...) {
    return;  // out of memory: the range stays retired (leaked address space, no harm)
  }
  retired_.erase(retired);
}

void Arena::ReturnUnleasedRanges() {
  std::lock_guard<std::mutex> views(views_mu_);
  for (const HeldRange& r : unleased_) ReturnFreeRange(r.offset, r.bytes);
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

size_t Arena::Commit(int64_t buffer_id, size_t start, size_t stop) {
  return CommitRanges({Range{buffer_id, start, stop}});
}

size_t Arena::BackedPrefix(int64_t buffer_id, size_t start, size_t stop) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Placement& p = PlacementOrThrow(buffer_id, "Arena.backed_prefix");
  CheckRange(p.info, start, stop, "Arena.backed_prefix");
  size_t pos = start;
  while (pos < stop) {
    const size_t c = pos / chunk_bytes_;
    if (!p.chunks[c]) break;
    pos = std::min(stop, (c + 1) * chunk_bytes_);
  }
  return pos - start;
}

size_t Arena::Decommit(int64_t buffer_id, size_t start, size_t stop) {
  std::lock_guard<std::mutex> lock(mu_);
  ThrowIfClosed("decommit");
  Placement& p = PlacementOrThrow(buffer_id, "Buffer.decommit");
  CheckRange(p.info, start, stop, "Buffer.decommit");
  if (start == stop) return 0;
  // Inward rounding: never drop a chunk that still holds bytes outside [start, stop),
  // except the buffer's own tail, which belongs to no one else.
  const size_t first = (start + chunk_bytes_ - 1) / chunk_bytes_;
  const size_t end = stop == p.info.nbytes ? p.chunks.size() : stop / chunk_bytes_;
  if (first >= end) return 0;
  return DecommitLocked(p, first, end);
}

size_t Arena::DecommitLocked(Placement& p, size_t first, size_t end) {
  const auto t0 = std::chrono::steady_clock::now();
  const size_t arena_chunk0 = p.info.offset / chunk_bytes_;
  size_t removed = 0;
  for (size_t c = first; c < end; ++c) {
    if (p.chunks[c]) {
      host_page_table_[arena_chunk0 + c] = 0;
      ++removed;
    }
  }
  if (removed == 0) return 0;
  // Order matters for device code: first tell kernels the chunks are gone, then wait for
  // work already in flight, then unmap. A kernel launched after this call sees the
  // cleared table and drops its writes instead of faulting.
  PublishPageTable(arena_chunk0 + first, end - first);
  driver_->Synchronize();
  // Unmap each contiguous run of backed chunks with one call, then release them.
  for (size_t c = first; c < end;) {
    if (!p.chunks[c]) {
      ++c;
      continue;
    }
    const size_t run_begin = c;
    while (c < end && p.chunks[c]) p.chunks[c++]->mapped = false;
    driver_->UnmapRun(p.info.address + run_begin * chunk_bytes_, c - run_begin);
  }
  for (size_t c = first; c < end; ++c) p.chunks[c].reset();
  const size_t bytes = removed * chunk_bytes_;
  p.info.backed_bytes -= bytes;
  stats_.backed_bytes -= bytes;
  stats_.chunks_released += static_cast<int64_t>(removed);
  stats_.decommit_calls += 1;
  stats_.decommit_seconds += SecondsSince(t0);
  return bytes;
}

size_t Arena::ArenaChunk(const Placement& p, size_t buffer_chunk) const {
  return p.info.offset / chunk_bytes_ + buffer_chunk;
}

void Arena::PublishPageTable(size_t first_chunk_index, size_t count) {
  if (count == 0) return;
  driver_->CopyToMetadata(device_page_table_ + first_chunk_index,
                          host_page_table_.data() + first_chunk_index, count);
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
  s.closed = closed_;
  std::lock_guard<std::mutex> views(views_mu_);
  for (const auto& [uid, count] : live_views_) s.live_views += count;
  for (const auto& [uid, range] : retired_) s.retired_bytes += range.bytes;
  return s;
}

void Arena::Close() {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return;
  for (auto& [id, p] : buffers_) DecommitLocked(p, 0, p.chunks.size());
  closed_ = true;
}

bool Arena::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

uint64_t Arena::DropCount(int64_t buffer_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Placement& p = PlacementOrThrow(buffer_id, "Arena.drop_count");
  unsigned long long value = 0;
  driver_->CopyFromMetadata(&value, device_drop_counters_ + p.counter_slot, sizeof(value));
  return value;
}

void Arena::ResetDropCount(int64_t buffer_id) {
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
  std::lock_guard<std::mutex> lock(mu_);
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
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, p] : buffers_) {
    if (p.info.uid == buffer_uid) {
      FillRef(p, out);
      *name = p.info.name;
      *closed = closed_;
      return true;
    }
  }
  return false;
}

}  // namespace jax_vmm
