"""Step time against cache capacity: the same jitted decode step over a small and a
large KV cache, in one process, as a ratio (issue #10: no copy of the cache per step).

Every step writes one token per sequence into every layer (``jax_vmm.kv_write(layer,
...)``) and attends over the layer (``jax_vmm.decode_attention(q, layer, lengths)``);
the live lengths are the same at both capacities, only ``max_tokens`` (the capacity)
differs. Cases:

  arena       ``kv.cache()``: arena layers (the cache pytree carries one token per
              layer; the arena is written in place). Goal: ratio 1.0.
  arrays      ``KVCache.from_arrays`` of ``jnp.zeros``, donated: XLA updates it in place.
  arrays-kept the same, not donated: XLA copies the cache into the step's output, every
              step (what a cache pytree whose leaves are the arrays costs when the user
              does not donate, and on the CPU for arena views even when donated).

Each case is timed as single calls (``--steps`` calls of the jitted step, dispatch
included) and as one ``fori_loop`` of ``--steps`` steps per call (device time). Reported:
ms per step (best of ``--repeats`` passes), and large / small.

  python bench/capacity.py                     # CPU: 64 MiB vs 2 GiB; GPU: 1 GiB vs 32 GiB
  python bench/capacity.py --json out/capacity.json
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the arena needs the GPU too

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_vmm  # noqa: E402
from _common import (  # noqa: E402
    GiB,
    MiB,
    Table,
    command_line,
    fmt_size,
    parse_list,
    parse_size,
    write_json,  # noqa: E402
)
from _stack import if_it_fits  # noqa: E402

CASES = ("arena", "arrays", "arrays-kept")
TABLE = Table(
    ("case", 12, "<"),
    ("mode", 5, "<"),
    ("small ms", 10),
    ("large ms", 10),
    ("large/small", 12),
)


class Geometry:
    def __init__(self, args: argparse.Namespace, capacity: int):
        self.layers, self.batch = args.layers, args.batch
        self.kv_heads, self.q_heads, self.head_dim = args.kv_heads, args.q_heads, args.head_dim
        self.dtype = jnp.dtype(args.dtype)
        token = 2 * self.layers * self.kv_heads * self.head_dim * self.dtype.itemsize
        self.max_tokens = capacity // (token * self.batch)
        self.capacity = self.max_tokens * token * self.batch


def make_cache(case: str, g: Geometry, device: jax.Device, live: int):
    """(cache, kv arena or None) for `case`, with `live` tokens ensured per sequence."""
    if case == "arena":
        kv = jax_vmm.kv_arena(
            num_layers=g.layers,
            num_kv_heads=g.kv_heads,
            head_dim=g.head_dim,
            max_tokens=g.max_tokens,
            max_seqs=g.batch,
            dtype=g.dtype,
            device=device,
        )
        for seq in range(g.batch):
            kv.ensure(live, seq)
        return kv.cache(), kv
    shape = (g.batch, g.max_tokens, g.kv_heads, g.head_dim)
    with jax.default_device(device):
        zeros = jax.jit(lambda: jnp.zeros(shape, g.dtype))
        ks = [zeros() for _ in range(g.layers)]
        vs = [zeros() for _ in range(g.layers)]
    return jax_vmm.KVCache.from_arrays(ks, vs), None


def decode_step(cache, q, new_k, new_v, pos):
    """One token per sequence at `pos` in every layer, then attention over [0, pos]."""
    batch, max_tokens = cache[0].shape[:2]
    slots = (jnp.arange(batch, dtype=jnp.int32) * max_tokens + pos).astype(jnp.int32)
    lengths = jnp.full((batch,), pos + 1, jnp.int32)
    out = jnp.zeros(q.shape[1:], q.dtype)
    for layer in range(len(cache)):
        written = jax_vmm.kv_write(cache[layer], new_k[layer], new_v[layer], slots)
        out = out + jax_vmm.decode_attention(q[layer], written, lengths)
        cache = cache.replace(layer, written)
    return cache, out


def time_case(case: str, g: Geometry, args: argparse.Namespace, device: jax.Device) -> dict:
    """ms per step, single calls and in a fori_loop."""
    start = args.live
    cache, kv = make_cache(case, g, device, start + args.steps * (args.repeats + 2) + 1)
    rng = np.random.default_rng(0)
    put = lambda shape: jax.device_put(  # noqa: E731
        jnp.asarray(rng.standard_normal(shape), g.dtype), device
    )
    q = put((g.layers, g.batch, g.q_heads, g.head_dim))
    nk = put((g.layers, g.batch, g.kv_heads, g.head_dim))
    nv = put((g.layers, g.batch, g.kv_heads, g.head_dim))
    donate = () if case == "arrays-kept" else (0,)
    step = jax.jit(decode_step, donate_argnums=donate)

    def loop(cache, q, nk, nv, pos):
        def body(i, carry):
            cache, acc = carry
            cache, out = decode_step(cache, q, nk, nv, pos + i)
            return cache, acc + out

        return jax.lax.fori_loop(0, args.steps, body, (cache, jnp.zeros(q.shape[1:], q.dtype)))

    looped = jax.jit(loop, donate_argnums=donate)
    pos = start
    result = {}
    try:
        for mode in ("call", "loop"):
            best = float("inf")
            for rep in range(args.repeats + 1):  # the first pass compiles
                t0 = time.perf_counter()
                if mode == "call":
                    for _ in range(args.steps):
                        cache, out = step(cache, q, nk, nv, jnp.int32(pos))
                        pos += 1
                else:
                    cache, out = looped(cache, q, nk, nv, jnp.int32(pos))
                    pos += args.steps
                jax.block_until_ready((cache, out))
                if rep:
                    best = min(best, (time.perf_counter() - t0) / args.steps)
            result[mode] = 1e3 * best
            pos = start  # the next mode rewrites the same positions
        if kv is not None:
            kv.check(cache, out)
            result["backed_bytes"] = kv.arena.backed_bytes
    finally:
        del cache
        if kv is not None:
            kv.close()
        gc.collect()
    return result


def main(argv: list[str] | None = None) -> dict:
    device = jax.devices()[0]
    gpu = device.platform != "cpu"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", type=parse_size, default="1G" if gpu else "64M")
    p.add_argument("--large", type=parse_size, default="32G" if gpu else "2G")
    p.add_argument("--layers", type=int, default=8 if gpu else 2)
    p.add_argument("--batch", type=int, default=32 if gpu else 4)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--live", type=int, default=512 if gpu else 256, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cases", type=parse_list(str), default=",".join(CASES))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    small, large = Geometry(args, args.small), Geometry(args, args.large)
    print(
        f"device {device.device_kind} ({device.platform}) | {args.layers} layers, batch "
        f"{args.batch}, {args.q_heads}/{args.kv_heads} heads x {args.head_dim} {args.dtype} | "
        f"~{args.live} live tokens per sequence | capacity {fmt_size(small.capacity)} "
        f"(max_tokens {small.max_tokens}) vs {fmt_size(large.capacity)} "
        f"(max_tokens {large.max_tokens})"
    )
    print(TABLE.header())
    rows = []
    for case in args.cases:
        got = if_it_fits(
            lambda c=case: (time_case(c, small, args, device), time_case(c, large, args, device))
        )
        if isinstance(got, str):
            rows.append(dict(case=case, skipped=got))
            print(f"{case}: {got}")
            gc.collect()
            continue
        a, b = got
        for mode in ("call", "loop"):
            row = dict(
                case=case, mode=mode, small_ms=a[mode], large_ms=b[mode], ratio=b[mode] / a[mode]
            )
            rows.append(row)
            print(TABLE.row(case, mode, f"{a[mode]:.3f}", f"{b[mode]:.3f}", f"{row['ratio']:.2f}"))
        if "backed_bytes" in b:
            print(
                f"  ({case}: backed {b['backed_bytes'] / MiB:.1f} MiB of the large cache's "
                f"{large.capacity / GiB:.1f} GiB)"
            )
    out = dict(
        device=device.device_kind,
        platform=device.platform,
        jax=jax.__version__,
        small_bytes=small.capacity,
        large_bytes=large.capacity,
        args=vars(args),
        rows=rows,
        command=command_line(__file__, argv),
    )
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
