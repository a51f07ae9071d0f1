// Division by a run-time invariant divisor as a multiply-high and a shift (Granlund and
// Montgomery, "Division by invariant integers using multiplication", 1994), for kernels
// that divide every element's index by the same count: a 32-bit integer division is a
// ~20-instruction sequence on the GPU, this is 2-3.
//
// Exact for dividends in [0, 2^31) and divisors in [1, 2^31). Header-only; the methods
// compile for host and device, so the host-side tests run the device's arithmetic.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JAX_VMM_DIVMOD_HD __host__ __device__ __forceinline__
#else
#define JAX_VMM_DIVMOD_HD inline
#endif

namespace jax_vmm {

class FastDivmod {
 public:
  FastDivmod() = default;

  // divisor in [1, 2^31).
  explicit FastDivmod(uint32_t divisor) {
    uint32_t log2 = 0;  // ceil(log2(divisor))
    while ((uint64_t{1} << log2) < divisor) ++log2;
    if (divisor == 1) return;  // multiplier_ 0 marks "n / 1 = n"
    // m = ceil(2^(31 + log2) / d) < 2^32 because 2^(log2 - 1) < d; with n < 2^31 the
    // rounding error of m stays below one quotient step.
    const uint64_t p = uint64_t{1} << (31 + log2);
    multiplier_ = static_cast<uint32_t>((p + divisor - 1) / divisor);
    shift_ = log2 - 1;
  }

  // n / divisor for n in [0, 2^31).
  JAX_VMM_DIVMOD_HD uint32_t Div(uint32_t n) const {
    if (multiplier_ == 0) return n;
    return MulHi(n, multiplier_) >> shift_;
  }

 private:
  static JAX_VMM_DIVMOD_HD uint32_t MulHi(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
    return __umulhi(a, b);
#else
    return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
  }

  uint32_t multiplier_ = 0;
  uint32_t shift_ = 0;
};

}  // namespace jax_vmm

#undef JAX_VMM_DIVMOD_HD
