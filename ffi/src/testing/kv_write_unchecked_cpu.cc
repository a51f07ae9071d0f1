// The unchecked kv_write CPU targets: the production CPU handlers (ops/kv_write/
// kv_write_cpu.h) instantiated with UncheckedTokens.
#include "ops/kv_write/kv_write_cpu.h"
#include "ops/kv_write/kv_write_ffi.h"
#include "testing/kv_write_unchecked.h"
#include "testing/testing_targets.h"

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmTestingKvWriteUncheckedCpu,
                              jax_vmm::kv::CpuWriteImpl<jax_vmm::testing::UncheckedTokens>,
                              jax_vmm::kv::BindWrite(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmTestingKvWriteThroughUncheckedCpu,
                              jax_vmm::kv::CpuWriteThroughImpl<jax_vmm::testing::UncheckedTokens>,
                              jax_vmm::kv::BindWriteThrough(xla::ffi::Ffi::Bind()));

void jax_vmm::testing::AddUncheckedKvWriteCpuTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_testing_kv_write_unchecked", "cpu", JaxVmmTestingKvWriteUncheckedCpu);
  registry.Add("jax_vmm_testing_kv_write_through_unchecked", "cpu",
               JaxVmmTestingKvWriteThroughUncheckedCpu);
}
