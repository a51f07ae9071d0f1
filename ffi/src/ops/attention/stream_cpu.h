// The CPU handler of jax_vmm_decode_attention_v2 (the streaming kernel's C++ model), its
// body shared with the testing layer's variant.
#pragma once

#include "ops/attention/stream_check.h"
#include "ops/attention/stream_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace jax_vmm::attention::stream {

inline constexpr const char* kCpuName = "jax_vmm_decode_attention_v2 (cpu)";

// What the handler checks before it touches memory: operands, shapes the kernel can
// serve, the combine attribute. Fills *shapes and *kv.
ffi::Error ValidateCpu(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                       const ffi::Buffer<ffi::S32>& lengths, const ffi::AnyBuffer& k_scale,
                       const ffi::AnyBuffer& v_scale, const ffi::AnyBuffer& out,
                       const StreamAttrs& attrs, Shapes* shapes, KvStorage* kv);

// Validates, then computes `out` as the CUDA kernel does (same partition, slots, merge
// order and combine), in float32.
ffi::Error RunCpu(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                  const ffi::Buffer<ffi::S32>& lengths, const ffi::AnyBuffer& k_scale,
                  const ffi::AnyBuffer& v_scale, ffi::AnyBuffer out, const StreamAttrs& attrs);

}  // namespace jax_vmm::attention::stream
