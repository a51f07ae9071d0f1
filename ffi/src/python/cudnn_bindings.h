// Python bindings of the cuDNN attention backend (built only with JAX_VMM_HAVE_CUDNN).
#pragma once

#include <nanobind/nanobind.h>

namespace jax_vmm {
void BindCudnn(nanobind::module_& m);  // cudnn_bindings.cc
}  // namespace jax_vmm
