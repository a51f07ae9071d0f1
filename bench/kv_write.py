"""kv_write against XLA's own cache update, and against the device copy bandwidth.

Decode-size writes (n = batch, one token per sequence) into a KV cache of a given total
capacity (K + V), side by side with XLA's donated ``cache.at[slots].set(...)`` on an
equal, fully preallocated cache:

  cache     the cache API: jax_vmm.kv_write(layer, ...) on ``kv.cache()[0]``, the
            KVCache pytree carried through the loop (it holds one token: nothing to
            copy or donate; the arena is written in place)
  dest      the array level: jax_vmm.kv_write(k, v, ..., dest=kv.dest(0)) on kv_arena
            views, cache donated (in place on a GPU; on the CPU XLA's copy is written too)
  xla       k.at[slots].set(new_k), v.at[...] on plain donated jnp arrays

Each executable runs L writes in a ``fori_loop`` (device time per write, dispatch
amortised); "call" rows run one write per executable call (what a decode step pays,
dispatch included). Goal: cache/xla <= 1.0 and flat from 1 GiB to 32 GiB.

Prefill-size writes (n contiguous tokens) report bandwidth (bytes read + written per
second) as a share of the measured device copy bandwidth (a 1 GiB device-to-device
copy, as in bench/attention.py: the best of an XLA copy kernel and, with cupy, a runtime
memcpy). Goal >= 85%.

  python bench/kv_write.py                      # GPU: 1 GiB and 32 GiB; CPU: scaled down
  python bench/kv_write.py --capacities 1 --batches 8 --json out.json
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_vmm
from _common import (
    GiB,
    MiB,
    Table,
    copy_bandwidth,
    looped_writes,
    median_time,
    parse_list,
    ring_slots,
    write_json,
)

KINDS = ("cache", "dest", "xla")
DECODE = Table(
    ("capacity", 10),
    ("n", 5),
    ("mode", 5),
    ("cache", 9),
    ("dest", 9),
    ("xla", 9),
    ("cache/xla", 9),
    ("dest/xla", 8),
)
PREFILL = Table(
    ("capacity", 10),
    ("n", 6),
    ("cache GB/s", 10),
    ("cache %", 7),
    ("dest GB/s", 9),
    ("dest %", 6),
    ("xla GB/s", 9),
    ("xla %", 6),
)


class Writer:
    """One way of writing `n` tokens per step into a cache of `num_slots` slots: runs
    `loop` steps per executable call, slots advancing by n each step (wrapping)."""

    def __init__(self, kind: str, num_slots: int, n: int, loop: int, h: int, d: int, dtype, device):
        self.kind, self.num_slots, self.n, self.loop = kind, num_slots, n, loop
        self.device = device
        rng = np.random.default_rng(n)
        self.nk = jax.device_put(jnp.asarray(rng.standard_normal((n, h, d)), dtype), device)
        self.nv = jax.device_put(jnp.asarray(rng.standard_normal((n, h, d)), dtype), device)
        self.kv = self.cache = None
        if kind == "xla":
            self.k = jax.device_put(jnp.zeros((num_slots, h, d), dtype), device)
            self.v = jax.device_put(jnp.zeros((num_slots, h, d), dtype), device)
        else:
            self.kv = jax_vmm.kv_arena(
                num_layers=1,
                num_kv_heads=h,
                head_dim=d,
                max_tokens=num_slots,
                dtype=dtype,
                device=device,
                initial_tokens=num_slots,
            )
            self.k, self.v = self.kv.k[0], self.kv.v[0]
        self.start = jax.device_put(jnp.int32(0), device)
        self.exe = self._compile()

    def _compile(self):
        nk, nv, loop = self.nk, self.nv, self.loop
        if self.kind == "cache":
            self.cache = self.kv.cache()

            def c(cache, start):
                def body(i, cache):
                    slots = ring_slots(start, i, self.n, self.num_slots)
                    layer = jax_vmm.kv_write(cache[0], nk, nv, slots)
                    return cache.replace(0, layer)

                return jax.lax.fori_loop(0, loop, body, cache), start + loop * self.n

            return jax.jit(c, donate_argnums=(0, 1)).lower(self.cache, self.start).compile()
        dest = self.kv.dest(0) if self.kind == "dest" else None

        def update(k, v, slots):
            if self.kind == "xla":
                return k.at[slots].set(nk, mode="drop"), v.at[slots].set(nv, mode="drop")
            return jax_vmm.kv_write(k, v, nk, nv, slots, dest=dest)

        g = looped_writes(update, self.n, loop, self.num_slots)
        return jax.jit(g, donate_argnums=(0, 1, 2)).lower(self.k, self.v, self.start).compile()

    def step(self):
        if self.kind == "cache":
            self.cache, self.start = self.exe(self.cache, self.start)
            return self.start
        self.k, self.v, self.start = self.exe(self.k, self.v, self.start)
        if self.kind == "dest":  # donation may have used the views up: take fresh ones
            self.k, self.v = self.kv.k[0], self.kv.v[0]
        return self.start

    def close(self) -> None:
        self.k = self.v = self.cache = None
        if self.kv is not None:
            self.kv.close()


def per_write(kind, num_slots, n, loop, args, device, repeats) -> float:
    w = Writer(kind, num_slots, n, loop, args.heads, args.head_dim, args.dtype, device)
    try:
        return median_time(w.step, repeats) / loop
    finally:
        w.close()


def per_write_each(num_slots, n, loop, args, device) -> dict[str, float]:
    """Seconds per write of every writer (KINDS)."""
    return {k: per_write(k, num_slots, n, loop, args, device, args.repeats) for k in KINDS}


def main(argv: list[str] | None = None) -> int:
    dev = jax.devices()[0]
    gpu = dev.platform != "cpu"
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--capacities",
        type=parse_list(float),
        default="1,32" if gpu else "0.015625,0.125",
        help="total K+V cache sizes in GiB (comma separated)",
    )
    p.add_argument(
        "--batches",
        type=parse_list(int),
        default="1,8,64" if gpu else "8",
        help="decode batch sizes (tokens per write)",
    )
    p.add_argument(
        "--prefill",
        type=parse_list(int),
        default="4096,32768" if gpu else "1024",
        help="prefill sizes (tokens per write)",
    )
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--loop", type=int, default=64, help="writes per executable call")
    p.add_argument("--repeats", type=int, default=20 if gpu else 5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.dtype = jnp.dtype(args.dtype)
    tb = args.heads * args.head_dim * args.dtype.itemsize
    rows: list[dict] = []

    print(
        f"device {dev.device_kind} ({dev.platform}); token {args.heads}x{args.head_dim} "
        f"{args.dtype.name} = {tb} B per K or V"
    )
    bw = copy_bandwidth(dev, (1 * GiB) if gpu else 64 * MiB)
    print(f"device copy bandwidth (read + write): {bw / 1e9:.1f} GB/s\n")

    print("decode: time per write of n tokens (us); ratios against xla")
    print(DECODE.header())
    for cap_gib in args.capacities:
        num_slots = int(cap_gib * GiB) // (2 * tb)
        for n in args.batches:
            for mode, loop in (("loop", args.loop), ("call", 1)):
                t = per_write_each(num_slots, n, loop, args, dev)
                row = dict(
                    kind="decode",
                    capacity_gib=cap_gib,
                    n=n,
                    mode=mode,
                    **{f"{k}_us": v * 1e6 for k, v in t.items()},
                    cache_over_xla=t["cache"] / t["xla"],
                    dest_over_xla=t["dest"] / t["xla"],
                )
                rows.append(row)
                print(
                    DECODE.row(
                        f"{cap_gib:g}G",
                        n,
                        mode,
                        f"{row['cache_us']:.2f}",
                        f"{row['dest_us']:.2f}",
                        f"{row['xla_us']:.2f}",
                        f"{row['cache_over_xla']:.3f}",
                        f"{row['dest_over_xla']:.3f}",
                    )
                )

    print("\nprefill: bandwidth (read + write) as a share of the device copy bandwidth")
    print(PREFILL.header())
    cap_gib = args.capacities[0]
    num_slots = int(cap_gib * GiB) // (2 * tb)
    for n in args.prefill:
        if n > num_slots:
            print(f"(skipping n={n}: more than the {num_slots} slots of a {cap_gib:g} GiB cache)")
            continue
        moved = 2 * 2 * n * tb  # K and V, each read once and written once
        loop = max(1, min(args.loop, num_slots // n))
        t = per_write_each(num_slots, n, loop, args, dev)
        row = dict(
            kind="prefill",
            capacity_gib=cap_gib,
            n=n,
            copy_gbps=bw / 1e9,
            **{f"{k}_gbps": moved / v / 1e9 for k, v in t.items()},
            **{f"{k}_pct_of_copy": 100 * moved / v / bw for k, v in t.items()},
        )
        rows.append(row)
        print(
            PREFILL.row(
                f"{cap_gib:g}G",
                n,
                f"{row['cache_gbps']:.1f}",
                f"{row['cache_pct_of_copy']:.1f}%",
                f"{row['dest_gbps']:.1f}",
                f"{row['dest_pct_of_copy']:.1f}%",
                f"{row['xla_gbps']:.1f}",
                f"{row['xla_pct_of_copy']:.1f}%",
            )
        )

    print("\nkv_write stats:", jax_vmm.kv_write_stats())
    if args.json:
        write_json(
            args.json,
            dict(
                device=dev.device_kind,
                platform=dev.platform,
                copy_gbps=bw / 1e9,
                token_bytes=tb,
                rows=rows,
            ),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
