// Operand validation of jax_vmm_decode_attention_v2 (the streaming kernel), shared by its
// CPU and CUDA handlers and the testing layer's variants. Python validates first (at trace
// time); this is the handlers' own guard.
#pragma once

#include <string>

#include "ops/attention/attention_check.h"
#include "ops/attention/stream_plan.h"
#include "xla/ffi/api/ffi.h"

namespace jax_vmm::attention::stream {

// Checks (q, k, v, lengths, k_scale, v_scale, out); fills *shapes and *kv.
inline ffi::Error CheckStreamOperands(const char* name, const ffi::AnyBuffer& q,
                                      const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                      const ffi::Buffer<ffi::S32>& lengths,
                                      const ffi::AnyBuffer& k_scale, const ffi::AnyBuffer& v_scale,
                                      const ffi::AnyBuffer& out, Shapes* shapes, KvStorage* kv) {
  if (ffi::Error err = CheckShapes(name, q, k, v, lengths, out, shapes); err.failure()) return err;
  const std::string who = std::string(name) + ": ";
  if (shapes->q_len != 1) {
    return ffi::Error::InvalidArgument(who +
                                       "q must be (B, H_q, D): the streaming kernel serves "
                                       "one query token per sequence");
  }
  const ffi::DataType qt = q.element_type();
  if ((qt != ffi::DataType::BF16 && qt != ffi::DataType::F16) || out.element_type() != qt) {
    return ffi::Error::InvalidArgument(who +
                                       "q and the output must be bfloat16 or float16 (one dtype)");
  }
  const ffi::DataType kt = k.element_type();
  if (v.element_type() != kt) {
    return ffi::Error::InvalidArgument(who + "k and v must share one dtype");
  }
  if (kt == qt) {
    *kv = qt == ffi::DataType::BF16 ? KvStorage::kBf16 : KvStorage::kF16;
  } else if (kt == ffi::DataType::F8E4M3FN || kt == ffi::DataType::U8) {
    *kv = KvStorage::kFp8;
  } else {
    return ffi::Error::InvalidArgument(who +
                                       "k and v must have q's dtype or float8_e4m3fn (uint8 bits)");
  }
  for (const ffi::AnyBuffer* s : {&k_scale, &v_scale}) {
    auto d = s->dimensions();
    if (s->element_type() != ffi::DataType::F32 || d.size() != 1 || d[0] != shapes->kv_heads) {
      return ffi::Error::InvalidArgument(who + "k_scale and v_scale must be float32 of shape (" +
                                         std::to_string(shapes->kv_heads) + ",), got " +
                                         DimsString(d));
    }
  }
  return ffi::Error::Success();
}

// The `combine` attribute (a value of Combine, stream_plan.h).
inline ffi::Error CheckCombine(const char* name, int64_t combine) {
  if (combine == 0 || combine == 1) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(name) +
                                     ": combine must be 0 (fused) or 1 (kernel), got " +
                                     std::to_string(combine));
}

}  // namespace jax_vmm::attention::stream
