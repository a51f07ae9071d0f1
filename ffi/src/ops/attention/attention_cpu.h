// The CPU decode-attention handler's body, shared with the testing layer's variant.
#pragma once

#include <cstdint>

#include "ops/attention/attention_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace jax_vmm::attention {

inline constexpr const char* kCpuName = "jax_vmm_decode_attention (cpu)";

// Validates the operands, plans the split and computes `out`, with the partials in
// `workspace` (the XLA workspace result) or, when null, in a local buffer. token_heads:
// Shapes::token_heads of k and v (0: dense).
xla::ffi::Error RunCpu(xla::ffi::AnyBuffer q, xla::ffi::AnyBuffer k, xla::ffi::AnyBuffer v,
                       xla::ffi::Buffer<xla::ffi::S32> lengths, xla::ffi::AnyBuffer out,
                       xla::ffi::AnyBuffer* workspace, float scale, int64_t chunk, int64_t splits,
                       const Semantics& sem, int64_t impl = 0, int64_t token_heads = 0);

}  // namespace jax_vmm::attention
