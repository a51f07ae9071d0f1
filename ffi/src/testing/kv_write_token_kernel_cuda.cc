// The CUDA token-kernel kv_write targets (testing_targets.h): the production host
// handlers (ops/kv_write/kv_write_cuda.h) with the production token kernel forced
// (LaunchKvWriteTokenKernel), the fallback LaunchKvWrite picks only for tokens too large
// for the tiled kernel; so tests reach that path, and benchmarks compare the two kernels.
#include "ops/kv_write/kv_write_cuda.h"
#include "ops/kv_write/kv_write_ffi.h"
#include "ops/kv_write/kv_write_kernels.h"
#include "testing/testing_targets.h"

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxVmmTestingKvWriteThroughTokenKernelCuda,
    jax_vmm::kv::CudaWriteThroughImpl<jax_vmm::kv::LaunchKvWriteTokenKernel>,
    jax_vmm::kv::BindWriteThrough(jax_vmm::kv::BindCudaContext()),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmTestingKvWriteTokenKernelCuda,
                              jax_vmm::kv::CudaWriteImpl<jax_vmm::kv::LaunchKvWriteTokenKernel>,
                              jax_vmm::kv::BindWrite(jax_vmm::kv::BindCudaContext()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

void jax_vmm::testing::AddTokenKernelKvWriteCudaTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_testing_kv_write_token_kernel", "CUDA",
               JaxVmmTestingKvWriteTokenKernelCuda);
  registry.Add("jax_vmm_testing_kv_write_through_token_kernel", "CUDA",
               JaxVmmTestingKvWriteThroughTokenKernelCuda);
}
