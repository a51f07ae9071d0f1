// CUDA driver VMM backend of the Driver interface (see driver.h for the semantics).
//
// No CUDA toolkit header is needed: libcuda is opened at run time and the few types
// used are declared below with the exact layout of cuda.h (CUDA 13.0, checked by
// static_assert), so the module imports and the host driver works where no libcuda
// exists. Entry points come from cuGetProcAddress_v2 at a pinned ABI version (12000),
// falling back to dlsym of the versioned names (cuMemGetInfo_v2, ...) on older drivers.
//
// Layout of a reservation: every chunk of the range maps one shared physical "zero
// chunk" (chunk_bytes, zero-filled once) read-only, so unbacked memory reads as zeros
// and never faults. Map swaps the zero mapping of one chunk for a real allocation,
// Unmap swaps it back.
#include <dlfcn.h>

#include <atomic>
#include <cinttypes>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "jax_vmm/driver.h"
#include "jax_vmm/errors.h"

namespace jax_vmm {
namespace {

// ---------------------------------------------------------------------------------------
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

// ---------------------------------------------------------------------------------------
// The entry points, resolved once per process and never unloaded (JAX and other
// libraries share libcuda; other threads may still be inside a call at exit).
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

using GetProcAddressFn = CUresult (*)(const char*, void**, int, cuuint64_t, int*);

// Resolves `base` (e.g. "cuMemGetInfo") to the variant of ABI kAbiVersion; falls back to
// dlsym of `versioned` (e.g. "cuMemGetInfo_v2") when the driver predates cuGetProcAddress_v2.
void* Resolve(void* lib, GetProcAddressFn get_proc, const char* base, const char* versioned) {
  if (get_proc != nullptr) {
    void* fn = nullptr;
    int status = -1;
    if (get_proc(base, &fn, kAbiVersion, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &status) ==
            CUDA_SUCCESS &&
        status == CU_GET_PROC_ADDRESS_SUCCESS && fn != nullptr) {
      return fn;
    }
  }
  return dlsym(lib, versioned);
}

Api LoadApi() {
  Api api;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();  // the reason for libcuda.so.1, the name drivers install
    api.error = std::string("cannot load the CUDA driver library (") +
                (why ? why : "dlopen(libcuda.so.1) failed") +
                "); install an NVIDIA driver, or use the host driver (a cpu device)";
    return api;
  }
  auto get_proc = reinterpret_cast<GetProcAddressFn>(dlsym(lib, "cuGetProcAddress_v2"));
  std::string missing;
  auto bind = [&](auto& slot, const char* base, const char* versioned) {
    void* fn = Resolve(lib, get_proc, base, versioned);
    if (fn == nullptr) missing += std::string(missing.empty() ? "" : ", ") + versioned;
    slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(fn);
  };
  bind(api.cuGetErrorName, "cuGetErrorName", "cuGetErrorName");
  bind(api.cuGetErrorString, "cuGetErrorString", "cuGetErrorString");
  bind(api.cuInit, "cuInit", "cuInit");
  bind(api.cuDeviceGetCount, "cuDeviceGetCount", "cuDeviceGetCount");
  bind(api.cuDeviceGet, "cuDeviceGet", "cuDeviceGet");
  bind(api.cuDeviceGetName, "cuDeviceGetName", "cuDeviceGetName");
  bind(api.cuDeviceGetAttribute, "cuDeviceGetAttribute", "cuDeviceGetAttribute");
  bind(api.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain");
  bind(api.cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxRelease_v2");
  bind(api.cuCtxPushCurrent, "cuCtxPushCurrent", "cuCtxPushCurrent_v2");
  bind(api.cuCtxPopCurrent, "cuCtxPopCurrent", "cuCtxPopCurrent_v2");
  bind(api.cuCtxSynchronize, "cuCtxSynchronize", "cuCtxSynchronize");
  bind(api.cuStreamCreate, "cuStreamCreate", "cuStreamCreate");
  bind(api.cuStreamDestroy, "cuStreamDestroy", "cuStreamDestroy_v2");
  bind(api.cuStreamSynchronize, "cuStreamSynchronize", "cuStreamSynchronize");
  bind(api.cuMemGetInfo, "cuMemGetInfo", "cuMemGetInfo_v2");
  bind(api.cuMemAlloc, "cuMemAlloc", "cuMemAlloc_v2");
  bind(api.cuMemFree, "cuMemFree", "cuMemFree_v2");
  bind(api.cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync", "cuMemcpyHtoDAsync_v2");
  bind(api.cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync", "cuMemcpyDtoHAsync_v2");
  bind(api.cuMemsetD8Async, "cuMemsetD8Async", "cuMemsetD8Async");
  bind(api.cuMemAddressReserve, "cuMemAddressReserve", "cuMemAddressReserve");
  bind(api.cuMemAddressFree, "cuMemAddressFree", "cuMemAddressFree");
  bind(api.cuMemCreate, "cuMemCreate", "cuMemCreate");
  bind(api.cuMemRelease, "cuMemRelease", "cuMemRelease");
  bind(api.cuMemMap, "cuMemMap", "cuMemMap");
  bind(api.cuMemUnmap, "cuMemUnmap", "cuMemUnmap");
  bind(api.cuMemSetAccess, "cuMemSetAccess", "cuMemSetAccess");
  bind(api.cuMemGetAccess, "cuMemGetAccess", "cuMemGetAccess");
  bind(api.cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity",
       "cuMemGetAllocationGranularity");
  if (!missing.empty()) {
    api.error = "the CUDA driver library lacks entry points jax_vmm needs (" + missing +
                "); CUDA virtual memory management needs driver API 10.2 or newer";
  }
  return api;
}

// The process-wide table; loading is thread-safe (function-local static).
const Api& GetApi() {
  static const Api api = LoadApi();
  return api;
}

std::string ResultName(const Api& api, CUresult r) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (api.cuGetErrorName == nullptr || api.cuGetErrorName(r, &name) != CUDA_SUCCESS ||
      name == nullptr) {
    return "CUresult " + std::to_string(r);
  }
  std::string out = name;
  if (api.cuGetErrorString != nullptr && api.cuGetErrorString(r, &text) == CUDA_SUCCESS &&
      text != nullptr) {
    out += std::string(" (") + text + ")";
  }
  return out;
}

std::string Hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%" PRIx64, v);
  return buf;
}

// "<call> failed on CUDA device N with CUDA_ERROR_X (text)" -- the single place that
// formats driver failures, so every message names the call, its arguments and the result.
std::string Failure(const Api& api, int ordinal, const std::string& call, CUresult r) {
  const std::string where =
      ordinal >= 0 ? " on CUDA device " + std::to_string(ordinal) : std::string();
  return "jax_vmm: " + call + " failed" + where + " with " + ResultName(api, r);
}

[[noreturn]] void ThrowDriver(const Api& api, int ordinal, const std::string& call, CUresult r) {
  throw DriverError(Failure(api, ordinal, call, r));
}

// Destructors and noexcept methods cannot throw: they report on stderr instead. A
// deinitialised driver (interpreter exit after CUDA shut down) is not worth a message.
void Report(const Api& api, int ordinal, const std::string& call, CUresult r) noexcept {
  if (r == CUDA_ERROR_DEINITIALIZED) return;
  try {
    std::fprintf(stderr, "%s (ignored in a cleanup path)\n",
                 Failure(api, ordinal, call, r).c_str());
  } catch (...) {
  }
}

const Api& LoadedApiOrThrow() {
  const Api& api = GetApi();
  if (!api.error.empty()) throw DriverError("jax_vmm: " + api.error);
  return api;
}

void InitOrThrow(const Api& api) {
  CUresult r = api.cuInit(0);
  if (r != CUDA_SUCCESS) {
    throw DriverError("jax_vmm: cuInit(0) failed with " + ResultName(api, r) +
                      "; no usable CUDA GPU (check the driver, CUDA_VISIBLE_DEVICES)");
  }
}

// ---------------------------------------------------------------------------------------
// RAII owners, one per driver object.

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
    CUresult r = api_.cuCtxPushCurrent(ctx);
    if (r != CUDA_SUCCESS) ThrowDriver(api_, ordinal, "cuCtxPushCurrent", r);
    pushed_ = true;
  }
  // Non-throwing form, for destructors and noexcept methods: check ok().
  ContextGuard(const Api& api, CUcontext ctx, int ordinal, std::nothrow_t) noexcept : api_(api) {
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

// A physical allocation released on destruction (the zero chunk; temporary handles).
class OwnedHandle {
 public:
  OwnedHandle(const Api& api, CUcontext ctx, int ordinal)
      : api_(api), ctx_(ctx), ordinal_(ordinal) {}
  ~OwnedHandle() {
    if (handle_ == 0) return;
    ContextGuard g(api_, ctx_, ordinal_, std::nothrow);
    if (!g.ok()) return;
    CUresult r = api_.cuMemRelease(handle_);
    if (r != CUDA_SUCCESS) Report(api_, ordinal_, "cuMemRelease(zero chunk)", r);
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

std::string DeviceName(const Api& api, CUdevice dev) {
  char name[256] = {};
  if (api.cuDeviceGetName(name, sizeof(name) - 1, dev) != CUDA_SUCCESS) return "?";
  return name;
}

CUmemAllocationProp DeviceAllocationProp(CUdevice dev) {
  CUmemAllocationProp prop;
  std::memset(&prop, 0, sizeof(prop));
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  return prop;
}

CUmemAccessDesc DeviceAccess(CUdevice dev, int flags) {
  CUmemAccessDesc desc;
  std::memset(&desc, 0, sizeof(desc));
  desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  desc.location.id = dev;
  desc.flags = flags;
  return desc;
}

// Checks ordinal and VMM support; returns the CUdevice.
CUdevice VmmDeviceOrThrow(const Api& api, int ordinal) {
  int count = 0;
  CUresult r = api.cuDeviceGetCount(&count);
  if (r != CUDA_SUCCESS) ThrowDriver(api, ordinal, "cuDeviceGetCount", r);
  if (ordinal < 0 || ordinal >= count) {
    throw InvalidArgument("jax_vmm: CUDA device ordinal " + std::to_string(ordinal) +
                          " does not exist; this process sees " + std::to_string(count) +
                          " CUDA device(s) (ordinals 0.." + std::to_string(count - 1) +
                          ", after CUDA_VISIBLE_DEVICES)");
  }
  CUdevice dev = 0;
  r = api.cuDeviceGet(&dev, ordinal);
  if (r != CUDA_SUCCESS) {
    ThrowDriver(api, ordinal, "cuDeviceGet(" + std::to_string(ordinal) + ")", r);
  }
  int vmm = 0;
  r = api.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
  if (r != CUDA_SUCCESS) {
    ThrowDriver(api, ordinal,
                "cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device=" +
                    std::to_string(ordinal) + ")",
                r);
  }
  if (vmm == 0) {
    throw DriverError("jax_vmm: CUDA device " + std::to_string(ordinal) + " (" +
                      DeviceName(api, dev) +
                      ") does not support CUDA virtual memory management "
                      "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0; "
                      "e.g. a vGPU or WSL setup without VMM); an arena cannot live on it");
  }
  return dev;
}

// ---------------------------------------------------------------------------------------
// The driver.
//
// Thread-safety: every method may be called from any thread concurrently. After
// construction the object holds only immutable state (device, context, stream, zero
// chunk, prebuilt descriptors) plus atomics (the FaultInjector's, the learned
// span_unmap_ flag); each call pushes the primary context on the calling thread's own
// context stack and pops it on return. Calls on the same chunk must not overlap (the
// arena serialises per-buffer work). Concurrent calls may share the private stream:
// each one only waits for it to drain, so correctness holds.
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
    faults_.Check(DriverOp::kCreate, chunk_bytes_);
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
    for (size_t i = 0; i < count; ++i) faults_.Check(DriverOp::kMap, chunk_bytes_);
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
    faults_.Check(DriverOp::kSetAccess, bytes);
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

size_t GranularityOrThrow(const Api& api, int ordinal, CUdevice dev, int which) {
  const CUmemAllocationProp prop = DeviceAllocationProp(dev);
  size_t granularity = 0;
  CUresult r = api.cuMemGetAllocationGranularity(&granularity, &prop, which);
  if (r != CUDA_SUCCESS || granularity == 0) {
    ThrowDriver(api, ordinal,
                "cuMemGetAllocationGranularity(device=" + std::to_string(ordinal) + ")",
                r == CUDA_SUCCESS ? -1 : r);
  }
  return granularity;
}

}  // namespace

std::unique_ptr<Driver> MakeCudaDriver(int device_ordinal, size_t chunk_bytes) {
  const Api& api = LoadedApiOrThrow();
  InitOrThrow(api);
  const CUdevice dev = VmmDeviceOrThrow(api, device_ordinal);
  const size_t granularity =
      GranularityOrThrow(api, device_ordinal, dev, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (chunk_bytes == 0) chunk_bytes = granularity;
  if (chunk_bytes % granularity != 0) {
    throw InvalidArgument("jax_vmm: chunk_bytes=" + std::to_string(chunk_bytes) +
                          " is not a multiple of CUDA device " + std::to_string(device_ordinal) +
                          "'s VMM granularity (" + std::to_string(granularity) +
                          " bytes); use a multiple of it, or 0 for the default");
  }
  return std::make_unique<CudaDriver>(api, device_ordinal, dev, granularity, chunk_bytes);
}

std::vector<CudaDeviceInfo> QueryCudaDevices(std::string* error) {
  std::vector<CudaDeviceInfo> out;
  std::string why;
  try {
    const Api& api = LoadedApiOrThrow();
    InitOrThrow(api);
    int count = 0;
    CUresult r = api.cuDeviceGetCount(&count);
    if (r != CUDA_SUCCESS) ThrowDriver(api, -1, "cuDeviceGetCount", r);
    for (int i = 0; i < count; ++i) {
      CudaDeviceInfo info;
      info.ordinal = i;
      CUdevice dev = 0;
      r = api.cuDeviceGet(&dev, i);
      if (r != CUDA_SUCCESS) ThrowDriver(api, i, "cuDeviceGet", r);
      info.name = DeviceName(api, dev);
      int vmm = 0;
      if (api.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                   dev) == CUDA_SUCCESS) {
        info.vmm_supported = vmm != 0;
      }
      if (info.vmm_supported) {
        info.granularity_min = GranularityOrThrow(api, i, dev, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
        info.granularity_recommended =
            GranularityOrThrow(api, i, dev, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
      }
      // Free memory needs a context. Retaining the primary context reuses JAX's when it
      // is active; otherwise it creates it for the duration of the query only.
      {
        PrimaryContext ctx(api, dev, i);
        ContextGuard g(api, ctx.get(), i);
        r = api.cuMemGetInfo(&info.free_bytes, &info.total_bytes);
        if (r != CUDA_SUCCESS) ThrowDriver(api, i, "cuMemGetInfo", r);
      }
      out.push_back(std::move(info));
    }
  } catch (const std::exception& e) {
    why = e.what();
  }
  if (error != nullptr) *error = why;
  return out;
}

}  // namespace jax_vmm
