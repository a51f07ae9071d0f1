// The CUDA target of jax_vmm_kv_cache_check_views (ordered_views.h): host checks only, no
// device work (a decode step runs one check per layer; a memset would be one more node of
// its command buffer per layer); command-buffer compatible (a replay runs no host code,
// and XLA re-records when the buffers it hands over move).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "ops/kv_cache/kv_cache_targets.h"
#include "ops/kv_cache/ordered_views.h"

namespace jax_vmm::kvcache {
namespace {

ffi::Error CheckViewsCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> result,
                          uint64_t cache_uid, int64_t layer) {
  (void)stream;
  (void)token;   // orders the call after the layer's writes
  (void)result;  // carries no value (ordered_views.h)
  if (std::string err = CheckOrderedViews("cuda", device, cache_uid, layer, k, v); !err.empty()) {
    return ffi::Error::InvalidArgument(err);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_vmm::kvcache

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxVmmKvCacheCheckViewsCuda, jax_vmm::kvcache::CheckViewsCuda,
    jax_vmm::kvcache::BindCheckViews(xla::ffi::Ffi::Bind()
                                         .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                         .Ctx<xla::ffi::DeviceOrdinal>()),
    {xla::ffi::Traits::kCmdBufferCompatible});

namespace jax_vmm::kvcache {

void AddCudaTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_kv_cache_check_views", "CUDA", JaxVmmKvCacheCheckViewsCuda);
  AddReadLengthsCudaTarget(registry);
}

}  // namespace jax_vmm::kvcache
