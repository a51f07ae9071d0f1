// The address-only kv_write CUDA targets: the production CUDA host handlers and kernel
// (ops/kv_write/kv_write_cuda.h) with the dest resolved by its address alone
// (kv_write_address_only.h).
#include "ops/kv_write/kv_write_cuda.h"
#include "ops/kv_write/kv_write_ffi.h"
#include "ops/kv_write/kv_write_kernels.h"
#include "testing/kv_write_address_only.h"
#include "testing/testing_targets.h"

namespace jax_vmm::testing {
namespace {

namespace ffi = xla::ffi;

ffi::Error Write(cudaStream_t stream, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer new_k,
                 ffi::AnyBuffer new_v, ffi::Buffer<ffi::S32> slots,
                 ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                 uint64_t dest_k, uint64_t dest_v, uint64_t, uint64_t) {
  return kv::CudaWrite(kv::LaunchKvWrite, stream, k, v, new_k, new_v, slots, k_out, v_out,
                       AddressOnly(dest_k, dest_v));
}

ffi::Error WriteThrough(cudaStream_t stream, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer new_k, ffi::AnyBuffer new_v, ffi::Buffer<ffi::S32> slots,
                        ffi::Result<ffi::Buffer<ffi::S32>> status, bool require_arena,
                        uint64_t dest_k, uint64_t dest_v, uint64_t, uint64_t) {
  return kv::CudaWriteThrough(kv::LaunchKvWrite, stream, k, v, new_k, new_v, slots, status,
                              require_arena, AddressOnly(dest_k, dest_v));
}

}  // namespace
}  // namespace jax_vmm::testing

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmTestingKvWriteAddressOnlyCuda, jax_vmm::testing::Write,
                              jax_vmm::kv::BindWrite(jax_vmm::kv::BindCudaContext()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmTestingKvWriteThroughAddressOnlyCuda,
                              jax_vmm::testing::WriteThrough,
                              jax_vmm::kv::BindWriteThrough(jax_vmm::kv::BindCudaContext()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

void jax_vmm::testing::AddAddressOnlyKvWriteCudaTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_testing_kv_write_address_only", "CUDA",
               JaxVmmTestingKvWriteAddressOnlyCuda);
  registry.Add("jax_vmm_testing_kv_write_through_address_only", "CUDA",
               JaxVmmTestingKvWriteThroughAddressOnlyCuda);
}
