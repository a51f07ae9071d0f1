// The read-only zero memory under every unbacked byte of the CUDA reservations of one
// device: one physical allocation per zero-piece size (granularity x 2^k up to
// ZeroPieceBytes), zero-filled once, per device and process, shared by every driver of
// that device (arenas, scratch workspaces) and released with the last.
//
// Why one per size: cuMemMap maps an allocation only whole, so a zero piece of n bytes
// needs an allocation of exactly n bytes (zero_layout.h). All sizes are made up front
// (2 x the largest in all: 510 MiB on an H200), so that the restore paths, which must not
// fail, never allocate. Larger pieces mean fewer cuMemMap/cuMemUnmap calls per reserved
// or committed byte; the memory is spent once per device, not per arena.
//
// Thread-safety: ForDevice is thread-safe; the object is immutable after construction.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "drivers/cuda/cuda_abi.h"
#include "drivers/cuda/cuda_api.h"
#include "drivers/cuda/cuda_owners.h"

namespace jax_vmm::cuda {

// 256 MiB: driver calls cost per mapping, not per byte (unmap ~20 us, set-access ~25 us on
// an H200), so growing a buffer by 256 MiB over one zero piece instead of eight 32 MiB
// ones is ~2.5x faster (docs/design.md, "Zero reads"); the price is 510 MiB of zero memory
// per device.
inline constexpr size_t kDefaultZeroPieceCeiling = size_t{256} << 20;

// The largest zero piece for a device with `total_bytes` of memory and `granularity`: a
// power of two times the granularity, at most `ceiling` and 1/512 of the device's memory
// (so the zero allocations, 2x the largest piece, stay under 1/256 of it).
size_t ZeroPieceBytes(size_t total_bytes, size_t granularity,
                      size_t ceiling = kDefaultZeroPieceCeiling);
// The ceiling in force: JAX_VMM_ZERO_PIECE_MAX_BYTES when set (read when a device's zero
// allocations are made), else kDefaultZeroPieceCeiling. InvalidArgument for a value that is
// not a positive integer.
size_t ZeroPieceCeilingFromEnv();

class ZeroAllocations {
 public:
  // The zero allocations of device `ordinal` of `api`'s driver (one set per table and
  // ordinal), made on first use (throws OutOfMemory / DriverError).
  static std::shared_ptr<const ZeroAllocations> ForDevice(const Api& api, int ordinal, CUdevice dev,
                                                          size_t granularity);
  // Allocations of granularity, 2 x granularity, ..., max_piece bytes.
  ZeroAllocations(const Api& api, int ordinal, CUdevice dev, size_t granularity, size_t max_piece);
  ZeroAllocations(const ZeroAllocations&) = delete;
  ZeroAllocations& operator=(const ZeroAllocations&) = delete;

  // The allocation of exactly `bytes` (granularity x 2^k, <= max_piece), or 0 for another
  // size (a bookkeeping bug in the caller; cuMemMap then fails with a clear error).
  CUmemGenericAllocationHandle handle(size_t bytes) const;
  size_t granularity() const { return granularity_; }
  size_t max_piece() const { return max_piece_; }

 private:
  void Make(const Api& api, int ordinal, CUdevice dev, size_t bytes);

  // Declaration order is teardown order reversed: the handles go before the context.
  PrimaryContext ctx_;
  size_t granularity_;
  size_t max_piece_;
  std::vector<std::unique_ptr<OwnedHandle>> by_size_;  // [k]: granularity << k bytes
};

}  // namespace jax_vmm::cuda
