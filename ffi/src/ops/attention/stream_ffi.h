// The FFI signature every jax_vmm_decode_attention_v2 target shares (CPU, CUDA and the
// testing layer's variants): operands q, k, v, lengths, k_scale, v_scale first, attributes
// last.
#pragma once

#include <cstdint>
#include <utility>

#include "ops/attention/attention_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace jax_vmm::attention::stream {

// q (B, H_q, D), k and v (B, T, H_kv, D), lengths s32 (B,), k_scale and v_scale f32
// (H_kv,), after the context arguments already bound in `b`.
template <typename B>
auto BindStreamInputs(B&& b) {
  return BindInputs(std::forward<B>(b))
      .template Arg<ffi::AnyBuffer>()   // k_scale
      .template Arg<ffi::AnyBuffer>();  // v_scale
}

// scale (softmax scale); the plan: ctas (grid size), min_tiles (fewest tiles per CTA), 0 =
// automatic; CUDA choices the CPU model accepts and ignores: stages (ring slots per warp,
// 0 = automatic), bulk (1: tiles by bulk copies); combine (a Combine value).
template <typename B>
auto BindStreamAttrs(B&& b) {
  return std::forward<B>(b)
      .template Attr<float>("scale")
      .template Attr<int64_t>("ctas")
      .template Attr<int64_t>("stages")
      .template Attr<int64_t>("min_tiles")
      .template Attr<int64_t>("combine")
      .template Attr<int64_t>("bulk");
}

// The attributes of one call, as the handlers pass them on.
struct StreamAttrs {
  float scale = 0;
  int64_t ctas = 0, stages = 0, min_tiles = 0, combine = 0, bulk = 0;
  int64_t token_heads = 0;  // Shapes::token_heads of k and v (0: dense); not an attribute
};

}  // namespace jax_vmm::attention::stream
