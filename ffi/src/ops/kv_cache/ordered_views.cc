// The host checks of jax_vmm_kv_cache_check_views (ordered_views.h) and its CPU target.
#include "ops/kv_cache/ordered_views.h"

#include <string>

#include "common/format.h"
#include "jax_vmm/arena.h"
#include "ops/kv_cache/kv_cache_call.h"
#include "ops/kv_cache/kv_cache_targets.h"

namespace jax_vmm::kvcache {
namespace {

constexpr const char* kOp = "jax_vmm.ordered_views";

// What XLA handed over at `ptr`, for the message.
std::string WhatIsAt(uintptr_t ptr, size_t bytes) {
  BufferRef ref;
  std::string name;
  if (FindArenaBuffer(ptr, bytes, &ref) &&
      FindArenaBufferByUid(ref.buffer_uid, &ref, &name) == UidLookup::kFound) {
    return "a view of arena buffer '" + name + "' (uid " + std::to_string(ref.buffer_uid) + ")";
  }
  return "memory outside the arena (XLA's copy: on the CPU a donated view is copied, and a "
         "view updated by another op of the step is too)";
}

std::string CheckSide(const CacheLayer& c, char side, const ffi::AnyBuffer& x, uintptr_t want) {
  const uintptr_t got = reinterpret_cast<uintptr_t>(x.untyped_data());
  const size_t bytes = c.cache->geometry().buffer_bytes();
  if (got == want && x.size_bytes() == bytes) return "";
  return std::string(kOp) + ": the " + side + " handed over (" + Hex(got) + ", " +
         std::to_string(x.size_bytes()) + " bytes) is " + WhatIsAt(got, x.size_bytes()) +
         ", not KV cache " + std::to_string(c.cache->uid()) + " layer " + std::to_string(c.layer) +
         "'s " + side + " buffer (" + Hex(want) + ", " + std::to_string(bytes) +
         " bytes). Pass kv.k[layer] and kv.v[layer] of that layer as jit arguments, neither "
         "donated nor returned nor updated by the step";
}

ffi::Error CheckViewsCpu(int32_t device, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer token,
                         ffi::Result<ffi::AnyBuffer> result, uint64_t cache_uid, int64_t layer) {
  (void)token;   // orders the call after the layer's writes
  (void)result;  // carries no value (ordered_views.h)
  if (std::string err = CheckOrderedViews("host", device, cache_uid, layer, k, v); !err.empty()) {
    return ffi::Error::InvalidArgument(err);
  }
  return ffi::Error::Success();
}

}  // namespace

std::string CheckOrderedViews(const char* driver_kind, int device, uint64_t cache_uid,
                              int64_t layer, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v) {
  CacheLayer c;
  if (std::string err = ResolveCacheLayer(kOp, driver_kind, device, cache_uid, layer, false, &c);
      !err.empty()) {
    return err;
  }
  if (std::string err = CheckSide(c, 'k', k, c.buffers.k_address); !err.empty()) return err;
  return CheckSide(c, 'v', v, c.buffers.v_address);
}

}  // namespace jax_vmm::kvcache

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxVmmKvCacheCheckViewsCpu, jax_vmm::kvcache::CheckViewsCpu,
    jax_vmm::kvcache::BindCheckViews(xla::ffi::Ffi::Bind().Ctx<xla::ffi::DeviceOrdinal>()));

namespace jax_vmm::kvcache {

void AddCpuTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_kv_cache_check_views", "cpu", JaxVmmKvCacheCheckViewsCpu);
}

}  // namespace jax_vmm::kvcache
