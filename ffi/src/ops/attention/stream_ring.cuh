// The streaming kernel's shared-memory ring (stream_kernel.cuh): how K/V elements are
// stored and read back, where each byte of a tile sits, and the two ways tiles arrive
// (16-byte cp.async into a swizzled ring, or bulk copies on mbarriers). Device code only.
//
// A slot holds one tile of K then one of V: 16 token rows of RB = D * sizeof(storage)
// bytes each. cp.async: 16-byte chunk c of row r sits at chunk c ^ Swizzle(r); bulk: plain
// rows padded by 16 bytes. Both are bank-conflict free for the fragment reads of the
// kernel (tests/ops/test_attention_v2_layout.py models the addresses).
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace jax_vmm::attention::stream {

struct Fp8E4M3 {};  // storage tag: one float8_e4m3fn byte per element

// Storage<S>: how 8 consecutive elements of a K/V row are read from shared memory as 4
// words of compute-type pairs (word i = elements 2i, 2i+1, the lower in the low half).
template <typename S>
struct Storage;

template <>
struct Storage<__nv_bfloat16> {
  using Compute = __nv_bfloat16;
  static constexpr int kBytes = 2;
  static __device__ __forceinline__ uint4 Load8(const uint8_t* p) {
    return *reinterpret_cast<const uint4*>(p);
  }
};

template <>
struct Storage<__half> {
  using Compute = __half;
  static constexpr int kBytes = 2;
  static __device__ __forceinline__ uint4 Load8(const uint8_t* p) {
    return *reinterpret_cast<const uint4*>(p);
  }
};

// Four float8_e4m3fn bytes as two fp16 pairs, bytes 0-1 in `lo` and 2-3 in `hi` (exact:
// every e4m3 value is an fp16 value). On sm_89+ each pair is one conversion that reads its
// half of the word in place; the intrinsic's 16-bit argument costs a shift and a mask
// per pair, a quarter of the fp8 tile loop's instructions (SASS, sm_90).
__device__ __forceinline__ void Fp8QuadToHalf2(uint32_t four_bytes, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n"
      " cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(four_bytes));
#else
  const auto pair = [](uint32_t two) {
    const __half2_raw h =
        __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two), __NV_E4M3);
    return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
  };
  lo = pair(four_bytes & 0xffffu);
  hi = pair(four_bytes >> 16);
#endif
}

template <>
struct Storage<Fp8E4M3> {
  using Compute = __half;
  static constexpr int kBytes = 1;
  static __device__ __forceinline__ uint4 Load8(const uint8_t* p) {
    const uint2 r = *reinterpret_cast<const uint2*>(p);
    uint4 w;
    Fp8QuadToHalf2(r.x, w.x, w.y);
    Fp8QuadToHalf2(r.y, w.z, w.w);
    return w;
  }
};

// Word i of w; i is a compile-time constant at every call.
__device__ __forceinline__ uint32_t Word(const uint4& w, int i) {
  return i == 0 ? w.x : (i == 1 ? w.y : (i == 2 ? w.z : w.w));
}

// -- layout ------------------------------------------------------------------------------

template <int RB>
__device__ __forceinline__ int Swizzle(int row) {
  constexpr int kChunks = RB / 16;
  static_assert(kChunks >= 4, "rows shorter than 64 bytes are not supported");
  if constexpr (kChunks >= 8) {
    return row & 7;
  } else {
    return (row >> 1) & 3;
  }
}

// Where row r of a tile sits. Rows of 64 bytes share a 128-byte bank line in pairs; the
// PV reads take rows 2 tig (+ 1, + 8, + 9), all even (or all odd), so rows 2 and 3, 6 and
// 7, ... trade places to spread each such set over both halves of the banks.
template <int RB>
__device__ __forceinline__ int PhysicalRow(int row) {
  if constexpr (RB / 16 >= 8) {
    return row;
  } else {
    return row ^ ((row >> 1) & 1);
  }
}

template <int RB>
__device__ __forceinline__ int RingOffset(int row, int byte) {
  return PhysicalRow<RB>(row) * RB + (((byte >> 4) ^ Swizzle<RB>(row)) << 4) + (byte & 15);
}

// Byte of (row, byte) in a tile: the swizzled ring, or (bulk) plain rows padded by 16.
template <int RB, bool kBulk>
__device__ __forceinline__ int TileOffset(int row, int byte) {
  if constexpr (kBulk) {
    return row * (RB + 16) + byte;
  } else {
    return RingOffset<RB>(row, byte);
  }
}

// -- copies ------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared, L2 only; src_bytes 0 reads nothing and writes zeros.
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most n of this thread's committed groups are pending (n < 8).
__device__ __forceinline__ void CpAsyncWait(int n) {
  switch (n) {
    case 0:
      asm volatile("cp.async.wait_group 0;\n" ::: "memory");
      break;
    case 1:
      asm volatile("cp.async.wait_group 1;\n" ::: "memory");
      break;
    case 2:
      asm volatile("cp.async.wait_group 2;\n" ::: "memory");
      break;
    case 3:
      asm volatile("cp.async.wait_group 3;\n" ::: "memory");
      break;
    case 4:
      asm volatile("cp.async.wait_group 4;\n" ::: "memory");
      break;
    case 5:
      asm volatile("cp.async.wait_group 5;\n" ::: "memory");
      break;
    case 6:
      asm volatile("cp.async.wait_group 6;\n" ::: "memory");
      break;
    default:
      asm volatile("cp.async.wait_group 7;\n" ::: "memory");
      break;
  }
}

__device__ __forceinline__ void MbarInit(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SharedAddress(bar)), "r"(count)
               : "memory");
}
__device__ __forceinline__ void MbarFenceInit() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void MbarArriveExpectTx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(SharedAddress(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void MbarWait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred done;\n"
      "WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n}\n" ::"r"(SharedAddress(bar)),
      "r"(parity)
      : "memory");
}
// One contiguous global -> shared copy by the bulk copy engine, completing on `bar`.
__device__ __forceinline__ void BulkCopy(void* dst, const void* src, unsigned bytes,
                                         uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
      "[%3];\n" ::"r"(SharedAddress(dst)),
      "l"(src), "r"(bytes), "r"(SharedAddress(bar))
      : "memory");
}
// Orders this thread's ordinary shared-memory stores before later bulk-copy writes.
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Transposes the warp's 8x8 matrix of 16-bit pairs (lane 4 r + c holds row r, columns
// 2c, 2c + 1): afterwards the lane holds row r, columns 2c, 2c + 1 of the transpose.
__device__ __forceinline__ uint32_t MoveTransposed(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

}  // namespace jax_vmm::attention::stream
