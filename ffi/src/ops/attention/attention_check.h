// Operand validation shared by the CPU and CUDA decode-attention handlers. Python
// validates first (at trace time); this is the handler's own guard, with messages that
// name the operand, its shape and what was expected.
#pragma once

#include <cstdint>
#include <string>

#include "common/format.h"
#include "ops/attention/attention_plan.h"
#include "xla/ffi/api/ffi.h"

namespace jax_vmm::attention {

namespace ffi = xla::ffi;

inline std::string DimsString(ffi::AnyBuffer::Dimensions d) {
  return ShapeString(d.begin(), d.size());
}

inline bool IsSupportedDtype(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

// Checks ranks and shapes of (q, k, v, lengths, out), not their dtypes; fills *shapes
// (q_len = S of a rank-4 q, else 1).
// Shared with the streaming kernel's checks (stream_check.h), which admit other dtypes.
inline ffi::Error CheckShapes(const char* name, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                              const ffi::AnyBuffer& v, const ffi::Buffer<ffi::S32>& lengths,
                              const ffi::AnyBuffer& out, Shapes* shapes) {
  const std::string who = std::string(name) + ": ";
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if ((qd.size() != 3 && qd.size() != 4) || kd.size() != 4) {
    return ffi::Error::InvalidArgument(
        who + "q must be (B, H_q, D) or (B, S, H_q, D) and k, v (B, T, H_kv, D); got q " +
        DimsString(qd) + ", k " + DimsString(kd));
  }
  if (DimsString(kd) != DimsString(vd)) {
    return ffi::Error::InvalidArgument(who + "k " + DimsString(kd) + " and v " + DimsString(vd) +
                                       " must have the same shape");
  }
  const size_t r = qd.size();  // q's head and dim axes are its last two
  shapes->batch = qd[0];
  shapes->q_len = r == 4 ? qd[1] : 1;
  shapes->q_heads = qd[r - 2];
  shapes->head_dim = qd[r - 1];
  shapes->max_tokens = kd[1];
  shapes->kv_heads = kd[2];
  if (kd[0] != qd[0] || kd[3] != qd[r - 1]) {
    return ffi::Error::InvalidArgument(who + "k " + DimsString(kd) + " does not match q " +
                                       DimsString(qd) +
                                       " (expected k = (B, T, H_kv, D) with q's B and D)");
  }
  if (std::string err = ValidateShapes(*shapes); !err.empty()) {
    return ffi::Error::InvalidArgument(who + err);
  }
  auto ld = lengths.dimensions();
  if (ld.size() != 1 || ld[0] != qd[0]) {
    return ffi::Error::InvalidArgument(who + "lengths has shape " + DimsString(ld) +
                                       ", expected (" + std::to_string(qd[0]) + ",)");
  }
  if (DimsString(out.dimensions()) != DimsString(qd)) {
    return ffi::Error::InvalidArgument(who + "output shape " + DimsString(out.dimensions()) +
                                       " differs from q " + DimsString(qd));
  }
  return ffi::Error::Success();
}

// Checks ranks, shapes and dtypes of (q, k, v, lengths, out); fills *shapes.
inline ffi::Error CheckOperands(const char* name, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                const ffi::AnyBuffer& v, const ffi::Buffer<ffi::S32>& lengths,
                                const ffi::AnyBuffer& out, Shapes* shapes) {
  if (ffi::Error err = CheckShapes(name, q, k, v, lengths, out, shapes); err.failure()) return err;
  if (!IsSupportedDtype(q.element_type()) || k.element_type() != q.element_type() ||
      v.element_type() != q.element_type() || out.element_type() != q.element_type()) {
    return ffi::Error::InvalidArgument(
        std::string(name) +
        ": q, k, v and the output must share one dtype out of float32, bfloat16, float16");
  }
  return ffi::Error::Success();
}

// Whether the CUDA build runs the tensor-core split kernel (bf16/f16, head_dim 64, 128 or
// 256, impl not simple); the simple kernel otherwise.
inline bool TensorCoreSupported(ffi::DataType t, int64_t head_dim) {
  return (t == ffi::DataType::BF16 || t == ffi::DataType::F16) &&
         (head_dim == 64 || head_dim == 128 || head_dim == 256);
}
inline bool UsesTensorCores(ffi::DataType t, int64_t head_dim, int64_t impl) {
  return impl != static_cast<int64_t>(Impl::kSimple) && TensorCoreSupported(t, head_dim);
}

// The `impl` attribute: a known value, and tensor_core only where the call supports it.
inline ffi::Error CheckImpl(const char* name, int64_t impl, ffi::DataType t, int64_t head_dim) {
  switch (static_cast<Impl>(impl)) {
    case Impl::kAuto:
    case Impl::kSimple:
      return ffi::Error::Success();
    case Impl::kTensorCore:
    case Impl::kTensorCoreOneTile:
      if (TensorCoreSupported(t, head_dim)) return ffi::Error::Success();
      return ffi::Error::InvalidArgument(std::string(name) +
                                         ": impl=tensor_core needs bfloat16/float16 and "
                                         "head_dim 64, 128 or 256; got head_dim=" +
                                         std::to_string(head_dim));
  }
  return ffi::Error::InvalidArgument(std::string(name) + ": unknown impl " + std::to_string(impl) +
                                     " (expected 0 auto, 1 tensor_core, 2 simple)");
}

// What the CUDA kernels' int indexing and grid can take. Checked on the CPU too, with the
// kernel a GPU would run, so that a call a GPU refuses is refused everywhere.
inline ffi::Error CheckLaunchLimits(const char* name, const Shapes& sh, const Plan& plan,
                                    bool tensor_core) {
  const int64_t blocks_y =
      tensor_core ? sh.kv_heads * plan.row_blocks : sh.q_len * sh.q_heads;
  if (sh.batch > 65535 || blocks_y > 65535) {
    return ffi::Error::InvalidArgument(
        std::string(name) + ": batch " + std::to_string(sh.batch) + " or head blocks " +
        std::to_string(blocks_y) + " (" + (tensor_core ? "kv_heads x row blocks" : "S x q_heads") +
        ") exceed the CUDA grid limit of 65535; split the call (fewer sequences, or fewer "
        "queries per sequence in each call)");
  }
  if (sh.max_tokens > INT32_MAX || sh.head_dim > 4096) {
    return ffi::Error::InvalidArgument(
        std::string(name) + ": max_tokens must be < 2^31 and head_dim <= 4096; got " +
        std::to_string(sh.max_tokens) + ", " + std::to_string(sh.head_dim));
  }
  return ffi::Error::Success();
}

// The XLA workspace result (workspace="xla") must hold the plan's partials; Python sizes
// it from the same plan, so a mismatch means the two halves of jax_vmm disagree.
inline ffi::Error CheckWorkspace(const char* name, size_t workspace_bytes, const Plan& plan) {
  if (static_cast<int64_t>(workspace_bytes) >= plan.workspace_bytes) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(name) + ": workspace result has " +
                                     std::to_string(workspace_bytes) + " bytes, the plan needs " +
                                     std::to_string(plan.workspace_bytes) +
                                     " (Python and C++ plans disagree: rebuild jax_vmm)");
}

}  // namespace jax_vmm::attention
