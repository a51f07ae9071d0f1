// The CUDA handler of jax_vmm_kv_cache_read_lengths (read_lengths.h).
#include "ops/kv_cache/read_lengths.h"

#include <string>

#include "ops/kv_cache/kv_cache_call.h"
#include "ops/kv_cache/kv_cache_kernels.h"
#include "ops/kv_cache/kv_cache_targets.h"

namespace jax_vmm::kvcache {

ffi::Error ReadLengthsCudaExecute(bool use_limits, cudaStream_t stream, int32_t device,
                                  ffi::Buffer<ffi::S32> lengths,
                                  ffi::Result<ffi::Buffer<ffi::S32>> read_lengths,
                                  uint64_t cache_uid) {
  constexpr const char* kName = "jax_vmm_kv_cache_read_lengths (CUDA)";
  CacheLayer call;  // layer 0 stands for the cache: its table is shared by every layer
  if (std::string err =
          ResolveCacheLayer(kName, "cuda", device, cache_uid, 0, /*pin=*/true, &call);
      !err.empty()) {
    return ffi::Error::InvalidArgument(err);
  }
  const Geometry& g = call.cache->geometry();
  const size_t batch = static_cast<size_t>(g.max_seqs);
  if (!g.per_sequence || lengths.element_count() != batch ||
      read_lengths->element_count() != batch) {
    return ffi::Error::InvalidArgument(
        std::string(kName) + ": lengths must be (" + std::to_string(batch) +
        ",), one per sequence of a KV arena with one buffer row per sequence");
  }
  if (cudaError_t e = LaunchClampLengths(
          lengths.typed_data(), use_limits ? call.cache->device_read_limits() : nullptr,
          read_lengths->typed_data(), static_cast<int>(batch), static_cast<int>(g.max_tokens),
          call.cache->device_read_clamps(), stream);
      e != cudaSuccess) {
    return ffi::Error::Internal(std::string(kName) + ": clamp kernel launch failed: " +
                                cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

}  // namespace jax_vmm::kvcache

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxVmmKvCacheReadLengthsCuda, jax_vmm::kvcache::ReadLengthsCuda<true>,
    jax_vmm::kvcache::BindReadLengths(xla::ffi::Ffi::Bind()),
    {xla::ffi::Traits::kCmdBufferCompatible});

namespace jax_vmm::kvcache {

void AddReadLengthsCudaTarget(FfiRegistry& registry) {
  registry.Add("jax_vmm_kv_cache_read_lengths", "CUDA", JaxVmmKvCacheReadLengthsCuda);
}

}  // namespace jax_vmm::kvcache
