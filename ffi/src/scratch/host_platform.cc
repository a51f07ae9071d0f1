// The host device platform of graph-safe scratch (device kHostDevice, the cpu platform)
// and the lookup of a device's platform (see device_platform.h).
#include <cstdlib>
#include <memory>
#include <string>

#include "common/math.h"
#include "jax_vmm/driver.h"
#include "scratch/device_platform.h"

namespace jax_vmm::scratch::internal {
namespace {

bool HostIsCapturing(void*, std::string*) { return false; }

void* HostAlloc(int, size_t bytes, std::string* error) {
  void* p = std::aligned_alloc(256, RoundUp(bytes, 256));
  if (p == nullptr) *error = "aligned_alloc of " + std::to_string(bytes) + " bytes failed";
  return p;
}

void HostFree(int, void* p) { std::free(p); }

std::unique_ptr<Driver> HostMakeDriver(int, std::string* error) {
  try {
    return MakeHostDriver(0);
  } catch (const std::exception& e) {
    *error = e.what();
    return nullptr;
  }
}

const DevicePlatform& HostPlatform() {
  static const DevicePlatform p = [] {
    DevicePlatform h;
    h.name = "host";
    h.is_capturing = HostIsCapturing;
    h.alloc = HostAlloc;
    h.free = HostFree;
    h.make_driver = HostMakeDriver;
    h.alloc_granularity = 4096;
    return h;
  }();
  return p;
}

DevicePlatform& CudaPlatformSlot() {
  static DevicePlatform p;  // empty until the module init installs the CUDA platform
  return p;
}

}  // namespace

const DevicePlatform* PlatformFor(int device, std::string* error) {
  if (device == kHostDevice) return &HostPlatform();
  const DevicePlatform& cuda = CudaPlatformSlot();
  if (cuda.alloc == nullptr) {
    *error = "jax_vmm scratch: device " + DeviceName(device) +
             " needs CUDA, but this jax_vmm build has no CUDA kernels (rebuild with "
             "JAX_VMM_CUDA=ON and nvcc on PATH)";
    return nullptr;
  }
  if (device < 0) {
    *error = "jax_vmm scratch: invalid device ordinal " + std::to_string(device);
    return nullptr;
  }
  return &cuda;
}

void RegisterCudaPlatform(const DevicePlatform& platform) { CudaPlatformSlot() = platform; }

}  // namespace jax_vmm::scratch::internal
