// The host emulation of the CUDA VMM driver API; the rules are in fake_cuda.h.
#include "testing/fake_cuda.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <mutex>
#include <set>
#include <stdexcept>
#include <utility>

#include "common/math.h"

namespace jax_vmm::testing::fake_cuda {
namespace {

using cuda::CUcontext;
using cuda::CUDA_ERROR_OUT_OF_MEMORY;
using cuda::CUDA_SUCCESS;
using cuda::CUdevice;
using cuda::CUdeviceptr;
using cuda::CUmemAccessDesc;
using cuda::CUmemAllocationProp;
using cuda::CUmemGenericAllocationHandle;
using cuda::CUmemLocation;
using cuda::CUresult;
using cuda::CUstream;

struct ResultText {
  CUresult code;
  const char* name;
  const char* text;
};
constexpr ResultText kResults[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {kInvalidValue, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {kNotInitialized, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {cuda::CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {kInvalidDevice, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {kInvalidContext, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {kInvalidHandle, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {kIllegalAddress, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {kNotSupported, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
};

constexpr int kReadBit = cuda::CU_MEM_ACCESS_FLAGS_PROT_READ;  // 0x1
constexpr int kWriteBit = 0x2;                                 // set only in READWRITE
constexpr unsigned char kFreshByte = 0xCD;                     // cuMemCreate's "garbage"

// Names of the entry points that count calls and can be armed to fail.
const char* const kEntries[] = {"cuInit",
                                "cuDeviceGetCount",
                                "cuDeviceGet",
                                "cuDeviceGetName",
                                "cuDeviceGetAttribute",
                                "cuDevicePrimaryCtxRetain",
                                "cuDevicePrimaryCtxRelease",
                                "cuCtxPushCurrent",
                                "cuCtxPopCurrent",
                                "cuCtxSynchronize",
                                "cuStreamCreate",
                                "cuStreamDestroy",
                                "cuStreamSynchronize",
                                "cuMemGetInfo",
                                "cuMemAlloc",
                                "cuMemFree",
                                "cuMemcpyHtoDAsync",
                                "cuMemcpyDtoHAsync",
                                "cuMemsetD8Async",
                                "cuMemcpyAsync",
                                "cuMemHostAlloc",
                                "cuMemFreeHost",
                                "cuMemAddressReserve",
                                "cuMemAddressFree",
                                "cuMemCreate",
                                "cuMemRelease",
                                "cuMemMap",
                                "cuMemUnmap",
                                "cuMemSetAccess",
                                "cuMemGetAccess",
                                "cuMemGetAllocationGranularity"};

struct PhysicalAllocation {
  int fd = -1;
  size_t bytes = 0;
  int64_t mappings = 0;
  bool released = false;
};

struct Reservation {
  size_t bytes = 0;
  std::vector<unsigned char> flags;  // per granularity page; 0 where unmapped
};

// Where an address range lies, for the copy rules.
enum class Space { kReservation, kMetadata, kPinnedHost, kPageableHost, kStraddles };

class State {
 public:
  std::mutex mu;

  // Counts the call, applies an armed failure and the initialisation rule. Caller holds mu.
  CUresult Enter(const char* entry, bool needs_init = true) {
    ++calls_[entry];
    auto armed = armed_.find(entry);
    if (armed != armed_.end() && --armed->second.first == 0) {
      const CUresult r = armed->second.second;
      armed_.erase(armed);
      return r;
    }
    if (needs_init && !initialized_) return kNotInitialized;
    return CUDA_SUCCESS;
  }
  // Enter plus the current-context rule.
  CUresult EnterInContext(const char* entry) {
    CUresult r = Enter(entry);
    if (r == CUDA_SUCCESS && ContextDepth() == 0) r = kInvalidContext;
    return r;
  }
  static int& ContextDepth() {
    thread_local int depth = 0;
    return depth;
  }

  bool initialized_ = false;
  std::map<std::string, int64_t> calls_;
  std::map<std::string, std::pair<int64_t, CUresult>> armed_;  // entry -> (countdown, result)
  std::map<uintptr_t, Reservation> reservations_;              // by base
  std::map<uintptr_t, Mapping> mappings_;                      // by va, disjoint
  std::map<uint64_t, PhysicalAllocation> allocations_;         // by handle
  std::map<uintptr_t, size_t> metadata_;                       // cuMemAlloc blocks
  std::map<uintptr_t, size_t> pinned_host_;                    // cuMemHostAlloc blocks
  std::set<uintptr_t> streams_;
  std::vector<MapCall> map_log_;
  uint64_t next_handle_ = 1;
  uintptr_t next_stream_ = 1;
  int64_t context_refs_ = 0;
  int64_t partial_map_refusals_ = 0;
  int64_t illegal_addresses_ = 0;
  size_t used_bytes_ = 0;

  // The reservation wholly holding [va, va + bytes), or null.
  std::pair<const uintptr_t, Reservation>* ReservationOf(uintptr_t va, size_t bytes) {
    auto it = reservations_.upper_bound(va);
    if (it == reservations_.begin()) return nullptr;
    --it;
    if (va - it->first >= it->second.bytes || bytes > it->second.bytes - (va - it->first)) {
      return nullptr;
    }
    return &*it;
  }
  bool TouchesReservation(uintptr_t va, size_t bytes) const {
    auto it = reservations_.upper_bound(va + bytes - 1);
    if (it == reservations_.begin()) return false;
    --it;
    return it->first + it->second.bytes > va;
  }
  // The block of `blocks` wholly holding the range, or whether one overlaps it partly.
  static Space BlockSpace(const std::map<uintptr_t, size_t>& blocks, uintptr_t va, size_t bytes,
                          Space inside) {
    auto it = blocks.upper_bound(va + bytes - 1);
    if (it == blocks.begin()) return Space::kPageableHost;
    --it;
    if (it->first + it->second <= va) return Space::kPageableHost;
    return it->first <= va && va + bytes <= it->first + it->second ? inside : Space::kStraddles;
  }
  Space SpaceOf(uintptr_t va, size_t bytes) {
    if (TouchesReservation(va, bytes)) {
      return ReservationOf(va, bytes) != nullptr ? Space::kReservation : Space::kStraddles;
    }
    const Space meta = BlockSpace(metadata_, va, bytes, Space::kMetadata);
    if (meta != Space::kPageableHost) return meta;
    return BlockSpace(pinned_host_, va, bytes, Space::kPinnedHost);
  }

  // Whether every byte of [va, va + bytes) is covered by mappings.
  bool FullyMapped(uintptr_t va, size_t bytes) const {
    auto it = mappings_.upper_bound(va);
    if (it == mappings_.begin()) return false;
    --it;
    uintptr_t at = va;
    const uintptr_t end = va + bytes;
    while (at < end) {
      if (it == mappings_.end() || it->first > at || it->first + it->second.bytes <= at) {
        return false;
      }
      at = it->first + it->second.bytes;
      ++it;
    }
    return true;
  }
  bool OverlapsMapping(uintptr_t va, size_t bytes) const {
    auto it = mappings_.lower_bound(va + bytes);
    if (it == mappings_.begin()) return false;
    --it;
    return it->first + it->second.bytes > va;
  }

  // The copy rule for one side of a copy or memset: `need` is kReadBit or kWriteBit;
  // `device_only` refuses pageable host memory (a memset target, a DtoH source...).
  CUresult CheckSide(uintptr_t va, size_t bytes, int need, bool device_only) {
    if (bytes == 0) return CUDA_SUCCESS;
    if (va + bytes < va) return kInvalidValue;
    switch (SpaceOf(va, bytes)) {
      case Space::kMetadata:
        return CUDA_SUCCESS;
      case Space::kPinnedHost:
        return CUDA_SUCCESS;
      case Space::kPageableHost:
        return device_only ? kInvalidValue : CUDA_SUCCESS;
      case Space::kStraddles:
        ++illegal_addresses_;
        return kIllegalAddress;
      case Space::kReservation:
        break;
    }
    auto* res = ReservationOf(va, bytes);
    const size_t first = (va - res->first) / kGranularity;
    const size_t last = (va + bytes - 1 - res->first) / kGranularity;
    for (size_t page = first; page <= last; ++page) {
      if ((res->second.flags[page] & need) == 0) {
        ++illegal_addresses_;
        return kIllegalAddress;
      }
    }
    return CUDA_SUCCESS;
  }

  void SetFlags(uintptr_t va, size_t bytes, unsigned char flags) {
    auto* res = ReservationOf(va, bytes);
    const size_t first = (va - res->first) / kGranularity;
    std::fill_n(res->second.flags.begin() + first, bytes / kGranularity, flags);
  }

  // One mapping fewer on the allocation; its memory goes with the last one once released.
  void DropMappingOf(uint64_t handle) {
    auto it = allocations_.find(handle);
    if (it == allocations_.end()) return;
    if (--it->second.mappings == 0 && it->second.released) Destroy(it);
  }
  void Destroy(std::map<uint64_t, PhysicalAllocation>::iterator it) {
    close(it->second.fd);
    used_bytes_ -= it->second.bytes;
    allocations_.erase(it);
  }
};

State& S() {
  static State* state = new State;  // never destroyed: other threads may call in at exit
  return *state;
}

// The frame of an entry point: the lock, the call counted, an armed failure, the
// initialisation rule and, for kContext, the current-context rule; then the body.
enum class Needs { kInit, kContext };
template <typename Body>
CUresult Call(Needs needs, const char* entry, Body body) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  const CUresult r = needs == Needs::kContext ? s.EnterInContext(entry) : s.Enter(entry);
  return r != CUDA_SUCCESS ? r : body(s);
}

uintptr_t Addr(CUdeviceptr p) { return static_cast<uintptr_t>(p); }
CUcontext PrimaryContextHandle() {
  static char marker;
  return reinterpret_cast<CUcontext>(&marker);
}
bool IsDevice(CUdevice dev) { return dev == 0; }
bool IsDeviceProp(const CUmemAllocationProp* prop) {
  return prop != nullptr && prop->type == cuda::CU_MEM_ALLOCATION_TYPE_PINNED &&
         prop->location.type == cuda::CU_MEM_LOCATION_TYPE_DEVICE && IsDevice(prop->location.id);
}
bool StreamOk(State& s, CUstream stream) {
  return stream == nullptr || s.streams_.count(reinterpret_cast<uintptr_t>(stream)) != 0;
}

// ---- errors, init, devices -------------------------------------------------------------

CUresult GetErrorName(CUresult r, const char** out) {
  for (const ResultText& t : kResults) {
    if (t.code == r) {
      *out = t.name;
      return CUDA_SUCCESS;
    }
  }
  *out = nullptr;
  return kInvalidValue;
}

CUresult GetErrorString(CUresult r, const char** out) {
  for (const ResultText& t : kResults) {
    if (t.code == r) {
      *out = t.text;
      return CUDA_SUCCESS;
    }
  }
  *out = nullptr;
  return kInvalidValue;
}

CUresult Init(unsigned int flags) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  CUresult r = s.Enter("cuInit", false);
  if (r != CUDA_SUCCESS) return r;
  if (flags != 0) return kInvalidValue;
  s.initialized_ = true;
  return CUDA_SUCCESS;
}

CUresult DeviceGetCount(int* count) {
  return Call(Needs::kInit, "cuDeviceGetCount", [&](State& s) -> CUresult {
    if (count == nullptr) return kInvalidValue;
    *count = 1;
    return CUDA_SUCCESS;
  });
}

CUresult DeviceGet(CUdevice* dev, int ordinal) {
  return Call(Needs::kInit, "cuDeviceGet", [&](State& s) -> CUresult {
    if (dev == nullptr) return kInvalidValue;
    if (ordinal != 0) return kInvalidDevice;
    *dev = 0;
    return CUDA_SUCCESS;
  });
}

CUresult DeviceGetName(char* name, int len, CUdevice dev) {
  return Call(Needs::kInit, "cuDeviceGetName", [&](State& s) -> CUresult {
    if (name == nullptr || len <= 0) return kInvalidValue;
    if (!IsDevice(dev)) return kInvalidDevice;
    const char* fake = "fake CUDA VMM device";
    const size_t n = std::min(std::strlen(fake), static_cast<size_t>(len) - 1);
    std::memcpy(name, fake, n);
    name[n] = '\0';
    return CUDA_SUCCESS;
  });
}

// Only the attributes the driver asks for are modelled; any other is refused, so that a
// new query shows up here instead of reading a made-up value.
CUresult DeviceGetAttribute(int* value, int attribute, CUdevice dev) {
  return Call(Needs::kInit, "cuDeviceGetAttribute", [&](State& s) -> CUresult {
    if (value == nullptr) return kInvalidValue;
    if (!IsDevice(dev)) return kInvalidDevice;
    if (attribute != cuda::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) {
      return kInvalidValue;
    }
    *value = 1;
    return CUDA_SUCCESS;
  });
}

CUresult MemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                     int which) {
  return Call(Needs::kInit, "cuMemGetAllocationGranularity", [&](State& s) -> CUresult {
    if (granularity == nullptr || !IsDeviceProp(prop)) return kInvalidValue;
    if (which != cuda::CU_MEM_ALLOC_GRANULARITY_MINIMUM &&
        which != cuda::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) {
      return kInvalidValue;
    }
    *granularity = kGranularity;
    return CUDA_SUCCESS;
  });
}

// ---- contexts and streams --------------------------------------------------------------

CUresult PrimaryCtxRetain(CUcontext* ctx, CUdevice dev) {
  return Call(Needs::kInit, "cuDevicePrimaryCtxRetain", [&](State& s) -> CUresult {
    if (ctx == nullptr) return kInvalidValue;
    if (!IsDevice(dev)) return kInvalidDevice;
    ++s.context_refs_;
    *ctx = PrimaryContextHandle();
    return CUDA_SUCCESS;
  });
}

CUresult PrimaryCtxRelease(CUdevice dev) {
  return Call(Needs::kInit, "cuDevicePrimaryCtxRelease", [&](State& s) -> CUresult {
    if (!IsDevice(dev)) return kInvalidDevice;
    if (s.context_refs_ == 0) return kInvalidContext;
    --s.context_refs_;
    return CUDA_SUCCESS;
  });
}

CUresult CtxPushCurrent(CUcontext ctx) {
  return Call(Needs::kInit, "cuCtxPushCurrent", [&](State& s) -> CUresult {
    if (ctx != PrimaryContextHandle() || s.context_refs_ == 0) return kInvalidContext;
    ++State::ContextDepth();
    return CUDA_SUCCESS;
  });
}

CUresult CtxPopCurrent(CUcontext* ctx) {
  return Call(Needs::kInit, "cuCtxPopCurrent", [&](State& s) -> CUresult {
    if (State::ContextDepth() == 0) return kInvalidContext;
    --State::ContextDepth();
    if (ctx != nullptr) *ctx = PrimaryContextHandle();
    return CUDA_SUCCESS;
  });
}

CUresult CtxSynchronize() {
  return Call(Needs::kContext, "cuCtxSynchronize", [](State&) -> CUresult { return CUDA_SUCCESS; });
}

CUresult StreamCreate(CUstream* stream, unsigned int flags) {
  return Call(Needs::kContext, "cuStreamCreate", [&](State& s) -> CUresult {
    if (stream == nullptr || (flags & ~cuda::CU_STREAM_NON_BLOCKING) != 0) return kInvalidValue;
    const uintptr_t id = s.next_stream_++ << 4;  // never 0 (the legacy stream)
    s.streams_.insert(id);
    *stream = reinterpret_cast<CUstream>(id);
    return CUDA_SUCCESS;
  });
}

CUresult StreamDestroy(CUstream stream) {
  return Call(Needs::kContext, "cuStreamDestroy", [&](State& s) -> CUresult {
    if (s.streams_.erase(reinterpret_cast<uintptr_t>(stream)) == 0) return kInvalidHandle;
    return CUDA_SUCCESS;
  });
}

CUresult StreamSynchronize(CUstream stream) {
  return Call(Needs::kContext, "cuStreamSynchronize", [&](State& s) -> CUresult {
    return StreamOk(s, stream) ? CUDA_SUCCESS : kInvalidHandle;
  });
}

// ---- plain allocations -----------------------------------------------------------------

CUresult MemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  return Call(Needs::kContext, "cuMemGetInfo", [&](State& s) -> CUresult {
    if (free_bytes == nullptr || total_bytes == nullptr) return kInvalidValue;
    *free_bytes = kTotalBytes - s.used_bytes_;
    *total_bytes = kTotalBytes;
    return CUDA_SUCCESS;
  });
}

CUresult MemAlloc(CUdeviceptr* ptr, size_t bytes) {
  return Call(Needs::kContext, "cuMemAlloc", [&](State& s) -> CUresult {
    if (ptr == nullptr || bytes == 0) return kInvalidValue;
    if (bytes > kTotalBytes - s.used_bytes_) return CUDA_ERROR_OUT_OF_MEMORY;
    void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (p == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
    s.metadata_[reinterpret_cast<uintptr_t>(p)] = bytes;
    s.used_bytes_ += bytes;
    *ptr = reinterpret_cast<uintptr_t>(p);
    return CUDA_SUCCESS;
  });
}

CUresult MemFree(CUdeviceptr ptr) {
  return Call(Needs::kContext, "cuMemFree", [&](State& s) -> CUresult {
    auto it = s.metadata_.find(Addr(ptr));
    if (it == s.metadata_.end()) return kInvalidValue;
    s.used_bytes_ -= it->second;
    std::free(reinterpret_cast<void*>(it->first));
    s.metadata_.erase(it);
    return CUDA_SUCCESS;
  });
}

CUresult MemHostAlloc(void** ptr, size_t bytes, unsigned int) {
  return Call(Needs::kContext, "cuMemHostAlloc", [&](State& s) -> CUresult {
    if (ptr == nullptr || bytes == 0) return kInvalidValue;
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    s.pinned_host_[reinterpret_cast<uintptr_t>(p)] = bytes;
    *ptr = p;
    return CUDA_SUCCESS;
  });
}

CUresult MemFreeHost(void* ptr) {
  return Call(Needs::kContext, "cuMemFreeHost", [&](State& s) -> CUresult {
    auto it = s.pinned_host_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == s.pinned_host_.end()) return kInvalidValue;
    munmap(ptr, it->second);
    s.pinned_host_.erase(it);
    return CUDA_SUCCESS;
  });
}

// ---- copies ----------------------------------------------------------------------------

CUresult CheckedCopy(const char* entry, uintptr_t dst, bool dst_device_only, uintptr_t src,
                     bool src_device_only, size_t bytes, CUstream stream) {
  return Call(Needs::kContext, entry, [&](State& s) -> CUresult {
    if (!StreamOk(s, stream)) return kInvalidHandle;
    if ((dst == 0 || src == 0) && bytes != 0) return kInvalidValue;
    CUresult r = s.CheckSide(dst, bytes, kWriteBit, dst_device_only);
    if (r == CUDA_SUCCESS) r = s.CheckSide(src, bytes, kReadBit, src_device_only);
    if (r != CUDA_SUCCESS) return r;
    if (bytes != 0) {
      std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes);
    }
    return CUDA_SUCCESS;
  });
}

CUresult MemcpyHtoDAsync(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream) {
  return CheckedCopy("cuMemcpyHtoDAsync", Addr(dst), true, reinterpret_cast<uintptr_t>(src), false,
                     bytes, stream);
}

CUresult MemcpyDtoHAsync(void* dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  return CheckedCopy("cuMemcpyDtoHAsync", reinterpret_cast<uintptr_t>(dst), false, Addr(src), true,
                     bytes, stream);
}

// Unified addressing: either side may be host memory.
CUresult MemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  return CheckedCopy("cuMemcpyAsync", Addr(dst), false, Addr(src), false, bytes, stream);
}

CUresult MemsetD8Async(CUdeviceptr dst, unsigned char value, size_t bytes, CUstream stream) {
  return Call(Needs::kContext, "cuMemsetD8Async", [&](State& s) -> CUresult {
    if (!StreamOk(s, stream)) return kInvalidHandle;
    const CUresult r = s.CheckSide(Addr(dst), bytes, kWriteBit, true);
    if (r != CUDA_SUCCESS) return r;
    if (bytes != 0) std::memset(reinterpret_cast<void*>(Addr(dst)), value, bytes);
    return CUDA_SUCCESS;
  });
}

// ---- virtual memory management ---------------------------------------------------------

CUresult MemAddressReserve(CUdeviceptr* ptr, size_t bytes, size_t alignment, CUdeviceptr,
                           unsigned long long flags) {
  return Call(Needs::kContext, "cuMemAddressReserve", [&](State& s) -> CUresult {
    if (ptr == nullptr || bytes == 0 || bytes % kGranularity != 0 || flags != 0) {
      return kInvalidValue;
    }
    if (alignment == 0) alignment = kGranularity;
    if (!IsPow2(alignment)) return kInvalidValue;
    alignment = std::max(alignment, kGranularity);
    if (bytes > (size_t{1} << 46) || alignment > (size_t{1} << 40)) return CUDA_ERROR_OUT_OF_MEMORY;
    const size_t span = bytes + alignment;
    void* raw = mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t base = (start + alignment - 1) & ~(alignment - 1);
    if (base > start) munmap(raw, base - start);
    if (start + span > base + bytes) {
      munmap(reinterpret_cast<void*>(base + bytes), start + span - (base + bytes));
    }
    Reservation res;
    res.bytes = bytes;
    res.flags.assign(bytes / kGranularity, 0);
    s.reservations_.emplace(base, std::move(res));
    *ptr = base;
    return CUDA_SUCCESS;
  });
}

CUresult MemAddressFree(CUdeviceptr ptr, size_t bytes) {
  return Call(Needs::kContext, "cuMemAddressFree", [&](State& s) -> CUresult {
    auto it = s.reservations_.find(Addr(ptr));
    if (it == s.reservations_.end() || it->second.bytes != bytes) return kInvalidValue;
    if (s.OverlapsMapping(it->first, bytes)) return kInvalidValue;
    munmap(reinterpret_cast<void*>(it->first), bytes);
    s.reservations_.erase(it);
    return CUDA_SUCCESS;
  });
}

CUresult MemCreate(CUmemGenericAllocationHandle* handle, size_t bytes,
                   const CUmemAllocationProp* prop, unsigned long long flags) {
  return Call(Needs::kContext, "cuMemCreate", [&](State& s) -> CUresult {
    if (handle == nullptr || bytes == 0 || bytes % kGranularity != 0 || flags != 0 ||
        !IsDeviceProp(prop)) {
      return kInvalidValue;
    }
    if (bytes > kTotalBytes - s.used_bytes_) return CUDA_ERROR_OUT_OF_MEMORY;
    const int fd = memfd_create("fake_cuda_allocation", MFD_CLOEXEC);
    if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    // Garbage contents, so that a caller relying on fresh memory being zero reads wrong.
    std::vector<unsigned char> block(std::min(bytes, size_t{1} << 20), kFreshByte);
    for (size_t off = 0; off < bytes; off += block.size()) {
      const size_t n = std::min(block.size(), bytes - off);
      if (pwrite(fd, block.data(), n, static_cast<off_t>(off)) != static_cast<ssize_t>(n)) {
        close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
      }
    }
    const uint64_t id = s.next_handle_++;
    s.allocations_[id] = PhysicalAllocation{fd, bytes, 0, false};
    s.used_bytes_ += bytes;
    *handle = id;
    return CUDA_SUCCESS;
  });
}

CUresult MemRelease(CUmemGenericAllocationHandle handle) {
  return Call(Needs::kContext, "cuMemRelease", [&](State& s) -> CUresult {
    auto it = s.allocations_.find(handle);
    if (it == s.allocations_.end() || it->second.released) return kInvalidValue;
    it->second.released = true;
    if (it->second.mappings == 0) s.Destroy(it);
    return CUDA_SUCCESS;
  });
}

CUresult MemMap(CUdeviceptr ptr, size_t bytes, size_t offset, CUmemGenericAllocationHandle handle,
                unsigned long long flags) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  auto alloc = s.allocations_.find(handle);
  const bool live = alloc != s.allocations_.end() && !alloc->second.released;
  MapCall call{Addr(ptr), bytes, offset, handle, live ? alloc->second.bytes : 0, CUDA_SUCCESS};
  CUresult r = s.EnterInContext("cuMemMap");
  const uintptr_t va = Addr(ptr);
  if (r == CUDA_SUCCESS) {
    if (!live || flags != 0) {
      r = kInvalidValue;
    } else if (offset != 0 || bytes != alloc->second.bytes) {
      ++s.partial_map_refusals_;  // cuMemMap maps whole allocations only
      r = kNotSupported;
    } else if (va % kGranularity != 0 || s.ReservationOf(va, bytes) == nullptr ||
               s.OverlapsMapping(va, bytes)) {
      r = kInvalidValue;
    } else if (mmap(reinterpret_cast<void*>(va), bytes, PROT_NONE, MAP_SHARED | MAP_FIXED,
                    alloc->second.fd, 0) == MAP_FAILED) {
      r = CUDA_ERROR_OUT_OF_MEMORY;
    }
  }
  call.result = r;
  s.map_log_.push_back(call);
  if (r != CUDA_SUCCESS) return r;
  s.mappings_[va] = Mapping{va, bytes, handle};
  ++alloc->second.mappings;
  s.SetFlags(va, bytes, 0);
  return CUDA_SUCCESS;
}

CUresult MemUnmap(CUdeviceptr ptr, size_t bytes) {
  return Call(Needs::kContext, "cuMemUnmap", [&](State& s) -> CUresult {
    const uintptr_t va = Addr(ptr);
    if (bytes == 0 || va + bytes < va) return kInvalidValue;
    auto first = s.mappings_.find(va);
    if (first == s.mappings_.end() || !s.FullyMapped(va, bytes)) return kInvalidValue;
    auto last = s.mappings_.lower_bound(va + bytes);  // one past the range's mappings
    auto before_end = std::prev(last);
    if (before_end->first + before_end->second.bytes != va + bytes) return kInvalidValue;
    if (mmap(reinterpret_cast<void*>(va), bytes, PROT_NONE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) == MAP_FAILED) {
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    s.SetFlags(va, bytes, 0);
    std::vector<uint64_t> handles;
    for (auto it = first; it != last; ++it) handles.push_back(it->second.handle);
    s.mappings_.erase(first, last);
    for (uint64_t h : handles) s.DropMappingOf(h);
    return CUDA_SUCCESS;
  });
}

CUresult MemSetAccess(CUdeviceptr ptr, size_t bytes, const CUmemAccessDesc* desc, size_t count) {
  return Call(Needs::kContext, "cuMemSetAccess", [&](State& s) -> CUresult {
    const uintptr_t va = Addr(ptr);
    if (desc == nullptr || count != 1 || bytes == 0 || va % kGranularity != 0 ||
        bytes % kGranularity != 0 || va + bytes < va) {
      return kInvalidValue;
    }
    if (desc->location.type != cuda::CU_MEM_LOCATION_TYPE_DEVICE) return kInvalidValue;
    if (!IsDevice(desc->location.id)) return kInvalidDevice;
    int prot = 0;
    switch (desc->flags) {
      case 0:
        prot = PROT_NONE;
        break;
      case cuda::CU_MEM_ACCESS_FLAGS_PROT_READ:
        prot = PROT_READ;
        break;
      case cuda::CU_MEM_ACCESS_FLAGS_PROT_READWRITE:
        prot = PROT_READ | PROT_WRITE;
        break;
      default:
        return kInvalidValue;
    }
    if (s.ReservationOf(va, bytes) == nullptr || !s.FullyMapped(va, bytes)) return kInvalidValue;
    if (mprotect(reinterpret_cast<void*>(va), bytes, prot) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    s.SetFlags(va, bytes, static_cast<unsigned char>(desc->flags));
    return CUDA_SUCCESS;
  });
}

CUresult MemGetAccess(unsigned long long* flags, const CUmemLocation* location, CUdeviceptr ptr) {
  return Call(Needs::kContext, "cuMemGetAccess", [&](State& s) -> CUresult {
    if (flags == nullptr || location == nullptr ||
        location->type != cuda::CU_MEM_LOCATION_TYPE_DEVICE) {
      return kInvalidValue;
    }
    if (!IsDevice(location->id)) return kInvalidDevice;
    const uintptr_t va = Addr(ptr);
    if (!s.FullyMapped(va, 1)) return kInvalidValue;
    auto* res = s.ReservationOf(va, 1);
    *flags = res->second.flags[(va - res->first) / kGranularity];
    return CUDA_SUCCESS;
  });
}

cuda::Api MakeApi() {
  cuda::Api api;
  api.cuGetErrorName = GetErrorName;
  api.cuGetErrorString = GetErrorString;
  api.cuInit = Init;
  api.cuDeviceGetCount = DeviceGetCount;
  api.cuDeviceGet = DeviceGet;
  api.cuDeviceGetName = DeviceGetName;
  api.cuDeviceGetAttribute = DeviceGetAttribute;
  api.cuDevicePrimaryCtxRetain = PrimaryCtxRetain;
  api.cuDevicePrimaryCtxRelease = PrimaryCtxRelease;
  api.cuCtxPushCurrent = CtxPushCurrent;
  api.cuCtxPopCurrent = CtxPopCurrent;
  api.cuCtxSynchronize = CtxSynchronize;
  api.cuStreamCreate = StreamCreate;
  api.cuStreamDestroy = StreamDestroy;
  api.cuStreamSynchronize = StreamSynchronize;
  api.cuMemGetInfo = MemGetInfo;
  api.cuMemAlloc = MemAlloc;
  api.cuMemFree = MemFree;
  api.cuMemcpyHtoDAsync = MemcpyHtoDAsync;
  api.cuMemcpyDtoHAsync = MemcpyDtoHAsync;
  api.cuMemsetD8Async = MemsetD8Async;
  api.cuMemcpyAsync = MemcpyAsync;
  api.cuMemHostAlloc = MemHostAlloc;
  api.cuMemFreeHost = MemFreeHost;
  api.cuMemAddressReserve = MemAddressReserve;
  api.cuMemAddressFree = MemAddressFree;
  api.cuMemCreate = MemCreate;
  api.cuMemRelease = MemRelease;
  api.cuMemMap = MemMap;
  api.cuMemUnmap = MemUnmap;
  api.cuMemSetAccess = MemSetAccess;
  api.cuMemGetAccess = MemGetAccess;
  api.cuMemGetAllocationGranularity = MemGetAllocationGranularity;
  return api;
}

}  // namespace

const cuda::Api& FakeApi() {
  static const cuda::Api api = MakeApi();
  return api;
}

std::vector<std::pair<std::string, cuda::CUresult>> ResultCodes() {
  std::vector<std::pair<std::string, cuda::CUresult>> out;
  for (const ResultText& t : kResults) out.emplace_back(t.name, t.code);
  return out;
}

Stats GetStats() {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  Stats out;
  out.calls = s.calls_;
  out.live_reservations = static_cast<int64_t>(s.reservations_.size());
  out.live_mappings = static_cast<int64_t>(s.mappings_.size());
  out.live_allocations = static_cast<int64_t>(s.allocations_.size());
  for (const auto& [h, a] : s.allocations_) out.live_handles += a.released ? 0 : 1;
  out.live_metadata_allocs = static_cast<int64_t>(s.metadata_.size());
  out.live_host_allocs = static_cast<int64_t>(s.pinned_host_.size());
  out.live_streams = static_cast<int64_t>(s.streams_.size());
  out.primary_context_refs = s.context_refs_;
  out.partial_map_refusals = s.partial_map_refusals_;
  out.illegal_addresses = s.illegal_addresses_;
  out.used_bytes = s.used_bytes_;
  return out;
}

std::vector<Mapping> Mappings() {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  std::vector<Mapping> out;
  for (const auto& [va, m] : s.mappings_) out.push_back(m);
  return out;
}

std::vector<Allocation> Allocations() {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  std::vector<Allocation> out;
  for (const auto& [h, a] : s.allocations_) out.push_back({h, a.bytes, a.mappings, a.released});
  return out;
}

std::vector<MapCall> MapLog() {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.map_log_;
}

void ClearMapLog() {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  s.map_log_.clear();
}

void FailNth(const std::string& entry, int64_t nth, cuda::CUresult result) {
  if (std::find(std::begin(kEntries), std::end(kEntries), entry) == std::end(kEntries)) {
    throw std::invalid_argument("fake CUDA: no entry point named '" + entry +
                                "' can be failed (expected one of cuMemMap, cuMemCreate, ...)");
  }
  if (nth < 0) throw std::invalid_argument("fake CUDA: nth must be >= 0 (0 disarms)");
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  if (nth == 0) {
    s.armed_.erase(entry);
  } else {
    s.armed_[entry] = {nth, result};
  }
}

void DisarmAll() {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  s.armed_.clear();
}

std::pair<cuda::CUresult, unsigned long long> AccessOf(uintptr_t va) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.FullyMapped(va, 1)) return {kInvalidValue, 0};
  auto* res = s.ReservationOf(va, 1);
  return {CUDA_SUCCESS, res->second.flags[(va - res->first) / kGranularity]};
}

cuda::CUresult Read(uintptr_t va, void* dst, size_t bytes) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  const CUresult r = s.CheckSide(va, bytes, kReadBit, true);
  if (r == CUDA_SUCCESS && bytes != 0) {
    std::memcpy(dst, reinterpret_cast<const void*>(va), bytes);
  }
  return r;
}

cuda::CUresult Write(uintptr_t va, const void* src, size_t bytes) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  const CUresult r = s.CheckSide(va, bytes, kWriteBit, true);
  if (r == CUDA_SUCCESS && bytes != 0) {
    std::memcpy(reinterpret_cast<void*>(va), src, bytes);
  }
  return r;
}

}  // namespace jax_vmm::testing::fake_cuda
