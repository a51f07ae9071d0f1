"""Where a decode-size kv_write's time goes next to XLA's donated .at[].set (GPU).

    python bench/kv_write_overhead.py [--json OUT.json]

The kernel probe times n-token writes inside a jitted fori_loop of 64; at n = 1 ours took
3.5x XLA's time per iteration. This separates the parts: per write, (a) in the fori_loop,
(b) one jitted call per write dispatched back to back (host-bound: the dispatch and our
FFI handler's host work each time), (c) 64 writes unrolled in one jitted call (device
time plus one dispatch), for XLA's, ours on donated plain arrays, and ours through the
cache API over a KV arena (fixed addresses). (d) dispatch: host time until the unrolled
jit returns, per write. `--sizes 4096,32768` gives prefill sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_vmm
from _common import median_time, ring_slots

H, D, LOOP = 8, 128, 64
SLOTS = int(os.environ.get("KV_WRITE_SLOTS", 1 << 18))  # 1 GiB of K and V at bf16


def _median_us(fn, inner=1) -> float:
    return median_time(fn, 7, inner) * 1e6


def _time_forms(update, cache, n: int, donate: bool) -> dict[str, float]:
    """us per write of ``update(cache, slots) -> cache`` in each form: a fori_loop of
    LOOP writes, LOOP unrolled in one jit, one jit per write."""

    def slots_at(start, i):
        return ring_slots(start, i, n, SLOTS)

    def loop(c, start):
        c = jax.lax.fori_loop(0, LOOP, lambda i, c: update(c, slots_at(start, i)), c)
        return c, start + LOOP * n

    def unrolled(c, start):
        for i in range(LOOP):
            c = update(c, slots_at(start, i))
        return c, start + LOOP * n

    def one(c, start):
        return update(c, slots_at(start, 0)), start + n

    state = [cache, jnp.int32(0)]
    out = {}
    for name, f, per in (("loop", loop, LOOP), ("unrolled", unrolled, LOOP), ("call", one, 1)):
        exe = jax.jit(f, donate_argnums=(0, 1) if donate else ())

        def step(exe=exe):
            state[:] = exe(*state)
            return state[1]

        # 8 back-to-back calls per sample of the 64-write forms: the next call's dispatch
        # overlaps the device work, so they measure the device unless the host is slower.
        out[name] = _median_us(step, inner=LOOP if per == 1 else 8) / per
        if name == "unrolled":
            out["dispatch"] = _dispatch_us(step) / per
        if name == "loop":
            out["loop_handler_calls_per_write"] = _handler_calls(step) / per
    return out


def _handler_calls(step) -> int:
    """kv_write handler calls during one call of `step`: 0 when the form replays as a
    command buffer (CUDA graph), one per write when the host runs every write's handler."""

    def calls() -> int:
        st = jax_vmm.kv_write_stats()
        return st["kv_write"]["calls"] + st["kv_cache_write"]["calls"]

    jax.block_until_ready(step())
    before = calls()
    jax.block_until_ready(step())
    return calls() - before


def _dispatch_us(step) -> float:
    """Host time until the jitted call returns (its thunks launched, not waited for): when
    it is near the whole time per write, the writes are bound by the host launching them."""
    samples = []
    for _ in range(7):
        jax.block_until_ready(step())
        t0 = time.perf_counter()
        out = step()
        samples.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
    return float(np.median(samples)) * 1e6


def measure(n: int) -> dict:
    rng = np.random.default_rng(n)
    nk = jnp.asarray(rng.standard_normal((n, H, D)), jnp.bfloat16)
    nv = jnp.asarray(rng.standard_normal((n, H, D)), jnp.bfloat16)

    def xla(c, slots):
        k, v = c
        return k.at[slots].set(nk, mode="drop"), v.at[slots].set(nv, mode="drop")

    def ours(c, slots):
        return jax_vmm.kv_write(*c, nk, nv, slots)

    def plain_cache():
        return tuple(jnp.zeros((SLOTS, H, D), jnp.bfloat16) for _ in range(2))

    times = {
        "ours": _time_forms(ours, plain_cache(), n, donate=True),
        "xla": _time_forms(xla, plain_cache(), n, donate=True),
    }
    # The cache API over a KV arena: the layer names fixed arena buffers, so every call
    # sees the same addresses (no donation, nothing for XLA to re-record).
    kv = jax_vmm.kv_arena(
        num_layers=1, num_kv_heads=H, head_dim=D, max_tokens=SLOTS, initial_tokens=SLOTS
    )
    try:
        times["arena"] = _time_forms(
            lambda layer, slots: jax_vmm.kv_write(layer, nk, nv, slots),
            kv.cache()[0],
            n,
            donate=False,
        )
        kv.check()
    finally:
        kv.close()
    row = {"n": n}
    for kind, forms in times.items():
        row.update(
            {
                f"{kind}_{name}" + ("" if name.endswith("_per_write") else "_us"): v
                for name, v in forms.items()
            }
        )
    for name in ("loop", "unrolled", "call", "dispatch"):
        row[f"{name}_ours_over_xla"] = row[f"ours_{name}_us"] / row[f"xla_{name}_us"]
        row[f"{name}_arena_over_xla"] = row[f"arena_{name}_us"] / row[f"xla_{name}_us"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--sizes", default="1,8,64", help="comma-separated token counts n (prefill: 4096,32768)"
    )
    args = ap.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    rows = [measure(int(n)) for n in args.sizes.split(",")]
    cols = ["loop", "unrolled", "call", "dispatch"]
    for c in cols:
        print(f"-- {c}: us per write (ratio over XLA's donated .at[].set)")
        print(f"{'n':>4} {'xla':>9} {'ours':>9} {'ratio':>6} {'arena':>9} {'ratio':>6}")
        for r in rows:
            print(
                f"{r['n']:>4} {r[f'xla_{c}_us']:9.2f} {r[f'ours_{c}_us']:9.2f} "
                f"{r[f'{c}_ours_over_xla']:6.2f} {r[f'arena_{c}_us']:9.2f} "
                f"{r[f'{c}_arena_over_xla']:6.2f}"
            )
    print("-- kv_write handler calls per write in the fori_loop (0: replayed as a CUDA graph)")
    for r in rows:
        print(
            f"{r['n']:>6}  ours {r['ours_loop_handler_calls_per_write']:.2f}  arena "
            f"{r['arena_loop_handler_calls_per_write']:.2f}"
        )
    print(
        "loop = fori_loop of 64; unrolled = 64 in one jit; call = one jit each; dispatch = "
        "host time until the unrolled jit returns, per write; ours = "
        "kv_write on donated plain arrays; arena = kv_write(layer, ...) of a KV arena"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
