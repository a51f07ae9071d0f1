// CUDA driver VMM backend of the Driver interface (see driver.h for the semantics).
//
// Layout of a reservation: every unbacked byte maps one of the device's shared zero
// allocations (zero_allocation.h) read-only, in power-of-two pieces aligned to their size
// from the reservation base, each mapping the zero allocation of its exact size (cuMemMap
// maps only whole allocations); ZeroLayout (zero_layout.h) records the pieces. MapRun
// clears the zero pieces under its range (and maps the parts of them outside the range
// back), then maps the real pieces; UnmapRun unmaps real pieces and restores zero as
// aligned pieces.
//
// A reservation made by ReserveDeferringZeros maps no zero piece until EnableZeroReads:
// MapRun and UnmapRun there only map and unmap the real pieces (what the seed's code
// does), and the driver records those mappings so that EnableZeroReads can tile the
// holes between them. The zero allocations are made on first need (an eager Reserve or
// EnableZeroReads), so a driver whose reservations all defer holds none.
//
// The driver API comes from cuda_api.h (libcuda resolved at run time), its objects are
// held by the owners of cuda_owners.h, device facts come from cuda_device.h.
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "common/format.h"
#include "common/math.h"
#include "drivers/cuda/compute_streams.h"
#include "drivers/cuda/cuda_abi.h"
#include "drivers/cuda/cuda_api.h"
#include "drivers/cuda/cuda_device.h"
#include "drivers/cuda/cuda_driver.h"
#include "drivers/cuda/cuda_owners.h"
#include "drivers/cuda/zero_allocation.h"
#include "drivers/cuda/zero_layout.h"
#include "jax_vmm/driver.h"
#include "jax_vmm/errors.h"

namespace jax_vmm {
namespace cuda {
namespace {

// The driver.
//
// Thread-safety: every method may be called from any thread concurrently, on disjoint
// address ranges (the arena serialises work on any one chunk). Immutable state after
// construction, plus the zero layouts of the reservations and the real mappings of
// deferring ones (under zero_mu_, held only around bookkeeping, never around driver
// calls), the zero allocations (made once under zero_make_mu_, then read through an
// atomic pointer) and one learned atomic flag. Each call
// pushes the primary context on the calling thread's own context stack and pops it on
// return. Concurrent calls may share the private streams: each only waits for its stream
// to drain, so correctness holds.
class CudaDriver final : public Driver {
 public:
  CudaDriver(const Api& api, int ordinal, CUdevice dev, size_t granularity, size_t chunk_bytes)
      : api_(api),
        ordinal_(ordinal),
        dev_(dev),
        granularity_(granularity),
        chunk_bytes_(chunk_bytes),
        prop_(DeviceAllocationProp(dev)),
        read_only_(DeviceAccess(dev, CU_MEM_ACCESS_FLAGS_PROT_READ)),
        read_write_(DeviceAccess(dev, CU_MEM_ACCESS_FLAGS_PROT_READWRITE)),
        ctx_(api, dev, ordinal),
        stream_(api, ctx_.get(), ordinal),
        copy_stream_(api, ctx_.get(), ordinal),
        max_piece_(PlannedMaxPiece()) {}

  const char* kind() const override { return "cuda"; }
  int device_ordinal() const override { return ordinal_; }
  size_t granularity() const override { return granularity_; }
  size_t chunk_bytes() const override { return chunk_bytes_; }
  bool FreshMemoryIsZero() const override { return false; }  // cuMemCreate: no guarantee
  bool UnmapNeedsQuiescence() const override { return true; }

  MemInfo mem_info() const override {
    ContextGuard g(api_, ctx_.get(), ordinal_);
    MemInfo info;
    CUresult r = api_.cuMemGetInfo(&info.free_bytes, &info.total_bytes);
    if (r != CUDA_SUCCESS) ThrowDriver(api_, ordinal_, "cuMemGetInfo", r);
    return info;
  }

  // Cost: one cuMemMap per zero piece (about bytes / 256 MiB on an H200) plus one
  // cuMemSetAccess for the range.
  uintptr_t Reserve(size_t bytes) override { return ReserveWith(bytes, /*defer=*/false); }

  bool CanDeferZeroReads() const override { return true; }
  // Cost: the cuMemAddressReserve only.
  uintptr_t ReserveDeferringZeros(size_t bytes) override {
    return ReserveWith(bytes, /*defer=*/true);
  }

  // Tiles the holes between the real mappings with zero pieces (one cuMemMap each) and
  // makes each hole readable (one cuMemSetAccess per hole): what Reserve would have done,
  // minus what is mapped since. On failure the pieces mapped so far go again.
  void EnableZeroReads(uintptr_t base) override {
    ContextGuard g(api_, ctx_.get(), ordinal_);
    const ZeroAllocations& zero = Zero();
    std::vector<ZeroPiece> tiles;
    std::vector<ZeroPiece> holes;
    {
      std::lock_guard<std::mutex> lock(zero_mu_);
      auto it = deferred_.find(base);
      if (it == deferred_.end()) return;  // zeros from the start, or enabled already
      ZeroLayout& layout = layouts_.at(base);
      if (layout.max_piece() != zero.max_piece()) {  // still empty: plan it for these zeros
        layout = ZeroLayout(base, layout.bytes(), zero.max_piece(), granularity_);
      }
      uintptr_t at = base;
      for (const auto& [va, n] : it->second) {
        if (va > at) holes.push_back({at, va - at});
        at = va + n;
      }
      if (at < base + layout.bytes()) holes.push_back({at, base + layout.bytes() - at});
      for (const ZeroPiece& h : holes) {
        const std::vector<ZeroPiece> t = layout.Tile(h.va, h.bytes);
        tiles.insert(tiles.end(), t.begin(), t.end());
      }
    }
    size_t mapped = 0;
    CUresult r = CUDA_SUCCESS;
    std::string call;
    for (; mapped < tiles.size(); ++mapped) {
      r = MapZeroPiece(tiles[mapped]);
      if (r != CUDA_SUCCESS) {
        call = "cuMemMap(zero piece, va=" + Hex(tiles[mapped].va) + ")";
        break;
      }
    }
    for (size_t i = 0; r == CUDA_SUCCESS && i < holes.size(); ++i) {
      r = api_.cuMemSetAccess(holes[i].va, holes[i].bytes, &read_only_, 1);
      if (r != CUDA_SUCCESS) call = "cuMemSetAccess(READ, va=" + Hex(holes[i].va) + ")";
    }
    if (r != CUDA_SUCCESS) {
      for (size_t i = 0; i < mapped; ++i) api_.cuMemUnmap(tiles[i].va, tiles[i].bytes);
      if (r == CUDA_ERROR_OUT_OF_MEMORY) ThrowOutOfMemory(call + " (zero reads)", 0);
      ThrowDriver(api_, ordinal_,
                  call + " while giving the unbacked memory of the reservation at " + Hex(base) +
                      " its zero mapping",
                  r);
    }
    std::lock_guard<std::mutex> lock(zero_mu_);
    layouts_.at(base).Add(tiles);
    deferred_.erase(base);
  }

  void Unreserve(uintptr_t va, size_t bytes) noexcept override {
    ContextGuard g(api_, ctx_.get(), ordinal_, std::nothrow);
    if (!g.ok()) return;
    std::vector<ZeroPiece> pieces;
    {
      std::lock_guard<std::mutex> lock(zero_mu_);
      auto it = layouts_.find(va);
      if (it != layouts_.end()) {
        pieces = it->second.pieces();
        layouts_.erase(it);
      }
      deferred_.erase(va);
    }
    std::vector<bool> gone;
    const CUresult r0 = UnmapPieces(pieces, &gone);
    if (r0 != CUDA_SUCCESS) {
      Report(api_, ordinal_, "cuMemUnmap(zero pieces) in Unreserve(va=" + Hex(va) + ")", r0);
    }
    CUresult r = api_.cuMemAddressFree(va, bytes);
    if (r != CUDA_SUCCESS) {
      Report(api_, ordinal_,
             "cuMemAddressFree(va=" + Hex(va) + ", size=" + std::to_string(bytes) + ")", r);
    }
  }

  PhysicalHandle Create(size_t bytes) override {
    if (bytes == 0 || bytes % chunk_bytes_ != 0) {
      throw InvalidArgument("jax_vmm: CUDA allocation of " + std::to_string(bytes) +
                            " bytes: expected a positive multiple of chunk_bytes (" +
                            std::to_string(chunk_bytes_) + ")");
    }
    ContextGuard g(api_, ctx_.get(), ordinal_);
    CUmemGenericAllocationHandle handle = 0;
    CUresult r = api_.cuMemCreate(&handle, bytes, &prop_, 0);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) ThrowOutOfMemory("cuMemCreate", bytes);
    if (r != CUDA_SUCCESS) {
      ThrowDriver(api_, ordinal_,
                  "cuMemCreate(size=" + std::to_string(bytes) + ", pinned device memory)", r);
    }
    return handle;
  }

  void Release(PhysicalHandle handle) noexcept override {
    ContextGuard g(api_, ctx_.get(), ordinal_, std::nothrow);
    if (!g.ok()) return;
    CUresult r = api_.cuMemRelease(handle);
    if (r != CUDA_SUCCESS) Report(api_, ordinal_, "cuMemRelease(handle=" + Hex(handle) + ")", r);
  }

  // Clear the zero pieces under the run (one cuMemUnmap each, or one for all where the
  // driver allows), map their parts outside the run back, map the real pieces, and make
  // the zero remainders readable (one cuMemSetAccess over the cleared hull; the arena's
  // SetAccess then makes the run itself writable). On failure the hull reads zeros again.
  void MapRun(uintptr_t va, const MapPiece* pieces, size_t count) override {
    size_t total = 0;
    for (size_t i = 0; i < count; ++i) {
      if (pieces[i].offset != 0) {
        throw InvalidArgument("jax_vmm: CUDA MapRun piece " + std::to_string(i) + " at offset " +
                              std::to_string(pieces[i].offset) +
                              ": cuMemMap maps only whole allocations (offset 0)");
      }
      total += pieces[i].bytes;
    }
    if (total == 0) return;
    ContextGuard g(api_, ctx_.get(), ordinal_);
    ZeroLayout::Clear plan = ClaimZero(va, total);
    std::vector<bool> gone;
    CUresult r = UnmapPieces(plan.unmap, &gone);
    if (r != CUDA_SUCCESS) {
      // Put back what was unmapped; the pieces that refused are still mapped.
      std::vector<ZeroPiece> kept, holes;
      for (size_t i = 0; i < plan.unmap.size(); ++i) {
        (gone[i] ? holes : kept).push_back(plan.unmap[i]);
      }
      const std::vector<ZeroPiece> back = MapZero(holes);
      for (const ZeroPiece& p : back) ReadOnly(p.va, p.bytes);
      const bool restored = back.size() == holes.size();
      kept.insert(kept.end(), back.begin(), back.end());
      RecordZero(va, kept);
      ThrowDriver(api_, ordinal_,
                  "cuMemUnmap(zero pieces under va=" + Hex(va) + ", size=" + std::to_string(total) +
                      ") before mapping" + (restored ? "" : RestoreFailed()),
                  r);
    }
    size_t remapped = 0;
    for (; remapped < plan.remap.size() && r == CUDA_SUCCESS; ++remapped) {
      r = MapZeroPiece(plan.remap[remapped]);
      if (r != CUDA_SUCCESS) break;
    }
    std::string call;
    if (r != CUDA_SUCCESS)
      call = "cuMemMap(zero remainder, va=" + Hex(plan.remap[remapped].va) + ")";
    size_t mapped = 0;
    uintptr_t at = va;
    for (; r == CUDA_SUCCESS && mapped < count; ++mapped) {
      const MapPiece& p = pieces[mapped];
      r = api_.cuMemMap(at, p.bytes, p.offset, p.handle, 0);
      if (r != CUDA_SUCCESS) {
        call = "cuMemMap(va=" + Hex(at) + ", size=" + std::to_string(p.bytes) +
               ", offset=" + std::to_string(p.offset) + ", handle=" + Hex(p.handle) + ")";
        break;
      }
      at += p.bytes;
    }
    if (r == CUDA_SUCCESS && !plan.remap.empty()) {
      r = api_.cuMemSetAccess(plan.hull_va, plan.hull_bytes, &read_only_, 1);
      if (r != CUDA_SUCCESS) {
        call = "cuMemSetAccess(READ, zero remainders, va=" + Hex(plan.hull_va) + ")";
      }
    }
    if (r == CUDA_SUCCESS) {
      RecordZero(va, plan.remap);
      RecordReal(va, pieces, count);
      return;
    }
    // Undo: the real pieces mapped so far go; zero returns over the run and over the
    // remainders that were not mapped back.
    std::vector<size_t> sizes;
    for (size_t i = 0; i < mapped; ++i) sizes.push_back(pieces[i].bytes);
    std::vector<bool> real_gone;
    const bool unmapped = UnmapConsecutive(va, sizes, &real_gone) == CUDA_SUCCESS;
    std::vector<ZeroPiece> back(plan.remap.begin(), plan.remap.begin() + remapped);
    std::vector<ZeroPiece> fill = TileOf(va, total);
    fill.insert(fill.end(), plan.remap.begin() + remapped, plan.remap.end());
    const std::vector<ZeroPiece> filled = unmapped ? MapZero(fill) : std::vector<ZeroPiece>{};
    const bool restored = filled.size() == fill.size();
    back.insert(back.end(), filled.begin(), filled.end());
    ReadOnly(plan.hull_va, plan.hull_bytes);
    RecordZero(va, back);
    call += restored ? "" : RestoreFailed();
    if (r == CUDA_ERROR_OUT_OF_MEMORY) ThrowOutOfMemory(call, total);
    ThrowDriver(api_, ordinal_, call, r);
  }

  // Unmap the real pieces (one call where the driver allows), then zero over what went,
  // as aligned pieces with one cuMemSetAccess(READ) per contiguous range.
  void UnmapRun(uintptr_t va, const size_t* piece_bytes, size_t count) noexcept override {
    if (count == 0) return;
    ContextGuard g(api_, ctx_.get(), ordinal_, std::nothrow);
    if (!g.ok()) return;
    std::vector<size_t> sizes(piece_bytes, piece_bytes + count);
    std::vector<bool> gone;
    const CUresult r = UnmapConsecutive(va, sizes, &gone);
    if (r != CUDA_SUCCESS) {
      // A piece that refused stays mapped (it keeps reading its old contents, no fault).
      Report(api_, ordinal_, "cuMemUnmap(va=" + Hex(va) + ", pieces=" + std::to_string(count) + ")",
             r);
    }
    if (ForgetReal(va, sizes, gone)) return;  // zeros deferred: nothing to restore
    std::vector<ZeroPiece> fill;
    uintptr_t at = va;
    uintptr_t run_va = va;
    size_t run_bytes = 0;
    for (size_t i = 0; i <= count; ++i) {
      const bool went = i < count && gone[i];
      if (went) {
        if (run_bytes == 0) run_va = at;
        run_bytes += sizes[i];
      }
      if (!went && run_bytes > 0) {
        const std::vector<ZeroPiece> tiles = MapZero(TileOf(run_va, run_bytes));
        ReadOnly(run_va, run_bytes);
        fill.insert(fill.end(), tiles.begin(), tiles.end());
        run_bytes = 0;
      }
      if (i < count) at += sizes[i];
    }
    RecordZero(va, fill);
  }

  void SetAccess(uintptr_t va, size_t bytes) override {
    ContextGuard g(api_, ctx_.get(), ordinal_);
    CUresult r = api_.cuMemSetAccess(va, bytes, &read_write_, 1);
    if (r != CUDA_SUCCESS) {
      ThrowDriver(
          api_, ordinal_,
          "cuMemSetAccess(READWRITE, va=" + Hex(va) + ", size=" + std::to_string(bytes) + ")", r);
    }
  }

  // One memset on the private stream (HBM bandwidth) plus one stream sync; it never
  // waits for JAX's work.
  void ZeroFill(uintptr_t va, size_t bytes) override {
    ContextGuard g(api_, ctx_.get(), ordinal_);
    CUresult r = api_.cuMemsetD8Async(va, 0, bytes, stream_.get());
    if (r == CUDA_SUCCESS) r = api_.cuStreamSynchronize(stream_.get());
    if (r != CUDA_SUCCESS) {
      ThrowDriver(api_, ordinal_,
                  "cuMemsetD8(zero fill, va=" + Hex(va) + ", size=" + std::to_string(bytes) + ")",
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

  // On XLA's compute streams, where the kernels that read the table run (compute_streams.h):
  // in order with them, without a wait. A copy from pageable memory is staged before the
  // call returns, so the caller may change `src` at once. Before any jax_vmm handler ran on
  // this device nothing of ours can be queued: the plain copy then.
  void WriteTable(void* dst, const void* src, size_t bytes) override {
    const std::vector<void*> streams = ComputeStreams(api_, ordinal_);
    if (streams.empty()) {
      CopyToMetadata(dst, src, bytes);
      return;
    }
    ContextGuard g(api_, ctx_.get(), ordinal_);
    for (void* s : streams) {
      CUresult r = api_.cuMemcpyHtoDAsync(DevPtr(dst), src, bytes, static_cast<CUstream>(s));
      if (r != CUDA_SUCCESS) {
        ThrowDriver(api_, ordinal_,
                    "cuMemcpyHtoDAsync(table dst=" + Hex(DevPtr(dst)) + ", bytes=" +
                        std::to_string(bytes) + ", XLA compute stream " +
                        Hex(reinterpret_cast<uintptr_t>(s)) + ")",
                    r);
      }
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

  // Waits for XLA's compute streams of this device and for the driver's own copy stream,
  // not for the context: a context wait would break a command-buffer capture that XLA
  // runs meanwhile on another thread (compute_streams.h). With no compute stream known
  // (no jax_vmm handler ran on this device) the context is all there is to wait for.
  void Synchronize() override {
    ContextGuard g(api_, ctx_.get(), ordinal_);
    const std::vector<void*> streams = ComputeStreams(api_, ordinal_);
    if (streams.empty()) {
      CUresult r = api_.cuCtxSynchronize();
      if (r != CUDA_SUCCESS) ThrowDriver(api_, ordinal_, "cuCtxSynchronize", r);
      return;
    }
    for (void* s : streams) {
      CUresult r = api_.cuStreamSynchronize(static_cast<CUstream>(s));
      if (r != CUDA_SUCCESS) {
        ThrowDriver(
            api_, ordinal_,
            "cuStreamSynchronize(XLA compute stream " + Hex(reinterpret_cast<uintptr_t>(s)) + ")",
            r);
      }
    }
    CUresult r = api_.cuStreamSynchronize(stream_.get());
    if (r != CUDA_SUCCESS) ThrowDriver(api_, ordinal_, "cuStreamSynchronize(copy stream)", r);
  }

  void* AllocHost(size_t bytes) override {
    ContextGuard g(api_, ctx_.get(), ordinal_);
    void* p = nullptr;
    CUresult r = api_.cuMemHostAlloc(&p, bytes, 0);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {
      throw OutOfMemory("jax_vmm: cuMemHostAlloc of " + std::to_string(bytes) +
                            " bytes of page-locked host memory failed: out of memory",
                        bytes, 0);
    }
    if (r != CUDA_SUCCESS) {
      ThrowDriver(api_, ordinal_, "cuMemHostAlloc(size=" + std::to_string(bytes) + ")", r);
    }
    return p;
  }

  void FreeHost(void* ptr, size_t) noexcept override {
    if (ptr == nullptr) return;
    ContextGuard g(api_, ctx_.get(), ordinal_, std::nothrow);
    if (!g.ok()) return;
    CUresult r = api_.cuMemFreeHost(ptr);
    if (r != CUDA_SUCCESS) Report(api_, ordinal_, "cuMemFreeHost", r);
  }

  void CopyToHost(const CopyRegion* regions, size_t count) override {
    Copy(regions, count, "device to host");
  }
  void CopyToDevice(const CopyRegion* regions, size_t count) override {
    Copy(regions, count, "to device");
  }

 private:
  static CUdeviceptr DevPtr(const void* p) {
    return static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(p));
  }

  // All regions on the copy stream (unified addressing: any direction), one sync.
  void Copy(const CopyRegion* regions, size_t count, const char* what) {
    ContextGuard g(api_, ctx_.get(), ordinal_);
    CUresult r = CUDA_SUCCESS;
    size_t i = 0;
    for (; i < count && r == CUDA_SUCCESS; ++i) {
      r = api_.cuMemcpyAsync(DevPtr(regions[i].dst), DevPtr(regions[i].src), regions[i].bytes,
                             copy_stream_.get());
      if (r != CUDA_SUCCESS) break;
    }
    // Wait even after a failed issue: earlier copies must not land after we return.
    const CUresult s = api_.cuStreamSynchronize(copy_stream_.get());
    if (r == CUDA_SUCCESS) r = s;
    if (r != CUDA_SUCCESS) {
      const CopyRegion& at = regions[std::min(i, count - 1)];
      ThrowDriver(api_, ordinal_,
                  std::string("cuMemcpyAsync(") + what + ", dst=" + Hex(DevPtr(at.dst)) +
                      ", src=" + Hex(DevPtr(at.src)) + ", bytes=" + std::to_string(at.bytes) +
                      ") of " + std::to_string(count) + " regions",
                  r);
    }
  }

  uintptr_t ReserveWith(size_t bytes, bool defer) {
    if (bytes == 0 || bytes % chunk_bytes_ != 0) {
      throw InvalidArgument("jax_vmm: CUDA reservation of " + std::to_string(bytes) +
                            " bytes: expected a positive multiple of chunk_bytes (" +
                            std::to_string(chunk_bytes_) + ")");
    }
    ContextGuard g(api_, ctx_.get(), ordinal_);
    const size_t max_piece = defer ? max_piece_ : Zero().max_piece();
    // Chunks on large-page boundaries, and zero pieces on their own size where it fits.
    const size_t alignment =
        std::max(LowestBit(chunk_bytes_), std::min(max_piece, FloorPow2(bytes)));
    CUdeviceptr va = 0;
    CUresult r = api_.cuMemAddressReserve(&va, bytes, alignment, 0, 0);
    if (r != CUDA_SUCCESS) {
      ThrowDriver(api_, ordinal_,
                  "cuMemAddressReserve(size=" + std::to_string(bytes) +
                      ", alignment=" + std::to_string(alignment) +
                      ") (virtual address space; try a smaller reserve_bytes)",
                  r);
    }
    ZeroLayout layout(va, bytes, max_piece, granularity_);
    if (!defer) {
      const std::vector<ZeroPiece> tiles = layout.Tile(va, bytes);
      size_t mapped = 0;
      for (; mapped < tiles.size(); ++mapped) {
        r = MapZeroPiece(tiles[mapped]);
        if (r != CUDA_SUCCESS) break;
      }
      if (r == CUDA_SUCCESS) r = api_.cuMemSetAccess(va, bytes, &read_only_, 1);
      if (r != CUDA_SUCCESS) {
        const std::string call =
            mapped < tiles.size()
                ? "cuMemMap(zero piece, va=" + Hex(tiles[mapped].va) +
                      ", size=" + std::to_string(tiles[mapped].bytes) + ")"
                : "cuMemSetAccess(READ, va=" + Hex(va) + ", size=" + std::to_string(bytes) + ")";
        for (size_t i = 0; i < mapped; ++i) api_.cuMemUnmap(tiles[i].va, tiles[i].bytes);
        api_.cuMemAddressFree(va, bytes);
        ThrowDriver(api_, ordinal_, call + " while reserving " + std::to_string(bytes) + " bytes",
                    r);
      }
      layout.Add(tiles);
    }
    std::lock_guard<std::mutex> lock(zero_mu_);
    layouts_.emplace(va, std::move(layout));
    if (defer) deferred_[va];
    return static_cast<uintptr_t>(va);
  }

  // The largest zero piece this device's zero allocations will have (cuMemGetInfo and
  // JAX_VMM_ZERO_PIECE_MAX_BYTES, as ZeroAllocations::ForDevice decides).
  size_t PlannedMaxPiece() const {
    ContextGuard g(api_, ctx_.get(), ordinal_);
    MemInfo info;
    const CUresult r = api_.cuMemGetInfo(&info.free_bytes, &info.total_bytes);
    if (r != CUDA_SUCCESS) ThrowDriver(api_, ordinal_, "cuMemGetInfo", r);
    return ZeroPieceBytes(info.total_bytes, granularity_, ZeroPieceCeilingFromEnv());
  }

  // The device's zero allocations, made on first need (throws OutOfMemory / DriverError).
  const ZeroAllocations& Zero() {
    if (const ZeroAllocations* z = zero_.load(std::memory_order_acquire)) return *z;
    std::lock_guard<std::mutex> lock(zero_make_mu_);
    if (zero_owner_ == nullptr) {
      zero_owner_ = ZeroAllocations::ForDevice(api_, ordinal_, dev_, granularity_);
      zero_.store(zero_owner_.get(), std::memory_order_release);
    }
    return *zero_owner_;
  }

  // The real mappings of reservations whose zeros are deferred: recorded on MapRun,
  // forgotten on UnmapRun (returns whether the reservation defers its zeros).
  void RecordReal(uintptr_t va, const MapPiece* pieces, size_t count) noexcept {
    std::lock_guard<std::mutex> lock(zero_mu_);
    try {
      auto it = deferred_.find(LayoutOf(va).base());
      if (it == deferred_.end()) return;
      for (size_t i = 0; i < count; va += pieces[i].bytes, ++i) it->second[va] = pieces[i].bytes;
    } catch (const std::exception& e) {
      Report(api_, ordinal_, std::string("mapping bookkeeping: ") + e.what(), -1);
    }
  }

  bool ForgetReal(uintptr_t va, const std::vector<size_t>& sizes,
                  const std::vector<bool>& gone) noexcept {
    std::lock_guard<std::mutex> lock(zero_mu_);
    try {
      auto it = deferred_.find(LayoutOf(va).base());
      if (it == deferred_.end()) return false;
      for (size_t i = 0; i < sizes.size(); va += sizes[i], ++i) {
        if (gone[i]) it->second.erase(va);
      }
      return true;
    } catch (...) {
      return false;  // no layout: only reached after a bookkeeping bug
    }
  }

  // Whether the reservation containing va defers its zeros; caller holds zero_mu_.
  bool DeferredLocked(uintptr_t va) { return deferred_.count(LayoutOf(va).base()) > 0; }

  // The reservation's zero layout: the pieces under [va, va + bytes) are planned for
  // clearing and taken out of the record (they are this call's to unmap). Nothing to
  // clear while the reservation defers its zeros.
  ZeroLayout::Clear ClaimZero(uintptr_t va, size_t bytes) {
    std::lock_guard<std::mutex> lock(zero_mu_);
    if (DeferredLocked(va)) return {};
    ZeroLayout& layout = LayoutOf(va);
    ZeroLayout::Clear plan = layout.PlanClear(va, bytes);
    layout.Remove(plan.unmap);
    return plan;
  }

  void RecordZero(uintptr_t va, const std::vector<ZeroPiece>& pieces) noexcept {
    if (pieces.empty()) return;
    std::lock_guard<std::mutex> lock(zero_mu_);
    try {
      LayoutOf(va).Add(pieces);
    } catch (const std::exception& e) {
      Report(api_, ordinal_, std::string("zero layout bookkeeping: ") + e.what(), -1);
    }
  }

  std::vector<ZeroPiece> TileOf(uintptr_t va, size_t bytes) noexcept {
    std::lock_guard<std::mutex> lock(zero_mu_);
    try {
      if (DeferredLocked(va)) return {};
      return LayoutOf(va).Tile(va, bytes);
    } catch (...) {
      return {{va, bytes}};  // no layout: one piece (only reached after a bookkeeping bug)
    }
  }

  // The layout of the reservation containing va; caller holds zero_mu_.
  ZeroLayout& LayoutOf(uintptr_t va) {
    auto it = layouts_.upper_bound(va);
    if (it != layouts_.begin()) {
      --it;
      if (it->second.contains(va)) return it->second;
    }
    throw InvalidArgument("jax_vmm: " + Hex(va) + " is not inside a reservation of this driver");
  }

  // Unmaps the given (consecutive or not) zero pieces: one call for a contiguous group
  // where the driver accepts a range spanning several mappings, else one each. gone[i]
  // says whether piece i is unmapped. Returns the first failure.
  CUresult UnmapPieces(const std::vector<ZeroPiece>& pieces, std::vector<bool>* gone) noexcept {
    std::vector<size_t> sizes;
    gone->assign(pieces.size(), false);
    CUresult first = CUDA_SUCCESS;
    size_t i = 0;
    while (i < pieces.size()) {
      size_t j = i + 1;
      while (j < pieces.size() && pieces[j].va == pieces[j - 1].va + pieces[j - 1].bytes) ++j;
      sizes.clear();
      for (size_t k = i; k < j; ++k) sizes.push_back(pieces[k].bytes);
      std::vector<bool> part;
      const CUresult r = UnmapConsecutive(pieces[i].va, sizes, &part);
      for (size_t k = i; k < j; ++k) (*gone)[k] = part[k - i];
      if (first == CUDA_SUCCESS) first = r;
      i = j;
    }
    return first;
  }

  // Unmaps consecutive mappings of the given sizes from va: one call when this driver
  // accepts a range spanning several mappings (tried once, remembered), else one per
  // mapping. Caller holds the context. Returns the first failure (others reported).
  CUresult UnmapConsecutive(uintptr_t va, const std::vector<size_t>& sizes,
                            std::vector<bool>* gone) noexcept {
    gone->assign(sizes.size(), false);
    if (sizes.empty()) return CUDA_SUCCESS;
    if (sizes.size() > 1 && span_unmap_.load(std::memory_order_relaxed) != kNo) {
      size_t total = 0;
      for (size_t s : sizes) total += s;
      if (api_.cuMemUnmap(va, total) == CUDA_SUCCESS) {
        span_unmap_.store(kYes, std::memory_order_relaxed);
        gone->assign(sizes.size(), true);
        return CUDA_SUCCESS;
      }
      int unknown = kUnknown;  // a refusal before ever succeeding: stop trying
      span_unmap_.compare_exchange_strong(unknown, kNo, std::memory_order_relaxed);
    }
    CUresult first = CUDA_SUCCESS;
    uintptr_t at = va;
    for (size_t i = 0; i < sizes.size(); ++i) {
      const CUresult r = api_.cuMemUnmap(at, sizes[i]);
      (*gone)[i] = r == CUDA_SUCCESS;
      if (r != CUDA_SUCCESS) {
        if (first == CUDA_SUCCESS) {
          first = r;
        } else {
          Report(api_, ordinal_, "cuMemUnmap(va=" + Hex(at) + ")", r);
        }
      }
      at += sizes[i];
    }
    return first;
  }

  // The zero allocation of the piece's exact size, mapped at it (not yet readable).
  CUresult MapZeroPiece(const ZeroPiece& p) const noexcept {
    const ZeroAllocations* zero = zero_.load(std::memory_order_acquire);
    // No zero allocations yet: a handle of 0, which cuMemMap refuses (a bookkeeping bug).
    return api_.cuMemMap(p.va, p.bytes, 0, zero != nullptr ? zero->handle(p.bytes) : 0, 0);
  }

  // Maps every piece (made read-only by the caller); returns the pieces mapped. A piece
  // that could not get its zero allocation (reported) faults on access.
  std::vector<ZeroPiece> MapZero(const std::vector<ZeroPiece>& pieces) noexcept {
    std::vector<ZeroPiece> mapped;
    for (const ZeroPiece& p : pieces) {
      const CUresult r = MapZeroPiece(p);
      if (r == CUDA_SUCCESS) {
        mapped.push_back(p);
      } else {
        Report(api_, ordinal_, "cuMemMap(zero piece, va=" + Hex(p.va) + ")", r);
      }
    }
    return mapped;
  }

  // Read-only access over [va, va + bytes); where one call is refused (a hole left by a
  // failed restore), chunk by chunk for what is mapped.
  void ReadOnly(uintptr_t va, size_t bytes) noexcept {
    if (bytes == 0) return;
    if (api_.cuMemSetAccess(va, bytes, &read_only_, 1) == CUDA_SUCCESS) return;
    for (size_t off = 0; off < bytes; off += chunk_bytes_) {
      const CUresult r = api_.cuMemSetAccess(va + off, chunk_bytes_, &read_only_, 1);
      if (r != CUDA_SUCCESS && StillMapped(va + off)) {
        Report(api_, ordinal_, "cuMemSetAccess(READ, va=" + Hex(va + off) + ")", r);
      }
    }
  }

  // Whether something is mapped at va.
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
  const CUmemAllocationProp prop_;
  const CUmemAccessDesc read_only_;
  const CUmemAccessDesc read_write_;
  // Declaration order is teardown order reversed: the streams and the zero allocations go
  // before the context reference that they need.
  PrimaryContext ctx_;
  OwnedStream stream_;       // metadata copies and zero fills: small, latency-bound
  OwnedStream copy_stream_;  // bulk host <-> device copies (sleep, offload, put)
  const size_t max_piece_;  // of the zero allocations, once made
  std::mutex zero_make_mu_;
  std::shared_ptr<const ZeroAllocations> zero_owner_;  // made on first need
  std::atomic<const ZeroAllocations*> zero_{nullptr};  // zero_owner_, once made
  std::mutex zero_mu_;
  std::map<uintptr_t, ZeroLayout> layouts_;  // by reservation base
  // Reservations whose zeros are deferred: base -> their real mappings (va -> bytes).
  std::map<uintptr_t, std::map<uintptr_t, size_t>> deferred_;
  // Whether cuMemUnmap accepts a range spanning several mappings (learned on first use).
  static constexpr int kUnknown = -1, kNo = 0, kYes = 1;
  std::atomic<int> span_unmap_{kUnknown};
};

}  // namespace
}  // namespace cuda

std::unique_ptr<Driver> MakeCudaDriver(int device_ordinal, size_t chunk_bytes) {
  return MakeCudaDriverWith(cuda::LoadedApiOrThrow(), device_ordinal, chunk_bytes);
}

std::unique_ptr<Driver> MakeCudaDriverWith(const cuda::Api& api, int device_ordinal,
                                           size_t chunk_bytes) {
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
