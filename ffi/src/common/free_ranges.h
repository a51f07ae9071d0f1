// Free [offset, offset + bytes) ranges kept coalesced in an offset -> bytes map, with
// first-fit allocation: the arena's address-space placement and the host driver's memfd
// both use them. Thread-safety: none; callers hold their own lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>

namespace jax_vmm {

using FreeRangeMap = std::map<uint64_t, uint64_t>;
inline constexpr uint64_t kNoFreeRange = ~uint64_t{0};

// Takes `bytes` from the first free range large enough; kNoFreeRange when none is.
inline uint64_t TakeFirstFit(FreeRangeMap& free, uint64_t bytes) {
  for (auto it = free.begin(); it != free.end(); ++it) {
    if (it->second < bytes) continue;
    const uint64_t offset = it->first;
    const uint64_t left = it->second - bytes;
    free.erase(it);
    if (left > 0) free[offset + bytes] = left;
    return offset;
  }
  return kNoFreeRange;
}

// Gives [offset, offset + bytes) back, coalesced with its neighbours.
inline void GiveRange(FreeRangeMap& free, uint64_t offset, uint64_t bytes) {
  auto next = free.lower_bound(offset);
  if (next != free.end() && next->first == offset + bytes) {
    bytes += next->second;
    next = free.erase(next);
  }
  if (next != free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      bytes += prev->second;
      free.erase(prev);
    }
  }
  free[offset] = bytes;
}

inline uint64_t LargestRange(const FreeRangeMap& free) {
  uint64_t largest = 0;
  for (const auto& [offset, bytes] : free) largest = bytes > largest ? bytes : largest;
  return largest;
}

}  // namespace jax_vmm
