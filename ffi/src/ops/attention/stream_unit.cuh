// The per-unit helpers of the streaming kernel (stream_kernel.cuh, stream_kernels.cu): a
// unit's query heads as tensor-core fragments, and the merge of a split unit's pieces
// from the workspace into the output. Device code only.
#pragma once

#include <cstdint>
#include <type_traits>

#include "ops/attention/attention_device.cuh"
#include "ops/attention/stream_kernels.h"
#include "ops/attention/stream_plan.h"
#include "ops/attention/stream_ring.cuh"

namespace jax_vmm::attention::stream {

// Merges the pieces of unit (b, hg), owned by CTAs [first, last], from the workspace and
// writes the output. Called by a whole CTA; `tot` is shared scratch of 2 * head_group
// floats.
template <typename QT, int D>
__device__ void CombineUnit(const StreamParams& p, int b, int hg, int first, int last, float* tot) {
  const int GB = p.head_group;
  if (threadIdx.x < GB) {
    const int h = threadIdx.x;
    float M = -INFINITY;
    for (int c = first; c <= last; ++c) {
      M = fmaxf(M, __ldcg(p.ws_m + PartialRow(c, ContributorSlot(c, first), GB, h)));
    }
    float L = 0.f;
    for (int c = first; c <= last; ++c) {
      const int64_t r = PartialRow(c, ContributorSlot(c, first), GB, h);
      L += __ldcg(p.ws_l + r) * exp2f(__ldcg(p.ws_m + r) - M);
    }
    tot[h] = M;
    tot[GB + h] = 1.f / L;  // L >= 1: each piece holds a token of weight 1
  }
  __syncthreads();
  QT* o = static_cast<QT*>(p.out) + (static_cast<int64_t>(b) * p.q_heads + hg * GB) * D;
  for (int idx = threadIdx.x; idx < GB * D; idx += blockDim.x) {
    const int h = idx / D, d = idx - h * D;
    float a = 0.f;
    for (int c = first; c <= last; ++c) {
      const int64_t r = PartialRow(c, ContributorSlot(c, first), GB, h);
      a += __ldcg(p.ws_acc + r * D + d) * exp2f(__ldcg(p.ws_m + r) - tot[h]);
    }
    o[idx] = kernels::FromFloat<QT>(a * tot[GB + h]);
  }
}

// Loads the query heads of unit (b, hg) as QK B fragments (the permutation of the split
// kernel: lane (grp, tig) holds dims [32 j + 8 tig, +8) of head 8 nt + grp) and sets the
// per-column logit factor of the lane's heads 8 nt + 2 tig + e.
template <typename QT, typename T, int D, int NQT>
__device__ __forceinline__ void LoadQuery(const StreamParams& p, int b, int hg, float kscale,
                                          uint32_t (&qf)[NQT][D / 32][4], float (&lscale)[NQT][2]) {
  constexpr int kKBlocks = D / 32;
  const int lane = threadIdx.x & 31, grp = lane >> 2, tig = lane & 3;
  const int GB = p.head_group;
#pragma unroll
  for (int nt = 0; nt < NQT; ++nt) {
    const int head = nt * 8 + grp;
    const QT* qrow =
        static_cast<const QT*>(p.q) + (static_cast<int64_t>(b) * p.q_heads + hg * GB + head) * D;
    uint4 w[kKBlocks];
#pragma unroll
    for (int j = 0; j < kKBlocks; ++j) {
      w[j] = head < GB ? kernels::Load16(qrow + 32 * j + 8 * tig) : make_uint4(0, 0, 0, 0);
    }
    float qscale = 1.f;
    if constexpr (!std::is_same_v<QT, T>) {
      // bf16 -> fp16: scale by a power of two so that the head's largest |q| lands in
      // [2^14, 2^15) (no overflow, small entries keep their bits), undone in lscale.
      float amax = 0.f;
#pragma unroll
      for (int j = 0; j < kKBlocks; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint32_t x = Word(w[j], i);
          amax = fmaxf(amax, fmaxf(fabsf(__uint_as_float(x << 16)),
                                   fabsf(__uint_as_float(x & 0xffff0000u))));
        }
      }
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      if (amax > 0.f && isfinite(amax)) {
        int ex = 0;
        frexpf(amax, &ex);  // amax = m * 2^ex, m in [0.5, 1)
        qscale = ldexpf(1.f, min(15 - ex, 100));
      }
#pragma unroll
      for (int j = 0; j < kKBlocks; ++j) {
        uint32_t h[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint32_t x = Word(w[j], i);
          h[i] = kernels::TensorCore<T>::Pack(__uint_as_float(x << 16) * qscale,
                                              __uint_as_float(x & 0xffff0000u) * qscale);
        }
        w[j] = make_uint4(h[0], h[1], h[2], h[3]);
      }
    }
#pragma unroll
    for (int j = 0; j < kKBlocks; ++j) {
      qf[nt][j][0] = w[j].x;
      qf[nt][j][1] = w[j].y;
      qf[nt][j][2] = w[j].z;
      qf[nt][j][3] = w[j].w;
    }
    // columns of this lane: heads 8 nt + 2 tig + e, whose scale lane 4 * head computed
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float s = __shfl_sync(0xffffffffu, qscale, 4 * (2 * tig + e));
      lscale[nt][e] = p.scale_log2 * kscale / s;
    }
  }
}
}  // namespace jax_vmm::attention::stream
