// jax_vmm.ordered_views(layer, k, v) (jax_vmm/ops/layer_ops.py): a jitted step that reads a
// KVCache layer with plain XLA ops (cuDNN attention, say) gets the arena views as jit
// arguments; the reads follow the layer's writes because the layer comes into the
// computation (see ordered_views' docstring). Its custom call
//   jax_vmm_kv_cache_check_views(k, v, token) -> result   (s32 scalar, no value)
// with attributes cache_uid (u64) and layer (s64) checks at host time that the buffers
// XLA hands over ARE the layer's arena buffers (not a copy: a view donated on the CPU,
// or updated by another op, reaches the step as XLA's copy, which the layer's writes
// never touch), and fails the execution otherwise. It does no device work: its result
// is never read (jax_vmm/ops/views_check.py keeps the call, which has a side effect for
// XLA and no JAX effect). The checks shared by its CPU and CUDA handlers.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jax_vmm::kvcache {

namespace ffi = xla::ffi;

// An error message naming what XLA handed over instead, or "".
std::string CheckOrderedViews(const char* driver_kind, int device, uint64_t cache_uid,
                              int64_t layer, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v);

// The call's context (CPU: the device ordinal; CUDA: stream and device ordinal, already in
// `b`), operands, result and attributes.
template <typename B>
auto BindCheckViews(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::AnyBuffer>()  // k
      .template Arg<ffi::AnyBuffer>()  // v
      .template Arg<ffi::AnyBuffer>()  // token
      .template Ret<ffi::AnyBuffer>()  // zero (s32 scalar)
      .template Attr<uint64_t>("cache_uid")
      .template Attr<int64_t>("layer");
}

}  // namespace jax_vmm::kvcache
