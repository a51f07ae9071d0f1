// kv_write CPU handlers (contract in kv_write_common.h). Host memory, synchronous.
#include <cstdint>
#include <cstring>
#include <string>

#include "jax_vmm/ffi_targets.h"
#include "kv_write_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_vmm::kv {
namespace {

Dims DimsOf(const ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  return Dims{d.begin(), static_cast<int64_t>(d.size()), b.size_bytes(),
              static_cast<int>(b.element_type())};
}

template <typename B>
Dims DimsOfTyped(const B& b) {
  auto d = b.dimensions();
  return Dims{d.begin(), static_cast<int64_t>(d.size()),
              static_cast<size_t>(b.element_count()) * sizeof(int32_t),
              static_cast<int>(ffi::DataType::S32)};
}

// Validates (and for write-through, writes) every token of both sides.
void RunTokens(const Params& p, bool apply) {
  for (int s = 0; s < 2; ++s) {
    const Side& side = p.side[s];
    for (int64_t t = 0; t < p.n; ++t) {
      int32_t st;
      if (apply) {
        st = side.status[t];
      } else {
        st = CheckToken(p.slots[t], p, side);
        side.status[t] = st;
        if (st == kDroppedOutOfRange || st == kDroppedUnbacked) {
          GetCounters(Handler::kWriteThrough).host_dropped.fetch_add(1);
          if (side.drop_counter != nullptr) {
            __atomic_fetch_add(side.drop_counter, 1ULL, __ATOMIC_RELAXED);
          }
        }
      }
      if (st != kValid || side.dst == nullptr) continue;
      std::memcpy(side.dst + static_cast<uint64_t>(p.slots[t]) * p.token_bytes,
                  side.src + static_cast<uint64_t>(t) * p.token_bytes, p.token_bytes);
    }
  }
}

ffi::Error WriteThroughImpl(ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer new_k,
                            ffi::AnyBuffer new_v, ffi::Buffer<ffi::S32> slots,
                            ffi::Result<ffi::Buffer<ffi::S32>> status, bool require_arena) {
  Counters& counters = GetCounters(Handler::kWriteThrough);
  counters.calls.fetch_add(1);
  const Dims status_dims = DimsOfTyped(*status);
  Geometry g;
  std::string err = CheckGeometry("jax_vmm_kv_write_through", DimsOf(k), DimsOf(v),
                                  DimsOf(new_k), DimsOf(new_v), DimsOfTyped(slots),
                                  &status_dims, &g);
  if (!err.empty()) return ffi::Error::InvalidArgument(err);

  Params p;
  p.slots = slots.typed_data();
  p.n = g.n;
  p.num_slots = g.num_slots;
  p.token_bytes = g.token_bytes;
  p.unchecked = DebugUnchecked();
  ffi::AnyBuffer* caches[2] = {&k, &v};
  ffi::AnyBuffer* news[2] = {&new_k, &new_v};
  bool all_arena = true;
  for (int s = 0; s < 2; ++s) {
    Side& side = p.side[s];
    const bool arena = ResolveArenaSide(caches[s]->untyped_data(), caches[s]->size_bytes(),
                                        "host", &side);
    all_arena = all_arena && arena;
    side.src = static_cast<const uint8_t*>(news[s]->untyped_data());
    side.status = status->typed_data() + s * g.n;
  }
  if (!all_arena) {
    counters.non_arena.fetch_add(1);
    if (require_arena) {
      return ffi::Error::InvalidArgument(
          "jax_vmm.kv_write_through: the cache operand is not memory of a jax_vmm arena "
          "(XLA handed the custom call a copy). Pass the arena views (kv.k[l], kv.v[l]) "
          "directly as jit arguments, do not update them elsewhere in the same program, "
          "and on CPU do not donate them (PjRt copies donated external buffers).");
    }
  }
  RunTokens(p, /*apply=*/false);
  return ffi::Error::Success();
}

ffi::Error WriteImpl(ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer new_k,
                     ffi::AnyBuffer new_v, ffi::Buffer<ffi::S32> slots,
                     ffi::Buffer<ffi::S32> status, ffi::Result<ffi::AnyBuffer> k_out,
                     ffi::Result<ffi::AnyBuffer> v_out) {
  Counters& counters = GetCounters(Handler::kWrite);
  counters.calls.fetch_add(1);
  const Dims status_dims = DimsOfTyped(status);
  Geometry g;
  std::string err =
      CheckGeometry("jax_vmm_kv_write", DimsOf(k), DimsOf(v), DimsOf(new_k), DimsOf(new_v),
                    DimsOfTyped(slots), &status_dims, &g);
  if (!err.empty()) return ffi::Error::InvalidArgument(err);
  if (k_out->size_bytes() != k.size_bytes() || v_out->size_bytes() != v.size_bytes()) {
    return ffi::Error::InvalidArgument("jax_vmm_kv_write: outputs must match k and v");
  }

  Params p;
  p.slots = slots.typed_data();
  p.n = g.n;
  p.num_slots = g.num_slots;
  p.token_bytes = g.token_bytes;
  ffi::AnyBuffer* ins[2] = {&k, &v};
  ffi::Result<ffi::AnyBuffer>* outs[2] = {&k_out, &v_out};
  ffi::AnyBuffer* news[2] = {&new_k, &new_v};
  bool miss = false;
  for (int s = 0; s < 2; ++s) {
    void* out = (*outs[s])->untyped_data();
    // XLA aliases the output with operand s; a different pointer would mean it did
    // not, so copy the operand first to keep the op's meaning (defensive).
    if (out != ins[s]->untyped_data()) {
      std::memcpy(out, ins[s]->untyped_data(), ins[s]->size_bytes());
    }
    Side probe;
    const bool arena = ResolveArenaSide(out, (*outs[s])->size_bytes(), "host", &probe);
    Side& side = p.side[s];
    // Arena output: the write-through call already wrote these tokens into this very
    // buffer. Otherwise XLA handed us a copy: apply the valid tokens to it.
    side.dst = arena ? nullptr : static_cast<uint8_t*>(out);
    side.src = static_cast<const uint8_t*>(news[s]->untyped_data());
    side.status = const_cast<int32_t*>(status.typed_data()) + s * g.n;
    miss = miss || !arena;
  }
  if (miss) {
    counters.alias_misses.fetch_add(1);
    RunTokens(p, /*apply=*/true);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_vmm::kv

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmKvWriteThroughCpu, jax_vmm::kv::WriteThroughImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // k
                                  .Arg<ffi::AnyBuffer>()         // v
                                  .Arg<ffi::AnyBuffer>()         // new_k
                                  .Arg<ffi::AnyBuffer>()         // new_v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots
                                  .Ret<ffi::Buffer<ffi::S32>>()  // status (2, n)
                                  .Attr<bool>("require_arena"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmKvWriteCpu, jax_vmm::kv::WriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // k
                                  .Arg<ffi::AnyBuffer>()         // v
                                  .Arg<ffi::AnyBuffer>()         // new_k
                                  .Arg<ffi::AnyBuffer>()         // new_v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots
                                  .Arg<ffi::Buffer<ffi::S32>>()  // status (2, n)
                                  .Ret<ffi::AnyBuffer>()         // k (aliases operand 0)
                                  .Ret<ffi::AnyBuffer>());       // v (aliases operand 1)

JAX_VMM_FFI_TARGET("jax_vmm_kv_write_through", "cpu", JaxVmmKvWriteThroughCpu);
JAX_VMM_FFI_TARGET("jax_vmm_kv_write", "cpu", JaxVmmKvWriteCpu);
