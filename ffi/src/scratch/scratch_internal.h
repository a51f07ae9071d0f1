// Private to the scratch implementation: what a device platform must provide so that
// scratch.cc can serve workspaces on it. scratch.cc provides the host platform;
// scratch_cuda.cc the CUDA one, installed by the module init in builds with CUDA kernels.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "jax_vmm/driver.h"

namespace jax_vmm::scratch::internal {

struct DevicePlatform {
  const char* name = "";
  // True when `stream` is capturing into a graph. Sets *error (and returns false) when
  // the query itself failed.
  bool (*is_capturing)(void* stream, std::string* error) = nullptr;
  // Plain device allocation for retire mode; nullptr + *error on failure.
  void* (*alloc)(int device, size_t bytes, std::string* error) = nullptr;
  void (*free)(int device, void* ptr) = nullptr;
  // A VMM driver for grow-in-place, or nullptr + *error when the device cannot do VMM.
  std::unique_ptr<Driver> (*make_driver)(int device, std::string* error) = nullptr;
  // Retire-mode blocks are rounded up to this many bytes.
  size_t alloc_granularity = 1;
};

void RegisterCudaPlatform(const DevicePlatform& platform);

#ifdef JAX_VMM_HAVE_CUDA_KERNELS
// RegisterCudaPlatform() with the CUDA runtime's platform (scratch_cuda.cc). Called once
// from the module init.
void InstallCudaPlatform();
#endif

}  // namespace jax_vmm::scratch::internal
