// The kv_write kernels as templates over their token policy, and their launch. Device
// code; included by kv_write_kernels.cu (production) and the testing layer's variants.
//
// Policy: static __device__ int32_t Check(slot, params, side) (the token's TokenStatus)
// and static __device__ void CountDrop() (a dropped write, for the device-wide counter).
//
// LaunchKvKernel picks the tiled kernel (kv_write_bulk.cuh) for every token whose vector
// count fits its int indexing (kMaxTiledVectorsPerToken: tokens up to 256 MiB with 16-byte
// vectors), and this file's token kernel -- one group of threads per token, no index
// limit -- for larger ones.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ops/kv_write/kv_write.h"
#include "ops/kv_write/kv_write_bulk.cuh"

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
    const uint64_t offset = static_cast<uint64_t>(slot) * s.slot_bytes;
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
    align |= s.slot_bytes | reinterpret_cast<uintptr_t>(s.src);
    align |= reinterpret_cast<uintptr_t>(s.dst) | reinterpret_cast<uintptr_t>(s.dst2);
  }
  for (int v : {16, 8, 4, 2}) {
    if (align % v == 0) return v;
  }
  return 1;
}

// The token kernel for p, with vb-byte vectors (VectorBytes).
template <typename Policy>
cudaError_t LaunchTokenKernel(const Params& p, int vb, cudaStream_t stream) {
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

// The tiled kernel for p, with vb-byte vectors.
template <typename Policy>
cudaError_t LaunchBulkCopy(const Params& p, int vb, cudaStream_t stream) {
  const int vpt = static_cast<int>(p.token_bytes / vb);
  switch (vb) {
    case 16:
      return LaunchBulkKernel<Policy>(p, CopyVectors<uint4>{vpt}, stream);
    case 8:
      return LaunchBulkKernel<Policy>(p, CopyVectors<uint2>{vpt}, stream);
    case 4:
      return LaunchBulkKernel<Policy>(p, CopyVectors<uint32_t>{vpt}, stream);
    case 2:
      return LaunchBulkKernel<Policy>(p, CopyVectors<uint16_t>{vpt}, stream);
    default:
      return LaunchBulkKernel<Policy>(p, CopyVectors<uint8_t>{vpt}, stream);
  }
}

// The kernel for p: tiled, or the token kernel for tokens of more vectors than it indexes.
template <typename Policy>
cudaError_t LaunchKvKernel(const Params& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  const int vb = VectorBytes(p);
  if (static_cast<int64_t>(p.token_bytes) / vb <= kMaxTiledVectorsPerToken) {
    return LaunchBulkCopy<Policy>(p, vb, stream);
  }
  return LaunchTokenKernel<Policy>(p, vb, stream);
}

// The token kernel whatever the token size (what LaunchKvKernel picks for huge tokens).
template <typename Policy>
cudaError_t LaunchKvTokenKernel(const Params& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  return LaunchTokenKernel<Policy>(p, VectorBytes(p), stream);
}

}  // namespace jax_vmm::kv::kernels
