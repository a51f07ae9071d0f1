// Private to scratch/: what a device platform must provide so that workspaces can be
// served on it. host_platform.cc provides the host one; cuda_platform.cc the CUDA one,
// installed by the module init in builds with CUDA kernels.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "jax_vmm/driver.h"
#include "jax_vmm/scratch.h"

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

// "host" or "cuda:N", for messages.
inline std::string DeviceName(int device) {
  return device == kHostDevice ? std::string("host") : "cuda:" + std::to_string(device);
}

// The platform serving `device` (kHostDevice or a CUDA ordinal), or nullptr and *error
// (no CUDA platform in this build, a negative ordinal).
const DevicePlatform* PlatformFor(int device, std::string* error);

// Called once, before any workspace is served on a CUDA device.
void RegisterCudaPlatform(const DevicePlatform& platform);

#ifdef JAX_VMM_HAVE_CUDA_KERNELS
// RegisterCudaPlatform() with the CUDA runtime's platform (cuda_platform.cc). Called once
// from the module init.
void InstallCudaPlatform();
#endif

}  // namespace jax_vmm::scratch::internal
