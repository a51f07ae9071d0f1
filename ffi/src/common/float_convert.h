// Scalar float conversions of the CPU handlers (decode attention and kv_write_fp8):
// IEEE binary16, bfloat16 and float8_e4m3fn (OCP FP8 E4M3, "fn": no infinities, NaN =
// S.1111.111) to and from float32, round to nearest even. Header-only, host code.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace jax_vmm {

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

// float8_e4m3fn -> float (exact).
inline float Fp8E4M3ToFloat(uint8_t b) {
  const float sign = (b & 0x80) ? -1.0f : 1.0f;
  const int exp = (b >> 3) & 0xf, man = b & 7;
  if (exp == 15 && man == 7) return std::numeric_limits<float>::quiet_NaN();
  if (exp == 0) return sign * std::ldexp(static_cast<float>(man), -9);  // zero or subnormal
  return sign * std::ldexp(static_cast<float>(8 + man), exp - 10);
}

// float -> float8_e4m3fn, round to nearest even, saturating to +-448 (infinities too);
// NaN becomes the canonical NaN 0x7f, as the GPU conversion gives.
inline uint8_t FloatToFp8E4M3(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return 0x7f;
  const float a = std::fabs(x);
  if (a >= 448.0f) return static_cast<uint8_t>(sign | 0x7e);
  if (a < 0.015625f) {  // subnormal range, units of 2^-9 (8 units = the smallest normal)
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f)));
  }
  int e;
  std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1): unbiased exponent e - 1
  int q = static_cast<int>(std::nearbyint(std::ldexp(a, 4 - e)));  // 4 significant bits: [8, 16]
  int biased = e - 1 + 7;
  if (q == 16) {
    q = 8;
    ++biased;
  }
  const int code = (biased << 3) | (q - 8);
  return static_cast<uint8_t>(sign | (code > 0x7e ? 0x7e : code));
}

}  // namespace jax_vmm
