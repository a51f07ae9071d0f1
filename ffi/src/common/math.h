// Integer rounding and power-of-two helpers shared by the arena, scratch, the drivers and
// the op plans.
#pragma once

#include <cstddef>

namespace jax_vmm {

// ceil(a / b) for a >= 0, b > 0.
template <typename T>
constexpr T CeilDiv(T a, T b) {
  return (a + b - 1) / b;
}

// The smallest multiple of m that is >= x (x itself when m <= 1).
template <typename T, typename M>
constexpr T RoundUp(T x, M m) {
  const T step = static_cast<T>(m);
  return step <= 1 ? x : CeilDiv(x, step) * step;
}

constexpr bool IsPow2(size_t x) { return x != 0 && (x & (x - 1)) == 0; }

// The largest power of two dividing x (x > 0).
constexpr size_t LowestBit(size_t x) { return x & (~x + 1); }

// The largest power of two <= x (1 for x <= 1).
constexpr size_t FloorPow2(size_t x) {
  size_t p = 1;
  while (p * 2 <= x && p * 2 != 0) p *= 2;
  return p;
}

}  // namespace jax_vmm
