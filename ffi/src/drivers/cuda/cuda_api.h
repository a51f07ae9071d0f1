// The CUDA driver entry points jax_vmm calls, resolved from libcuda at run time, and the
// one place that turns a CUresult into an error message.
//
// Entry points come from cuGetProcAddress_v2 at a pinned ABI version (kAbiVersion),
// falling back to dlsym of the versioned names (cuMemGetInfo_v2, ...) on older drivers.
// The table is loaded once per process and never unloaded (JAX and other libraries share
// libcuda; other threads may still be inside a call at exit).
#pragma once

#include <string>

#include "drivers/cuda/cuda_abi.h"

namespace jax_vmm::cuda {

struct Api {
  CUresult (*cuGetErrorName)(CUresult, const char**) = nullptr;
  CUresult (*cuGetErrorString)(CUresult, const char**) = nullptr;
  CUresult (*cuInit)(unsigned int) = nullptr;
  CUresult (*cuDeviceGetCount)(int*) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*cuDeviceGetName)(char*, int, CUdevice) = nullptr;
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice) = nullptr;
  CUresult (*cuCtxPushCurrent)(CUcontext) = nullptr;
  CUresult (*cuCtxPopCurrent)(CUcontext*) = nullptr;
  CUresult (*cuCtxSynchronize)() = nullptr;
  CUresult (*cuStreamCreate)(CUstream*, unsigned int) = nullptr;
  CUresult (*cuStreamDestroy)(CUstream) = nullptr;
  CUresult (*cuStreamSynchronize)(CUstream) = nullptr;
  CUresult (*cuMemGetInfo)(size_t*, size_t*) = nullptr;
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t) = nullptr;
  CUresult (*cuMemFree)(CUdeviceptr) = nullptr;
  CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;
  CUresult (*cuMemcpyDtoHAsync)(void*, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*cuMemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream) = nullptr;
  CUresult (*cuMemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*cuMemHostAlloc)(void**, size_t, unsigned int) = nullptr;
  CUresult (*cuMemFreeHost)(void*) = nullptr;
  CUresult (*cuMemAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr,
                                  unsigned long long) = nullptr;
  CUresult (*cuMemAddressFree)(CUdeviceptr, size_t) = nullptr;
  CUresult (*cuMemCreate)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                          unsigned long long) = nullptr;
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                       unsigned long long) = nullptr;
  CUresult (*cuMemUnmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*cuMemGetAccess)(unsigned long long*, const CUmemLocation*, CUdeviceptr) = nullptr;
  CUresult (*cuMemGetAllocationGranularity)(size_t*, const CUmemAllocationProp*, int) = nullptr;

  std::string error;  // empty when every entry point was found
};

// The process-wide table (loaded on first use; thread-safe). Its `error` says why it is
// unusable, if it is.
const Api& GetApi();
// GetApi(), or a DriverError when libcuda is missing or lacks entry points.
const Api& LoadedApiOrThrow();
// cuInit(0), or a DriverError naming the result. Also records this process as the one
// that uses CUDA (see InForkedChild).
void InitOrThrow(const Api& api);
// Whether this is a child forked from the process that initialised CUDA: the parent's
// contexts, streams and allocations are unusable here (and must not be released).
bool InForkedChild() noexcept;
// ForkedProcess naming `ordinal`, when InForkedChild().
void ThrowIfForkedChild(int ordinal);

// "CUDA_ERROR_X (text)", or "CUresult N" when the driver cannot name it.
std::string ResultName(const Api& api, CUresult r);
// "jax_vmm: <call> failed on CUDA device N with CUDA_ERROR_X (text)": every driver
// failure message names the call, its arguments and the result. ordinal < 0: no device.
std::string Failure(const Api& api, int ordinal, const std::string& call, CUresult r);
[[noreturn]] void ThrowDriver(const Api& api, int ordinal, const std::string& call, CUresult r);
// Destructors and noexcept methods cannot throw: they report on stderr instead. A
// deinitialised driver (interpreter exit after CUDA shut down) is not worth a message.
void Report(const Api& api, int ordinal, const std::string& call, CUresult r) noexcept;

}  // namespace jax_vmm::cuda
