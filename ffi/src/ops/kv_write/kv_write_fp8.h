// kv_write_fp8: kv_write into a float8_e4m3fn (or uint8) cache, quantizing float32,
// bfloat16 or float16 tokens on the way, per KV head h:
//   fp8(x * (1 / scale[h])), round to nearest even, saturated to +-448, NaN kept;
// the dequantized value is fp8 * scale[h] (decode_attention's k_scale / v_scale).
// Validation, status and drop counting are kv_write's (kv_write.h); the FFI target
// jax_vmm_kv_write_fp8(k, v, new_k, new_v, slots, k_scale, v_scale) -> (k, v) aliases its
// outputs {0:0, 1:1} like kv_write. Here: the operand checks and operands shared by the
// CPU and CUDA handlers (kv_write_fp8_cpu.cc, kv_write_fp8_cuda.cc).
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "ops/kv_write/kv_write_call.h"
#include "ops/kv_write/kv_write_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace jax_vmm::kv {

inline constexpr const char* kFp8Name = "jax_vmm_kv_write_fp8";

// Dtype and scale checks (the shapes are CheckGeometry's); *src_type receives the new
// tokens' dtype. Empty string when fine.
inline std::string CheckFp8Write(const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                 const ffi::AnyBuffer& new_k, const ffi::AnyBuffer& new_v,
                                 const ffi::AnyBuffer& k_scale, const ffi::AnyBuffer& v_scale,
                                 ffi::DataType* src_type) {
  const std::string op = std::string(kFp8Name) + ": ";
  const ffi::DataType ct = k.element_type();
  if ((ct != ffi::DataType::F8E4M3FN && ct != ffi::DataType::U8) || v.element_type() != ct) {
    return op + "the cache k, v must be float8_e4m3fn (or uint8 bits), one dtype";
  }
  const ffi::DataType st = new_k.element_type();
  if ((st != ffi::DataType::F32 && st != ffi::DataType::BF16 && st != ffi::DataType::F16) ||
      new_v.element_type() != st) {
    return op + "new_k and new_v must be float32, bfloat16 or float16, one dtype";
  }
  *src_type = st;
  auto kd = k.dimensions();
  if (kd.size() < 3) return op + "the cache must have rank >= 3 (..., heads, head_dim)";
  for (const ffi::AnyBuffer* s : {&k_scale, &v_scale}) {
    auto d = s->dimensions();
    if (s->element_type() != ffi::DataType::F32 || d.size() != 1 || d[0] != kd[kd.size() - 2]) {
      return op + "k_scale and v_scale must be float32 of shape (" +
             std::to_string(kd[kd.size() - 2]) + ",)";
    }
  }
  return "";
}

// Bytes of one new-token element.
inline int SourceBytes(ffi::DataType src_type) { return src_type == ffi::DataType::F32 ? 4 : 2; }

// kv_write's operands of a kv_write_fp8 call: the new tokens, `src_bytes`-wide floats,
// seen as tokens of the cache's one-byte dtype, so that CheckGeometry checks their shape
// and size like a plain write's.
inline CallOperands Fp8WriteOperands(const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                     const ffi::AnyBuffer& new_k, const ffi::AnyBuffer& new_v,
                                     const ffi::Buffer<ffi::S32>& slots, void* k_out, void* v_out,
                                     const Dest& dest, int src_bytes) {
  CallOperands in = WriteOperands(k, v, new_k, new_v, slots, k_out, v_out, dest);
  for (Dims* d : {&in.new_k, &in.new_v}) {
    d->bytes /= static_cast<size_t>(src_bytes);
    d->dtype = in.k.dtype;
  }
  return in;
}

// The operands, results and attributes of jax_vmm_kv_write_fp8 after the platform's
// context arguments in `b`.
template <typename B>
auto BindWriteFp8(B&& b) {
  return BindDest(BindOperands(std::forward<B>(b))
                      .template Arg<ffi::AnyBuffer>()    // k_scale (H,)
                      .template Arg<ffi::AnyBuffer>()    // v_scale (H,)
                      .template Ret<ffi::AnyBuffer>()    // k (aliases operand 0)
                      .template Ret<ffi::AnyBuffer>());  // v (aliases operand 1)
}

}  // namespace jax_vmm::kv
