#include "ops/attention/cudnn/cudnn_library.h"

#include <dlfcn.h>
#include <link.h>

#include <cstdlib>
#include <mutex>
#include <string>

#include <cuda_runtime_api.h>
#include <cudnn_frontend_version.h>
#include <cudnn_version.h>

// The frontend's dynamic-loading mode reads every backend symbol from this handle
// (declared `extern` in cudnn_frontend_shim.h; the application defines it). Hidden, as
// the frontend is in cudnn_sdpa.cc: another copy of the frontend in the process must not
// bind to this one, nor this one to its.
namespace cudnn_frontend {
__attribute__((visibility("hidden"))) void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace jax_vmm::cudnn {
namespace {

constexpr const char* kSoname = "libcudnn.so.9";

std::mutex g_mu;
LibraryInfo g_info;

std::string DlError() {
  const char* e = dlerror();
  return e ? e : "unknown dlopen error";
}

std::string PathOf(void* handle) {
  struct link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr) {
    return map->l_name;
  }
  return "?";
}

// The frontend resolves its few CUDA runtime calls (device properties) in a shared
// libcudart that it dlopens by soname (libcudart.so.12, .13; newer frontends honour
// CUDNN_FRONTEND_CUDART_LIB_NAME). XLA links the runtime statically, so there may be none in
// the process: load the wheel's (`hint`) by path, after which the soname resolves to it.
std::string ChooseCudart(const std::string& hint) {
  if (const char* user = std::getenv("CUDNN_FRONTEND_CUDART_LIB_NAME"); user && *user) {
    return std::string(user) + " (CUDNN_FRONTEND_CUDART_LIB_NAME)";
  }
  const std::string soname = "libcudart.so." + std::to_string(CUDART_VERSION / 1000);
  std::string chosen;
  if (void* h = dlopen(soname.c_str(), RTLD_NOW | RTLD_NOLOAD); h != nullptr) {
    chosen = soname + " (already loaded)";
    dlclose(h);
  } else if (!hint.empty() && dlopen(hint.c_str(), RTLD_NOW | RTLD_GLOBAL) != nullptr) {
    chosen = hint + " (loaded)";  // kept loaded for the process
  } else if (dlopen(soname.c_str(), RTLD_NOW | RTLD_GLOBAL) != nullptr) {
    chosen = soname + " (from the loader's path)";
  } else {
    return "none: " + soname + " is not loaded" + (hint.empty() ? "" : " and " + hint) +
           " did not load (" + DlError() + "); the frontend will fail to find the CUDA runtime";
  }
  if (void* h = dlopen("libcudart.so.12", RTLD_NOW | RTLD_NOLOAD); h != nullptr) {
    chosen += "; WARNING: libcudart.so.12 is loaded too (older frontends refuse two runtimes)";
    dlclose(h);
  }
  // Once, under g_mu, before the frontend's first CUDA call reads it.
  setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", soname.c_str(), 0);
  return chosen;
}

}  // namespace

std::string Load(const std::string& cudnn_hint, const std::string& cudart_hint) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_info.loaded) return "";
  g_info.compiled_version = CUDNN_VERSION;
  g_info.frontend_version = CUDNN_FRONTEND_VERSION;
  void* handle = dlopen(kSoname, RTLD_NOW | RTLD_NOLOAD);
  std::string how = "already loaded by the process";
  std::string tried = std::string(kSoname) + " (not loaded yet)";
  if (handle == nullptr && !cudnn_hint.empty()) {
    handle = dlopen(cudnn_hint.c_str(), RTLD_NOW | RTLD_GLOBAL);
    how = "hint";
    if (handle == nullptr) tried += "; " + cudnn_hint + ": " + DlError();
  }
  if (handle == nullptr) {
    handle = dlopen(kSoname, RTLD_NOW | RTLD_GLOBAL);
    how = "soname";
    if (handle == nullptr) tried += "; " + std::string(kSoname) + ": " + DlError();
  }
  if (handle == nullptr) {
    g_info.error = "libcudnn could not be loaded (tried " + tried +
                   "). Install jax[cuda13] (it brings nvidia-cudnn-cu13) or put libcudnn.so.9 "
                   "on LD_LIBRARY_PATH.";
    return g_info.error;
  }
  using GetVersion = size_t (*)();
  auto get_version = reinterpret_cast<GetVersion>(dlsym(handle, "cudnnGetVersion"));
  if (get_version == nullptr) {
    g_info.error = PathOf(handle) + " has no cudnnGetVersion: not a cuDNN library";
    dlclose(handle);
    return g_info.error;
  }
  const int64_t version = static_cast<int64_t>(get_version());
  if (version < 90000) {
    g_info.error = PathOf(handle) + " is cuDNN " + std::to_string(version) +
                   "; the attention backend needs cuDNN 9";
    dlclose(handle);
    return g_info.error;
  }
  g_info.cudart = ChooseCudart(cudart_hint);
  cudnn_frontend::cudnn_dlhandle = handle;
  g_info.loaded = true;
  g_info.version = version;
  g_info.path = PathOf(handle);
  g_info.how = how;
  g_info.error.clear();
  return "";
}

LibraryInfo Info() {
  std::lock_guard<std::mutex> lock(g_mu);
  LibraryInfo info = g_info;
  info.compiled_version = CUDNN_VERSION;
  info.frontend_version = CUDNN_FRONTEND_VERSION;
  return info;
}

}  // namespace jax_vmm::cudnn
