#include "ops/kv_cache/kv_cache_call.h"

#include <cstring>
#include <string>

#include "common/format.h"
#include "jax_vmm/arena.h"

namespace jax_vmm::kvcache {
namespace {

const char* kRemedy =
    ": a KVCache names its KV arena for good. Build the cache of an open KV arena "
    "(kv.cache()) and trace the step again";

std::string Describe(uint64_t cache_uid) { return "KV cache " + std::to_string(cache_uid); }

// The buffer with this uid must be the cache's, in an open arena, where the cache says.
std::string CheckBuffer(const char* op, const CacheLayer& c, char side, uint64_t uid,
                        uintptr_t address, bool pin) {
  address -= c.cache->geometry().layer_offset(c.layer, side == 'k' ? 0 : 1);  // the base
  BufferRef ref;
  // Built on failure only: every step's initialize stage comes through here.
  const auto pre = [&] {
    return std::string(op) + ": " + Describe(c.cache->uid()) + " layer " +
           std::to_string(c.layer) + " " + side + " buffer (uid " + std::to_string(uid) + ") ";
  };
  switch (FindArenaBufferByUid(uid, &ref, /*name=*/nullptr, pin)) {
    case UidLookup::kClosed:
      return pre() + "belongs to an arena that was closed" + kRemedy;
    case UidLookup::kGone:
      return pre() + "no longer exists" + kRemedy;
    case UidLookup::kFound:
      break;
  }
  if (ref.buffer_base != address || ref.buffer_bytes < c.cache->geometry().buffer_bytes()) {
    return pre() + "is not where the cache placed it (" + Hex(ref.buffer_base) +
           ", expected " + Hex(address) + "): the arena was changed behind the KV cache";
  }
  return "";
}

}  // namespace

std::string ResolveCacheLayer(const char* op, const char* driver_kind, int device_ordinal,
                              uint64_t cache_uid, int64_t layer, bool pin, CacheLayer* out) {
  const auto pre = [&] { return std::string(op) + ": " + Describe(cache_uid); };
  std::shared_ptr<KvCache> cache;
  switch (FindKvCache(cache_uid, device_ordinal, &cache)) {
    case CacheLookup::kGone:
      return pre() +
             " no longer exists (its KV arena was closed and collected; a cache does not keep"
             " its KVArena alive: hold a reference to it while the cache is used)" +
             kRemedy;
    case CacheLookup::kClosed:
      return pre() + " was closed (kv.close())" + kRemedy;
    case CacheLookup::kOtherDevice:
      return pre() + " lives on " + cache->driver_kind() + " device " +
             std::to_string(cache->device_ordinal()) + ", but the call runs on device " +
             std::to_string(device_ordinal) +
             ": run the step on the KV arena's device (its inputs there, e.g. "
             "jax.device_put(x, kv.arena.device))";
    case CacheLookup::kFound:
      break;
  }
  if (std::strcmp(cache->driver_kind(), driver_kind) != 0) {
    return pre() + " is memory of a " + cache->driver_kind() + " arena, but the call runs on " +
           driver_kind + ": run the step on the KV arena's device";
  }
  const Geometry& g = cache->geometry();
  if (layer < 0 || layer >= g.num_layers) {
    return pre() + " has " + std::to_string(g.num_layers) + " layers; the call names layer " +
           std::to_string(layer);
  }
  out->cache = cache;
  out->layer = layer;
  out->buffers = cache->layer(layer);
  out->dims = g.dims();
  if (std::string err = CheckBuffer(op, *out, 'k', out->buffers.k_uid, out->buffers.k_address, pin);
      !err.empty()) {
    return err;
  }
  if (std::string err = CheckBuffer(op, *out, 'v', out->buffers.v_uid, out->buffers.v_address, pin);
      !err.empty()) {
    return err;
  }
  if (pin) cache->PinMetadataForGraphs();
  return "";
}

XLA_FFI_Buffer LayerBuffer(void* data, int dtype, std::vector<int64_t>& dims) {
  XLA_FFI_Buffer b;
  b.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
  b.extension_start = nullptr;
  b.dtype = static_cast<XLA_FFI_DataType>(dtype);
  b.data = data;
  b.rank = static_cast<int64_t>(dims.size());
  b.dims = dims.data();
  return b;
}

}  // namespace jax_vmm::kvcache
