// The kv_write CPU handlers (contract in kv_write.h): host memory, synchronous. Their
// bodies take the per-token check as a template argument (Tokens::Check, see
// CheckedTokens) so that the testing layer instantiates an unchecked variant from the
// same code; production instantiates CheckedTokens only (kv_write_cpu.cc).
#pragma once

#include <cstdint>
#include <cstring>

#include "ops/kv_write/kv_write.h"
#include "ops/kv_write/kv_write_ffi.h"
#include "ops/kv_write/kv_write_stats.h"
#include "xla/ffi/api/ffi.h"

namespace jax_vmm::kv {

// Validates every token of both sides, records its status, counts drops and copies the
// valid ones into the side's target (and its second destination).
template <typename Tokens>
void WriteTokensOnHost(const Params& p, Counters& counters) {
  for (const Side& side : p.side) {
    for (int64_t t = 0; t < p.n; ++t) {
      const int32_t st = Tokens::Check(p.slots[t], p, side);
      if (side.status != nullptr) side.status[t] = st;
      if (IsDropped(st)) {
        counters.host_dropped.fetch_add(1);
        if (side.drop_counter != nullptr) {
          __atomic_fetch_add(side.drop_counter, 1ULL, __ATOMIC_RELAXED);
        }
      }
      if (st != kValid) continue;
      const uint64_t offset = static_cast<uint64_t>(p.slots[t]) * p.token_bytes;
      const uint8_t* src = side.src + static_cast<uint64_t>(t) * p.token_bytes;
      if (side.dst != nullptr) std::memcpy(side.dst + offset, src, p.token_bytes);
      if (side.dst2 != nullptr) std::memcpy(side.dst2 + offset, src, p.token_bytes);
    }
  }
}

using HostTokenWriter = void (*)(const Params&, Counters&);

ffi::Error CpuWrite(HostTokenWriter write, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer new_k,
                    ffi::AnyBuffer new_v, ffi::Buffer<ffi::S32> slots,
                    ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                    const Dest& dest);

ffi::Error CpuWriteThrough(HostTokenWriter write, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer new_k, ffi::AnyBuffer new_v, ffi::Buffer<ffi::S32> slots,
                           ffi::Result<ffi::Buffer<ffi::S32>> status, bool require_arena,
                           const Dest& dest);

// The handler functions XLA_FFI_DEFINE_HANDLER_SYMBOL binds (with BindWrite /
// BindWriteThrough of kv_write_ffi.h).
template <typename Tokens>
ffi::Error CpuWriteImpl(ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer new_k,
                        ffi::AnyBuffer new_v, ffi::Buffer<ffi::S32> slots,
                        ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                        uint64_t dest_k, uint64_t dest_v, uint64_t dest_k_uid,
                        uint64_t dest_v_uid) {
  return CpuWrite(WriteTokensOnHost<Tokens>, k, v, new_k, new_v, slots, k_out, v_out,
                  Dest{dest_k, dest_v, dest_k_uid, dest_v_uid});
}

template <typename Tokens>
ffi::Error CpuWriteThroughImpl(ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer new_k,
                               ffi::AnyBuffer new_v, ffi::Buffer<ffi::S32> slots,
                               ffi::Result<ffi::Buffer<ffi::S32>> status, bool require_arena,
                               uint64_t dest_k, uint64_t dest_v, uint64_t dest_k_uid,
                               uint64_t dest_v_uid) {
  return CpuWriteThrough(WriteTokensOnHost<Tokens>, k, v, new_k, new_v, slots, status,
                         require_arena, Dest{dest_k, dest_v, dest_k_uid, dest_v_uid});
}

}  // namespace jax_vmm::kv
