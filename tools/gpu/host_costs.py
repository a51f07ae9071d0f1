"""Where the main job's host time in ensure/release goes, measured on the device.

    python tools/gpu/host_costs.py [--batch 64] [--json OUT.json]

Part 1 times the arena calls the engine makes, one at a time, over a KV arena of the gpu
preset's geometry (8 layers, 8 x 128 bf16, 8192 tokens per sequence, `--batch` slots),
once with the device idle and once while a long XLA computation runs on it:
  commit      ensure(q, 1088): a typical prompt (2 chunks per layer buffer, 16 buffers);
  table one   ensure(q, n) within backed chunks: one entry of the device table;
  table all   ensure_all(...) growing every sequence within its chunks: the whole table;
  release     release(q), without waiting for the device.
Part 2 times the raw driver calls one commit is made of (cuda-python, 4 MiB pieces,
idle and busy): cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease.
Part 3 runs the main job (examples/decode.py's engine, gpu preset) under cProfile, only
its serving loop, and prints the functions with the most own time under ensure/release.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import jax_vmm  # noqa: E402

PROMPT = 1088


def busy_device(seconds: float) -> jax.Array:
    """Dispatches about `seconds` of matrix products and returns without waiting."""
    x = jnp.ones((8192, 8192), jnp.bfloat16)
    jax.block_until_ready(x)

    @jax.jit
    def spin(x, n):
        return jax.lax.fori_loop(0, n, lambda i, y: (y @ x) * 1e-4, x)

    jax.block_until_ready(spin(x, 2))
    t0 = time.perf_counter()
    jax.block_until_ready(spin(x, 20))
    per = (time.perf_counter() - t0) / 20
    return spin(x, max(1, int(seconds / per)))


def micro(batch: int, busy: bool) -> dict:
    kv = jax_vmm.kv_arena(
        num_layers=8,
        num_kv_heads=8,
        head_dim=128,
        max_tokens=8192,
        max_seqs=batch,
        dtype=jnp.bfloat16,
    )
    rows: dict[str, list[float]] = {"commit": [], "table one": [], "table all": [], "release": []}
    n = min(batch, 32)
    work = busy_device(1.5) if busy else None

    def timed(name, fn, *a, **k):
        t0 = time.perf_counter()
        fn(*a, **k)
        rows[name].append(time.perf_counter() - t0)

    for q in range(n):
        timed("commit", kv.ensure, PROMPT, q)
    for q in range(n):
        timed("table one", kv.ensure, PROMPT + 1, q)
    tokens = np.zeros(batch, np.int64)
    for step in range(n):
        tokens[:n] = PROMPT + 2 + step
        timed("table all", kv.ensure_all, tokens)
    for q in range(n):
        timed("release", kv.release, q)
    still_busy = work is not None and not work.is_ready()
    if work is not None:
        jax.block_until_ready(work)
    stats = kv.stats()
    kv.close()
    out = {
        name: {"median_us": 1e6 * statistics.median(v), "max_us": 1e6 * max(v), "calls": len(v)}
        for name, v in rows.items()
    }
    out["device_still_busy_at_end"] = still_busy
    out["commit_seconds_core"] = stats["commit_seconds"]
    out["commit_calls_core"] = stats["commit_calls"]
    return out


def raw_calls(busy: bool, piece: int = 4 << 20, n: int = 32) -> dict:
    """Median microseconds per raw VMM call, n pieces of `piece` bytes in a fresh range."""
    from _raw import RawCuda

    raw = RawCuda(0)
    cu, ok = raw.cu, raw._ok
    va = raw.reserve(n * piece, piece)
    work = busy_device(1.0) if busy else None
    t: dict[str, list[float]] = {k: [] for k in ("create", "map", "set_access", "unmap", "release")}
    handles = []
    for i in range(n):
        a = va + i * piece
        t0 = time.perf_counter()
        h = ok(cu.cuMemCreate(piece, raw.prop, 0))
        t1 = time.perf_counter()
        ok(cu.cuMemMap(a, piece, 0, h, 0))
        t2 = time.perf_counter()
        ok(cu.cuMemSetAccess(a, piece, raw.rw, 1))
        t3 = time.perf_counter()
        t["create"].append(t1 - t0)
        t["map"].append(t2 - t1)
        t["set_access"].append(t3 - t2)
        handles.append(h)
    for i, h in enumerate(handles):
        a = va + i * piece
        t0 = time.perf_counter()
        ok(cu.cuMemUnmap(a, piece))
        t1 = time.perf_counter()
        ok(cu.cuMemRelease(h))
        t2 = time.perf_counter()
        t["unmap"].append(t1 - t0)
        t["release"].append(t2 - t1)
    still_busy = work is not None and not work.is_ready()
    if work is not None:
        jax.block_until_ready(work)
    raw.free(va, n * piece)
    out = {k: 1e6 * statistics.median(v) for k, v in t.items()}
    out["device_still_busy_at_end"] = still_busy
    return out


def profile_main_job(batch: int) -> tuple[dict, str]:
    from examples import decode as D
    from examples import engine as E

    prof = cProfile.Profile()
    original = E.Generator.run

    def run(self, requests, **kw):
        if kw.get("pause") is not None:  # a second run (sleep/wake): not profiled
            return original(self, requests, **kw)
        self.precompile(requests)
        prof.enable()
        try:
            return original(self, requests, **kw)
        finally:
            prof.disable()

    E.Generator.run = run
    try:
        summary = D.main(
            [
                "--preset",
                "gpu",
                "--batch",
                str(batch),
                "--requests",
                str(3 * batch),
                "--no-progress",
                "--no-plot",
            ]
        )
    finally:
        E.Generator.run = original
    st = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in st.stats.items():
        rows.append((tt, ct, nc, f"{Path(file).name}:{line}({fn})"))
    rows.sort(reverse=True)
    lines = [f"{'own ms':>9} {'cum ms':>9} {'calls':>7}  function"]
    lines += [f"{1e3 * tt:9.1f} {1e3 * ct:9.1f} {nc:7d}  {name}" for tt, ct, nc, name in rows[:30]]
    keep = {
        k: summary[k]
        for k in (
            "tokens_per_second",
            "seconds",
            "host_memory_seconds",
            "host_memory_share",
            "commit_calls",
            "commits_ahead",
            "commit_seconds",
            "decommit_calls",
            "decommit_seconds",
        )
    }
    return keep, "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    result = {"device": str(jax.devices()[0].device_kind)}
    for busy in (False, True):
        r = micro(args.batch, busy)
        result["busy" if busy else "idle"] = r
        print(f"-- arena calls, device {'busy' if busy else 'idle'} (batch {args.batch})")
        for name in ("commit", "table one", "table all", "release"):
            v = r[name]
            print(f"  {name:10s} median {v['median_us']:8.1f} us  max {v['max_us']:8.1f} us")
        print(f"  device still busy at the end: {r['device_still_busy_at_end']}")
    for busy in (False, True):
        r = raw_calls(busy)
        result["raw_busy" if busy else "raw_idle"] = r
        print(f"-- raw VMM calls on 4 MiB pieces, device {'busy' if busy else 'idle'} (median us)")
        cells = [f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()]
        print("  " + "  ".join(cells))
    summary, table = profile_main_job(args.batch)
    result["main_job"] = summary
    result["profile"] = table
    print(f"-- main job, batch {args.batch}: {json.dumps(summary)}")
    print(table)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
