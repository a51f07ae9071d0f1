"""Read bandwidth of the streaming attention kernel's access pattern, by tile order (issue 28).

The streaming kernel (docs/attention.md) reads K and V as tiles of `tile` tokens x one KV
head's row (RB bytes: 128 for fp8 at head_dim 128 and for 16-bit at head_dim 64, 256 for
16-bit at head_dim 128); rows of one head lie kv_heads x RB bytes apart in the
[B, T, H_kv, D] layout. Each CTA (4 warps, persistent, `--per-sm` per SM) takes an equal
range of all tiles, and warp w its tiles w, w + 4, ... as the kernel does. This times a
kernel that only reads those tiles (16-byte loads, the kernel's lane-to-chunk mapping)
in four orders of the global tile index:

  unit     (b, head, tile): the kernel's order; concurrent warps read different heads at
           unrelated token positions, so each 128- or 256-byte row piece is read alone
  segment  (b, 16-tile segment, head, tile): a unit's tiles in segments, heads between
  head     (b, tile, head): the 4 warps of a CTA read 4 heads of the same tokens at once
  linear   the same bytes as one contiguous stream (the ceiling of this kernel shape)

If `head` and `linear` read faster than `unit` at 128-byte rows and alike at 256-byte
rows, the fp8 kernel's gap to the HBM roofline is its order, not its arithmetic.

    python3 tools/gpu/row_read_probe.py [--batch 32 --tokens 8192 --kv-heads 8] [--json F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import cupy as cp

SOURCE = r"""
extern "C" __global__ void __launch_bounds__(128)
read_tiles(const uint4* __restrict__ k, const uint4* __restrict__ v, int B, int T, int H,
           int RB, int tt, int order, int total, unsigned* sink) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int C = gridDim.x, c = blockIdx.x;
  const long long g0 = (long long)c * total / C, g1 = (long long)(c + 1) * total / C;
  const int tpu = T / tt, chunks = RB / 16, per_lane = tt * RB / 512;
  const int seg = 16;
  unsigned acc = 0;
  for (long long g = g0 + warp; g < g1; g += 4) {
    long long base;  // byte offset of the tile's first row
    if (order == 3) {
      base = g * (long long)tt * RB;
    } else {
      const int b = (int)(g / ((long long)H * tpu));
      const int r = (int)(g % ((long long)H * tpu));
      int h, tile;
      if (order == 0) { h = r / tpu; tile = r % tpu; }
      else if (order == 1) {
        const int s = r / (H * seg), q = r % (H * seg);
        h = q / seg;
        tile = s * seg + q % seg;
      }
      else { tile = r / H; h = r % H; }
      base = (((long long)b * T + (long long)tile * tt) * H + h) * RB;
    }
    const long long stride = order == 3 ? RB : (long long)H * RB;
    uint4 x[16], y[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if (i < per_lane) {
        const int q = lane + 32 * i, row = q / chunks, col = q % chunks;
        const long long off = (base + row * stride) / 16 + col;
        x[i] = __ldg(k + off);
        y[i] = __ldg(v + off);
      }
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if (i < per_lane) acc ^= x[i].x ^ x[i].y ^ x[i].z ^ x[i].w;
      if (i < per_lane) acc ^= y[i].x ^ y[i].y ^ y[i].z ^ y[i].w;
    }
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the loads; practically never taken
}
"""

ORDERS = {"unit": 0, "segment": 1, "head": 2, "linear": 3}


def time_ms(fn, iters: int = 20) -> float:
    fn()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        best = min(best, cp.cuda.get_elapsed_time(start, end) / iters)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--per-sm", type=int, default=3, help="CTAs per SM")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    kernel = cp.RawKernel(SOURCE, "read_tiles")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    sink = cp.zeros(1, cp.uint32)
    rows = []
    print(f"{'row bytes':>9} {'tile':>4} {'order':>8} {'GB/s':>7} {'of linear':>9}")
    for rb, tt in ((128, 32), (128, 16), (256, 16)):
        nbytes = args.batch * args.tokens * args.kv_heads * rb
        k = cp.random.randint(0, 2**31, nbytes // 4, dtype=cp.int32).view(cp.uint8)
        v = cp.random.randint(0, 2**31, nbytes // 4, dtype=cp.int32).view(cp.uint8)
        total = args.batch * args.kv_heads * (args.tokens // tt)
        grid = args.per_sm * sms
        result = {}
        for name, order in ORDERS.items():
            call = lambda o=order: kernel(  # noqa: E731
                (grid,),
                (128,),
                (
                    k,
                    v,
                    cp.int32(args.batch),
                    cp.int32(args.tokens),
                    cp.int32(args.kv_heads),
                    cp.int32(rb),
                    cp.int32(tt),
                    cp.int32(o),
                    cp.int32(total),
                    sink,
                ),
            )
            result[name] = 2 * nbytes / (time_ms(call) * 1e-3) / 1e9
        for name, gbps in result.items():
            rows.append({"row_bytes": rb, "tile": tt, "order": name, "gbps": gbps})
            print(f"{rb:9d} {tt:4d} {name:>8} {gbps:7.0f} {gbps / result['linear']:9.3f}")
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": None}, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
