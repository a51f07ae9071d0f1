// CUDA driver VMM backend of the Driver interface (see driver.h for the semantics).
//
// Layout of a reservation: every chunk of the range maps one shared physical "zero
// chunk" (chunk_bytes, zero-filled once) read-only, so unbacked memory reads as zeros
// and never faults. Map swaps the zero mapping of one chunk for a real allocation,
// Unmap swaps it back.
//
// The driver API comes from cuda_api.h (libcuda resolved at run time), its objects are
// held by the owners of cuda_owners.h, device facts come from cuda_device.h.
#include <atomic>
#include <cstddef>
#include <memory>
#include <new>
#include <string>

#include "common/format.h"
#include "drivers/cuda/cuda_abi.h"
#include "drivers/cuda/cuda_api.h"
#include "drivers/cuda/cuda_device.h"
#include "drivers/cuda/cuda_owners.h"
#include "jax_vmm/driver.h"
#include "jax_vmm/errors.h"

namespace jax_vmm {
namespace cuda {
namespace {

// The driver.
//
// Thread-safety: every method may be called from any thread concurrently. After
// construction the object holds only immutable state (device, context, stream, zero
// chunk, prebuilt descriptors) plus one atomic (the learned span_unmap_ flag); each call pushes the
// primary context on the calling thread's own context stack and pops it on return. Calls on the
// same chunk must not overlap (the arena serialises per-buffer work). Concurrent calls may share
// the private stream: each one only waits for it to drain, so correctness holds.
class CudaDriver final : public Driver {
 public:
  CudaDriver(const Api& api, int ordinal, CUdevice dev, size_t granularity, size_t chunk_bytes)
      : api_(api),
        ordinal_(ordinal),
        dev_(dev),
        granularity_(granularity),
        chunk_bytes_(chunk_bytes),
        // Largest power of two dividing chunk_bytes: reservations are aligned to it so
        // chunks sit on large-page boundaries. chunk_bytes is a multiple of the
        // (power-of-two) granularity, so this is at least the granularity.
        alignment_(chunk_bytes & (~chunk_bytes + 1)),
        prop_(DeviceAllocationProp(dev)),
        read_only_(DeviceAccess(dev, CU_MEM_ACCESS_FLAGS_PROT_READ)),
        read_write_(DeviceAccess(dev, CU_MEM_ACCESS_FLAGS_PROT_READWRITE)),
        ctx_(api, dev, ordinal),
        stream_(api, ctx_.get(), ordinal),
        zero_(api, ctx_.get(), ordinal) {
    CreateZeroChunk();
  }

  const char* kind() const override { return "cuda"; }
  int device_ordinal() const override { return ordinal_; }
  size_t granularity() const override { return granularity_; }
  size_t chunk_bytes() const override { return chunk_bytes_; }

  MemInfo mem_info() const override {
    ContextGuard g(api_, ctx_.get(), ordinal_);
    MemInfo info;
    CUresult r = api_.cuMemGetInfo(&info.free_bytes, &info.total_bytes);
    if (r != CUDA_SUCCESS) ThrowDriver(api_, ordinal_, "cuMemGetInfo", r);
    return info;
  }

  // Cost: one cuMemMap per chunk (~2 us each) plus one cuMemSetAccess for the range.
  uintptr_t Reserve(size_t bytes) override {
    if (bytes == 0 || bytes % chunk_bytes_ != 0) {
      throw InvalidArgument("jax_vmm: CUDA reservation of " + std::to_string(bytes) +
                            " bytes: expected a positive multiple of chunk_bytes (" +
                            std::to_string(chunk_bytes_) + ")");
    }
    ContextGuard g(api_, ctx_.get(), ordinal_);
    CUdeviceptr va = 0;
    CUresult r = api_.cuMemAddressReserve(&va, bytes, alignment_, 0, 0);
    if (r != CUDA_SUCCESS) {
      ThrowDriver(api_, ordinal_,
                  "cuMemAddressReserve(size=" + std::to_string(bytes) +
                      ", alignment=" + std::to_string(alignment_) +
                      ") (virtual address space; try a smaller reserve_bytes)",
                  r);
    }
    ScopedReservation guard(api_, ordinal_, va, bytes, chunk_bytes_);
    const size_t n = bytes / chunk_bytes_;
    for (size_t i = 0; i < n; ++i) {
      const CUdeviceptr at = va + i * chunk_bytes_;
      r = api_.cuMemMap(at, chunk_bytes_, 0, zero_.get(), 0);
      if (r != CUDA_SUCCESS) {
        ThrowDriver(api_, ordinal_,
                    "cuMemMap(zero chunk, va=" + Hex(at) + ", size=" +
                        std::to_string(chunk_bytes_) + ") at chunk " + std::to_string(i) + " of " +
                        std::to_string(n) + " while reserving " + std::to_string(bytes) + " bytes",
                    r);
      }
      guard.count_mapped();
    }
    r = api_.cuMemSetAccess(va, bytes, &read_only_, 1);
    if (r != CUDA_SUCCESS) {
      ThrowDriver(api_, ordinal_,
                  "cuMemSetAccess(READ, va=" + Hex(va) + ", size=" + std::to_string(bytes) + ")",
                  r);
    }
    return static_cast<uintptr_t>(guard.release());
  }

  void Unreserve(uintptr_t va, size_t bytes) noexcept override {
    ContextGuard g(api_, ctx_.get(), ordinal_, std::nothrow);
    if (!g.ok()) return;
    const CUresult r0 = UnmapChunks(va, bytes / chunk_bytes_);
    if (r0 != CUDA_SUCCESS) {
      Report(api_, ordinal_, "cuMemUnmap in Unreserve(va=" + Hex(va) + ")", r0);
    }
    CUresult r = api_.cuMemAddressFree(va, bytes);
    if (r != CUDA_SUCCESS) {
      Report(api_, ordinal_,
             "cuMemAddressFree(va=" + Hex(va) + ", size=" + std::to_string(bytes) + ")", r);
    }
  }

  PhysicalHandle Create() override {
    ContextGuard g(api_, ctx_.get(), ordinal_);
    CUmemGenericAllocationHandle handle = 0;
    CUresult r = api_.cuMemCreate(&handle, chunk_bytes_, &prop_, 0);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) ThrowOutOfMemory("cuMemCreate", chunk_bytes_);
    if (r != CUDA_SUCCESS) {
      ThrowDriver(api_, ordinal_,
                  "cuMemCreate(size=" + std::to_string(chunk_bytes_) + ", pinned device memory)",
                  r);
    }
    return handle;
  }

  void Release(PhysicalHandle handle) noexcept override {
    ContextGuard g(api_, ctx_.get(), ordinal_, std::nothrow);
    if (!g.ok()) return;
    CUresult r = api_.cuMemRelease(handle);
    if (r != CUDA_SUCCESS) Report(api_, ordinal_, "cuMemRelease(handle=" + Hex(handle) + ")", r);
  }

  void Map(uintptr_t va, PhysicalHandle handle) override { MapRun(va, &handle, 1); }
  void Unmap(uintptr_t va) noexcept override { UnmapRun(va, 1); }

  // One cuMemUnmap for the run's zero mappings (where the driver allows), one cuMemMap
  // per chunk. On failure the run reads zeros again.
  void MapRun(uintptr_t va, const PhysicalHandle* handles, size_t count) override {
    if (count == 0) return;
    ContextGuard g(api_, ctx_.get(), ordinal_);
    CUresult r = UnmapChunks(va, count);
    if (r != CUDA_SUCCESS) {
      const bool restored = MapZeroRun(va, count, /*careful=*/true);
      ThrowDriver(api_, ordinal_,
                  "cuMemUnmap(zero mappings, va=" + Hex(va) + ", chunks=" + std::to_string(count) +
                      " of " + std::to_string(chunk_bytes_) + " bytes) before mapping" +
                      (restored ? "" : RestoreFailed()),
                  r);
    }
    size_t mapped = 0;
    for (; mapped < count; ++mapped) {
      r = api_.cuMemMap(va + mapped * chunk_bytes_, chunk_bytes_, 0, handles[mapped], 0);
      if (r != CUDA_SUCCESS) break;
    }
    if (mapped == count) return;
    const uintptr_t at = va + mapped * chunk_bytes_;
    // Undo: the real chunks mapped so far go, the zero chunk returns everywhere.
    const bool unmapped = UnmapChunks(va, mapped) == CUDA_SUCCESS;
    const bool restored = MapZeroRun(va, count, /*careful=*/!unmapped) && unmapped;
    const std::string call = "cuMemMap(va=" + Hex(at) + ", size=" + std::to_string(chunk_bytes_) +
                             ", handle=" + Hex(handles[mapped]) + ")" +
                             (restored ? "" : RestoreFailed());
    if (r == CUDA_ERROR_OUT_OF_MEMORY) ThrowOutOfMemory(call, chunk_bytes_);
    ThrowDriver(api_, ordinal_, call, r);
  }

  // One cuMemUnmap for the run (where the driver allows), the zero chunk mapped back at
  // each chunk, one cuMemSetAccess(READ) for the run.
  void UnmapRun(uintptr_t va, size_t count) noexcept override {
    if (count == 0) return;
    ContextGuard g(api_, ctx_.get(), ordinal_, std::nothrow);
    if (!g.ok()) return;
    CUresult r = UnmapChunks(va, count);
    if (r != CUDA_SUCCESS) {
      // Some chunk is still mapped (it keeps reading its old contents, no fault); put
      // the zero chunk back where the mapping is gone.
      Report(api_, ordinal_, "cuMemUnmap(va=" + Hex(va) + ", chunks=" + std::to_string(count) + ")",
             r);
    }
    MapZeroRun(va, count, /*careful=*/r != CUDA_SUCCESS);
  }

  // The run is freshly committed memory (the arena calls this once per new run): make it
  // read-write and zero-fill it. cuMemCreate gives no content guarantee (a chunk may hold
  // bytes this process freed earlier, JAX's included), and committed memory must read
  // zeros like unbacked memory does, as on the host driver. Cost: one memset of the run
  // on the driver's stream (~HBM bandwidth) plus one stream sync.
  void SetAccess(uintptr_t va, size_t bytes) override {
    ContextGuard g(api_, ctx_.get(), ordinal_);
    CUresult r = api_.cuMemSetAccess(va, bytes, &read_write_, 1);
    if (r != CUDA_SUCCESS) {
      ThrowDriver(
          api_, ordinal_,
          "cuMemSetAccess(READWRITE, va=" + Hex(va) + ", size=" + std::to_string(bytes) + ")", r);
    }
    r = api_.cuMemsetD8Async(va, 0, bytes, stream_.get());
    if (r == CUDA_SUCCESS) r = api_.cuStreamSynchronize(stream_.get());
    if (r != CUDA_SUCCESS) {
      ThrowDriver(api_, ordinal_,
                  "cuMemsetD8(zero-fill of newly committed memory, va=" + Hex(va) +
                      ", size=" + std::to_string(bytes) + ")",
                  r);
    }
  }

  void* AllocMetadata(size_t bytes) override {
    ContextGuard g(api_, ctx_.get(), ordinal_);
    CUdeviceptr ptr = 0;
    CUresult r = api_.cuMemAlloc(&ptr, bytes);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) ThrowOutOfMemory("cuMemAlloc (arena metadata)", bytes);
    if (r != CUDA_SUCCESS) {
      ThrowDriver(api_, ordinal_, "cuMemAlloc(size=" + std::to_string(bytes) + ")", r);
    }
    return reinterpret_cast<void*>(static_cast<uintptr_t>(ptr));
  }

  void FreeMetadata(void* ptr) noexcept override {
    if (ptr == nullptr) return;
    ContextGuard g(api_, ctx_.get(), ordinal_, std::nothrow);
    if (!g.ok()) return;
    CUresult r = api_.cuMemFree(DevPtr(ptr));
    if (r != CUDA_SUCCESS) Report(api_, ordinal_, "cuMemFree(" + Hex(DevPtr(ptr)) + ")", r);
  }

  // Returns once the bytes are in device memory (visible to kernels launched after).
  void CopyToMetadata(void* dst, const void* src, size_t bytes) override {
    ContextGuard g(api_, ctx_.get(), ordinal_);
    CUresult r = api_.cuMemcpyHtoDAsync(DevPtr(dst), src, bytes, stream_.get());
    if (r == CUDA_SUCCESS) r = api_.cuStreamSynchronize(stream_.get());
    if (r != CUDA_SUCCESS) {
      ThrowDriver(api_, ordinal_,
                  "cuMemcpyHtoD(dst=" + Hex(DevPtr(dst)) + ", bytes=" + std::to_string(bytes) + ")",
                  r);
    }
  }

  // Reads what device memory holds now; it does not wait for running kernels (call
  // Synchronize() first when device code may still be writing).
  void CopyFromMetadata(void* dst, const void* src, size_t bytes) override {
    ContextGuard g(api_, ctx_.get(), ordinal_);
    CUresult r = api_.cuMemcpyDtoHAsync(dst, DevPtr(src), bytes, stream_.get());
    if (r == CUDA_SUCCESS) r = api_.cuStreamSynchronize(stream_.get());
    if (r != CUDA_SUCCESS) {
      ThrowDriver(api_, ordinal_,
                  "cuMemcpyDtoH(src=" + Hex(DevPtr(src)) + ", bytes=" + std::to_string(bytes) + ")",
                  r);
    }
  }

  void Synchronize() override {
    ContextGuard g(api_, ctx_.get(), ordinal_);
    CUresult r = api_.cuCtxSynchronize();
    if (r != CUDA_SUCCESS) ThrowDriver(api_, ordinal_, "cuCtxSynchronize", r);
  }

 private:
  static CUdeviceptr DevPtr(const void* p) {
    return static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(p));
  }

  // Creates the zero chunk and fills it with zeros through a temporary read-write
  // mapping (fresh allocations carry no content guarantee).
  void CreateZeroChunk() {
    ContextGuard g(api_, ctx_.get(), ordinal_);
    CUresult r = api_.cuMemCreate(zero_.out(), chunk_bytes_, &prop_, 0);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) ThrowOutOfMemory("cuMemCreate (zero chunk)", chunk_bytes_);
    if (r != CUDA_SUCCESS) {
      ThrowDriver(api_, ordinal_,
                  "cuMemCreate(zero chunk, size=" + std::to_string(chunk_bytes_) + ")", r);
    }
    CUdeviceptr va = 0;
    r = api_.cuMemAddressReserve(&va, chunk_bytes_, alignment_, 0, 0);
    if (r != CUDA_SUCCESS) {
      ThrowDriver(api_, ordinal_, "cuMemAddressReserve(size=" + std::to_string(chunk_bytes_) + ")",
                  r);
    }
    ScopedReservation temp(api_, ordinal_, va, chunk_bytes_, chunk_bytes_);
    r = api_.cuMemMap(va, chunk_bytes_, 0, zero_.get(), 0);
    if (r != CUDA_SUCCESS) ThrowDriver(api_, ordinal_, "cuMemMap(zero chunk, temporary)", r);
    temp.count_mapped();
    r = api_.cuMemSetAccess(va, chunk_bytes_, &read_write_, 1);
    if (r != CUDA_SUCCESS) ThrowDriver(api_, ordinal_, "cuMemSetAccess(zero chunk, READWRITE)", r);
    r = api_.cuMemsetD8Async(va, 0, chunk_bytes_, stream_.get());
    if (r == CUDA_SUCCESS) r = api_.cuStreamSynchronize(stream_.get());
    if (r != CUDA_SUCCESS) ThrowDriver(api_, ordinal_, "cuMemsetD8(zero chunk)", r);
    // `temp` unmaps and frees the temporary range; the zero chunk lives on in zero_.
  }

  // Unmaps `count` whole chunk mappings from va: one call when this driver accepts a
  // range spanning several mappings (tried once, remembered), else one per chunk.
  // Caller holds the context. Returns the first failure (others reported), or success.
  CUresult UnmapChunks(uintptr_t va, size_t count) noexcept {
    if (count == 0) return CUDA_SUCCESS;
    if (count > 1 && span_unmap_.load(std::memory_order_relaxed) != kNo) {
      if (api_.cuMemUnmap(va, count * chunk_bytes_) == CUDA_SUCCESS) {
        span_unmap_.store(kYes, std::memory_order_relaxed);
        return CUDA_SUCCESS;
      }
      int unknown = kUnknown;  // a refusal before ever succeeding: stop trying
      span_unmap_.compare_exchange_strong(unknown, kNo, std::memory_order_relaxed);
    }
    CUresult first = CUDA_SUCCESS;
    for (size_t i = 0; i < count; ++i) {
      const CUresult r = api_.cuMemUnmap(va + i * chunk_bytes_, chunk_bytes_);
      if (r == CUDA_SUCCESS) continue;
      if (first == CUDA_SUCCESS) {
        first = r;
      } else {
        Report(api_, ordinal_, "cuMemUnmap(va=" + Hex(va + i * chunk_bytes_) + ")", r);
      }
    }
    return first;
  }

  // Maps the zero chunk at every chunk of the run and makes the run read-only with one
  // cuMemSetAccess. `careful` (after a failed unmap): skip chunks that are still mapped.
  // Caller holds the context. Returns false (after reporting) when some chunk could not
  // get it back: that chunk then faults on access.
  bool MapZeroRun(uintptr_t va, size_t count, bool careful = false) noexcept {
    bool all = true;
    for (size_t i = 0; i < count; ++i) {
      const uintptr_t at = va + i * chunk_bytes_;
      if (careful && StillMapped(at)) continue;
      const CUresult r = api_.cuMemMap(at, chunk_bytes_, 0, zero_.get(), 0);
      if (r != CUDA_SUCCESS) {
        Report(api_, ordinal_, "cuMemMap(zero chunk, va=" + Hex(at) + ")", r);
        all = false;
      }
    }
    if (all) {
      const CUresult r = api_.cuMemSetAccess(va, count * chunk_bytes_, &read_only_, 1);
      if (r == CUDA_SUCCESS) return true;
      Report(api_, ordinal_,
             "cuMemSetAccess(READ, va=" + Hex(va) + ", chunks=" + std::to_string(count) + ")", r);
    }
    // Slow path: chunk by chunk, for what is mapped.
    bool ok = all;
    for (size_t i = 0; i < count; ++i) {
      const uintptr_t at = va + i * chunk_bytes_;
      const CUresult r = api_.cuMemSetAccess(at, chunk_bytes_, &read_only_, 1);
      if (r != CUDA_SUCCESS && StillMapped(at)) {
        Report(api_, ordinal_, "cuMemSetAccess(READ, va=" + Hex(at) + ")", r);
        ok = false;
      }
    }
    return ok;
  }

  // Whether something is mapped at va (a failed unmap left a real chunk there).
  bool StillMapped(uintptr_t va) const noexcept {
    unsigned long long flags = 0;
    CUmemLocation loc{CU_MEM_LOCATION_TYPE_DEVICE, dev_};
    return api_.cuMemGetAccess(&flags, &loc, va) == CUDA_SUCCESS;
  }

  static std::string RestoreFailed() {
    return " [restoring the zero mapping also failed: reading there now faults]";
  }

  [[noreturn]] void ThrowOutOfMemory(const std::string& call, size_t requested) const {
    MemInfo info;  // best effort: the numbers are for the message only
    if (api_.cuMemGetInfo(&info.free_bytes, &info.total_bytes) != CUDA_SUCCESS) {
      info = MemInfo{};
    }
    throw OutOfMemory("jax_vmm: " + call + " on CUDA device " + std::to_string(ordinal_) +
                          ": out of GPU memory asking for " + std::to_string(requested) +
                          " bytes; " + std::to_string(info.free_bytes) + " bytes free of " +
                          std::to_string(info.total_bytes),
                      requested, info.free_bytes);
  }

  const Api& api_;
  const int ordinal_;
  const CUdevice dev_;
  const size_t granularity_;
  const size_t chunk_bytes_;
  const size_t alignment_;
  const CUmemAllocationProp prop_;
  const CUmemAccessDesc read_only_;
  const CUmemAccessDesc read_write_;
  // Declaration order is teardown order reversed: the zero chunk and the stream go
  // before the context reference that they need.
  PrimaryContext ctx_;
  OwnedStream stream_;
  OwnedHandle zero_;
  // Whether cuMemUnmap accepts a range spanning several mappings (learned on first use).
  static constexpr int kUnknown = -1, kNo = 0, kYes = 1;
  std::atomic<int> span_unmap_{kUnknown};
};

}  // namespace
}  // namespace cuda

std::unique_ptr<Driver> MakeCudaDriver(int device_ordinal, size_t chunk_bytes) {
  const cuda::Api& api = cuda::LoadedApiOrThrow();
  cuda::InitOrThrow(api);
  const cuda::CUdevice dev = cuda::VmmDeviceOrThrow(api, device_ordinal);
  const size_t granularity =
      cuda::GranularityOrThrow(api, device_ordinal, dev, cuda::CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (chunk_bytes == 0) chunk_bytes = granularity;
  if (chunk_bytes % granularity != 0) {
    throw InvalidArgument("jax_vmm: chunk_bytes=" + std::to_string(chunk_bytes) +
                          " is not a multiple of CUDA device " + std::to_string(device_ordinal) +
                          "'s VMM granularity (" + std::to_string(granularity) +
                          " bytes); use a multiple of it, or 0 for the default");
  }
  return std::make_unique<cuda::CudaDriver>(api, device_ordinal, dev, granularity, chunk_bytes);
}

}  // namespace jax_vmm
