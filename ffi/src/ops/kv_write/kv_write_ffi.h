// The FFI side of the kv_write handlers, shared by the CPU and CUDA ones (and their
// unchecked testing variants): the operands of each call unpacked from the XLA buffers,
// and the attribute bindings.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "ops/kv_write/kv_write_call.h"
#include "xla/ffi/api/ffi.h"

namespace jax_vmm::kv {

namespace ffi = xla::ffi;

inline Dims DimsOf(const ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  return Dims{d.begin(), static_cast<int64_t>(d.size()), b.size_bytes(),
              static_cast<int>(b.element_type())};
}

inline Dims DimsOfS32(const ffi::Buffer<ffi::S32>& b) {
  auto d = b.dimensions();
  return Dims{d.begin(), static_cast<int64_t>(d.size()),
              static_cast<size_t>(b.element_count()) * sizeof(int32_t),
              static_cast<int>(ffi::DataType::S32)};
}

// The operands both custom calls share.
inline CallOperands Operands(const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                             const ffi::AnyBuffer& new_k, const ffi::AnyBuffer& new_v,
                             const ffi::Buffer<ffi::S32>& slots) {
  CallOperands in;
  in.k = DimsOf(k);
  in.v = DimsOf(v);
  in.new_k = DimsOf(new_k);
  in.new_v = DimsOf(new_v);
  in.slots = DimsOfS32(slots);
  in.slot_values = slots.typed_data();
  return in;
}

// kv_write's operands; `k_out` / `v_out` are its results (XLA aliases them with k and v,
// and the caller has made them hold k and v when it did not).
inline CallOperands WriteOperands(const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                  const ffi::AnyBuffer& new_k, const ffi::AnyBuffer& new_v,
                                  const ffi::Buffer<ffi::S32>& slots, void* k_out, void* v_out,
                                  const Dest& dest) {
  CallOperands in = Operands(k, v, new_k, new_v, slots);
  in.side[0] = {dest.k, dest.k_uid, k_out, k.size_bytes(), new_k.untyped_data(), nullptr};
  in.side[1] = {dest.v, dest.v_uid, v_out, v.size_bytes(), new_v.untyped_data(), nullptr};
  return in;
}

// kv_write_through's operands; `status_dims` must outlive the result.
inline CallOperands WriteThroughOperands(const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                         const ffi::AnyBuffer& new_k, const ffi::AnyBuffer& new_v,
                                         const ffi::Buffer<ffi::S32>& slots,
                                         ffi::Buffer<ffi::S32>& status, const Dims& status_dims,
                                         const Dest& dest) {
  CallOperands in = Operands(k, v, new_k, new_v, slots);
  in.status = &status_dims;
  const int64_t n = status_dims.rank == 2 ? status_dims.d[1] : 0;
  in.side[0] = {dest.k,         dest.k_uid,           k.untyped_data(),
                k.size_bytes(), new_k.untyped_data(), status.typed_data()};
  in.side[1] = {dest.v,         dest.v_uid,           v.untyped_data(),
                v.size_bytes(), new_v.untyped_data(), status.typed_data() + n};
  return in;
}

// The checks the aliasing handlers (kv_write, kv_write_fp8: `op`) make before they touch
// their results.
inline ffi::Error CheckWriteResults(const char* op, const ffi::AnyBuffer& k,
                                    const ffi::AnyBuffer& v, const ffi::AnyBuffer& k_out,
                                    const ffi::AnyBuffer& v_out) {
  if (k_out.size_bytes() != k.size_bytes() || v_out.size_bytes() != v.size_bytes()) {
    return ffi::Error::InvalidArgument(std::string(op) + ": outputs must match k and v");
  }
  return ffi::Error::Success();
}

inline ffi::Error CheckStatusResult(const Dims& status_dims) {
  if (status_dims.rank != 2 || status_dims.d[0] != 2) {
    return ffi::Error::InvalidArgument("jax_vmm_kv_write_through: status must be (2, n)");
  }
  return ffi::Error::Success();
}

// The operands both custom calls take, after the platform's context arguments in `b`
// (none on the CPU, the stream on CUDA).
template <typename B>
auto BindOperands(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::AnyBuffer>()          // k
      .template Arg<ffi::AnyBuffer>()          // v
      .template Arg<ffi::AnyBuffer>()          // new_k
      .template Arg<ffi::AnyBuffer>()          // new_v
      .template Arg<ffi::Buffer<ffi::S32>>();  // slots
}

// The static destination's attributes, after the others (kv_write_call.h Dest).
template <typename B>
auto BindDest(B&& b) {
  return std::forward<B>(b)
      .template Attr<uint64_t>("dest_k")
      .template Attr<uint64_t>("dest_v")
      .template Attr<uint64_t>("dest_k_uid")
      .template Attr<uint64_t>("dest_v_uid");
}

template <typename B>
auto BindWrite(B&& b) {
  return BindDest(BindOperands(std::forward<B>(b))
                      .template Ret<ffi::AnyBuffer>()    // k (aliases operand 0)
                      .template Ret<ffi::AnyBuffer>());  // v (aliases operand 1)
}

template <typename B>
auto BindWriteThrough(B&& b) {
  return BindDest(BindOperands(std::forward<B>(b))
                      .template Ret<ffi::Buffer<ffi::S32>>()  // status (2, n)
                      .template Attr<bool>("require_arena"));
}

}  // namespace jax_vmm::kv
