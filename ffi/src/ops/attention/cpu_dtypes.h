// Element rows of the CPU decode-attention handler: float32, bfloat16 or float16 read
// into and written from float32 (conversions: common/float_convert.h).
#pragma once

#include <cstdint>
#include <cstring>

#include "common/float_convert.h"
#include "xla/ffi/api/ffi.h"

namespace jax_vmm::attention {

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
