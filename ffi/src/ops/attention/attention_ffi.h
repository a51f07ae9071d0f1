// The FFI signature every decode-attention target shares (CPU, CUDA and the testing
// layer's variants): operands q, k, v, lengths first, attributes last.
#pragma once

#include <cstdint>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jax_vmm::attention {

namespace ffi = xla::ffi;

// q (B, H_q, D), k and v (B, T, H_kv, D), lengths s32 (B,), after the context arguments
// already bound in `b`.
template <typename B>
auto BindInputs(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::AnyBuffer>()          // q
      .template Arg<ffi::AnyBuffer>()          // k
      .template Arg<ffi::AnyBuffer>()          // v
      .template Arg<ffi::Buffer<ffi::S32>>();  // lengths
}

// scale (softmax scale), chunk / splits (the plan; 0 = automatic), impl (CUDA kernel
// choice, see attention_plan.h; accepted and ignored on the CPU).
template <typename B>
auto BindAttrs(B&& b) {
  return std::forward<B>(b)
      .template Attr<float>("scale")
      .template Attr<int64_t>("chunk")
      .template Attr<int64_t>("splits")
      .template Attr<int64_t>("impl");
}

}  // namespace jax_vmm::attention
