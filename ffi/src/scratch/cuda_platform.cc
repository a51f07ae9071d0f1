// The CUDA device platform for graph-safe scratch (see device_platform.h). Only built
// into modules with CUDA kernels; without them scratch serves host workspaces only.
#include <cuda_runtime_api.h>

#include <memory>
#include <string>

#include "common/cuda_error.h"
#include "jax_vmm/driver.h"
#include "scratch/device_platform.h"

namespace jax_vmm::scratch {
namespace {

// Runs `fn` with `device` current, restoring the caller's device afterwards.
template <typename Fn>
cudaError_t OnDevice(int device, Fn fn) {
  int previous = -1;
  cudaError_t err = cudaGetDevice(&previous);
  if (err != cudaSuccess) return err;
  if (previous != device && (err = cudaSetDevice(device)) != cudaSuccess) return err;
  err = fn();
  if (previous != device) cudaSetDevice(previous);
  return err;
}

bool CudaIsCapturing(void* stream, std::string* error) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaError_t err = cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status);
  if (err != cudaSuccess) {
    *error = "jax_vmm scratch: " + CudaErrorMessage("cudaStreamIsCapturing", err);
    return false;
  }
  return status != cudaStreamCaptureStatusNone;
}

void* CudaAlloc(int device, size_t bytes, std::string* error) {
  void* p = nullptr;
  cudaError_t err = OnDevice(device, [&] { return cudaMalloc(&p, bytes); });
  if (err != cudaSuccess) {
    cudaGetLastError();  // an allocation failure is not sticky: clear the last-error slot
    *error = CudaErrorMessage("cudaMalloc", err) +
             ". JAX preallocates 75% of GPU memory by default: set "
             "XLA_PYTHON_CLIENT_PREALLOCATE=false or lower XLA_PYTHON_CLIENT_MEM_FRACTION";
    return nullptr;
  }
  return p;
}

void CudaFree(int device, void* p) {
  OnDevice(device, [&] { return cudaFree(p); });
}

std::unique_ptr<Driver> CudaMakeDriver(int device, std::string* error) {
  try {
    return MakeCudaDriver(device, 0);
  } catch (const std::exception& e) {
    *error = e.what();
    return nullptr;
  }
}

}  // namespace

void internal::InstallCudaPlatform() {
  internal::DevicePlatform p;
  p.name = "cuda";
  p.is_capturing = CudaIsCapturing;
  p.alloc = CudaAlloc;
  p.free = CudaFree;
  p.make_driver = CudaMakeDriver;
  p.alloc_granularity = size_t{2} << 20;  // like the VMM granularity: comparable stats
  internal::RegisterCudaPlatform(p);
}

}  // namespace jax_vmm::scratch
