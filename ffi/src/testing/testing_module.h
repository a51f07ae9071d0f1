// What the nanobind submodule jax_vmm._core.testing holds: every test-only binding and
// FFI target, compiled only with the CMake option JAX_VMM_TESTING (default ON). The
// module init (python/module.cc) creates the submodule; only jax_vmm/testing.py imports
// it.
#pragma once

#include <nanobind/nanobind.h>

#include "common/ffi_registry.h"

namespace jax_vmm::testing {

// The testing layer's FFI targets (testing_targets.h), for testing.registrations().
FfiRegistry TestingTargets();

// Fault injection, the scratch hooks and InjectedFault, into the submodule `m`.
void BindTestingHooks(nanobind::module_& m);

// The fake CUDA driver (fake_cuda.h) and arenas of the real CUDA driver over it
// (fake_cuda_bindings.cc).
void BindFakeCuda(nanobind::module_& m);

}  // namespace jax_vmm::testing
