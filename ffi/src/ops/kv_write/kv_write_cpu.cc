// kv_write CPU handlers (contract in kv_write_common.h). Host memory, synchronous.
#include <cstdint>
#include <cstring>
#include <string>

#include "ops/kv_write/kv_write_common.h"
#include "ops/kv_write/kv_write_targets.h"
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
Dims DimsOfS32(const B& b) {
  auto d = b.dimensions();
  return Dims{d.begin(), static_cast<int64_t>(d.size()),
              static_cast<size_t>(b.element_count()) * sizeof(int32_t),
              static_cast<int>(ffi::DataType::S32)};
}

// Validates every token of both sides, records its status, counts drops and copies the
// valid ones into the side's target (and its second destination).
void RunTokens(const Params& p, Counters& counters) {
  for (const Side& side : p.side) {
    for (int64_t t = 0; t < p.n; ++t) {
      const int32_t st = CheckToken(p.slots[t], p, side);
      if (side.status != nullptr) side.status[t] = st;
      if (st == kDroppedOutOfRange || st == kDroppedUnbacked) {
        counters.host_dropped.fetch_add(1);
        if (side.drop_counter != nullptr)
          __atomic_fetch_add(side.drop_counter, 1ULL, __ATOMIC_RELAXED);
      }
      if (st != kValid) continue;
      const uint64_t offset = static_cast<uint64_t>(p.slots[t]) * p.token_bytes;
      const uint8_t* src = side.src + static_cast<uint64_t>(t) * p.token_bytes;
      if (side.dst != nullptr) std::memcpy(side.dst + offset, src, p.token_bytes);
      if (side.dst2 != nullptr) std::memcpy(side.dst2 + offset, src, p.token_bytes);
    }
  }
}

// The common part of both handlers once the buffers are known.
ffi::Error Run(Op op, Handler h, const Dims dims[5], const Dims* status_dims, const int32_t* slots,
               const SideInput in[2], bool require_arena) {
  Counters& counters = GetCounters(h);
  counters.calls.fetch_add(1);
  Params p;
  Resolution r;
  std::string err = PrepareCall(op, "host", require_arena, dims, status_dims, slots, in, &p, &r);
  if (!err.empty()) return ffi::Error::InvalidArgument(err);
  if (r.alias_miss) counters.alias_misses.fetch_add(1);
  if (r.non_arena) counters.non_arena.fetch_add(1);
  RunTokens(p, counters);
  return ffi::Error::Success();
}

ffi::Error WriteImpl(ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer new_k, ffi::AnyBuffer new_v,
                     ffi::Buffer<ffi::S32> slots, ffi::Result<ffi::AnyBuffer> k_out,
                     ffi::Result<ffi::AnyBuffer> v_out, uint64_t dest_k, uint64_t dest_v) {
  const Dims dims[5] = {DimsOf(k), DimsOf(v), DimsOf(new_k), DimsOf(new_v), DimsOfS32(slots)};
  if (k_out->size_bytes() != k.size_bytes() || v_out->size_bytes() != v.size_bytes()) {
    return ffi::Error::InvalidArgument("jax_vmm_kv_write: outputs must match k and v");
  }
  // XLA aliases each output with its operand; if it ever did not, keep the op's meaning.
  if (k_out->untyped_data() != k.untyped_data()) {
    std::memcpy(k_out->untyped_data(), k.untyped_data(), k.size_bytes());
  }
  if (v_out->untyped_data() != v.untyped_data()) {
    std::memcpy(v_out->untyped_data(), v.untyped_data(), v.size_bytes());
  }
  const SideInput in[2] = {
      {dest_k, k_out->untyped_data(), k.size_bytes(), new_k.untyped_data(), nullptr},
      {dest_v, v_out->untyped_data(), v.size_bytes(), new_v.untyped_data(), nullptr}};
  return Run(Op::kWrite, Handler::kWrite, dims, nullptr, slots.typed_data(), in, false);
}

ffi::Error WriteThroughImpl(ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer new_k,
                            ffi::AnyBuffer new_v, ffi::Buffer<ffi::S32> slots,
                            ffi::Result<ffi::Buffer<ffi::S32>> status, bool require_arena,
                            uint64_t dest_k, uint64_t dest_v) {
  const Dims dims[5] = {DimsOf(k), DimsOf(v), DimsOf(new_k), DimsOf(new_v), DimsOfS32(slots)};
  const Dims status_dims = DimsOfS32(*status);
  if (status_dims.rank != 2 || status_dims.d[0] != 2) {
    return ffi::Error::InvalidArgument("jax_vmm_kv_write_through: status must be (2, n)");
  }
  const int64_t n = status_dims.d[1];
  const SideInput in[2] = {
      {dest_k, k.untyped_data(), k.size_bytes(), new_k.untyped_data(), status->typed_data()},
      {dest_v, v.untyped_data(), v.size_bytes(), new_v.untyped_data(), status->typed_data() + n}};
  return Run(Op::kWriteThrough, Handler::kWriteThrough, dims, &status_dims, slots.typed_data(), in,
             require_arena);
}

}  // namespace
}  // namespace jax_vmm::kv

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmKvWriteCpu, jax_vmm::kv::WriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // k
                                  .Arg<ffi::AnyBuffer>()         // v
                                  .Arg<ffi::AnyBuffer>()         // new_k
                                  .Arg<ffi::AnyBuffer>()         // new_v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots
                                  .Ret<ffi::AnyBuffer>()         // k (aliases operand 0)
                                  .Ret<ffi::AnyBuffer>()         // v (aliases operand 1)
                                  .Attr<uint64_t>("dest_k")
                                  .Attr<uint64_t>("dest_v"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmKvWriteThroughCpu, jax_vmm::kv::WriteThroughImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // k
                                  .Arg<ffi::AnyBuffer>()         // v
                                  .Arg<ffi::AnyBuffer>()         // new_k
                                  .Arg<ffi::AnyBuffer>()         // new_v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots
                                  .Ret<ffi::Buffer<ffi::S32>>()  // status (2, n)
                                  .Attr<bool>("require_arena")
                                  .Attr<uint64_t>("dest_k")
                                  .Attr<uint64_t>("dest_v"));

namespace jax_vmm::kv {

void AddCpuTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_kv_write_through", "cpu", JaxVmmKvWriteThroughCpu);
  registry.Add("jax_vmm_kv_write", "cpu", JaxVmmKvWriteCpu);
}

}  // namespace jax_vmm::kv
