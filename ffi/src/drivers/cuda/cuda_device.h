// Device queries of the CUDA driver: which device an ordinal names, whether it supports
// VMM, its allocation granularity, and the descriptors every driver call on it uses.
#pragma once

#include <cstddef>
#include <string>

#include "drivers/cuda/cuda_abi.h"
#include "drivers/cuda/cuda_api.h"

namespace jax_vmm::cuda {

// The device's name, "?" when the driver cannot say.
std::string DeviceName(const Api& api, CUdevice dev);

// Pinned device memory on `dev`, no shareable handle: what every chunk is made of.
CUmemAllocationProp DeviceAllocationProp(CUdevice dev);
// `flags` (CU_MEM_ACCESS_FLAGS_PROT_*) for `dev`.
CUmemAccessDesc DeviceAccess(CUdevice dev, int flags);

// Checks that `ordinal` exists and supports VMM (InvalidArgument / DriverError saying
// which); returns its CUdevice.
CUdevice VmmDeviceOrThrow(const Api& api, int ordinal);

// The device's allocation granularity; `which` is CU_MEM_ALLOC_GRANULARITY_MINIMUM or
// _RECOMMENDED.
size_t GranularityOrThrow(const Api& api, int ordinal, CUdevice dev, int which);

}  // namespace jax_vmm::cuda
