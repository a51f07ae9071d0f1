// Element conversions of the CPU decode-attention handler: rows of float32, bfloat16 or
// float16 read into and written from float32 (IEEE binary16 and bfloat16, round to
// nearest even).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "xla/ffi/api/ffi.h"

namespace jax_vmm::attention {

inline float Bf16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  float out;
  if (exp == 0) {
    out = std::ldexp(static_cast<float>(man), -24);  // zero or subnormal
  } else if (exp == 31) {
    out = man ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    out = std::ldexp(static_cast<float>(man | 0x400u), static_cast<int>(exp) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &out, 4);
  bits |= sign;
  std::memcpy(&out, &bits, 4);
  return out;
}

inline uint16_t FloatToHalf(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const float a = std::fabs(f);
  if (std::isnan(f)) return static_cast<uint16_t>(sign | 0x7e00u);
  if (a >= 65520.0f) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to infinity
  if (a < 6.103515625e-05f) {
    // Subnormal range: units of 2^-24, nearbyint rounds half to even.
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.0f)));
  }
  int e;
  const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  // 11 significant bits: mantissa in units of 2^(e-11); rounding may carry into the
  // exponent, which the bit layout below absorbs (0x400 overflow adds one to exp).
  uint32_t mant = static_cast<uint32_t>(std::nearbyint(m * 2048.0f));  // [1024, 2048]
  uint32_t exp = static_cast<uint32_t>(e - 1 + 15);
  uint32_t out = (exp << 10) + (mant - 1024u);
  return static_cast<uint16_t>(sign | out);
}

struct Converter {
  xla::ffi::DataType dtype;
  void Row(const void* base, int64_t offset, int64_t n, float* dst) const {
    switch (dtype) {
      case xla::ffi::DataType::F32:
        std::memcpy(dst, static_cast<const float*>(base) + offset, n * sizeof(float));
        return;
      case xla::ffi::DataType::BF16: {
        const uint16_t* p = static_cast<const uint16_t*>(base) + offset;
        for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(p[i]);
        return;
      }
      default: {  // F16 (validated)
        const uint16_t* p = static_cast<const uint16_t*>(base) + offset;
        for (int64_t i = 0; i < n; ++i) dst[i] = HalfToFloat(p[i]);
        return;
      }
    }
  }
  void Store(void* base, int64_t offset, int64_t n, const float* src) const {
    switch (dtype) {
      case xla::ffi::DataType::F32:
        std::memcpy(static_cast<float*>(base) + offset, src, n * sizeof(float));
        return;
      case xla::ffi::DataType::BF16: {
        uint16_t* p = static_cast<uint16_t*>(base) + offset;
        for (int64_t i = 0; i < n; ++i) p[i] = FloatToBf16(src[i]);
        return;
      }
      default: {
        uint16_t* p = static_cast<uint16_t*>(base) + offset;
        for (int64_t i = 0; i < n; ++i) p[i] = FloatToHalf(src[i]);
        return;
      }
    }
  }
};

}  // namespace jax_vmm::attention
