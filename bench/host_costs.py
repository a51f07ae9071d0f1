"""Where the main job's host time in ensure/release goes, measured on the device.

    python bench/host_costs.py [--batch 64] [--json OUT.json]

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
Part 4 times what a large commit adds to the raw calls (cuda-python): one run over the
read-only zero mapping the CUDA driver keeps under unbacked bytes (`--swaps`, default 8
pieces of 32 MiB; several cases show whether a call costs per mapping or per byte):
unmapping the pieces one call each and in one call spanning them (does this driver accept
it?), then cuMemCreate + cuMemMap + cuMemSetAccess of the run. Then the arena growing
16 -> 20 GiB, its zero pieces as large as JAX_VMM_ZERO_PIECE_MAX_BYTES allows.
(bench/dispatch_costs.py splits the main job's dispatching-thread time further.)
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_vmm

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


def zero_swap(piece: int = 32 << 20, pieces: int = 8, repeats: int = 5) -> dict:
    """Median microseconds of the calls that replace a run's zero pieces by real memory."""
    from _raw import RawCuda

    raw = RawCuda(0)
    cu, ok = raw.cu, raw._ok
    span = piece * pieces
    read = [raw._access(0, cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ)]
    zero = ok(cu.cuMemCreate(piece, raw.prop, 0))
    va = raw.reserve(span, piece)
    t: dict[str, list[float]] = {
        k: []
        for k in (
            "map_zero_pieces",
            "set_read_hull",
            "unmap_each",
            "unmap_span",
            "create_run",
            "map_run",
            "set_access_run",
            "unmap_run",
            "release_run",
        )
    }

    def lap(name: str, fn) -> object:
        t0 = time.perf_counter()
        out = fn()
        t[name].append(time.perf_counter() - t0)
        return out

    def map_zeros() -> None:
        lap(
            "map_zero_pieces",
            lambda: [ok(cu.cuMemMap(va + i * piece, piece, 0, zero, 0)) for i in range(pieces)],
        )
        lap("set_read_hull", lambda: ok(cu.cuMemSetAccess(va, span, read, 1)))

    span_ok = None
    for _ in range(repeats):
        map_zeros()
        lap("unmap_each", lambda: [ok(cu.cuMemUnmap(va + i * piece, piece)) for i in range(pieces)])
        map_zeros()
        t0 = time.perf_counter()
        (rc,) = cu.cuMemUnmap(va, span)
        span_ok = rc == cu.CUresult.CUDA_SUCCESS
        if span_ok:
            t["unmap_span"].append(time.perf_counter() - t0)
        else:  # refused: the pieces are still mapped
            [ok(cu.cuMemUnmap(va + i * piece, piece)) for i in range(pieces)]
        h = lap("create_run", lambda: ok(cu.cuMemCreate(span, raw.prop, 0)))
        lap("map_run", lambda: ok(cu.cuMemMap(va, span, 0, h, 0)))
        lap("set_access_run", lambda: ok(cu.cuMemSetAccess(va, span, raw.rw, 1)))
        lap("unmap_run", lambda: ok(cu.cuMemUnmap(va, span)))
        lap("release_run", lambda: ok(cu.cuMemRelease(h)))
    raw.free(va, span)
    ok(cu.cuMemRelease(zero))
    out = {k: 1e6 * statistics.median(v) for k, v in t.items() if v}
    out["span_unmap_accepted"] = span_ok
    out["piece_bytes"], out["pieces"] = piece, pieces
    return out


def arena_growth(repeats: int = 5) -> dict:
    """bench/growth.py's jax_vmm default (16 -> 20 GiB, 8 layers x K/V, one sequence):
    median wall ms of the growing ensure, and the part of it inside the core's commit
    (stats' commit_seconds), the rest being Python and the device-table update."""
    t_from, t_to = 524288, 655360
    kv = jax_vmm.kv_arena(
        num_layers=8, num_kv_heads=8, head_dim=128, max_tokens=t_to, dtype=jnp.bfloat16
    )
    kv.ensure(t_from)
    wall, core = [], []
    for i in range(repeats):
        if i:
            kv.shrink(t_from, wait=True)
        c0 = kv.stats()["commit_seconds"]
        t0 = time.perf_counter()
        kv.ensure(t_to)
        wall.append(time.perf_counter() - t0)
        core.append(kv.stats()["commit_seconds"] - c0)
    stats = kv.stats()
    kv.close()
    return {
        "wall_ms": 1e3 * statistics.median(wall),
        "core_commit_ms": 1e3 * statistics.median(core),
        "handles_created": stats["handles_created"],
        "commit_drains": stats["commit_drains"],
        "set_access_calls": stats["set_access_calls"],
    }


def profile_main_job(batch: int) -> tuple[dict, str]:
    from jax_vmm.serving import engine as E
    from jax_vmm.serving.cli import decode as D

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


def _cells(r: dict, digits: int = 1) -> str:
    """One indented line of `name value` cells, floats to `digits` decimals."""
    return "  " + "  ".join(
        f"{k} {v:.{digits}f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--json", type=Path)
    p.add_argument("--parts", default="1234", help="which parts to run (digits 1-4; default all)")
    p.add_argument(
        "--swaps",
        default="32x8",
        help="part 4's zero-piece cases, MiBxCOUNT, comma-separated (default: 8 pieces of 32 MiB)",
    )
    args = p.parse_args()
    result = {
        "device": str(jax.devices()[0].device_kind),
        "zero_piece_max_bytes_env": os.environ.get("JAX_VMM_ZERO_PIECE_MAX_BYTES"),
    }
    if "4" in args.parts:
        result["zero_swap"] = []
        for spec in args.swaps.split(","):
            piece_mib, pieces = (int(x) for x in spec.split("x"))
            r = zero_swap(piece_mib << 20, pieces)
            result["zero_swap"].append(r)
            run_mib = piece_mib * pieces
            print(f"-- a {run_mib} MiB run over {pieces} zero pieces of {piece_mib} MiB (us)")
            print(_cells(r))
        r = arena_growth()
        result["arena_growth"] = r
        print("-- the arena growing 16 -> 20 GiB (bench/growth.py's default), median of 5")
        print(_cells(r, digits=2))
    for busy in (False, True) if "1" in args.parts else ():
        r = micro(args.batch, busy)
        result["busy" if busy else "idle"] = r
        print(f"-- arena calls, device {'busy' if busy else 'idle'} (batch {args.batch})")
        for name in ("commit", "table one", "table all", "release"):
            v = r[name]
            print(f"  {name:10s} median {v['median_us']:8.1f} us  max {v['max_us']:8.1f} us")
        print(f"  device still busy at the end: {r['device_still_busy_at_end']}")
    for busy in (False, True) if "2" in args.parts else ():
        r = raw_calls(busy)
        result["raw_busy" if busy else "raw_idle"] = r
        print(f"-- raw VMM calls on 4 MiB pieces, device {'busy' if busy else 'idle'} (median us)")
        print(_cells(r))
    if "3" in args.parts:
        summary, table = profile_main_job(args.batch)
        result["main_job"] = summary
        result["profile"] = table
        print(f"-- main job, batch {args.batch}: {json.dumps(summary)}")
        print(table)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
