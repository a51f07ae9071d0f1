// A strict host emulation of the CUDA driver's virtual memory management API, as a
// cuda::Api table (drivers/cuda/cuda_api.h), so that the real CudaDriver, ZeroAllocations
// and ZeroLayout code runs on the CPU in CI (MakeCudaDriverWith(FakeApi(), 0, chunk)).
//
// One fake device (ordinal 0, "fake CUDA VMM device", 4 GiB, VMM supported, allocation
// granularity 64 KiB) whose memory is host memory. The rules, each one the real driver's:
//  * Every call but cuInit/cuGetErrorName/cuGetErrorString needs cuInit first
//    (CUDA_ERROR_NOT_INITIALIZED); memory, stream and synchronisation calls need a
//    context current on the calling thread (pushed primary context, else
//    CUDA_ERROR_INVALID_CONTEXT). Device queries name device 0 only (INVALID_DEVICE).
//  * cuMemAddressReserve: an anonymous PROT_NONE reservation aligned to the alignment
//    argument (a power of two; 0 = the granularity); size a positive multiple of the
//    granularity (else INVALID_VALUE). cuMemAddressFree: exactly a reservation (base and
//    size), refused (INVALID_VALUE) while any mapping remains inside it.
//  * cuMemCreate: pinned device memory on device 0, size a positive multiple of the
//    granularity (else INVALID_VALUE), OUT_OF_MEMORY beyond the device's free memory. The
//    allocation is a memfd filled with garbage (0xCD): cuMemCreate promises no contents.
//    The handle is an id never reused. cuMemRelease: allowed while mapped (the memory
//    lives until its last unmap); an unknown or released handle is INVALID_VALUE.
//  * cuMemMap(va, size, offset, handle): maps whole allocations only: offset 0 and size
//    equal to the allocation's size, else CUDA_ERROR_NOT_SUPPORTED (counted as a partial
//    map refusal). The range must lie inside one reservation, be granularity-aligned and
//    overlap no mapping (else INVALID_VALUE); the handle must be live (INVALID_VALUE). A
//    new mapping has no access (PROT_NONE) until cuMemSetAccess.
//  * cuMemUnmap(va, size): the range must start at a mapping's start, end at a mapping's
//    end and be covered by whole consecutive mappings (several are fine), else
//    INVALID_VALUE; the reservation's PROT_NONE placeholder goes back over it.
//  * cuMemSetAccess: every byte of the range mapped (else INVALID_VALUE), one descriptor
//    for device 0 with flags NONE, READ or READWRITE; sets PROT_NONE / PROT_READ /
//    PROT_READ|PROT_WRITE and records the flags per granularity page. cuMemGetAccess: the
//    flags of a mapped va, INVALID_VALUE when unmapped.
//  * cuMemsetD8Async / cuMemcpy{HtoD,DtoH,}Async: every byte touched inside a reservation
//    must have the access it needs (READ to read, READWRITE to write); cuMemAlloc'd and
//    cuMemHostAlloc'd blocks are always accessible (a range must stay inside its block);
//    other addresses are pageable host memory, accepted where a host pointer may be (not
//    as a memset target or a DtoH source / HtoD destination: INVALID_VALUE). A violation
//    is CUDA_ERROR_ILLEGAL_ADDRESS and touches nothing: the process never faults. Streams
//    must be live or the legacy stream (0), else INVALID_HANDLE. Work is done at once
//    (every stream is always drained).
//  * Contexts, streams, host and metadata allocations are tracked: releasing what is not
//    held is an error, so the tests can check that every object goes back.
//
// What it cannot show: kernels and graph replay, real timing and asynchrony (so no
// use-after-unmap race), the sticky context error a real illegal address leaves, real
// driver quirks not listed above (e.g. costs, fragmentation, the recommended granularity).
//
// Thread-safety: every entry point and every function below may be called from any
// thread; one mutex serialises them (copies run under it, so no mapping changes midway).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "drivers/cuda/cuda_api.h"

namespace jax_vmm::testing::fake_cuda {

// CUresult values the fake returns beyond those of cuda_abi.h (cuda.h, CUDA 13.0).
constexpr cuda::CUresult kInvalidValue = 1;
constexpr cuda::CUresult kNotInitialized = 3;
constexpr cuda::CUresult kInvalidDevice = 101;
constexpr cuda::CUresult kInvalidContext = 201;
constexpr cuda::CUresult kInvalidHandle = 400;
constexpr cuda::CUresult kIllegalAddress = 700;
constexpr cuda::CUresult kNotSupported = 801;

constexpr size_t kGranularity = size_t{64} << 10;
constexpr size_t kTotalBytes = size_t{4} << 30;

// The process-wide table (every entry point set, `error` empty).
const cuda::Api& FakeApi();

// (name, code) of every CUresult the fake can return.
std::vector<std::pair<std::string, cuda::CUresult>> ResultCodes();

struct Stats {
  std::map<std::string, int64_t> calls;  // per entry point, refused calls included
  int64_t live_reservations = 0;
  int64_t live_mappings = 0;
  int64_t live_allocations = 0;      // physical allocations whose memory still exists
  int64_t live_handles = 0;          // allocations not yet released (mapped or not)
  int64_t live_metadata_allocs = 0;  // cuMemAlloc
  int64_t live_host_allocs = 0;      // cuMemHostAlloc
  int64_t live_streams = 0;
  int64_t primary_context_refs = 0;
  int64_t partial_map_refusals = 0;
  int64_t illegal_addresses = 0;
  size_t used_bytes = 0;  // physical allocations + cuMemAlloc blocks
};
Stats GetStats();

struct Mapping {
  uintptr_t va = 0;
  size_t bytes = 0;
  uint64_t handle = 0;
};
std::vector<Mapping> Mappings();

struct Allocation {
  uint64_t handle = 0;
  size_t bytes = 0;
  int64_t mappings = 0;
  bool released = false;
};
std::vector<Allocation> Allocations();

// Every cuMemMap call since the last ClearMapLog, refused ones included.
struct MapCall {
  uintptr_t va = 0;
  size_t bytes = 0;
  size_t offset = 0;
  uint64_t handle = 0;
  size_t allocation_bytes = 0;  // 0: no live allocation has that handle
  cuda::CUresult result = 0;
};
std::vector<MapCall> MapLog();
void ClearMapLog();

// The nth (1-based) future call of `entry` (e.g. "cuMemMap") returns `result` without
// doing anything; 0 disarms that entry. Throws std::invalid_argument for an unknown entry.
void FailNth(const std::string& entry, int64_t nth, cuda::CUresult result);
void DisarmAll();

// cuMemGetAccess of va: (result, flags).
std::pair<cuda::CUresult, unsigned long long> AccessOf(uintptr_t va);
// A host-side copy of fake-device memory under the access rules of the copies (reading
// needs READ, writing READWRITE inside reservations); the result says whether it ran.
cuda::CUresult Read(uintptr_t va, void* dst, size_t bytes);
cuda::CUresult Write(uintptr_t va, const void* src, size_t bytes);

}  // namespace jax_vmm::testing::fake_cuda
