// The few CUDA driver API types and constants jax_vmm uses, with the exact layout of
// cuda.h (CUDA 13.0, checked by static_assert), so that no CUDA toolkit header is needed:
// libcuda is opened at run time (cuda_api.h) and the module imports where it is absent.
#pragma once

#include <cstddef>
#include <cstdint>

namespace jax_vmm::cuda {

// Minimal CUDA driver ABI, copied from cuda.h (CUDA 13.0). C enums are int-sized there
// (each has a 0x7FFFFFFF member), so plain int fields/arguments are ABI-identical.
using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;  // 64-bit platforms (CUdeviceptr_v2)
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUmemGenericAllocationHandle = unsigned long long;
using cuuint64_t = uint64_t;

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;
constexpr CUresult CUDA_ERROR_DEINITIALIZED = 4;
constexpr int CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102;
constexpr int CU_MEM_ALLOCATION_TYPE_PINNED = 0x1;
constexpr int CU_MEM_HANDLE_TYPE_NONE = 0x0;
constexpr int CU_MEM_LOCATION_TYPE_DEVICE = 0x1;
constexpr int CU_MEM_ACCESS_FLAGS_PROT_READ = 0x1;
constexpr int CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3;
constexpr int CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0;
constexpr int CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1;
constexpr unsigned int CU_STREAM_NON_BLOCKING = 0x1;
constexpr cuuint64_t CU_GET_PROC_ADDRESS_LEGACY_STREAM = 1 << 0;
constexpr int CU_GET_PROC_ADDRESS_SUCCESS = 0;
// The ABI version we request from cuGetProcAddress: every signature below is the one
// CUDA 12.0 headers bind to (e.g. cuCtxSynchronize without arguments, cuMemGetInfo_v2).
constexpr int kAbiVersion = 12000;

struct CUmemLocation {
  int type;  // CUmemLocationType
  int id;
};
struct CUmemAllocationProp {
  int type;                  // CUmemAllocationType
  int requestedHandleTypes;  // CUmemAllocationHandleType
  CUmemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};
struct CUmemAccessDesc {
  CUmemLocation location;
  int flags;  // CUmemAccess_flags
};
static_assert(sizeof(void*) == 8, "the CUDA VMM driver needs a 64-bit platform");
static_assert(sizeof(CUmemLocation) == 8, "CUmemLocation ABI");
static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp ABI");
static_assert(offsetof(CUmemAllocationProp, location) == 8, "CUmemAllocationProp ABI");
static_assert(offsetof(CUmemAllocationProp, win32HandleMetaData) == 16, "CUmemAllocationProp ABI");
static_assert(offsetof(CUmemAllocationProp, allocFlags) == 24, "CUmemAllocationProp ABI");
static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc ABI");
static_assert(offsetof(CUmemAccessDesc, flags) == 8, "CUmemAccessDesc ABI");

}  // namespace jax_vmm::cuda
