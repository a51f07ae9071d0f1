#include "jax_vmm/arena.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <unordered_set>
#include <utility>

#include "jax_vmm/errors.h"

namespace jax_vmm {
namespace {

size_t RoundUp(size_t x, size_t m) { return (x + m - 1) / m * m; }

std::string Bytes(size_t n) { return std::to_string(n) + " bytes"; }

// Every live arena, so FFI handlers can map a raw pointer back to its buffer.
std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}
std::vector<Arena*>& Registry() {
  static std::vector<Arena*> arenas;
  return arenas;
}

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

// One committed chunk: owns its physical handle and, once mapped, its mapping. The
// destructor undoes both, so a half-built commit unwinds itself on any exception.
struct Arena::Chunk {
  Chunk(Driver* d, uintptr_t address) : driver(d), va(address) { handle = driver->Create(); }
  ~Chunk() {
    if (mapped) driver->Unmap(va);
    driver->Release(handle);
  }
  Chunk(const Chunk&) = delete;
  Chunk& operator=(const Chunk&) = delete;

  Driver* driver;
  uintptr_t va;
  PhysicalHandle handle = 0;
  bool mapped = false;
};

std::shared_ptr<Arena> Arena::Create(std::unique_ptr<Driver> driver, size_t reserve_bytes) {
  std::shared_ptr<Arena> arena(new Arena(std::move(driver), reserve_bytes));
  std::lock_guard<std::mutex> lock(RegistryMutex());
  Registry().push_back(arena.get());
  return arena;
}

Arena::Arena(std::unique_ptr<Driver> driver, size_t reserve_bytes) : driver_(std::move(driver)) {
  if (reserve_bytes == 0) {
    throw InvalidArgument("Arena: reserve_bytes must be > 0");
  }
  chunk_bytes_ = driver_->chunk_bytes();
  reserved_bytes_ = RoundUp(reserve_bytes, chunk_bytes_);
  num_chunks_ = reserved_bytes_ / chunk_bytes_;
  // Reserve first: an impossible size fails here, with the OS's answer, before the
  // 1-byte-per-chunk page tables are allocated.
  base_ = driver_->Reserve(reserved_bytes_);
  try {
    host_page_table_.assign(num_chunks_, 0);
    device_page_table_ = static_cast<uint8_t*>(driver_->AllocMetadata(num_chunks_));
    driver_->CopyToMetadata(device_page_table_, host_page_table_.data(), num_chunks_);
    const size_t counters = kMaxBuffers * sizeof(unsigned long long);
    device_drop_counters_ = static_cast<unsigned long long*>(driver_->AllocMetadata(counters));
    std::vector<unsigned long long> zeros(kMaxBuffers, 0);
    driver_->CopyToMetadata(device_drop_counters_, zeros.data(), counters);
  } catch (...) {
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
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    auto& r = Registry();
    r.erase(std::remove(r.begin(), r.end(), this), r.end());
  }
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
  if (nbytes == 0) throw InvalidArgument("Arena.allocate: a buffer needs at least 1 byte");
  if (static_cast<int64_t>(buffers_.size()) >= kMaxBuffers) {
    throw ReservationFull("Arena.allocate: the arena already holds " + std::to_string(kMaxBuffers) +
                          " buffers, the most it can track; free() unused buffers or "
                          "use another arena");
  }
  const size_t placed = RoundUp(nbytes, chunk_bytes_);
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

  Placement p;
  p.info.id = next_id_++;
  p.info.name = name.empty() ? "buffer" + std::to_string(p.info.id) : name;
  p.info.offset = offset;
  p.info.nbytes = nbytes;
  p.info.address = base_ + offset;
  p.chunks.resize(placed / chunk_bytes_);
  // Counter slots are recycled; find one no live buffer uses.
  std::vector<bool> used(kMaxBuffers, false);
  for (const auto& [id, q] : buffers_) used[q.counter_slot] = true;
  p.counter_slot = static_cast<int64_t>(std::find(used.begin(), used.end(), false) - used.begin());
  const unsigned long long zero = 0;
  driver_->CopyToMetadata(device_drop_counters_ + p.counter_slot, &zero, sizeof(zero));
  const BufferInfo info = p.info;
  buffers_.emplace(info.id, std::move(p));
  stats_.placed_bytes += placed;
  stats_.num_buffers = static_cast<int64_t>(buffers_.size());
  return info;
}

void Arena::Free(int64_t buffer_id) {
  std::lock_guard<std::mutex> lock(mu_);
  Placement& p = PlacementOrThrow(buffer_id, "Arena.free");
  DecommitLocked(p, 0, p.chunks.size());
  const size_t placed = p.chunks.size() * chunk_bytes_;
  size_t offset = p.info.offset;
  size_t bytes = placed;
  buffers_.erase(buffer_id);
  // Coalesce with neighbours so large buffers can be placed again.
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
  stats_.placed_bytes -= placed;
  stats_.num_buffers = static_cast<int64_t>(buffers_.size());
}

static void CheckRange(const BufferInfo& info, size_t start, size_t stop, const char* op) {
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

size_t Arena::CommitRanges(const std::vector<Range>& ranges) {
  std::lock_guard<std::mutex> lock(mu_);
  ThrowIfClosed("commit");
  // Validate everything before the first driver call.
  for (const Range& r : ranges) {
    Placement& p = PlacementOrThrow(r.buffer_id, "Buffer.commit");
    CheckRange(p.info, r.start, r.stop, "Buffer.commit");
  }
  const auto t0 = std::chrono::steady_clock::now();

  // Build every missing chunk first; nothing enters the page tables until all driver
  // calls succeeded, so on any exception `pending` unwinds (unmap + release) and the
  // arena is exactly as before.
  struct Pending {
    Placement* placement;
    size_t chunk_index;
    std::unique_ptr<Chunk> chunk;
  };
  std::vector<Pending> pending;
  std::unordered_set<size_t> pending_global;       // arena-wide chunk indexes in `pending`
  std::vector<std::pair<size_t, size_t>> touched;  // arena-wide [first, end) per range
  int64_t set_access_calls = 0;
  std::string names;
  // Mapping a chunk replaces the zero mapping at its address. A kernel still reading
  // those zeros (a full-array op over the cache) would fault mid-swap, so wait for
  // in-flight device work first, but only when this call really maps something.
  // Also what the commit asks for, for an out-of-memory message: missing chunks (counted
  // once when ranges overlap) and the buffers they belong to.
  std::unordered_set<size_t> missing;
  for (const Range& r : ranges) {
    if (r.start == r.stop) continue;
    const Placement& p = buffers_.at(r.buffer_id);
    const size_t chunk0 = p.info.offset / chunk_bytes_;
    bool any = false;
    for (size_t c = r.start / chunk_bytes_; c < (r.stop + chunk_bytes_ - 1) / chunk_bytes_; ++c) {
      if (!p.chunks[c] && missing.insert(chunk0 + c).second) any = true;
    }
    if (any && names.find("'" + p.info.name + "'") == std::string::npos) {
      names += (names.empty() ? "'" : ", '") + p.info.name + "'";
    }
  }
  if (missing.empty()) return 0;
  const size_t asked = missing.size() * chunk_bytes_;
  driver_->Synchronize();
  // Undo a failed commit: the device page table must say "unbacked" again *before* the
  // chunks are unmapped (a kernel must never see 1 for a chunk that is gone).
  auto unwind = [&]() noexcept {
    for (const Pending& q : pending) {
      host_page_table_[q.placement->info.offset / chunk_bytes_ + q.chunk_index] = 0;
    }
    for (const auto& [first, end] : touched) {
      try {
        PublishPageTable(first, end - first);
      } catch (...) {
        // The table copy only fails when the device is already broken.
      }
    }
    if (debug_skip_rollback_) {
      for (Pending& q : pending) q.chunk.release();  // TEST ONLY: leak, mapped
    }
    pending.clear();
    ++stats_.failed_commits;
  };
  try {
    for (const Range& r : ranges) {
      if (r.start == r.stop) continue;
      Placement& p = buffers_.at(r.buffer_id);
      const size_t first = r.start / chunk_bytes_;
      const size_t end = (r.stop + chunk_bytes_ - 1) / chunk_bytes_;
      const size_t chunk0 = p.info.offset / chunk_bytes_;
      touched.emplace_back(chunk0 + first, chunk0 + end);
      size_t c = first;
      while (c < end) {
        // Skip chunks already backed, or already pending from an overlapping range.
        auto is_pending = [&](size_t i) {
          return !pending_global.empty() && pending_global.count(chunk0 + i) > 0;
        };
        if (p.chunks[c] || is_pending(c)) {
          ++c;
          continue;
        }
        const size_t run_begin = c;
        const size_t run_first_pending = pending.size();
        for (; c < end && !p.chunks[c] && !is_pending(c); ++c) {
          pending.push_back({&p, c, nullptr});
          pending.back().chunk =
              std::make_unique<Chunk>(driver_.get(), p.info.address + c * chunk_bytes_);
          pending_global.insert(chunk0 + c);
        }
        // One map call per run (all-or-nothing), so the driver can batch its work.
        std::vector<PhysicalHandle> handles;
        for (size_t i = run_first_pending; i < pending.size(); ++i) {
          handles.push_back(pending[i].chunk->handle);
        }
        driver_->MapRun(p.info.address + run_begin * chunk_bytes_, handles.data(), handles.size());
        for (size_t i = run_first_pending; i < pending.size(); ++i) {
          pending[i].chunk->mapped = true;
        }
        // One access call per contiguous run: it dominates the driver cost.
        driver_->SetAccess(p.info.address + run_begin * chunk_bytes_,
                           (c - run_begin) * chunk_bytes_);
        ++set_access_calls;
      }
    }
    for (const Pending& q : pending) {
      host_page_table_[q.placement->info.offset / chunk_bytes_ + q.chunk_index] = 1;
    }
    for (const auto& [first, end] : touched) PublishPageTable(first, end - first);
  } catch (const OutOfMemory& e) {
    const size_t got = pending.empty() ? 0 : (pending.size() - 1) * chunk_bytes_;
    unwind();
    const size_t free_bytes = driver_->mem_info().free_bytes;
    throw OutOfMemory("commit of buffer(s) " + names + ": out of physical memory on " +
                          driver_->kind() + " device " + std::to_string(driver_->device_ordinal()) +
                          ": asked for " + Bytes(asked) + " (chunks of " + Bytes(chunk_bytes_) +
                          "), failed after " + Bytes(got) + "; " + Bytes(free_bytes) +
                          " free. Nothing was committed. Driver said: " + e.what(),
                      asked, free_bytes);
  } catch (...) {
    unwind();
    throw;
  }
  if (pending.empty()) return 0;
  for (Pending& q : pending) {
    q.placement->chunks[q.chunk_index] = std::move(q.chunk);
    q.placement->info.backed_bytes += chunk_bytes_;
  }
  const size_t added = pending.size() * chunk_bytes_;
  stats_.backed_bytes += added;
  stats_.peak_backed_bytes = std::max(stats_.peak_backed_bytes, stats_.backed_bytes);
  stats_.chunks_created += static_cast<int64_t>(pending.size());
  stats_.set_access_calls += set_access_calls;
  stats_.commit_calls += 1;
  stats_.commit_seconds += SecondsSince(t0);
  return added;
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

bool Arena::FindBufferLocked(uintptr_t ptr, size_t bytes, BufferRef* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_ || ptr < base_ || ptr + bytes > base_ + reserved_bytes_) return false;
  for (const auto& [id, p] : buffers_) {
    const uintptr_t b = p.info.address;
    if (ptr >= b && ptr + bytes <= b + p.info.nbytes) {
      out->buffer_base = b;
      out->buffer_bytes = p.info.nbytes;
      out->arena_base = base_;
      out->chunk_bytes = chunk_bytes_;
      out->page_table = device_page_table_;
      out->drop_counter = device_drop_counters_ + p.counter_slot;
      out->buffer_id = id;
      out->device_ordinal = driver_->device_ordinal();
      out->driver_kind = driver_->kind();
      return true;
    }
  }
  return false;
}

bool FindArenaBuffer(uintptr_t ptr, size_t bytes, BufferRef* out, bool pin_metadata) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  for (const Arena* arena : Registry()) {
    if (arena->FindBufferLocked(ptr, bytes, out)) {
      if (pin_metadata) arena->PinMetadataForGraphs();
      return true;
    }
  }
  return false;
}

}  // namespace jax_vmm
