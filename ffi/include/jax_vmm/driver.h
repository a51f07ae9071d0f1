// The driver interface: the only layer that talks to the OS or the CUDA driver.
//
// Semantics shared by both implementations (host: mmap/memfd, cuda: driver VMM):
//   reserve()  -> a virtual range whose every byte reads as zero and never faults
//                 (host: PROT_READ anonymous mapping; cuda: one shared read-only zero
//                 chunk mapped at every chunk of the range).
//   create()   -> one physical chunk of `chunk_bytes()` bytes.
//   map()      -> put a physical chunk at a chunk-aligned address of the range,
//                 replacing the zero mapping there (not yet writable).
//   set_access -> make a run of mapped chunks read-write: one call per contiguous run.
//   unmap()    -> remove a chunk's mapping and restore the zero mapping.
//   release()  -> give a physical chunk back.
// Addresses and sizes handed to map/unmap/set_access are multiples of chunk_bytes().
//
// Thread-safety: a Driver may be called from several threads at once; implementations
// keep no mutable state besides atomics (the arena serialises per-buffer work itself).
//
// Tests fail driver calls on purpose through testing/fault_injecting_driver.h, a Driver
// that wraps another one; drivers themselves carry no test hooks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace jax_vmm {

struct MemInfo {
  size_t free_bytes = 0;
  size_t total_bytes = 0;
};

using PhysicalHandle = uint64_t;

class Driver {
 public:
  virtual ~Driver() = default;

  virtual const char* kind() const = 0;  // "host" or "cuda"
  virtual int device_ordinal() const = 0;
  // The smallest unit the OS/driver maps (CUDA: minimum VMM granularity).
  virtual size_t granularity() const = 0;
  // The size of every physical chunk this driver creates: a multiple of granularity().
  virtual size_t chunk_bytes() const = 0;
  virtual MemInfo mem_info() const = 0;

  virtual uintptr_t Reserve(size_t bytes) = 0;
  virtual void Unreserve(uintptr_t va, size_t bytes) noexcept = 0;

  virtual PhysicalHandle Create() = 0;
  virtual void Release(PhysicalHandle handle) noexcept = 0;
  virtual void Map(uintptr_t va, PhysicalHandle handle) = 0;
  virtual void Unmap(uintptr_t va) noexcept = 0;
  virtual void SetAccess(uintptr_t va, size_t bytes) = 0;

  // Run forms of map/unmap: `count` chunks starting at `va`, one call per contiguous
  // run, so a driver can batch its expensive calls (CUDA: one cuMemUnmap and one
  // cuMemSetAccess per run instead of one per chunk). The defaults loop over Map/Unmap.
  // MapRun is all-or-nothing: when it throws, every chunk of the run reads zeros again.
  virtual void MapRun(uintptr_t va, const PhysicalHandle* handles, size_t count);
  virtual void UnmapRun(uintptr_t va, size_t count) noexcept;

  // Small memory that both the host (through the copies below) and device code can
  // read: the arena's page-valid table and counters live here.
  virtual void* AllocMetadata(size_t bytes) = 0;
  virtual void FreeMetadata(void* ptr) noexcept = 0;
  virtual void CopyToMetadata(void* dst, const void* src, size_t bytes) = 0;
  virtual void CopyFromMetadata(void* dst, const void* src, size_t bytes) = 0;
  // Wait until device work that may touch arena memory has finished (before unmap).
  virtual void Synchronize() = 0;
};

// Host driver: a real virtual-memory backend for JAX's cpu platform.
// chunk_bytes must be a multiple of the OS page size (0 picks the default, 64 KiB).
std::unique_ptr<Driver> MakeHostDriver(size_t chunk_bytes);

// CUDA driver VMM for one device. chunk_bytes must be a multiple of the device's
// granularity (0 picks the granularity). Throws DriverError when no CUDA driver is
// loadable or the device lacks VMM support.
std::unique_ptr<Driver> MakeCudaDriver(int device_ordinal, size_t chunk_bytes);

// By name: "host" (MakeHostDriver; `device` is ignored) or "cuda" (MakeCudaDriver);
// InvalidArgument for another name.
std::unique_ptr<Driver> MakeDriver(const std::string& kind, int device, size_t chunk_bytes);

// What the CUDA driver offers on this machine, without creating anything.
struct CudaDeviceInfo {
  int ordinal = -1;
  std::string name;
  bool vmm_supported = false;
  size_t granularity_min = 0;
  size_t granularity_recommended = 0;
  size_t free_bytes = 0;
  size_t total_bytes = 0;
};
// Empty when libcuda cannot be loaded; `error` then says why.
std::vector<CudaDeviceInfo> QueryCudaDevices(std::string* error);

}  // namespace jax_vmm
