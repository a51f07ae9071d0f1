// The driver interface: the only layer that talks to the OS or the CUDA driver.
//
// Semantics shared by both implementations (host: mmap/memfd, cuda: driver VMM):
//   reserve()    -> a virtual range whose every byte reads as zero and never faults
//                   (host: PROT_READ anonymous mapping; cuda: shared read-only zero
//                   allocations mapped over the whole range in aligned power-of-two
//                   pieces, see drivers/cuda/zero_layout.h).
//   reserve_deferring_zeros() -> the same range, except that unbacked bytes may fault
//                   when read until enable_zero_reads() (cuda: no zero piece is mapped,
//                   so map_run/unmap_run pay no zero-piece calls; host: as reserve()).
//   create(n)    -> one physical allocation of n bytes (a multiple of chunk_bytes()).
//   map_run()    -> put consecutive pieces of physical allocations at a chunk-aligned,
//                   zero-mapped range, replacing the zero mapping there (not yet
//                   writable). A piece is (allocation, offset into it, bytes).
//   set_access   -> make mapped memory read-write: one call per contiguous run.
//   zero_fill    -> write zeros over mapped, writable memory (returns when done).
//   unmap_run()  -> remove consecutive pieces (each exactly as one map_run mapped it) and
//                   restore the zero mapping over them.
//   release()    -> give a physical allocation back (after its last piece is unmapped).
// Addresses and sizes handed to map/unmap/set_access/zero_fill are multiples of
// chunk_bytes().
//
// Thread-safety: a Driver may be called from several threads at once, on disjoint address
// ranges (the arena serialises work on any one chunk). Implementations keep their own
// shared state (host: the memfd free list; cuda: the zero-mapping layout) under their
// own locks.
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

// `bytes` of allocation `handle` starting `offset` bytes into it. The CUDA driver maps
// only whole allocations (offset 0, bytes = the allocation's size): cuMemMap refuses parts.
struct MapPiece {
  PhysicalHandle handle = 0;
  size_t offset = 0;
  size_t bytes = 0;
};

// One host <-> device copy: pointers as the device's unified address space sees them
// (cuda: device addresses and host pointers; host driver: plain pointers).
struct CopyRegion {
  void* dst = nullptr;
  const void* src = nullptr;
  size_t bytes = 0;
};

class Driver {
 public:
  virtual ~Driver() = default;

  virtual const char* kind() const = 0;  // "host" or "cuda"
  virtual int device_ordinal() const = 0;
  // The smallest unit the OS/driver maps (CUDA: minimum VMM granularity).
  virtual size_t granularity() const = 0;
  // The arena's page-table unit: every map/unmap/set_access range is a multiple of it.
  virtual size_t chunk_bytes() const = 0;
  virtual MemInfo mem_info() const = 0;

  virtual uintptr_t Reserve(size_t bytes) = 0;
  virtual void Unreserve(uintptr_t va, size_t bytes) noexcept = 0;
  // A reservation for a caller whose readers never touch unbacked memory: until
  // EnableZeroReads(base), reading an unbacked byte may fault, and MapRun/UnmapRun in it
  // cost no more than the mapping itself. Default: Reserve (zeros from the start).
  virtual uintptr_t ReserveDeferringZeros(size_t bytes) { return Reserve(bytes); }
  // Whether ReserveDeferringZeros really leaves unbacked memory unmapped (false: it is
  // Reserve, and unbacked memory reads zeros from the start).
  virtual bool CanDeferZeroReads() const { return false; }
  // From now on every unbacked byte of the reservation at `base` reads zeros, as after
  // Reserve. The caller runs no MapRun/UnmapRun in that reservation meanwhile. Throws
  // OutOfMemory (the zero memory) or DriverError, having changed nothing. Idempotent;
  // nothing to do for a reservation made by Reserve.
  virtual void EnableZeroReads(uintptr_t base) { (void)base; }

  // Before a commit creates `bytes` in all: throws OutOfMemory if the memory is plainly
  // not there, where running out would not fail a Create but kill the process (host).
  virtual void CheckRoomFor(size_t bytes) { (void)bytes; }
  // One physical allocation of `bytes` (a positive multiple of chunk_bytes()). Throws
  // OutOfMemory when the device (or the host) has no room.
  virtual PhysicalHandle Create(size_t bytes) = 0;
  virtual void Release(PhysicalHandle handle) noexcept = 0;

  // Maps `count` pieces back to back from `va` (chunk-aligned, currently zero-mapped or,
  // while zeros are deferred, unmapped). All-or-nothing: when it throws, the range is as
  // before (reads zeros again, or is unmapped again).
  virtual void MapRun(uintptr_t va, const MapPiece* pieces, size_t count) = 0;
  // Unmaps `count` consecutive mappings from `va` (their sizes in `piece_bytes`, each as
  // one MapRun piece mapped it) and restores the zero mapping over all of them (none while
  // the reservation's zeros are deferred).
  virtual void UnmapRun(uintptr_t va, const size_t* piece_bytes, size_t count) noexcept = 0;
  virtual void SetAccess(uintptr_t va, size_t bytes) = 0;
  // Zeros over mapped, read-write memory; returns once the zeros are in memory.
  virtual void ZeroFill(uintptr_t va, size_t bytes) = 0;

  // Whether freshly created memory is known to read zeros (host: fallocate'd memfd
  // pages), so that a zero-filling arena can skip the fill of new runs.
  virtual bool FreshMemoryIsZero() const = 0;
  // Whether unmapping memory that device work may still touch needs that work to finish
  // first (cuda: yes, a kernel would fault; host: no, mmap(MAP_FIXED) swaps the mapping
  // atomically and the CPU never sees a hole). The arena defers unmapping accordingly.
  virtual bool UnmapNeedsQuiescence() const = 0;

  // Small memory that both the host (through the copies below) and device code can
  // read: the arena's page-valid table and counters live here.
  virtual void* AllocMetadata(size_t bytes) = 0;
  virtual void FreeMetadata(void* ptr) noexcept = 0;
  // At once: lands before the call returns (counters, a new table's first contents).
  virtual void CopyToMetadata(void* dst, const void* src, size_t bytes) = 0;
  virtual void CopyFromMetadata(void* dst, const void* src, size_t bytes) = 0;
  // A change to a table that device code reads in dispatch order (the readers' copy of a
  // KV cache's ensured tokens): the device work dispatched before the call still sees
  // the old contents, work dispatched after sees the new, and the caller does not wait
  // for the former. So a release right after dispatching a step that reads the sequence
  // leaves that step its tokens. A later Synchronize covers the change. `src` may change
  // once the call returns. Default: CopyToMetadata (the host backend's readers keep the
  // table of their read epoch instead, jax_vmm/cache/read_epochs.py).
  virtual void WriteTable(void* dst, const void* src, size_t bytes) {
    CopyToMetadata(dst, src, bytes);
  }
  // Waits until all device work dispatched before the call has finished (any thread may
  // call it; it blocks only the caller).
  virtual void Synchronize() = 0;

  // Host memory for device <-> host copies at full speed (cuda: page-locked; host:
  // page-aligned anonymous memory). Throws OutOfMemory.
  virtual void* AllocHost(size_t bytes) = 0;
  virtual void FreeHost(void* ptr, size_t bytes) noexcept = 0;
  // Copies device memory to host memory / host or device memory to device memory, all
  // regions issued together on the driver's copy stream; returns when all have landed.
  virtual void CopyToHost(const CopyRegion* regions, size_t count) = 0;
  virtual void CopyToDevice(const CopyRegion* regions, size_t count) = 0;
};

// Host driver: a real virtual-memory backend for JAX's cpu platform.
// chunk_bytes must be a multiple of the OS page size (0 picks the default, 64 KiB).
std::unique_ptr<Driver> MakeHostDriver(size_t chunk_bytes);

namespace testing {
// Test-only: the host driver's CheckRoomFor takes `bytes` (0: /proc/meminfo's) as the
// memory available and checks every commit, so tests show its refusal without filling
// the machine. Process-wide.
void SetHostAvailableBytes(size_t bytes);
// Test-only: while set, the host driver fills the memory it commits with 0xFF bytes (NaN in
// every float type) instead of zeros, as a GPU's fresh memory may hold anything, and says
// so (FreshMemoryIsZero false: a zero-filling arena zeroes it). Process-wide.
void SetHostFreshMemoryPoisoned(bool poisoned);
}  // namespace testing

// CUDA driver VMM for one device. chunk_bytes must be a multiple of the device's
// granularity (0 picks the granularity). Throws DriverError when no CUDA driver is
// loadable or the device lacks VMM support.
std::unique_ptr<Driver> MakeCudaDriver(int device_ordinal, size_t chunk_bytes);

// By name: "host" (MakeHostDriver; `device` is ignored) or "cuda" (MakeCudaDriver);
// InvalidArgument for another name.
std::unique_ptr<Driver> MakeDriver(const std::string& kind, int device, size_t chunk_bytes);

// Convenience forms over the run calls (one chunk-aligned piece of one allocation).
void MapWhole(Driver& driver, uintptr_t va, PhysicalHandle handle, size_t bytes);
void UnmapWhole(Driver& driver, uintptr_t va, size_t bytes) noexcept;

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
