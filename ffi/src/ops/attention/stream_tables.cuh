// The streaming kernel's view of the partition (stream_plan.h) on the device: the clamped
// lengths and tile prefix of every sequence, which the kernel builds in shared memory, and
// a cursor that walks a CTA's global tiles. Device code only.
#pragma once

#include <cstdint>

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

  // The cursor at global tile g (0 <= g < groups * prefix[batch]).
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
};

}  // namespace jax_vmm::attention::stream
