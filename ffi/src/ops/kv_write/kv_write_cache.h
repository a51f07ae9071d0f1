// kv_write on a KVCache layer (jax_vmm/ops/layer_ops.py): the custom calls
//   jax_vmm_kv_cache_write(new_k, new_v, slots, token) -> token          (aliased {3:0})
//   jax_vmm_kv_cache_write_fp8(new_k, new_v, slots, token, k_scale, v_scale) -> token
// with attributes cache_uid (u64) and layer (s64). The cache is not an operand (it is not
// an XLA value, so XLA never copies it): the handler finds the layer's buffers through the
// KV cache registry (ops/kv_cache/kv_cache_call.h) and writes them as kv_write writes a
// dest, with the same per-token checks (range, page table, ensured tokens) and drop
// counting. The token only orders: the call's result is its operand, and every later
// op that takes it (decode attention over the layer, the next write) runs after it.
// Here: what the CPU and CUDA handlers share before any memory is touched.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "ops/kv_cache/kv_cache_call.h"
#include "ops/kv_write/kv_write_call.h"
#include "ops/kv_write/kv_write_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace jax_vmm::kv {

// One cache write: the resolved layer (held for the call) and kv_write's operands with
// the layer's buffers as the two sides' dest (nothing handed over).
struct CacheWriteCall {
  kvcache::CacheLayer layer;
  CallOperands in;
};

// Resolves the layer and fills call->in. `driver_kind`: "host" or "cuda" (CUDA pins the
// metadata: the call may be recorded into a graph). An error message, or "".
inline std::string PrepareCacheWrite(const char* driver_kind, int device, uint64_t cache_uid,
                                     int64_t layer, const ffi::AnyBuffer& new_k,
                                     const ffi::AnyBuffer& new_v,
                                     const ffi::Buffer<ffi::S32>& slots, CacheWriteCall* call) {
  if (std::string err =
          kvcache::ResolveCacheLayer("jax_vmm.kv_write", driver_kind, device, cache_uid, layer,
                                     std::strcmp(driver_kind, "cuda") == 0, &call->layer);
      !err.empty()) {
    return err;
  }
  const kvcache::Geometry& g = call->layer.cache->geometry();
  const kvcache::LayerBuffers& b = call->layer.buffers;
  CallOperands& in = call->in;
  // One layer's K as an array (its bytes give the element size), whatever the layout.
  const Dims cache{call->layer.dims.data(), static_cast<int64_t>(call->layer.dims.size()),
                   static_cast<size_t>(g.num_slots()) * g.token_bytes(), g.dtype};
  in.k = cache;
  in.v = cache;
  in.new_k = DimsOf(new_k);
  in.new_v = DimsOf(new_v);
  in.slots = DimsOfS32(slots);
  in.slot_values = slots.typed_data();
  // The sides name the buffers by their bases (the dest's identity), the layer by offset.
  const uint64_t k_offset = g.layer_offset(call->layer.layer, 0);
  const uint64_t v_offset = g.layer_offset(call->layer.layer, 1);
  in.side[0] = {b.k_address - k_offset, b.k_uid, nullptr, g.buffer_bytes(),
                new_k.untyped_data(), nullptr, k_offset};
  in.side[1] = {b.v_address - v_offset, b.v_uid, nullptr, g.buffer_bytes(),
                new_v.untyped_data(), nullptr, v_offset};
  return "";
}

// The token operand and result are one buffer (aliased); should XLA ever hand over two,
// the result must still carry the value.
inline bool TokenAliased(const ffi::AnyBuffer& token, const ffi::AnyBuffer& token_out) {
  return token.untyped_data() == token_out.untyped_data();
}

// The operands both cache writes start with, after the platform's context arguments in
// `b` (none on the CPU, the stream on CUDA); the fp8 write's k_scale, v_scale follow.
template <typename B>
auto BindCacheWriteInputs(B&& b) {
  return std::forward<B>(b)
      .template Ctx<ffi::DeviceOrdinal>()
      .template Arg<ffi::AnyBuffer>()         // new_k
      .template Arg<ffi::AnyBuffer>()         // new_v
      .template Arg<ffi::Buffer<ffi::S32>>()  // slots
      .template Arg<ffi::AnyBuffer>();        // token
}

// The result and attributes both cache writes end with.
template <typename B>
auto BindCacheWriteResult(B&& b) {
  return std::forward<B>(b)
      .template Ret<ffi::AnyBuffer>()  // token (aliases operand 3)
      .template Attr<uint64_t>("cache_uid")
      .template Attr<int64_t>("layer");
}

// jax_vmm_kv_cache_write.
template <typename B>
auto BindCacheWrite(B&& b) {
  return BindCacheWriteResult(BindCacheWriteInputs(std::forward<B>(b)));
}

// jax_vmm_kv_cache_write_fp8.
template <typename B>
auto BindCacheWriteFp8(B&& b) {
  return BindCacheWriteResult(BindCacheWriteInputs(std::forward<B>(b))
                                  .template Arg<ffi::AnyBuffer>()    // k_scale (H,)
                                  .template Arg<ffi::AnyBuffer>());  // v_scale (H,)
}

}  // namespace jax_vmm::kv
