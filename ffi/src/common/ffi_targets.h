// Self-registration of XLA FFI handlers. Each handler's source file adds
//   JAX_VMM_FFI_TARGET("jax_vmm_kv_write", "cpu", KvWriteCpu);
// and the module exposes them all through registrations(); Python registers each with
// jax.ffi.register_ffi_target(name, capsule, platform=platform). Platform is "cpu" or
// "CUDA". Keeping registration next to the handler means no central list to edit.
#pragma once

#include <vector>

namespace jax_vmm {

struct FfiTarget {
  const char* name;
  const char* platform;
  void* handler;  // an XLA_FFI_Handler*
};

std::vector<FfiTarget>& FfiTargets();

struct FfiTargetRegistrar {
  FfiTargetRegistrar(const char* name, const char* platform, void* handler) {
    FfiTargets().push_back({name, platform, handler});
  }
};

}  // namespace jax_vmm

#define JAX_VMM_FFI_CONCAT_INNER(a, b) a##b
#define JAX_VMM_FFI_CONCAT(a, b) JAX_VMM_FFI_CONCAT_INNER(a, b)
#define JAX_VMM_FFI_TARGET(name, platform, symbol)                                        \
  static ::jax_vmm::FfiTargetRegistrar JAX_VMM_FFI_CONCAT(jax_vmm_ffi_reg_, __COUNTER__)( \
      name, platform, reinterpret_cast<void*>(symbol))
