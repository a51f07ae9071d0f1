// The FFI signature every split-K attention target shares (CPU, CUDA and the testing
// layer's variants): operands q, k, v, lengths first, attributes last, then the optional
// q_lengths operand and the window / softcap attributes of jax_vmm.attention.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jax_vmm::attention {

namespace ffi = xla::ffi;

// q (B, H_q, D) or (B, S, H_q, D), k and v (B, T, H_kv, D), lengths s32 (B,), after the context
// arguments already bound in `b`.
template <typename B>
auto BindInputs(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::AnyBuffer>()          // q
      .template Arg<ffi::AnyBuffer>()          // k
      .template Arg<ffi::AnyBuffer>()          // v
      .template Arg<ffi::Buffer<ffi::S32>>();  // lengths
}

// scale (softmax scale), chunk / splits (the plan; 0 = automatic), impl (CUDA kernel
// choice, see attention_plan.h; accepted and ignored on the CPU); then the optional
// q_lengths operand s32 (B,) (the last operand: absent = every row of q is live) and
// window (s64, 0 = none) and softcap (f32, 0 = none). See Semantics.
template <typename B>
auto BindAttrs(B&& b) {
  return std::forward<B>(b)
      .template Attr<float>("scale")
      .template Attr<int64_t>("chunk")
      .template Attr<int64_t>("splits")
      .template Attr<int64_t>("impl")
      .template OptionalArg<ffi::Buffer<ffi::S32>>()  // q_lengths
      .template Attr<int64_t>("window")
      .template Attr<float>("softcap");
}

using OptionalLengths = std::optional<ffi::Buffer<ffi::S32>>;

// The masking and logit options of one call. Query row i < S of sequence b sits at
// position p = lengths[b] - q_len[b] + i (q_len = clamp(q_lengths[b], 0, lengths[b]),
// S when absent) and attends to tokens j with max(0, p - window + 1) <= j <= p (no lower
// bound for window 0); rows i >= q_len[b] are zeros. softcap > 0: logits (after the
// scale) become softcap * tanh(logit / softcap). Plain(): S = 1 decode with neither,
// whose kernels run unchanged.
struct Semantics {
  const int32_t* q_lengths = nullptr;  // device (CUDA) or host (CPU) memory; null = S each
  int64_t window = 0;
  float softcap = 0.f;
  bool Plain(int64_t q_len) const {
    return q_len == 1 && q_lengths == nullptr && window == 0 && softcap == 0.f;
  }
};

// Semantics from the bound values; q_lengths must be s32 (B,).
inline ffi::Error MakeSemantics(const char* name, int64_t batch, const OptionalLengths& q_lengths,
                                int64_t window, float softcap, Semantics* out) {
  if (window < 0 || !(softcap >= 0.f) || softcap == __builtin_huge_valf()) {
    return ffi::Error::InvalidArgument(std::string(name) + ": window must be >= 0 (0 = none) " +
                                       "and softcap finite and >= 0 (0 = none); got window " +
                                       std::to_string(window) + ", softcap " +
                                       std::to_string(softcap));
  }
  out->window = window;
  out->softcap = softcap;
  out->q_lengths = nullptr;
  if (q_lengths.has_value()) {
    auto d = q_lengths->dimensions();
    if (d.size() != 1 || d[0] != batch) {
      return ffi::Error::InvalidArgument(std::string(name) + ": q_lengths must be (" +
                                         std::to_string(batch) + ",), got rank " +
                                         std::to_string(d.size()));
    }
    out->q_lengths = q_lengths->typed_data();
  }
  return ffi::Error::Success();
}

}  // namespace jax_vmm::attention
