// The unchecked kv_write CUDA targets: the production kernel template
// (ops/kv_write/kv_write_kernel.cuh) and host handlers (kv_write_cuda.h) with
// UncheckedTokens.
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/kv_write/kv_write_cuda.h"
#include "ops/kv_write/kv_write_ffi.h"
#include "ops/kv_write/kv_write_kernel.cuh"
#include "testing/kv_write_unchecked.h"
#include "testing/testing_targets.h"

namespace jax_vmm::testing {
namespace {

struct UncheckedOnDevice {
  static __device__ int32_t Check(int32_t slot, const kv::Params& p, const kv::Side& s) {
    return UncheckedTokens::Check(slot, p, s);
  }
  static __device__ void CountDrop() {}  // never called: unchecked writes drop nothing
};

}  // namespace

cudaError_t LaunchKvWriteUnchecked(const kv::Params& p, cudaStream_t stream) {
  return kv::kernels::LaunchKvKernel<UncheckedOnDevice>(p, stream);
}

}  // namespace jax_vmm::testing

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxVmmTestingKvWriteThroughUncheckedCuda,
    jax_vmm::kv::CudaWriteThroughImpl<jax_vmm::testing::LaunchKvWriteUnchecked>,
    jax_vmm::kv::BindWriteThrough(jax_vmm::kv::BindCudaContext()),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmTestingKvWriteUncheckedCuda,
                              jax_vmm::kv::CudaWriteImpl<jax_vmm::testing::LaunchKvWriteUnchecked>,
                              jax_vmm::kv::BindWrite(jax_vmm::kv::BindCudaContext()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

void jax_vmm::testing::AddUncheckedKvWriteCudaTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_testing_kv_write_unchecked", "CUDA", JaxVmmTestingKvWriteUncheckedCuda);
  registry.Add("jax_vmm_testing_kv_write_through_unchecked", "CUDA",
               JaxVmmTestingKvWriteThroughUncheckedCuda);
}
