// The tiled kv_write kernel (contract: kv_write.h), for plain copies and, with another
// transfer policy, for fp8 quantization (kv_write_fp8.cuh). Device code; included by
// kv_write_kernel.cuh.
//
// Each block takes tiles of `tile` (<= kTileTokens) tokens of one side (blockIdx.y: 0 = k,
// 1 = v), grid-striding over the tiles (tokens of at most kMaxTiledVectorsPerToken vectors):
//   1. every thread issues its first kUnroll source loads of the tile (the new tokens'
//      bytes do not depend on the slots), while threads 0..tile-1 validate one
//      token each (Tokens::Check: slot range, page table), record its status, count its
//      drop, and publish its destination offset (or -1) in shared memory;
//   2. after one barrier the tile's (token, vector) pairs, flattened, are stored where
//      valid, kUnroll vectors in flight per thread.
// So a prefill of n contiguous tokens moves as one coalesced stream with ~kUnroll x 16 B
// per thread in flight, and a decode-size write (n = batch) pays the slot and page-table
// latency once, overlapped with its data loads. Small writes get small tiles (TileTokens),
// so that a decode-size write spreads over many SMs instead of queueing rounds of loads
// in a few blocks. Loads index the tile's vectors flat (the new tokens are contiguous);
// the stores' token of a vector is one FastDivmod, not an integer division (~20
// instructions per 16-byte vector, enough to cap a prefill near 75% of the copy
// bandwidth).
//
// Tokens (the token policy): static __device__ int32_t Check(slot, params, side) and
// static __device__ void CountDrop(), as for the token kernel (kv_write_kernel.cuh).
// Transfer: the type Vec, int vecs_per_token, Load(side, side_index, flat) -> Vec (vector
// `flat` of the side's new tokens, token-major) and Store(dst_token, side_index, i, vec)
// (vector i of a token; CopyVectors below, QuantizeVectors).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/fast_divmod.h"
#include "ops/kv_write/kv_write.h"
#include "ops/kv_write/kv_write_kernels.h"

namespace jax_vmm::kv::kernels {

inline constexpr int kBulkThreads = 256;
inline constexpr int kTileTokens = 32;
inline constexpr int kUnroll = 8;

// Plain copy in units of V (the widest type that divides the token size and addresses).
template <typename V>
struct CopyVectors {
  using Vec = V;
  int vecs_per_token;  // token_bytes / sizeof(V)
  __device__ __forceinline__ Vec Load(const Side& s, int side, int64_t flat) const {
    (void)side;
    return reinterpret_cast<const V*>(s.src)[flat];
  }
  __device__ __forceinline__ void Store(uint8_t* dst_token, int side, int i, const Vec& x) const {
    (void)side;
    reinterpret_cast<V*>(dst_token)[i] = x;
  }
};

template <typename Tokens, typename Transfer>
__global__ void __launch_bounds__(kBulkThreads)
    KvBulkKernel(Params p, Transfer tr, FastDivmod per_token, int tile) {
  const int side = blockIdx.y;
  const Side& s = p.side[side];
  __shared__ long long dst_offset[kTileTokens];  // byte offset of the token's slot, or -1
  const int vpt = tr.vecs_per_token;
  for (int64_t t0 = static_cast<int64_t>(blockIdx.x) * tile; t0 < p.n;
       t0 += static_cast<int64_t>(gridDim.x) * tile) {
    const int tt = static_cast<int>(p.n - t0 < tile ? p.n - t0 : tile);
    const int total = tt * vpt;
    const int64_t flat0 = t0 * vpt;
    typename Transfer::Vec r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = threadIdx.x + u * kBulkThreads;
      if (i < total) r[u] = tr.Load(s, side, flat0 + i);
    }
    if (threadIdx.x < tt) {
      const int64_t t = t0 + threadIdx.x;
      const int32_t slot = p.slots[t];
      const int32_t st = Tokens::Check(slot, p, s);
      if (s.status != nullptr) s.status[t] = st;
      if (IsDropped(st)) {
        Tokens::CountDrop();
        if (s.drop_counter != nullptr) atomicAdd(s.drop_counter, 1ULL);
      }
      dst_offset[threadIdx.x] =
          st == kValid ? static_cast<long long>(slot) * static_cast<long long>(s.slot_bytes) : -1;
    }
    __syncthreads();
    for (int base = threadIdx.x;; base += kUnroll * kBulkThreads) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * kBulkThreads;
        if (i < total) {
          const int tok = static_cast<int>(per_token.Div(static_cast<uint32_t>(i)));
          const long long off = dst_offset[tok];
          if (off >= 0) {
            if (s.dst != nullptr) tr.Store(s.dst + off, side, i - tok * vpt, r[u]);
            if (s.dst2 != nullptr) tr.Store(s.dst2 + off, side, i - tok * vpt, r[u]);
          }
        }
      }
      const int next = base + kUnroll * kBulkThreads;
      if (next >= total) break;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = next + u * kBulkThreads;
        if (i < total) r[u] = tr.Load(s, side, flat0 + i);
      }
    }
    __syncthreads();  // dst_offset is rewritten by the next tile
  }
}

// Tokens per tile for n tokens of vecs_per_token vectors: kTileTokens from about
// kSpreadTiles x kTileTokens tokens up (a prefill: full tiles, one coalesced stream); below
// that, enough tiles per side to reach kSpreadTiles blocks, each with at least one vector
// per thread.
inline constexpr int64_t kSpreadTiles = 128;
inline int TileTokens(int64_t n, int vecs_per_token) {
  int64_t tile = (n + kSpreadTiles - 1) / kSpreadTiles;
  const int64_t fill = (kBulkThreads + vecs_per_token - 1) / vecs_per_token;
  if (tile < fill) tile = fill;
  return static_cast<int>(tile < kTileTokens ? tile : kTileTokens);
}

// Launches KvBulkKernel for p.n > 0 tokens: one tile per block, at most 65535 blocks
// (grid-stride beyond), both sides.
template <typename Tokens, typename Transfer>
cudaError_t LaunchBulkKernel(const Params& p, const Transfer& tr, cudaStream_t stream) {
  const int tile = TileTokens(p.n, tr.vecs_per_token);
  const int64_t tiles = (p.n + tile - 1) / tile;
  const dim3 grid(static_cast<unsigned>(tiles < 65535 ? tiles : 65535), 2);
  const FastDivmod per_token(static_cast<uint32_t>(tr.vecs_per_token));
  KvBulkKernel<Tokens, Transfer><<<grid, kBulkThreads, 0, stream>>>(p, tr, per_token, tile);
  return cudaGetLastError();
}

}  // namespace jax_vmm::kv::kernels
