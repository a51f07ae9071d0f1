#include "drivers/cuda/zero_layout.h"

#include <algorithm>
#include <string>

#include "common/format.h"
#include "jax_vmm/errors.h"

namespace jax_vmm::cuda {

ZeroLayout::ZeroLayout(uintptr_t base, size_t bytes, size_t max_piece)
    : base_(base), bytes_(bytes), max_piece_(max_piece) {
  if (max_piece == 0) throw InvalidArgument("ZeroLayout: max_piece must be > 0");
}

std::vector<ZeroPiece> ZeroLayout::Tile(uintptr_t va, size_t bytes) const {
  std::vector<ZeroPiece> out;
  uintptr_t at = va;
  const uintptr_t end = va + bytes;
  while (at < end) {
    const size_t from_base = at - base_;
    const uintptr_t boundary = base_ + (from_base / max_piece_ + 1) * max_piece_;
    const uintptr_t stop = std::min(end, boundary);
    out.push_back({at, stop - at});
    at = stop;
  }
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
    if (it->first < va) plan.remap.push_back({it->first, va - it->first});
    if (p_end > end) plan.remap.push_back({end, p_end - end});
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
