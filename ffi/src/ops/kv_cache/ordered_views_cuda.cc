// The CUDA targets of jax_vmm_kv_cache_check_views (ordered_views.h): host checks only, no
// device work (a decode step runs one check per layer; a memset would be one more node of
// its command buffer per layer); command-buffer compatible (a replay runs no host code,
// and XLA re-records when the buffers it hands over move).
//
// jax_vmm_kv_cache_check_views_recorded is the same check with XLA's record stage
// (common/ffi_record_stage.h): in a command buffer it checks when XLA records or updates
// the call and records no command, so the step's graph has no node for it and an update
// costs one host check instead of a child graph's re-trace and update. XLA orders the
// commands after it by its own dependencies.
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "common/ffi_record_stage.h"
#include "ops/kv_cache/kv_cache_targets.h"
#include "ops/kv_cache/ordered_views.h"

namespace jax_vmm::kvcache {
namespace {

std::atomic<int64_t> g_record_checks{0};

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

#ifdef JAX_VMM_HAVE_FFI_RECORD
ffi::Error CheckViewsRecordCuda(int32_t device, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> result,
                                uint64_t cache_uid, int64_t layer) {
  g_record_checks.fetch_add(1, std::memory_order_relaxed);
  return CheckViewsCuda(nullptr, device, k, v, token, result, cache_uid, layer);
}
#endif

}  // namespace

int64_t CheckViewsRecordCalls() { return g_record_checks.load(std::memory_order_relaxed); }

}  // namespace jax_vmm::kvcache

#ifdef JAX_VMM_HAVE_FFI_RECORD
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxVmmKvCacheCheckViewsRecordCuda, jax_vmm::kvcache::CheckViewsRecordCuda,
    jax_vmm::kvcache::BindCheckViews(
        xla::ffi::Ffi::BindRecord().Ctx<xla::ffi::DeviceOrdinal>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
#endif

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxVmmKvCacheCheckViewsCuda, jax_vmm::kvcache::CheckViewsCuda,
    jax_vmm::kvcache::BindCheckViews(xla::ffi::Ffi::Bind()
                                         .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                         .Ctx<xla::ffi::DeviceOrdinal>()),
    {xla::ffi::Traits::kCmdBufferCompatible});

namespace jax_vmm::kvcache {

void AddCudaTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_kv_cache_check_views", "CUDA", JaxVmmKvCacheCheckViewsCuda);
#ifdef JAX_VMM_HAVE_FFI_RECORD
  record_stage::Add({"jax_vmm_kv_cache_check_views_recorded", JaxVmmKvCacheCheckViewsCuda,
                     JaxVmmKvCacheCheckViewsRecordCuda});
#endif
  AddReadLengthsCudaTarget(registry);
}

}  // namespace jax_vmm::kvcache
