#include "drivers/cuda/zero_layout.h"

#include <algorithm>
#include <string>

#include "common/format.h"
#include "common/math.h"
#include "jax_vmm/errors.h"

namespace jax_vmm::cuda {

ZeroLayout::ZeroLayout(uintptr_t base, size_t bytes, size_t max_piece, size_t unit)
    : base_(base), bytes_(bytes), max_piece_(max_piece), unit_(unit) {
  if (!IsPow2(max_piece) || !IsPow2(unit) || unit > max_piece) {
    throw InvalidArgument("ZeroLayout: max_piece (" + std::to_string(max_piece) + ") and unit (" +
                          std::to_string(unit) + ") must be powers of two, unit <= max_piece");
  }
}

void ZeroLayout::AppendAligned(uintptr_t va, size_t bytes, std::vector<ZeroPiece>* out) const {
  while (bytes >= unit_) {
    const size_t from_base = va - base_;
    size_t piece = max_piece_;
    while (piece > unit_ && (from_base % piece != 0 || piece > bytes)) piece /= 2;
    out->push_back({va, piece});
    va += piece;
    bytes -= piece;
  }
}

bool ZeroLayout::IsAligned(const ZeroPiece& p) const {
  return p.va >= base_ && IsPow2(p.bytes) && p.bytes >= unit_ && p.bytes <= max_piece_ &&
         (p.va - base_) % p.bytes == 0;
}

std::vector<ZeroPiece> ZeroLayout::Tile(uintptr_t va, size_t bytes) const {
  std::vector<ZeroPiece> out;
  AppendAligned(va, bytes, &out);
  return out;
}

ZeroLayout::Clear ZeroLayout::PlanClear(uintptr_t va, size_t bytes) const {
  Clear plan;
  if (bytes == 0) return plan;
  const uintptr_t end = va + bytes;
  // The piece containing va starts at or before it.
  auto it = pieces_.upper_bound(va);
  if (it == pieces_.begin())
    it = pieces_.end();
  else
    --it;
  uintptr_t covered_to = va;
  if (it == pieces_.end() || it->first + it->second <= va) {
    throw InvalidArgument("ZeroLayout: " + Hex(va) + " is not zero-mapped (clearing [" + Hex(va) +
                          ", " + Hex(end) + "))");
  }
  for (; it != pieces_.end() && it->first < end; ++it) {
    if (it->first > covered_to) {
      throw InvalidArgument("ZeroLayout: [" + Hex(covered_to) + ", " + Hex(it->first) +
                            ") is not zero-mapped (clearing [" + Hex(va) + ", " + Hex(end) + "))");
    }
    const uintptr_t p_end = it->first + it->second;
    plan.unmap.push_back({it->first, it->second});
    if (it->first < va) AppendAligned(it->first, va - it->first, &plan.remap);
    if (p_end > end) AppendAligned(end, p_end - end, &plan.remap);
    covered_to = p_end;
  }
  if (covered_to < end) {
    throw InvalidArgument("ZeroLayout: [" + Hex(covered_to) + ", " + Hex(end) +
                          ") is not zero-mapped (clearing [" + Hex(va) + ", " + Hex(end) + "))");
  }
  plan.hull_va = plan.unmap.front().va;
  plan.hull_bytes = covered_to - plan.hull_va;
  return plan;
}

void ZeroLayout::Add(const std::vector<ZeroPiece>& pieces) {
  for (const ZeroPiece& p : pieces) {
    if (!IsAligned(p)) {
      throw InvalidArgument("ZeroLayout: piece [" + Hex(p.va) + ", " + Hex(p.va + p.bytes) +
                            ") is not a power-of-two piece of " + std::to_string(unit_) + " to " +
                            std::to_string(max_piece_) + " bytes aligned to its size");
    }
  }
  for (const ZeroPiece& p : pieces) {
    auto next = pieces_.lower_bound(p.va);
    const bool overlaps_next = next != pieces_.end() && next->first < p.va + p.bytes;
    const bool overlaps_prev =
        next != pieces_.begin() && std::prev(next)->first + std::prev(next)->second > p.va;
    if (overlaps_next || overlaps_prev || p.bytes == 0) {
      throw InvalidArgument("ZeroLayout: piece [" + Hex(p.va) + ", " + Hex(p.va + p.bytes) +
                            ") overlaps a zero mapping already recorded (or is empty)");
    }
    pieces_.emplace(p.va, p.bytes);
  }
}

void ZeroLayout::Remove(const std::vector<ZeroPiece>& pieces) {
  for (const ZeroPiece& p : pieces) {
    auto it = pieces_.find(p.va);
    if (it != pieces_.end() && it->second == p.bytes) pieces_.erase(it);
  }
}

std::vector<ZeroPiece> ZeroLayout::pieces() const {
  std::vector<ZeroPiece> out;
  for (const auto& [va, bytes] : pieces_) out.push_back({va, bytes});
  return out;
}

size_t ZeroLayout::Covered(uintptr_t va, size_t bytes) const {
  const uintptr_t end = va + bytes;
  size_t total = 0;
  auto it = pieces_.upper_bound(va);
  if (it != pieces_.begin()) --it;
  for (; it != pieces_.end() && it->first < end; ++it) {
    const uintptr_t lo = std::max(va, it->first);
    const uintptr_t hi = std::min(end, it->first + it->second);
    if (hi > lo) total += hi - lo;
  }
  return total;
}

}  // namespace jax_vmm::cuda
