"""Commit and release costs of a jax_vmm arena next to the raw driver, and the host time the
decode path spends in ensure/release.

1. Throughput, per handle size (the largest physical allocation of a commit: the arena's
   handle_bytes; the raw driver's allocation size) and range size, in one process:
     arena     Buffer.commit() of the whole range, zero_fill=False (the KV default)
     +fill     the same with zero_fill=True (the Arena default: fresh memory reads zeros)
     raw       the bare driver sequence for the same bytes and handle size (GPU:
               cuMemCreate + cuMemMap per handle, one cuMemSetAccess per run; release:
               cuMemUnmap + cuMemRelease per handle; CPU: the host driver's syscalls)
   release  = Buffer.decommit(wait=True): until the memory is back with the driver
   call     = Buffer.decommit() as the decode path calls it: returns at once, the memory
              goes back once the device is done (the reclaimer thread)
   ratio = arena / raw (goal: commit <= 1.25x at the same handle size).
2. The decode path: a decode loop of B sequences (8 layers, 8x128 bf16) whose steps are a
   device kernel of --step-ms; each step the host calls kv.ensure_all() for the next
   position, and sequences that reach their length are released and start again. Host
   time in ensure/release as a share of the loop's wall time (goal <= 1% at B=64), for:
   commit ahead (the KV default, no raw view), no commit ahead, and raw views held
   (kv.k[l]: every commit waits for the device).
3. Arena creation for a 64 GiB reservation against the raw reserve.

  python bench/commit.py                    # GPU if JAX has one, else CPU
  python bench/commit.py --device cpu --sizes 2M,64M --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jax_vmm
from _common import (
    GiB,
    Table,
    fmt,
    fmt_size,
    median_time,
    parse_list,
    parse_size,
    pick_device,
    ratio,
    write_json,
)
from _raw import RawCuda, RawHost, raw_for


def time_pair(
    commit: Callable[[], None], decommit: Callable[[], None], repeats: int
) -> tuple[float, float]:
    """Median seconds of commit and of decommit, alternating them (warm-up first)."""
    commit()
    decommit()
    tc, td = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        commit()
        t1 = time.perf_counter()
        decommit()
        t2 = time.perf_counter()
        tc.append(t1 - t0)
        td.append(t2 - t1)
    return statistics.median(tc), statistics.median(td)


# -- 1. throughput ------------------------------------------------------------------------


def arena_times(device, size: int, handle: int, zero_fill: bool, repeats: int) -> dict:
    arena = jax_vmm.Arena(
        size + 2 * handle, device=device, handle_bytes=handle, zero_fill=zero_fill
    )
    buf = arena.allocate((size,), jnp.uint8)
    c, d = time_pair(buf.commit, lambda: buf.decommit(wait=True), repeats)
    calls = []
    for _ in range(repeats):  # the deferred release as the decode path calls it
        buf.commit()
        t0 = time.perf_counter()
        buf.decommit()
        calls.append(time.perf_counter() - t0)
        arena.reclaim()
    arena.close()
    return {"commit_s": c, "release_s": d, "release_call_s": statistics.median(calls)}


def raw_times(raw, size: int, handle: int, repeats: int) -> dict | None:
    if raw is None:
        return None
    if isinstance(raw, RawCuda):
        va = raw.reserve(size, min(handle, 1 << 30) & -min(handle, 1 << 30))
        c, d, nc, nd = raw.runs_ops([(va, size)], handle)
        out = time_pair(c, d, repeats)
        raw.free(va, size)
    else:
        va = raw.reserve(size)
        c, d, nc, nd = raw.runs_ops([(va, size)], handle, base=va)
        out = time_pair(c, d, repeats)
        raw.unreserve(va, size)
    return {"commit_s": out[0], "release_s": out[1], "calls": (nc, nd)}


def gibs(n: int, s: float | None) -> str:
    return fmt(n / GiB / s if s else None, "{:.1f}", "-")


THROUGHPUT = Table(
    ("handle", 8),
    ("range", 8),
    ("|", 1),
    ("commit GiB/s: arena", 19),
    ("+fill", 7),
    ("raw", 7),
    ("arena/raw", 9),
    ("|", 1),
    ("release GiB/s: arena", 20),
    ("raw", 7),
    ("arena/raw", 9),
    ("|", 1),
    ("call us", 8),
)


def bench_throughput(device, sizes, handles, repeats, raw) -> list[dict]:
    print(THROUGHPUT.header())
    rows = []
    chunk = jax_vmm.Arena(1, device=device).chunk_bytes
    for handle in handles:
        handle = max(handle, chunk)
        for size in sizes:
            if size < handle or size % handle or size % chunk:
                continue
            a = arena_times(device, size, handle, False, repeats)
            f = arena_times(device, size, handle, True, repeats)
            r = raw_times(raw, size, handle, repeats)
            row = dict(handle=handle, size=size, arena=a, fill=f, raw=r)
            rows.append(row)
            rc, rd = (r["commit_s"], r["release_s"]) if r else (None, None)
            print(
                THROUGHPUT.row(
                    fmt_size(handle),
                    fmt_size(size),
                    "|",
                    gibs(size, a["commit_s"]),
                    gibs(size, f["commit_s"]),
                    gibs(size, rc),
                    fmt(ratio(a["commit_s"], rc), "{:.2f}x", "-"),
                    "|",
                    gibs(size, a["release_s"]),
                    gibs(size, rd),
                    fmt(ratio(a["release_s"], rd), "{:.2f}x", "-"),
                    "|",
                    f"{a['release_call_s'] * 1e6:.0f}",
                ),
                flush=True,
            )
    return rows


# -- 2. the decode path ----------------------------------------------------------------------


def make_step(device, step_ms: float):
    """A jitted device step of about step_ms (a chain of matmuls on one matrix)."""
    n = 2048 if device.platform != "cpu" else 256
    x = jax.device_put(jnp.eye(n, dtype=jnp.float32) * 0.5, device)

    def build(k):
        @jax.jit
        def step(a):
            for _ in range(k):
                a = jnp.tanh(a @ a)
            return a

        return step

    step = build(1)
    t1 = median_time(lambda: step(x), 5)
    k = max(1, int(round(step_ms / 1e3 / max(t1, 1e-6))))
    step = build(k)
    return step, x, median_time(lambda: step(x), 5)


def decode_loop(device, batch: int, steps: int, step_ms: float, mode: str, seed: int = 0) -> dict:
    L, H, D = 8, 8, 128
    chunk = jax_vmm.Arena(1, device=device).chunk_bytes
    tpc = chunk // (H * D * 2)  # tokens per chunk of one layer's K
    T = 4 * tpc
    kw = {} if mode == "ahead" else {"commit_ahead_tokens": 0}
    kv = jax_vmm.kv_arena(
        num_layers=L,
        num_kv_heads=H,
        head_dim=D,
        max_tokens=T,
        max_seqs=batch,
        dtype=jnp.bfloat16,
        device=device,
        **kw,
    )
    held = [kv.k[l] for l in range(L)] if mode == "views" else []
    step, x, step_s = make_step(device, step_ms)
    rng = np.random.default_rng(seed)
    pos = rng.integers(0, 2 * tpc, size=batch)  # staggered: crossings spread over the steps
    length = rng.integers(tpc, T, size=batch)
    kv.ensure_all(np.minimum(pos + 1, T))
    kv._ahead.wait_idle()
    host = {"ensure": 0.0, "release": 0.0}
    calls = {"ensure": 0, "release": 0}
    out = step(x)
    jax.block_until_ready(out)
    t_start = time.perf_counter()
    for _ in range(steps):
        out = step(out)  # the device works on this step while the host prepares the next
        pos += 1
        done = np.flatnonzero(pos >= length)
        if done.size:
            t0 = time.perf_counter()
            for q in done:
                kv.release(int(q), reuse=True)  # the slot takes the next sequence
            host["release"] += time.perf_counter() - t0
            calls["release"] += int(done.size)
            pos[done] = 0
            length[done] = rng.integers(tpc, T, size=done.size)
        t0 = time.perf_counter()
        kv.ensure_all(pos + 1)
        host["ensure"] += time.perf_counter() - t0
        calls["ensure"] += 1
        jax.block_until_ready(out)  # the token goes back to the host (sampling)
    wall = time.perf_counter() - t_start
    kv._ahead.wait_idle()
    s = kv.stats()
    del held
    kv.close()
    share = (host["ensure"] + host["release"]) / wall
    return dict(
        mode=mode,
        batch=batch,
        steps=steps,
        step_device_s=step_s,
        wall_s=wall,
        ensure_s=host["ensure"],
        release_s=host["release"],
        releases=calls["release"],
        share=share,
        commit_calls=s["commit_calls"],
        commits_ahead=s["commits_ahead"],
        commit_drains=s["commit_drains"],
        deferred_releases=s["deferred_releases"],
    )


DECODE = Table(
    ("mode", 26, "<"),
    ("step ms", 8),
    ("loop ms/step", 12),
    ("ensure us/step", 14),
    ("release us/call", 15),
    ("host share", 10),
    ("commits", 8),
    ("ahead", 6),
    ("drains", 7),
)

MODES = {
    "ahead": "commit ahead (KV default)",
    "no_ahead": "no commit ahead",
    "views": "raw views held",
}


def bench_decode(device, batch, steps, step_ms) -> list[dict]:
    print(
        f"\ndecode loop: B={batch}, {steps} steps, 8 layers x 8x128 bf16, a step = a device "
        f"kernel of ~{step_ms} ms + ensure_all + releases (goal: host share <= 1%)"
    )
    print(DECODE.header())
    rows = []
    for mode in MODES:
        r = decode_loop(device, batch, steps, step_ms, mode)
        rows.append(r)
        print(
            DECODE.row(
                MODES[mode],
                f"{r['step_device_s'] * 1e3:.2f}",
                f"{r['wall_s'] / steps * 1e3:.2f}",
                f"{r['ensure_s'] / steps * 1e6:.1f}",
                f"{r['release_s'] / max(1, r['releases']) * 1e6:.0f}",
                f"{100 * r['share']:.2f}%",
                r["commit_calls"],
                r["commits_ahead"],
                r["commit_drains"],
            ),
            flush=True,
        )
    return rows


# -- 3. creation --------------------------------------------------------------------------------


def bench_creation(device, reserve: int, repeats: int, raw) -> dict:
    holder: list = []

    def create():
        holder.append(jax_vmm.Arena(reserve, device=device))

    def destroy():
        holder.pop().close()  # close, then the last reference goes: unreserve

    t_create, t_destroy = time_pair(create, destroy, repeats)
    row = dict(reserve=reserve, arena_create_s=t_create, arena_destroy_s=t_destroy)
    if isinstance(raw, RawCuda):
        row["raw_reserve_s"] = median_time(
            lambda: raw.free(raw.reserve(reserve, 0), reserve), repeats, warmups=1
        )
    elif isinstance(raw, RawHost):
        row["raw_reserve_s"] = median_time(
            lambda: raw.unreserve(raw.reserve(reserve), reserve), repeats, warmups=1
        )
    ms = lambda k: f"{row[k] * 1e3:.2f} ms" if k in row else "-"  # noqa: E731
    print(
        f"\n{fmt_size(reserve)} arena: create {ms('arena_create_s')}, close+destroy "
        f"{ms('arena_destroy_s')} | raw reserve {ms('raw_reserve_s')}",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    p.add_argument(
        "--sizes", type=parse_list(parse_size), default=None, help="range sizes, e.g. 2M,64M,1G,4G"
    )
    p.add_argument(
        "--handles",
        type=parse_list(parse_size),
        default=None,
        help="handle sizes (0 = one chunk); default 0,64M,1G on a GPU, 0,1M on the CPU",
    )
    p.add_argument("--reserve", default="64G", help="reservation for the creation benchmark")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="decode-loop steps (default 2048 on a GPU, 64 on the CPU)",
    )
    p.add_argument(
        "--step-ms",
        type=float,
        default=2.5,
        help="device time of a decode step (2.53 ms: B64 T4k on an H200)",
    )
    p.add_argument("--sections", default="throughput,decode,creation")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    device = pick_device(args.device)
    on_gpu = device.platform != "cpu"
    sizes = args.sizes or parse_list(parse_size)("2M,64M,1G,4G" if on_gpu else "2M,64M,256M")
    handles = args.handles or parse_list(parse_size)("0,64M,1G" if on_gpu else "0,1M")
    steps = args.steps or (2048 if on_gpu else 64)
    raw = raw_for(device)
    print(
        f"jax_vmm commit benchmark on {device} ({device.platform}); jax {jax.__version__}; "
        f"median of {args.repeats}; raw = {type(raw).__name__ if raw else 'none (no cuda-python)'}"
    )
    for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        print(f"  {k}={os.environ.get(k, '<unset>')}")
    if raw is not None:
        print(
            f"  raw per-call Python overhead ~{raw.call_overhead() * 1e6:.2f} us (not subtracted)"
        )
    sections = set(args.sections.split(","))
    out = dict(device=str(device), platform=device.platform, jax=jax.__version__)
    if "throughput" in sections:
        out["throughput"] = bench_throughput(device, sizes, handles, args.repeats, raw)
    if "decode" in sections:
        out["decode"] = bench_decode(device, args.batch, steps, args.step_ms)
    if "creation" in sections:
        out["creation"] = bench_creation(device, parse_size(args.reserve), args.repeats, raw)
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
