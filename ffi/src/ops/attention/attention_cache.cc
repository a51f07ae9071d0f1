// What the CPU and CUDA handlers of decode attention over a KVCache layer share
// (attention_cache.h): the layer's resolution and the host clamp of the lengths.
#include "ops/attention/attention_cache.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/format.h"

namespace jax_vmm::attention {

namespace {

// What both preparations share: the layer resolved for `op` (pinned for a CUDA graph), a
// per-sequence layout, lengths and read_lengths of shape (B,), and the layer's buffers as
// FFI buffers. An error message, or "".
std::string ResolveLayer(const char* op, const char* driver_kind, int device, uint64_t cache_uid,
                         int64_t layer, const ffi::Buffer<ffi::S32>& lengths,
                         const ffi::Buffer<ffi::S32>& read_lengths, CacheAttention* out) {
  const bool cuda = std::strcmp(driver_kind, "cuda") == 0;
  if (std::string err =
          kvcache::ResolveCacheLayer(op, driver_kind, device, cache_uid, layer, cuda, &out->layer);
      !err.empty()) {
    return err;
  }
  const kvcache::Geometry& g = out->layer.cache->geometry();
  // Built on failure only: every step's initialize stage comes through here.
  const auto who = [op] { return std::string(op) + ": "; };
  if (!g.per_sequence) {
    return who() +
           "attention needs a KV arena with one buffer row per sequence "
           "(kv_arena(..., max_seqs=batch))";
  }
  for (auto d : {lengths.dimensions(), read_lengths.dimensions()}) {
    if (d.size() != 1 || d[0] != g.max_seqs) {
      return who() + "lengths must be (" + std::to_string(g.max_seqs) + ",), got " +
             ShapeString(d.begin(), d.size());
    }
  }
  out->k = kvcache::LayerBuffer(reinterpret_cast<void*>(out->layer.buffers.k_address), g.dtype,
                                out->layer.dims);
  out->v = kvcache::LayerBuffer(reinterpret_cast<void*>(out->layer.buffers.v_address), g.dtype,
                                out->layer.dims);
  return "";
}

}  // namespace

std::string PrepareCacheAttention(const char* op, const char* driver_kind, int device,
                                  uint64_t cache_uid, int64_t layer, const ffi::AnyBuffer& q,
                                  const ffi::Buffer<ffi::S32>& lengths,
                                  const ffi::Buffer<ffi::S32>& read_lengths, CacheAttention* out) {
  if (std::string err =
          ResolveLayer(op, driver_kind, device, cache_uid, layer, lengths, read_lengths, out);
      !err.empty()) {
    return err;
  }
  const int64_t B = out->batch();
  auto qd = q.dimensions();
  if ((qd.size() != 3 && qd.size() != 4) || qd[0] != B) {
    return std::string(op) + ": q must be (" + std::to_string(B) + ", H_q, D) or (" +
           std::to_string(B) + ", S, H_q, D), queries of every sequence of the KV cache; got " +
           ShapeString(qd.begin(), qd.size());
  }
  return "";
}

std::string PrepareCacheCopy(const char* op, const char* driver_kind, int device,
                             uint64_t cache_uid, int64_t layer,
                             const ffi::Buffer<ffi::S32>& lengths, const ffi::AnyBuffer& k_out,
                             const ffi::AnyBuffer& v_out,
                             const ffi::Buffer<ffi::S32>& read_lengths, CacheAttention* out) {
  if (std::string err =
          ResolveLayer(op, driver_kind, device, cache_uid, layer, lengths, read_lengths, out);
      !err.empty()) {
    return err;
  }
  if (out->batch() > 65535) {  // the copy kernel's grid.y
    return std::string(op) + ": at most 65535 sequences, got " + std::to_string(out->batch());
  }
  const std::vector<int64_t>& dims = out->layer.dims;
  const int dtype = out->layer.cache->geometry().dtype;
  for (const ffi::AnyBuffer* b : {&k_out, &v_out}) {
    auto d = b->dimensions();
    if (static_cast<int>(b->element_type()) != dtype ||
        !std::equal(d.begin(), d.end(), dims.begin(), dims.end())) {
      return std::string(op) + ": the copies must have the layer's shape " +
             ShapeString(dims.data(), dims.size()) + " and dtype; got " +
             ShapeString(d.begin(), d.size());
    }
  }
  return "";
}

int32_t TokenEpochOnHost(const ffi::AnyBuffer& token) {
  if (token.element_type() != ffi::DataType::S32 || token.size_bytes() < sizeof(int32_t)) return -1;
  int32_t epoch = 0;
  std::memcpy(&epoch, token.untyped_data(), sizeof(epoch));
  return epoch;
}

void ClampLengthsOnHost(const CacheAttention& call, const int32_t* lengths, int32_t* read,
                        bool use_limits, int32_t epoch) {
  const int64_t T = call.max_tokens();
  // Held for the call: a kept table stays alive while this reader uses it.
  const std::shared_ptr<const std::vector<int32_t>> kept =
      use_limits ? call.layer.cache->ReadTableOf(epoch) : nullptr;
  const int32_t* limits =
      kept != nullptr ? kept->data() : call.layer.cache->device_limits();  // host memory
  unsigned long long clamped = 0;
  for (int64_t b = 0; b < call.batch(); ++b) {
    const int64_t n = std::clamp<int64_t>(lengths[b], 0, T);
    if (!use_limits) {
      read[b] = static_cast<int32_t>(n);
      continue;
    }
    const int32_t ensured = __atomic_load_n(limits + b, __ATOMIC_RELAXED);
    if (lengths[b] > ensured) ++clamped;
    read[b] = static_cast<int32_t>(std::min<int64_t>(n, ensured));
  }
  if (clamped != 0) {
    __atomic_fetch_add(call.layer.cache->device_read_clamps(), clamped, __ATOMIC_RELAXED);
  }
}

}  // namespace jax_vmm::attention
