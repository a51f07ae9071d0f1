// The CPU side of the token-kernel kv_write targets (testing_targets.h): the CPU has one
// writer, so these are the production CPU handlers (ops/kv_write/kv_write_cpu.h) under
// the testing names, and a step traced with jax_vmm.testing.token_kernel_kv_writes() runs
// on either platform.
#include "ops/kv_write/kv_write_cpu.h"
#include "ops/kv_write/kv_write_ffi.h"
#include "testing/testing_targets.h"

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmTestingKvWriteTokenKernelCpu,
                              jax_vmm::kv::CpuWriteImpl<jax_vmm::kv::CheckedTokens>,
                              jax_vmm::kv::BindWrite(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmTestingKvWriteThroughTokenKernelCpu,
                              jax_vmm::kv::CpuWriteThroughImpl<jax_vmm::kv::CheckedTokens>,
                              jax_vmm::kv::BindWriteThrough(xla::ffi::Ffi::Bind()));

void jax_vmm::testing::AddTokenKernelKvWriteCpuTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_testing_kv_write_token_kernel", "cpu", JaxVmmTestingKvWriteTokenKernelCpu);
  registry.Add("jax_vmm_testing_kv_write_through_token_kernel", "cpu",
               JaxVmmTestingKvWriteThroughTokenKernelCpu);
}
