// The extension jax_vmm._core_testing (testing_module.cc): every test-only binding and FFI
// target, over the same core library as jax_vmm._core (it imports _core first, whose
// classes, such as Arena, its functions take and return). Built unless the CMake option
// JAX_VMM_TESTING is OFF; only jax_vmm/testing.py and the tests import it.
#pragma once

#include <nanobind/nanobind.h>

namespace jax_vmm::testing {

// The fake CUDA driver (fake_cuda.h) and arenas of the real CUDA driver over it
// (fake_cuda_bindings.cc).
void BindFakeCuda(nanobind::module_& m);

}  // namespace jax_vmm::testing
