// Device code of the kv_write CUDA handlers (see kv_write_kernels.h): the production
// instantiations of the kernels, and the per-device counter of dropped writes behind
// kv_write_stats().
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <set>

#include "ops/kv_write/kv_write.h"
#include "ops/kv_write/kv_write_fp8.cuh"
#include "ops/kv_write/kv_write_kernel.cuh"
#include "ops/kv_write/kv_write_kernels.h"
#include "ops/kv_write/kv_write_stats.h"
#include "ops/kv_write/kv_write_targets.h"

namespace jax_vmm::kv {
namespace {

// Dropped token writes on this device (all buffers, both handlers); read by
// kv_write_stats() through cudaMemcpyFromSymbol.
__device__ unsigned long long g_dropped_writes;

struct CheckedOnDevice {
  static __device__ int32_t Check(int32_t slot, const Params& p, const Side& s) {
    return CheckedTokens::Check(slot, p, s);
  }
  static __device__ void CountDrop() { atomicAdd(&g_dropped_writes, 1ULL); }
};

// Devices whose counter kv_write_stats() must read.
std::mutex g_devices_mu;
std::set<int>& SeenDevices() {
  static std::set<int> devices;
  return devices;
}

std::set<int> DevicesSeen() {
  std::lock_guard<std::mutex> lock(g_devices_mu);
  return SeenDevices();
}

// Runs fn(device) with each device the handlers ran on current, then restores the
// caller's device.
template <typename Fn>
void ForEachSeenDevice(Fn fn) {
  int previous = 0;
  cudaGetDevice(&previous);
  for (int d : DevicesSeen()) {
    if (cudaSetDevice(d) == cudaSuccess) fn();
  }
  cudaSetDevice(previous);
}

// Device counters for kv_write_stats(): summed over the devices the handlers ran on.
uint64_t ReadDeviceDrops() {
  uint64_t total = 0;
  ForEachSeenDevice([&] {
    unsigned long long value = 0;
    if (cudaMemcpyFromSymbol(&value, g_dropped_writes, sizeof(value)) == cudaSuccess) {
      total += value;
    }
  });
  return total;
}

void ResetDeviceDrops() {
  const unsigned long long zero = 0;
  ForEachSeenDevice([&] { cudaMemcpyToSymbol(g_dropped_writes, &zero, sizeof(zero)); });
}

}  // namespace

cudaError_t LaunchKvWrite(const Params& p, cudaStream_t stream) {
  return kernels::LaunchKvKernel<CheckedOnDevice>(p, stream);
}

cudaError_t LaunchKvWriteTokenKernel(const Params& p, cudaStream_t stream) {
  return kernels::LaunchKvTokenKernel<CheckedOnDevice>(p, stream);
}

namespace {

template <typename SrcT>
cudaError_t LaunchQuantize(const Params& p, const Fp8Quantization& q, cudaStream_t stream) {
  kernels::QuantizeVectors<SrcT> tr;
  tr.vecs_per_token = static_cast<int>(p.token_bytes / 8);
  tr.per_head = FastDivmod(static_cast<uint32_t>(q.head_dim / 8));
  tr.scale[0] = q.scale[0];
  tr.scale[1] = q.scale[1];
  return kernels::LaunchBulkKernel<CheckedOnDevice>(p, tr, stream);
}

}  // namespace

cudaError_t LaunchKvWriteFp8(const Params& p, const Fp8Quantization& q, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  switch (q.source) {
    case Fp8Quantization::Source::kBF16:
      return LaunchQuantize<__nv_bfloat16>(p, q, stream);
    case Fp8Quantization::Source::kF16:
      return LaunchQuantize<__half>(p, q, stream);
    default:
      return LaunchQuantize<float>(p, q, stream);
  }
}

void NoteDevice(int device) {
  std::lock_guard<std::mutex> lock(g_devices_mu);
  SeenDevices().insert(device);
}

void InstallCudaDropHooks() {
  SetDeviceDropHooks(DeviceDropHooks{ReadDeviceDrops, ResetDeviceDrops});
}

}  // namespace jax_vmm::kv
