// Loading libcudnn at run time for the cuDNN attention backend.
//
// The module is built with the cuDNN frontend in dynamic-loading mode
// (NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING): nothing links against libcudnn, so
// jax_vmm._core imports on machines without cuDNN, and every backend call goes through
// the handle set here. Load() prefers the libcudnn.so.9 already in the process (the one
// jaxlib's CUDA plugin loaded), so XLA and jax_vmm share one cuDNN.
//
// Thread-safety: all functions are thread-safe. Load() must succeed before any other
// frontend call (the frontend caches each symbol on first use).
#pragma once

#include <cstdint>
#include <string>

namespace jax_vmm::cudnn {

struct LibraryInfo {
  bool loaded = false;
  int64_t version = 0;        // cudnnGetVersion(), e.g. 91900
  std::string path;           // the file the handle refers to
  std::string how;            // "already loaded by the process", "hint", "soname"
  std::string cudart;         // the libcudart the frontend resolves its CUDA calls in
  std::string error;          // why loading failed (when !loaded)
  int64_t compiled_version = 0;  // CUDNN_VERSION of the headers this module was built with
  int64_t frontend_version = 0;  // CUDNN_FRONTEND_VERSION of the headers
};

// Loads libcudnn once per process: the libcudnn.so.9 already loaded, else
// `cudnn_hint` (a path), else libcudnn.so.9 from the loader's search path. Points the
// frontend at the libcudart already loaded (CUDNN_FRONTEND_CUDART_LIB_NAME, unless the
// user set it), else at `cudart_hint`. Returns the empty string on success, else why.
// A failure is retried on the next call (e.g. once jaxlib has loaded cuDNN).
std::string Load(const std::string& cudnn_hint = "", const std::string& cudart_hint = "");

// What Load() found (loaded == false before a successful Load()).
LibraryInfo Info();

}  // namespace jax_vmm::cudnn
