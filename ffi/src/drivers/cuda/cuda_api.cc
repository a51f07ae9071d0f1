#include "drivers/cuda/cuda_api.h"

#include <dlfcn.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <string>
#include <type_traits>

#include "jax_vmm/errors.h"

namespace jax_vmm::cuda {
namespace {

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

// Fills every entry point of `api` from `lib`; names the missing ones in *missing.
void BindEntryPoints(void* lib, Api& api, std::string* missing) {
  auto get_proc = reinterpret_cast<GetProcAddressFn>(dlsym(lib, "cuGetProcAddress_v2"));
  auto bind = [&](auto& slot, const char* base, const char* versioned) {
    void* fn = Resolve(lib, get_proc, base, versioned);
    if (fn == nullptr) *missing += std::string(missing->empty() ? "" : ", ") + versioned;
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
  bind(api.cuMemcpyAsync, "cuMemcpyAsync", "cuMemcpyAsync");
  bind(api.cuMemHostAlloc, "cuMemHostAlloc", "cuMemHostAlloc");
  bind(api.cuMemFreeHost, "cuMemFreeHost", "cuMemFreeHost");
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
  std::string missing;
  BindEntryPoints(lib, api, &missing);
  if (!missing.empty()) {
    api.error = "the CUDA driver library lacks entry points jax_vmm needs (" + missing +
                "); CUDA virtual memory management needs driver API 10.2 or newer";
  }
  return api;
}

}  // namespace

const Api& GetApi() {
  static const Api api = LoadApi();  // function-local static: thread-safe loading
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

std::string Failure(const Api& api, int ordinal, const std::string& call, CUresult r) {
  const std::string where =
      ordinal >= 0 ? " on CUDA device " + std::to_string(ordinal) : std::string();
  return "jax_vmm: " + call + " failed" + where + " with " + ResultName(api, r);
}

[[noreturn]] void ThrowDriver(const Api& api, int ordinal, const std::string& call, CUresult r) {
  throw DriverError(Failure(api, ordinal, call, r));
}

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

namespace {
std::atomic<long> g_cuda_pid{0};  // the process that ran cuInit (0: none yet)
}  // namespace

bool InForkedChild() noexcept {
  const long pid = g_cuda_pid.load(std::memory_order_relaxed);
  return pid != 0 && pid != static_cast<long>(getpid());
}

void ThrowIfForkedChild(int ordinal) {
  if (!InForkedChild()) return;
  const std::string what =
      ordinal < 0 ? std::string("CUDA") : "CUDA device " + std::to_string(ordinal);
  throw ForkedProcess("jax_vmm: " + what + " was set up by process " +
                      std::to_string(g_cuda_pid.load()) + "; this is a child (pid " +
                      std::to_string(static_cast<long>(getpid())) +
                      ") forked from it, which cannot use the parent's CUDA context. Create a "
                      "new arena in the child (or start workers with multiprocessing's "
                      "'spawn' method)");
}

void InitOrThrow(const Api& api) {
  if (InForkedChild()) ThrowIfForkedChild(-1);
  long none = 0;
  g_cuda_pid.compare_exchange_strong(none, static_cast<long>(getpid()));
  CUresult r = api.cuInit(0);
  if (r != CUDA_SUCCESS) {
    throw DriverError("jax_vmm: cuInit(0) failed with " + ResultName(api, r) +
                      "; no usable CUDA GPU (check the driver, CUDA_VISIBLE_DEVICES)");
  }
}

}  // namespace jax_vmm::cuda
