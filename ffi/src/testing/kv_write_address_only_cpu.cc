// The address-only kv_write CPU targets: the production CPU handlers (ops/kv_write/
// kv_write_cpu.h) with the dest resolved by its address alone (kv_write_address_only.h).
#include "ops/kv_write/kv_write_cpu.h"
#include "ops/kv_write/kv_write_ffi.h"
#include "testing/kv_write_address_only.h"
#include "testing/testing_targets.h"

namespace jax_vmm::testing {
namespace {

namespace ffi = xla::ffi;
using kv::CheckedTokens;

ffi::Error Write(ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer new_k, ffi::AnyBuffer new_v,
                 ffi::Buffer<ffi::S32> slots, ffi::Result<ffi::AnyBuffer> k_out,
                 ffi::Result<ffi::AnyBuffer> v_out, uint64_t dest_k, uint64_t dest_v, uint64_t,
                 uint64_t) {
  return kv::CpuWrite(kv::WriteTokensOnHost<CheckedTokens>, k, v, new_k, new_v, slots, k_out, v_out,
                      AddressOnly(dest_k, dest_v));
}

ffi::Error WriteThrough(ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer new_k,
                        ffi::AnyBuffer new_v, ffi::Buffer<ffi::S32> slots,
                        ffi::Result<ffi::Buffer<ffi::S32>> status, bool require_arena,
                        uint64_t dest_k, uint64_t dest_v, uint64_t, uint64_t) {
  return kv::CpuWriteThrough(kv::WriteTokensOnHost<CheckedTokens>, k, v, new_k, new_v, slots,
                             status, require_arena, AddressOnly(dest_k, dest_v));
}

}  // namespace
}  // namespace jax_vmm::testing

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmTestingKvWriteAddressOnlyCpu, jax_vmm::testing::Write,
                              jax_vmm::kv::BindWrite(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmTestingKvWriteThroughAddressOnlyCpu,
                              jax_vmm::testing::WriteThrough,
                              jax_vmm::kv::BindWriteThrough(xla::ffi::Ffi::Bind()));

void jax_vmm::testing::AddAddressOnlyKvWriteCpuTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_testing_kv_write_address_only", "cpu", JaxVmmTestingKvWriteAddressOnlyCpu);
  registry.Add("jax_vmm_testing_kv_write_through_address_only", "cpu",
               JaxVmmTestingKvWriteThroughAddressOnlyCpu);
}
