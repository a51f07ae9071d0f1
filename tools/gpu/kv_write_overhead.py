"""Where a decode-size kv_write's time goes next to XLA's donated .at[].set (GPU).

    python tools/gpu/kv_write_overhead.py [--json OUT.json]

The kernel probe times n-token writes inside a jitted fori_loop of 64; at n = 1 ours took
3.5x XLA's time per iteration. This separates the parts: per write, (a) in the fori_loop,
(b) one jitted call per write dispatched back to back (host-bound: the dispatch and our
FFI handler's host work each time), (c) 64 writes unrolled in one jitted call (device
time plus one dispatch), for XLA's, ours on donated plain arrays, and ours through the
cache API over a KV arena (fixed addresses).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_vmm

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # bench/_common.py
from _common import median_time  # noqa: E402

H, D, LOOP = 8, 128, 64
SLOTS = int(os.environ.get("KV_WRITE_SLOTS", 1 << 18))  # 1 GiB of K and V at bf16


def _median_us(fn, inner=1) -> float:
    return median_time(fn, 7, inner) * 1e6


def measure(n: int) -> dict:
    rng = np.random.default_rng(n)
    nk = jnp.asarray(rng.standard_normal((n, H, D)), jnp.bfloat16)
    nv = jnp.asarray(rng.standard_normal((n, H, D)), jnp.bfloat16)

    def update(kind, k, v, slots):
        if kind == "xla":
            return k.at[slots].set(nk, mode="drop"), v.at[slots].set(nv, mode="drop")
        return jax_vmm.kv_write(k, v, nk, nv, slots)

    def slots_at(start, i):
        return ((start + i * n + jnp.arange(n, dtype=jnp.int32)) % SLOTS).astype(jnp.int32)

    row = {"n": n}
    for kind in ("ours", "xla"):
        state = [jnp.zeros((SLOTS, H, D), jnp.bfloat16) for _ in range(2)] + [jnp.int32(0)]

        def loop(k, v, start, kind=kind):
            k, v = jax.lax.fori_loop(
                0, LOOP, lambda i, c: update(kind, *c, slots_at(start, i)), (k, v)
            )
            return k, v, start + LOOP * n

        def unrolled(k, v, start, kind=kind):
            for i in range(LOOP):
                k, v = update(kind, k, v, slots_at(start, i))
            return k, v, start + LOOP * n

        def one(k, v, start, kind=kind):
            k, v = update(kind, k, v, slots_at(start, 0))
            return k, v, start + n

        for name, f, per in (("loop", loop, LOOP), ("unrolled", unrolled, LOOP), ("call", one, 1)):
            exe = jax.jit(f, donate_argnums=(0, 1, 2))

            def step(exe=exe):
                state[:] = exe(*state)
                return state[2]

            inner = LOOP if per == 1 else 1
            row[f"{kind}_{name}_us"] = _median_us(step, inner=inner) / per
    # The cache API over a KV arena: the layer names fixed arena buffers, so every call
    # sees the same addresses (no donation, nothing for XLA to re-record).
    kv = jax_vmm.kv_arena(
        num_layers=1, num_kv_heads=H, head_dim=D, max_tokens=SLOTS, initial_tokens=SLOTS
    )
    try:
        carry = [kv.cache()[0], jnp.int32(0)]

        def arena_update(layer, slots):
            return jax_vmm.kv_write(layer, nk, nv, slots)

        def a_loop(layer, start):
            layer = jax.lax.fori_loop(
                0, LOOP, lambda i, c: arena_update(c, slots_at(start, i)), layer
            )
            return layer, start + LOOP * n

        def a_unrolled(layer, start):
            for i in range(LOOP):
                layer = arena_update(layer, slots_at(start, i))
            return layer, start + LOOP * n

        def a_one(layer, start):
            return arena_update(layer, slots_at(start, 0)), start + n

        for name, f, per in (
            ("loop", a_loop, LOOP),
            ("unrolled", a_unrolled, LOOP),
            ("call", a_one, 1),
        ):
            exe = jax.jit(f)

            def step(exe=exe):
                carry[:] = exe(*carry)
                return carry[1]

            row[f"arena_{name}_us"] = _median_us(step, inner=LOOP if per == 1 else 1) / per
        kv.check()
    finally:
        kv.close()
    for name in ("loop", "unrolled", "call"):
        row[f"{name}_ours_over_xla"] = row[f"ours_{name}_us"] / row[f"xla_{name}_us"]
        row[f"{name}_arena_over_xla"] = row[f"arena_{name}_us"] / row[f"xla_{name}_us"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    rows = [measure(n) for n in (1, 8, 64)]
    cols = ["loop", "unrolled", "call"]
    for c in cols:
        print(f"-- {c}: us per write (ratio over XLA's donated .at[].set)")
        print(f"{'n':>4} {'xla':>9} {'ours':>9} {'ratio':>6} {'arena':>9} {'ratio':>6}")
        for r in rows:
            print(
                f"{r['n']:>4} {r[f'xla_{c}_us']:9.2f} {r[f'ours_{c}_us']:9.2f} "
                f"{r[f'{c}_ours_over_xla']:6.2f} {r[f'arena_{c}_us']:9.2f} "
                f"{r[f'{c}_arena_over_xla']:6.2f}"
            )
    print(
        "loop = fori_loop of 64; unrolled = 64 in one jit; call = one jit each; ours = "
        "kv_write on donated plain arrays; arena = kv_write(layer, ...) of a KV arena"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
