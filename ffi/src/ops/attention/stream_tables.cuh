// The streaming kernel's view of the partition (stream_plan.h) on the device: the clamped
// lengths and tile prefix of every sequence in shared memory, and a cursor that walks a
// CTA's global tiles. Device code only.
#pragma once

#include <cstdint>

#include "ops/attention/attention_device.cuh"
#include "ops/attention/stream_plan.h"

namespace jax_vmm::attention::stream {

// Global tile g is tile `tile` of unit (b, hg).
struct Cursor {
  int g, b, hg, tile;
};

struct Tables {
  const int* lens;    // [B] clamped lengths
  const int* prefix;  // [B + 1] exclusive prefix of TilesOf(lens)
  int batch, groups;

  __device__ __forceinline__ int Tiles(int b) const { return prefix[b + 1] - prefix[b]; }
  __device__ __forceinline__ int Total() const { return groups * prefix[batch]; }

  // The cursor at global tile g (0 <= g < Total()).
  __device__ Cursor Locate(int g) const {
    const UnitTile u = LocateTile(prefix, batch, groups, g);
    return Cursor{g, u.b, u.hg, u.tile};
  }

  // Moves c forward by `step` tiles; `valid` turns false once it would reach `end`.
  __device__ __forceinline__ void Advance(Cursor& c, bool& valid, int step, int end) const {
    if (!valid) return;
    if (c.g + step >= end) {
      valid = false;
      return;
    }
    c.g += step;
    c.tile += step;
    for (int t = Tiles(c.b); c.tile >= t; t = Tiles(c.b)) {
      c.tile -= t;
      if (++c.hg == groups) {
        c.hg = 0;
        ++c.b;
      }
    }
  }

  // Moves a cursor at the end of a unit to the first tile of the next unit with tiles.
  __device__ __forceinline__ void NextUnit(Cursor& c) const {
    c.tile = 0;
    do {
      if (++c.hg == groups) {
        c.hg = 0;
        ++c.b;
      }
    } while (Tiles(c.b) == 0);
  }
};

// Fills lens[0, B) with the clamped lengths and prefix[0, B] with the exclusive prefix of
// their tile counts: thread t owns sequences [t per, (t + 1) per), the warps scan with
// shuffles, then add the earlier warps' totals (scan: kWarps ints of scratch). Called by
// the whole CTA (barriers); the tables are ready when it returns.
__device__ __forceinline__ Tables BuildTables(const int32_t* lengths, int B, int max_tokens,
                                              int groups, int* lens, int* prefix, int* scan) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int per = (B + kThreads - 1) / kThreads;
  int mine = 0;
  for (int i = 0; i < per; ++i) {
    const int b = threadIdx.x * per + i;
    if (b < B) {
      lens[b] = kernels::LiveLength(lengths, b, max_tokens);
      mine += TilesOf(lens[b]);
    }
  }
  int incl = mine;  // inclusive scan over the warp
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int x = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += x;
  }
  if (lane == 31) scan[warp] = incl;
  __syncthreads();
  int run = incl - mine;  // exclusive within the warp, plus the earlier warps' totals
  for (int w = 0; w < warp; ++w) run += scan[w];
  for (int i = 0; i < per; ++i) {
    const int b = threadIdx.x * per + i;
    if (b < B) {
      prefix[b] = run;
      run += TilesOf(lens[b]);
    }
  }
  if (threadIdx.x == kThreads - 1) prefix[B] = run;
  __syncthreads();
  return Tables{lens, prefix, B, groups};
}

}  // namespace jax_vmm::attention::stream
