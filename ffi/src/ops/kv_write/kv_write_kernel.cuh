// The kv_write kernel as a template over its token policy, and its launch. Device code;
// included by kv_write_kernels.cu (production) and the testing layer's unchecked variant.
//
// Policy: static __device__ int32_t Check(slot, params, side) (the token's TokenStatus)
// and static __device__ void CountDrop() (a dropped write, for the device-wide counter).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ops/kv_write/kv_write.h"

namespace jax_vmm::kv::kernels {

constexpr int kThreads = 256;

// Each group of `tpt` threads handles one token of one side (blockIdx.y: 0 = k, 1 = v)
// at a time, grid-striding over tokens: validate, record the status, count drops, copy
// valid tokens into the target and the second destination (see kv_write.h).
template <typename V, typename Policy>
__global__ void __launch_bounds__(kThreads) KvKernel(Params p, int tpt) {
  const Side& s = p.side[blockIdx.y];
  const int group = threadIdx.x / tpt;
  const int lane = threadIdx.x % tpt;
  const int groups = blockDim.x / tpt;
  const int64_t vecs = static_cast<int64_t>(p.token_bytes / sizeof(V));
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * groups + group; t < p.n;
       t += static_cast<int64_t>(gridDim.x) * groups) {
    const int32_t slot = p.slots[t];
    const int32_t st = Policy::Check(slot, p, s);
    if (lane == 0) {
      if (s.status != nullptr) s.status[t] = st;
      if (IsDropped(st)) {
        Policy::CountDrop();
        if (s.drop_counter != nullptr) atomicAdd(s.drop_counter, 1ULL);
      }
    }
    if (st != kValid) continue;
    const uint64_t offset = static_cast<uint64_t>(slot) * p.token_bytes;
    const V* src = reinterpret_cast<const V*>(s.src + static_cast<uint64_t>(t) * p.token_bytes);
    if (s.dst != nullptr) {
      V* dst = reinterpret_cast<V*>(s.dst + offset);
      for (int64_t i = lane; i < vecs; i += tpt) dst[i] = src[i];
    }
    if (s.dst2 != nullptr) {
      V* dst = reinterpret_cast<V*>(s.dst2 + offset);
      for (int64_t i = lane; i < vecs; i += tpt) dst[i] = src[i];
    }
  }
}

// The widest copy unit that divides the token size and every base address.
inline int VectorBytes(const Params& p) {
  uintptr_t align = p.token_bytes;
  for (const Side& s : p.side) {
    align |= reinterpret_cast<uintptr_t>(s.src);
    align |= reinterpret_cast<uintptr_t>(s.dst) | reinterpret_cast<uintptr_t>(s.dst2);
  }
  for (int v : {16, 8, 4, 2}) {
    if (align % v == 0) return v;
  }
  return 1;
}

template <typename Policy>
cudaError_t LaunchKvKernel(const Params& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  const int vb = VectorBytes(p);
  const int64_t vecs = static_cast<int64_t>(p.token_bytes) / vb;
  int tpt = 1;
  while (tpt < vecs && tpt < kThreads) tpt *= 2;
  const int groups = kThreads / tpt;
  const int64_t blocks = std::min<int64_t>((p.n + groups - 1) / groups, 65535);
  const dim3 grid(static_cast<unsigned>(blocks), 2);
  switch (vb) {
    case 16:
      KvKernel<uint4, Policy><<<grid, kThreads, 0, stream>>>(p, tpt);
      break;
    case 8:
      KvKernel<uint2, Policy><<<grid, kThreads, 0, stream>>>(p, tpt);
      break;
    case 4:
      KvKernel<uint32_t, Policy><<<grid, kThreads, 0, stream>>>(p, tpt);
      break;
    case 2:
      KvKernel<uint16_t, Policy><<<grid, kThreads, 0, stream>>>(p, tpt);
      break;
    default:
      KvKernel<uint8_t, Policy><<<grid, kThreads, 0, stream>>>(p, tpt);
      break;
  }
  return cudaGetLastError();
}

}  // namespace jax_vmm::kv::kernels
