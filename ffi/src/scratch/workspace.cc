#include "scratch/workspace.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "common/math.h"

namespace jax_vmm::scratch::internal {

Workspace::Workspace(int device, uintptr_t stream, int64_t generation,
                     const DevicePlatform& platform)
    : platform_(platform) {
  stats_.device = device;
  stats_.stream = stream;
  stats_.generation = generation;
}

std::string Workspace::GrowTo(size_t bytes, ScratchMode requested, size_t reserve_bytes,
                              const GrowthPolicy& policy) {
  if (bytes == 0) bytes = 1;
  // Far beyond any device, and rounding it up to a chunk or granule would wrap to 0: a
  // size_t made from a negative int64 lands here.
  constexpr size_t kMaxBytes = size_t{1} << 62;
  if (bytes > kMaxBytes) {
    return "jax_vmm scratch: a workspace of " + std::to_string(bytes) + " bytes on " +
           DeviceName(stats_.device) + " is more than any device holds (at most 2^62); " +
           "ask for less (was the size a negative number converted to size_t?)";
  }
  if (bytes <= stats_.capacity) return "";
  if (stats_.mode == ScratchMode::kDefault) {
    std::string err = ChooseMode(requested);
    if (!err.empty()) return err;
  }
  std::string err =
      driver_ != nullptr ? GrowRange(bytes, reserve_bytes, policy) : GrowPlain(bytes, policy);
  if (err.empty()) stats_.growth_events += 1;
  return err;
}

std::string Workspace::ChooseMode(ScratchMode requested) {
  std::string why;
  driver_ = platform_.make_driver(stats_.device, &why);
  if (requested == ScratchMode::kGrowInPlace && driver_ == nullptr) {
    return "jax_vmm scratch: grow-in-place mode was selected but device " +
           DeviceName(stats_.device) + " cannot provide virtual memory (" + why +
           "); select the 'retire' mode (jax_vmm.ops.scratch.set_scratch_mode('retire')) or "
           "'default', which falls back to it";
  }
  if (requested == ScratchMode::kRetire || driver_ == nullptr) {
    stats_.mode = ScratchMode::kRetire;
    if (requested == ScratchMode::kDefault) stats_.fallback_reason = why;
  } else {
    stats_.mode = ScratchMode::kGrowInPlace;
  }
  stats_.vmm = driver_ != nullptr;
  return "";
}

// Maps [range.mapped, want_chunks * chunk) of `range` as one new allocation (one create,
// one MapRun, one SetAccess); all-or-nothing.
std::string Workspace::MapChunks(Range& range, size_t want_chunks) {
  const size_t want = want_chunks * driver_->chunk_bytes();
  if (want <= range.mapped) return "";
  const size_t bytes = want - range.mapped;
  const uintptr_t va = range.va + range.mapped;
  PhysicalHandle fresh = 0;
  bool created = false, mapped = false;
  try {
    driver_->CheckRoomFor(bytes);
    fresh = driver_->Create(bytes);
    created = true;
    const MapPiece piece{fresh, 0, bytes};
    driver_->MapRun(va, &piece, 1);
    mapped = true;
    driver_->SetAccess(va, bytes);
  } catch (const std::exception& e) {
    if (mapped) driver_->UnmapRun(va, &bytes, 1);
    if (created) driver_->Release(fresh);
    return std::string("jax_vmm scratch: growing the workspace on ") + DeviceName(stats_.device) +
           " to " + std::to_string(want) + " bytes failed: " + e.what();
  }
  range.pieces.push_back({fresh, bytes});
  range.mapped = want;
  return "";
}

// Gives the physical memory back. The virtual range stays reserved (reading zeros,
// writes fault), so a graph that still points here faults instead of silently writing
// into whatever would reuse the addresses.
void Workspace::ReleaseChunks(Range& range) noexcept {
  std::vector<size_t> sizes;
  for (const Piece& p : range.pieces) sizes.push_back(p.bytes);
  driver_->UnmapRun(range.va, sizes.data(), sizes.size());
  for (const Piece& p : range.pieces) driver_->Release(p.handle);
  range.pieces.clear();
  range.mapped = 0;
}

std::string Workspace::NewRange(size_t reserve, size_t want_chunks, Range* out) {
  try {
    out->va = driver_->Reserve(reserve);
    out->reserved = reserve;
  } catch (const std::exception& e) {
    return "jax_vmm scratch: reserving " + std::to_string(reserve) +
           " bytes of virtual address space on " + DeviceName(stats_.device) +
           " failed: " + e.what() +
           "; ask for less (jax_vmm.ops.scratch.reserve, set_reserve_bytes)";
  }
  std::string err = MapChunks(*out, want_chunks);
  if (!err.empty()) {
    driver_->Unreserve(out->va, out->reserved);
    *out = Range{};
  }
  return err;
}

// Grow in place (map at the tail) where the mode, the policy and the reservation allow
// it; else move to a new range (retire mode: exactly what is needed).
std::string Workspace::GrowRange(size_t bytes, size_t reserve_bytes, const GrowthPolicy& policy) {
  const size_t chunk = driver_->chunk_bytes();
  const size_t need = RoundUp(bytes, chunk);
  const bool in_place = stats_.mode == ScratchMode::kGrowInPlace && policy.GrowsInPlace();
  if (in_place && current_.va != 0 && need <= current_.reserved) {
    std::string err = MapChunks(current_, need / chunk);
    if (!err.empty()) return err;
  } else {
    const size_t reserve =
        in_place ? RoundUp(std::max<size_t>({reserve_bytes, need, current_.reserved * 2}), chunk)
                 : need;
    Range next;
    std::string err = NewRange(reserve, need / chunk, &next);
    if (!err.empty()) return err;
    if (current_.va != 0) {
      outgrown_.push_back(std::move(current_));
      Range& old = outgrown_.back();
      Outgrow(OutgrownBlock{stats_.device, old.mapped,
                            [this, &old] { ReleaseChunks(old); }},
              policy);
    }
    current_ = std::move(next);
  }
  stats_.address = current_.va;
  stats_.capacity = current_.mapped;
  stats_.reserved_bytes = current_.reserved;
  stats_.backed_bytes = stats_.capacity + stats_.retired_bytes;
  return "";
}

// Retire mode without VMM: plain device allocations.
std::string Workspace::GrowPlain(size_t bytes, const GrowthPolicy& policy) {
  const size_t need = RoundUp(bytes, platform_.alloc_granularity);
  std::string err;
  void* block = platform_.alloc(stats_.device, need, &err);
  if (block == nullptr) {
    return "jax_vmm scratch: allocating a " + std::to_string(need) + "-byte workspace block on " +
           DeviceName(stats_.device) + " failed: " + err;
  }
  if (stats_.address != 0) {
    void* old = ptr();
    Outgrow(OutgrownBlock{stats_.device, stats_.capacity,
                          [this, old] { platform_.free(stats_.device, old); }},
            policy);
  }
  stats_.address = reinterpret_cast<uintptr_t>(block);
  stats_.capacity = need;
  stats_.reserved_bytes = need;
  stats_.backed_bytes = stats_.capacity + stats_.retired_bytes;
  return "";
}

void Workspace::Outgrow(const OutgrownBlock& block, const GrowthPolicy& policy) {
  if (policy.Retire(block)) {
    stats_.retired_blocks += 1;
    stats_.retired_bytes += block.bytes;
  } else {
    stats_.freed_blocks += 1;
  }
}

}  // namespace jax_vmm::scratch::internal
