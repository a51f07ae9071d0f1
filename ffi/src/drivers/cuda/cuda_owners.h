// RAII owners, one per CUDA driver object: each holds what it depends on, so teardown
// order follows from declaration order and a failed multi-step setup unwinds itself.
// Destructors never throw; they report failures on stderr (cuda_api.h, Report).
//
// Thread-safety: an owner is used by one thread at a time, except PrimaryContext::get(),
// OwnedStream::get() and OwnedHandle::get(), which only read.
#pragma once

#include <cstddef>
#include <new>
#include <string>
#include <utility>

#include "drivers/cuda/cuda_abi.h"
#include "drivers/cuda/cuda_api.h"

namespace jax_vmm::cuda {

// A reference on the device's primary context (the one JAX uses).
class PrimaryContext {
 public:
  PrimaryContext(const Api& api, CUdevice dev, int ordinal) : api_(api), dev_(dev) {
    CUresult r = api_.cuDevicePrimaryCtxRetain(&ctx_, dev_);
    if (r != CUDA_SUCCESS) {
      ThrowDriver(api_, ordinal, "cuDevicePrimaryCtxRetain(device=" + std::to_string(dev) + ")", r);
    }
  }
  ~PrimaryContext() {
    if (InForkedChild()) return;  // the parent's reference: not ours to drop
    CUresult r = api_.cuDevicePrimaryCtxRelease(dev_);
    if (r != CUDA_SUCCESS) Report(api_, dev_, "cuDevicePrimaryCtxRelease", r);
  }
  PrimaryContext(const PrimaryContext&) = delete;
  PrimaryContext& operator=(const PrimaryContext&) = delete;
  CUcontext get() const { return ctx_; }

 private:
  const Api& api_;
  CUdevice dev_;
  CUcontext ctx_ = nullptr;
};

// Makes a context current on this thread for one scope (the context stack is per
// thread, so guards on different threads do not interact).
class ContextGuard {
 public:
  // Throwing form, for methods that may throw.
  ContextGuard(const Api& api, CUcontext ctx, int ordinal) : api_(api) {
    ThrowIfForkedChild(ordinal);
    CUresult r = api_.cuCtxPushCurrent(ctx);
    if (r != CUDA_SUCCESS) ThrowDriver(api_, ordinal, "cuCtxPushCurrent", r);
    pushed_ = true;
  }
  // Non-throwing form, for destructors and noexcept methods: check ok().
  // In a forked child it is never ok(): the caller then releases nothing of the parent's.
  ContextGuard(const Api& api, CUcontext ctx, int ordinal, std::nothrow_t) noexcept : api_(api) {
    if (InForkedChild()) return;
    CUresult r = api_.cuCtxPushCurrent(ctx);
    if (r != CUDA_SUCCESS) {
      Report(api_, ordinal, "cuCtxPushCurrent", r);
    } else {
      pushed_ = true;
    }
  }
  ~ContextGuard() {
    if (pushed_) {
      CUcontext popped = nullptr;
      api_.cuCtxPopCurrent(&popped);
    }
  }
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;
  bool ok() const { return pushed_; }

 private:
  const Api& api_;
  bool pushed_ = false;
};

// A private non-blocking stream for metadata copies and the zero fill: they then never
// wait behind (nor order against) JAX's queued work on the legacy default stream.
class OwnedStream {
 public:
  OwnedStream(const Api& api, CUcontext ctx, int ordinal)
      : api_(api), ctx_(ctx), ordinal_(ordinal) {
    ContextGuard g(api_, ctx_, ordinal_);
    CUresult r = api_.cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING);
    if (r != CUDA_SUCCESS) ThrowDriver(api_, ordinal_, "cuStreamCreate(NON_BLOCKING)", r);
  }
  ~OwnedStream() {
    ContextGuard g(api_, ctx_, ordinal_, std::nothrow);
    if (!g.ok()) return;
    CUresult r = api_.cuStreamDestroy(stream_);
    if (r != CUDA_SUCCESS) Report(api_, ordinal_, "cuStreamDestroy", r);
  }
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  CUstream get() const { return stream_; }

 private:
  const Api& api_;
  CUcontext ctx_;
  int ordinal_;
  CUstream stream_ = nullptr;
};

// A physical allocation released on destruction (the zero allocations).
class OwnedHandle {
 public:
  OwnedHandle(const Api& api, CUcontext ctx, int ordinal)
      : api_(api), ctx_(ctx), ordinal_(ordinal) {}
  ~OwnedHandle() {
    if (handle_ == 0) return;
    ContextGuard g(api_, ctx_, ordinal_, std::nothrow);
    if (!g.ok()) return;
    CUresult r = api_.cuMemRelease(handle_);
    if (r != CUDA_SUCCESS) Report(api_, ordinal_, "cuMemRelease(zero allocation)", r);
  }
  OwnedHandle(const OwnedHandle&) = delete;
  OwnedHandle& operator=(const OwnedHandle&) = delete;
  CUmemGenericAllocationHandle get() const { return handle_; }
  CUmemGenericAllocationHandle* out() { return &handle_; }

 private:
  const Api& api_;
  CUcontext ctx_;
  int ordinal_;
  CUmemGenericAllocationHandle handle_ = 0;
};

// A virtual range reservation plus the mappings made in it so far, undone on
// destruction unless release()d: lets multi-step setup unwind itself.
class ScopedReservation {
 public:
  ScopedReservation(const Api& api, int ordinal, CUdeviceptr va, size_t bytes, size_t chunk)
      : api_(api), ordinal_(ordinal), va_(va), bytes_(bytes), chunk_(chunk) {}
  ~ScopedReservation() {
    if (va_ == 0) return;
    for (size_t i = 0; i < mapped_chunks_; ++i) {
      CUresult r = api_.cuMemUnmap(va_ + i * chunk_, chunk_);
      if (r != CUDA_SUCCESS) Report(api_, ordinal_, "cuMemUnmap (rollback)", r);
    }
    CUresult r = api_.cuMemAddressFree(va_, bytes_);
    if (r != CUDA_SUCCESS) Report(api_, ordinal_, "cuMemAddressFree (rollback)", r);
  }
  ScopedReservation(const ScopedReservation&) = delete;
  ScopedReservation& operator=(const ScopedReservation&) = delete;
  void count_mapped() { ++mapped_chunks_; }
  CUdeviceptr release() { return std::exchange(va_, 0); }

 private:
  const Api& api_;
  int ordinal_;
  CUdeviceptr va_;
  size_t bytes_;
  size_t chunk_;
  size_t mapped_chunks_ = 0;
};

}  // namespace jax_vmm::cuda
