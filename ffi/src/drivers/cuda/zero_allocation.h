// The read-only zero memory under every unbacked byte of the CUDA reservations of one
// device: one physical allocation per device and process, zero-filled once, shared by
// every driver of that device (arenas, scratch workspaces) and released with the last.
//
// Its size is the largest zero mapping the driver makes (ZeroLayout's max_piece): a power
// of two between the granularity and 256 MiB, at most 1/512 of the device's memory
// (256 MiB on an H200). Larger pieces mean fewer cuMemMap/cuMemUnmap calls per reserved
// or committed byte; the memory is spent once per device, not per arena.
//
// Thread-safety: ForDevice is thread-safe; the object is immutable after construction.
#pragma once

#include <cstddef>
#include <memory>

#include "drivers/cuda/cuda_abi.h"
#include "drivers/cuda/cuda_api.h"
#include "drivers/cuda/cuda_owners.h"

namespace jax_vmm::cuda {

// The zero-piece size for a device with `total_bytes` of memory and `granularity`.
size_t ZeroPieceBytes(size_t total_bytes, size_t granularity);

class ZeroAllocation {
 public:
  // The device's zero allocation, made on first use (throws OutOfMemory / DriverError).
  static std::shared_ptr<const ZeroAllocation> ForDevice(const Api& api, int ordinal, CUdevice dev,
                                                         size_t granularity);
  ZeroAllocation(const Api& api, int ordinal, CUdevice dev, size_t bytes);
  ZeroAllocation(const ZeroAllocation&) = delete;
  ZeroAllocation& operator=(const ZeroAllocation&) = delete;

  CUmemGenericAllocationHandle handle() const { return handle_.get(); }
  size_t bytes() const { return bytes_; }

 private:
  // Declaration order is teardown order reversed: the handle goes before the context.
  PrimaryContext ctx_;
  OwnedHandle handle_;
  size_t bytes_;
};

}  // namespace jax_vmm::cuda
