// Integer rounding shared by the arena, scratch and the op plans.
#pragma once

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

}  // namespace jax_vmm
