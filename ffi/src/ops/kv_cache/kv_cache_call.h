// How a handler of a KVCache-layer op (kv_write on a layer, decode attention over a
// layer, ordered views) finds what its static attributes name: the cache by (uid,
// device ordinal), then the layer's two buffers, checked against the arena registry by
// their uids (an arena closed behind the cache's back is refused too). Shared by the
// CPU and CUDA handlers of kv_write and attention.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ops/kv_cache/kv_cache.h"
#include "xla/ffi/api/c_api.h"

namespace jax_vmm::kvcache {

// One layer of a cache, resolved for one call. Holds the cache while the handler runs.
struct CacheLayer {
  std::shared_ptr<KvCache> cache;
  int64_t layer = 0;
  LayerBuffers buffers;
  std::vector<int64_t> dims;  // the shape of each buffer (Geometry::dims)
};

// Resolves layer `layer` of cache `cache_uid` for `op` (named in errors) running on
// `driver_kind` ("host" or "cuda") device `device_ordinal`. Returns an error message
// (empty on success) naming what was wrong and what to do: a closed or destroyed cache,
// another device or platform, a layer out of range, a buffer whose arena is gone.
// pin: the handler may be recorded into a CUDA graph (pins the arena's and the cache's
// metadata, see PinMetadataForGraphs).
std::string ResolveCacheLayer(const char* op, const char* driver_kind, int device_ordinal,
                              uint64_t cache_uid, int64_t layer, bool pin, CacheLayer* out);

// An XLA_FFI_Buffer over `data` with the layer's shape and `dtype` (an XLA_FFI_DataType),
// so that handler bodies written for operands read the arena buffer itself. `dims` must
// outlive the buffer.
XLA_FFI_Buffer LayerBuffer(void* data, int dtype, std::vector<int64_t>& dims);

}  // namespace jax_vmm::kvcache
