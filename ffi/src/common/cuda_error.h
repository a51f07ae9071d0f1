// CUDA runtime failures in one format everywhere: "<call> failed: cudaErrorX (text)".
// Only for sources built with the CUDA toolkit (the CUDA source list in CMakeLists.txt).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_vmm {

inline std::string CudaErrorMessage(const std::string& call, cudaError_t err) {
  return call + " failed: " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
}

// The ffi::Error a handler returns for a failed runtime call: "<op>: <call> failed: ...".
inline xla::ffi::Error CudaFfiError(const std::string& op, const std::string& call,
                                    cudaError_t err) {
  return xla::ffi::Error::Internal(op + ": " + CudaErrorMessage(call, err));
}

}  // namespace jax_vmm
