// The kv_write CPU handlers (contract in kv_write.h): host memory, synchronous. Their
// bodies take the per-token check as a template argument (Tokens::Check, see
// CheckedTokens) so that the testing layer instantiates an unchecked variant from the
// same code; production instantiates CheckedTokens only (kv_write_cpu.cc).
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>

#include "ops/kv_write/kv_write.h"
#include "ops/kv_write/kv_write_call.h"
#include "ops/kv_write/kv_write_ffi.h"
#include "ops/kv_write/kv_write_stats.h"
#include "xla/ffi/api/ffi.h"

namespace jax_vmm::kv {

// Validates every token of both sides, records its status, counts drops and has
// store(side index, token, destination) write each valid one into the side's target (and
// its second destination).
template <typename Tokens, typename Store>
void ForEachValidToken(const Params& p, Counters& counters, const Store& store) {
  for (int si = 0; si < 2; ++si) {
    const Side& side = p.side[si];
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
      const uint64_t offset = static_cast<uint64_t>(p.slots[t]) * side.slot_bytes;
      if (side.dst != nullptr) store(si, t, side.dst + offset);
      if (side.dst2 != nullptr) store(si, t, side.dst2 + offset);
    }
  }
}

// kv_write's tokens: the valid ones copied unchanged.
template <typename Tokens>
void WriteTokensOnHost(const Params& p, Counters& counters) {
  ForEachValidToken<Tokens>(p, counters, [&p](int si, int64_t t, uint8_t* dst) {
    std::memcpy(dst, p.side[si].src + static_cast<uint64_t>(t) * p.token_bytes, p.token_bytes);
  });
}

using HostTokenWriter = void (*)(const Params&, Counters&);

// What every CPU handler does once its operands are unpacked: counts the call, prepares
// it (kv_write_call.h), counts the resolution, then write(params, counters).
ffi::Error RunOnHost(Op op, Handler h, const CallOperands& in, bool require_arena,
                     const std::function<void(const Params&, Counters&)>& write);

// kv_write's results: checks their sizes and, should XLA not alias them with k and v,
// copies k and v into them (the op's meaning). `op` names the op in the error.
ffi::Error PrepareWriteResultsOnHost(const char* op, const ffi::AnyBuffer& k,
                                     const ffi::AnyBuffer& v, ffi::AnyBuffer& k_out,
                                     ffi::AnyBuffer& v_out);

ffi::Error CpuWrite(HostTokenWriter write, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer new_k,
                    ffi::AnyBuffer new_v, ffi::Buffer<ffi::S32> slots,
                    ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                    const Dest& dest);

ffi::Error CpuWriteThrough(HostTokenWriter write, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer new_k, ffi::AnyBuffer new_v, ffi::Buffer<ffi::S32> slots,
                           ffi::Result<ffi::Buffer<ffi::S32>> status, bool require_arena,
                           const Dest& dest);

// kv_write on a KVCache layer (kv_write_cache.h): resolves the layer, writes it with
// `write`, passes the token on.
ffi::Error CpuCacheWrite(HostTokenWriter write, int32_t device, ffi::AnyBuffer new_k,
                         ffi::AnyBuffer new_v, ffi::Buffer<ffi::S32> slots, ffi::AnyBuffer token,
                         ffi::Result<ffi::AnyBuffer> token_out, uint64_t cache_uid, int64_t layer);

// The token result of a cache op: its operand's value (XLA aliases the two).
void PassTokenOnHost(const ffi::AnyBuffer& token, ffi::AnyBuffer& token_out);

// The handler functions XLA_FFI_DEFINE_HANDLER_SYMBOL binds (with BindWrite /
// BindWriteThrough of kv_write_ffi.h, BindCacheWrite of kv_write_cache.h).
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

// kWrite: WriteTokensOnHost<CheckedTokens> in production.
template <HostTokenWriter kWrite>
ffi::Error CpuCacheWriteImpl(int32_t device, ffi::AnyBuffer new_k, ffi::AnyBuffer new_v,
                             ffi::Buffer<ffi::S32> slots, ffi::AnyBuffer token,
                             ffi::Result<ffi::AnyBuffer> token_out, uint64_t cache_uid,
                             int64_t layer) {
  return CpuCacheWrite(kWrite, device, new_k, new_v, slots, token, token_out, cache_uid, layer);
}

}  // namespace jax_vmm::kv
