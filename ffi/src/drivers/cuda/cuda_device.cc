#include "drivers/cuda/cuda_device.h"

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "drivers/cuda/cuda_owners.h"
#include "jax_vmm/driver.h"
#include "jax_vmm/errors.h"

namespace jax_vmm {
namespace cuda {

std::string DeviceName(const Api& api, CUdevice dev) {
  char name[256] = {};
  if (api.cuDeviceGetName(name, sizeof(name) - 1, dev) != CUDA_SUCCESS) return "?";
  return name;
}

CUmemAllocationProp DeviceAllocationProp(CUdevice dev) {
  CUmemAllocationProp prop;
  std::memset(&prop, 0, sizeof(prop));
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  return prop;
}

CUmemAccessDesc DeviceAccess(CUdevice dev, int flags) {
  CUmemAccessDesc desc;
  std::memset(&desc, 0, sizeof(desc));
  desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  desc.location.id = dev;
  desc.flags = flags;
  return desc;
}

// Checks ordinal and VMM support; returns the CUdevice.
CUdevice VmmDeviceOrThrow(const Api& api, int ordinal) {
  int count = 0;
  CUresult r = api.cuDeviceGetCount(&count);
  if (r != CUDA_SUCCESS) ThrowDriver(api, ordinal, "cuDeviceGetCount", r);
  if (ordinal < 0 || ordinal >= count) {
    throw InvalidArgument("jax_vmm: CUDA device ordinal " + std::to_string(ordinal) +
                          " does not exist; this process sees " + std::to_string(count) +
                          " CUDA device(s) (ordinals 0.." + std::to_string(count - 1) +
                          ", after CUDA_VISIBLE_DEVICES)");
  }
  CUdevice dev = 0;
  r = api.cuDeviceGet(&dev, ordinal);
  if (r != CUDA_SUCCESS) {
    ThrowDriver(api, ordinal, "cuDeviceGet(" + std::to_string(ordinal) + ")", r);
  }
  int vmm = 0;
  r = api.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
  if (r != CUDA_SUCCESS) {
    ThrowDriver(api, ordinal,
                "cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device=" +
                    std::to_string(ordinal) + ")",
                r);
  }
  if (vmm == 0) {
    throw DriverError("jax_vmm: CUDA device " + std::to_string(ordinal) + " (" +
                      DeviceName(api, dev) +
                      ") does not support CUDA virtual memory management "
                      "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0; "
                      "e.g. a vGPU or WSL setup without VMM); an arena cannot live on it");
  }
  return dev;
}

size_t GranularityOrThrow(const Api& api, int ordinal, CUdevice dev, int which) {
  const CUmemAllocationProp prop = DeviceAllocationProp(dev);
  size_t granularity = 0;
  CUresult r = api.cuMemGetAllocationGranularity(&granularity, &prop, which);
  if (r != CUDA_SUCCESS || granularity == 0) {
    ThrowDriver(api, ordinal,
                "cuMemGetAllocationGranularity(device=" + std::to_string(ordinal) + ")",
                r == CUDA_SUCCESS ? -1 : r);
  }
  return granularity;
}

namespace {

// What the driver says about device `ordinal`, without creating anything that outlives
// the call.
CudaDeviceInfo DescribeDevice(const Api& api, int ordinal) {
  CudaDeviceInfo info;
  info.ordinal = ordinal;
  CUdevice dev = 0;
  CUresult r = api.cuDeviceGet(&dev, ordinal);
  if (r != CUDA_SUCCESS) ThrowDriver(api, ordinal, "cuDeviceGet", r);
  info.name = DeviceName(api, dev);
  int vmm = 0;
  if (api.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                               dev) == CUDA_SUCCESS) {
    info.vmm_supported = vmm != 0;
  }
  if (info.vmm_supported) {
    info.granularity_min = GranularityOrThrow(api, ordinal, dev, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    info.granularity_recommended =
        GranularityOrThrow(api, ordinal, dev, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  }
  // Free memory needs a context. Retaining the primary context reuses JAX's when it is
  // active; otherwise it creates it for the duration of the query only.
  PrimaryContext ctx(api, dev, ordinal);
  ContextGuard g(api, ctx.get(), ordinal);
  r = api.cuMemGetInfo(&info.free_bytes, &info.total_bytes);
  if (r != CUDA_SUCCESS) ThrowDriver(api, ordinal, "cuMemGetInfo", r);
  return info;
}

}  // namespace
}  // namespace cuda

std::vector<CudaDeviceInfo> QueryCudaDevices(std::string* error) {
  std::vector<CudaDeviceInfo> out;
  std::string why;
  try {
    const cuda::Api& api = cuda::LoadedApiOrThrow();
    cuda::InitOrThrow(api);
    int count = 0;
    cuda::CUresult r = api.cuDeviceGetCount(&count);
    if (r != cuda::CUDA_SUCCESS) cuda::ThrowDriver(api, -1, "cuDeviceGetCount", r);
    for (int i = 0; i < count; ++i) out.push_back(cuda::DescribeDevice(api, i));
  } catch (const std::exception& e) {
    why = e.what();
  }
  if (error != nullptr) *error = why;
  return out;
}

}  // namespace jax_vmm
