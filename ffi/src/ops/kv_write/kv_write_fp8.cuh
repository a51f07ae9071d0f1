// The fp8 transfer policy of the tiled kv_write kernel (kv_write_bulk.cuh): quantizes
// new tokens into a float8_e4m3fn cache as kv_write_fp8.h says. Device code; included by
// kv_write_kernels.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>

#include "common/fast_divmod.h"
#include "ops/kv_write/kv_write.h"

namespace jax_vmm::kv::kernels {

// 8 source elements (SrcT: float, __half or __nv_bfloat16) per vector, stored as 8
// float8_e4m3fn bytes: round to nearest even of x * (1 / scale[head]), saturated to +-448
// (NaN stays NaN; cvt.rn.satfinite).
template <typename SrcT>
struct QuantizeVectors {
  static constexpr int kSrcWords = sizeof(SrcT) * 8 / 16;  // 16-byte words per 8 elements
  struct Vec {
    uint4 w[kSrcWords];  // 8 source elements, raw
  };
  int vecs_per_token;     // heads * head_dim / 8
  FastDivmod per_head;    // head_dim / 8: a vector's head is per_head.Div(i)
  const float* scale[2];  // (heads,) per side

  __device__ __forceinline__ Vec Load(const Side& s, int side, int64_t flat) const {
    (void)side;
    const uint4* src = reinterpret_cast<const uint4*>(s.src) + flat * kSrcWords;
    Vec v;
#pragma unroll
    for (int j = 0; j < kSrcWords; ++j) v.w[j] = src[j];
    return v;
  }
  static __device__ __forceinline__ float2 Pair(const Vec& v, int j) {  // elements 2j, 2j + 1
    if constexpr (sizeof(SrcT) == 4) {
      const uint4& w = v.w[j / 2];
      return (j % 2) == 0 ? make_float2(__uint_as_float(w.x), __uint_as_float(w.y))
                          : make_float2(__uint_as_float(w.z), __uint_as_float(w.w));
    } else {
      const uint32_t x = j == 0 ? v.w[0].x : (j == 1 ? v.w[0].y : (j == 2 ? v.w[0].z : v.w[0].w));
      SrcT lo, hi;
      const uint16_t l16 = static_cast<uint16_t>(x & 0xffffu), h16 = static_cast<uint16_t>(x >> 16);
      memcpy(&lo, &l16, 2);
      memcpy(&hi, &h16, 2);
      return make_float2(static_cast<float>(lo), static_cast<float>(hi));
    }
  }
  __device__ __forceinline__ void Store(uint8_t* dst_token, int side, int i, const Vec& v) const {
    const float inv = 1.0f / __ldg(scale[side] + per_head.Div(static_cast<uint32_t>(i)));
    uint32_t w[2] = {0, 0};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = Pair(v, j);
      const __nv_fp8x2_storage_t pair =
          __nv_cvt_float2_to_fp8x2(make_float2(f.x * inv, f.y * inv), __NV_SATFINITE, __NV_E4M3);
      w[j / 2] |= static_cast<uint32_t>(pair) << (16 * (j % 2));
    }
    reinterpret_cast<uint2*>(dst_token)[i] = make_uint2(w[0], w[1]);
  }
};

}  // namespace jax_vmm::kv::kernels
