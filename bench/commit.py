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
4. (GPU, cuda-python) "seed": the KV cache of issue 31's geometry (32 layers x K,V = 64
   buffers, 8 KV heads x 128, bf16, 1M tokens reserved) against the seed-style baseline
   (bench/_seed.py: one cuMemCreate + cuMemMap + cuMemSetAccess per extension of a
   buffer), alternating in one process (in the grow, fill and step rows each repeat
   starts with another contender and ends with a pause after the releases): grow 16 ->
   20 GiB, fill 0 -> 16 GiB, ensure in steps of 4096 and of 256 tokens (empty -> 64k,
   total), a new arena (first, later ones' median), a 20 GiB cache from nothing (and one
   20 GiB allocation, what torch_memory_saver does), and the physical memory a fresh
   arena takes (cuMemGetInfo; measured first, before anything made the device's zero
   pieces). jax_vmm runs with commit_ahead_tokens=0: every commit is inside the timed
   call, as the seed's is. The grow and fill rows add the seed's calls over buffers laid
   out as the arena's (back to back in one reservation): what the driver charges for that
   layout, apart from jax_vmm. The fill row also runs from the seed's own start (page 0 of
   every buffer backed, as its arena is made, on both sides): the fill from empty maps
   each buffer's first granule too, which the seed did when it was made.
   ``--kv-layout interleaved`` runs jax_vmm's side with every layer in one buffer (the
   seed keeps 64): a growth is then one range instead of 64.

  python bench/commit.py                    # GPU if JAX has one, else CPU
  python bench/commit.py --sections seed    # issue 31's table only (GPU, ~1 minute)
  python bench/commit.py --device cpu --sizes 2M,64M --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

# The seed section reads cuMemGetInfo: XLA must not take the device's memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_vmm  # noqa: E402
from _common import (  # noqa: E402
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
from _raw import RawCuda, RawHost, raw_for  # noqa: E402
from _seed import OneAllocation, SeedKV  # noqa: E402


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


# -- 4. against the seed (issue 31's geometry) ---------------------------------------------

SEED_GEOMETRY = dict(num_layers=32, num_kv_heads=8, head_dim=128, max_tokens=1 << 20)
# Pause after the releases of one repeat. Without it a fill right after 48 GiB were given
# back took either 5-7 ms or ~40 ms, for the seed and jax_vmm alike (H200, 15 repeats):
# the driver still settling its freed memory, not the commit path under test.
SETTLE_S = 0.5

SEED = Table(
    ("measure", 44, "<"),
    ("seed", 10),
    ("jax_vmm", 10),
    ("jax_vmm/seed", 12),
    ("paired: median [IQR]", 24),
)


def paired_ratios(seed: list[float], arena: list[float]) -> dict:
    """The ratio arena / seed of each repeat (both timed within it, in the repeat's rotated
    order), as median and interquartile range: steadier than the ratio of the two medians
    when the driver's state moves both sides between repeats."""
    r = sorted(a / s for a, s in zip(arena, seed) if s > 0)
    if not r:
        return {}
    q = statistics.quantiles(r, n=4, method="inclusive") if len(r) > 1 else [r[0]] * 3
    return {"median": statistics.median(r), "q1": q[0], "q3": q[2], "n": len(r)}


def paired_text(p: dict) -> str:
    if not p:
        return "-"
    return f"{p['median']:.2f}x [{p['q1']:.2f}-{p['q3']:.2f}] n={p['n']}"


class SeedBench:
    """jax_vmm's KV arena and the seed side by side on one device, same geometry."""

    def __init__(self, device, raw: RawCuda, layout: str = "per_layer"):
        g = SEED_GEOMETRY
        self.device, self.raw, self.layout = device, raw, layout
        self.token_bytes = g["num_kv_heads"] * g["head_dim"] * 2  # one buffer, bf16
        self.buffers = 2 * g["num_layers"]

    @property
    def tokens_per_granule(self) -> int:  # the seed's page 0: one 2 MiB granule a buffer
        return (2 << 20) // self.token_bytes

    def tokens(self, gib: float) -> int:  # tokens per sequence for gib over all buffers
        return int(gib * GiB) // (self.buffers * self.token_bytes)

    def kv(self):
        return jax_vmm.kv_arena(
            **SEED_GEOMETRY,
            dtype=jnp.bfloat16,
            device=self.device,
            commit_ahead_tokens=0,
            layout=self.layout,
        )

    def seed(self, one_reservation: bool = False) -> SeedKV:
        return SeedKV(
            self.raw,
            self.buffers,
            SEED_GEOMETRY["max_tokens"] * self.token_bytes,
            one_reservation=one_reservation,
        )

    def fresh_memory(self) -> tuple[int, int]:
        """Physical bytes (cuMemGetInfo) a fresh arena takes: (seed, jax_vmm). Must run
        before anything in this process made the device's zero pieces."""
        free = self.raw.free_bytes
        f0 = free()
        s = self.seed()
        f1 = free()
        s.close()
        f2 = free()
        kv = self.kv()
        f3 = free()
        kv.close()
        return f0 - f1, f2 - f3

    def creation(self, repeats: int) -> dict:
        ts, tk = [], []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            s = self.seed()
            t1 = time.perf_counter()
            kv = self.kv()
            t2 = time.perf_counter()
            ts.append(t1 - t0)
            tk.append(t2 - t1)
            s.close()
            kv.close()
        return {
            "seed": statistics.median(ts[1:]),
            "jax_vmm": statistics.median(tk[1:]),
            "paired": paired_ratios(ts[1:], tk[1:]),
        }

    def from_nothing(self, gib: float, repeats: int) -> dict:
        """Median seconds to make a cache of ``gib`` and back it whole: the seed (create +
        grow), jax_vmm (kv_arena + ensure), one allocation of it all (torch_memory_saver's
        way). Each repeat starts with another of the three and lets the driver settle
        after each release, as grow() does."""
        n = self.tokens(gib)

        def seed() -> float:
            t0 = time.perf_counter()
            s = self.seed()
            s.grow_to(n * self.token_bytes)
            dt = time.perf_counter() - t0
            s.close()
            return dt

        def arena() -> float:
            t0 = time.perf_counter()
            kv = self.kv()
            kv.ensure(n)
            dt = time.perf_counter() - t0
            kv.close()
            return dt

        def one() -> float:
            t0 = time.perf_counter()
            alloc = OneAllocation(self.raw, n * self.token_bytes * self.buffers)
            dt = time.perf_counter() - t0
            alloc.close()
            return dt

        runs = [("seed", seed), ("jax_vmm", arena), ("one_allocation", one)]
        times: dict[str, list[float]] = {name: [] for name, _ in runs}
        for i in range(repeats + 1):
            for name, fn in runs[i % 3 :] + runs[: i % 3]:
                times[name].append(fn())
                time.sleep(SETTLE_S)
        out: dict = {name: statistics.median(ts[1:]) for name, ts in times.items()}
        out["paired"] = paired_ratios(times["seed"][1:], times["jax_vmm"][1:])
        out["all"] = {name: ts[1:] for name, ts in times.items()}
        return out

    def grow(self, steps: list[int], base: int, repeats: int) -> dict:
        """Total seconds of ensure(t) for t in steps, from `base` tokens backed; both give
        back to `base` between repeats (jax_vmm: waiting until the driver has it). Also the
        seed's calls with its buffers in one reservation, laid out as the arena's are."""
        s, s1, kv = self.seed(), self.seed(one_reservation=True), self.kv()
        try:
            if base:
                s.grow_to(base * self.token_bytes)
                s1.grow_to(base * self.token_bytes)
                kv.ensure(base)

            def total(grow) -> float:  # seconds of grow(t) over the steps
                t0 = time.perf_counter()
                for t in steps:
                    grow(t)
                return time.perf_counter() - t0

            ts, tk, ts1 = [], [], []
            runs = [
                (ts, lambda t: s.grow_to(t * self.token_bytes)),
                (tk, kv.ensure),
                (ts1, lambda t: s1.grow_to(t * self.token_bytes)),
            ]
            for i in range(repeats + 1):
                # Each repeat starts with a different one: the first to commit after the
                # releases gets the driver's free memory in another state than the last.
                for times, grow in runs[i % 3 :] + runs[: i % 3]:
                    times.append(total(grow))
                s.shrink_to(base * self.token_bytes)
                s1.shrink_to(base * self.token_bytes)
                kv.shrink(base, wait=True)
                time.sleep(SETTLE_S)
            st = kv.stats()
            return {
                "seed": statistics.median(ts[1:]),
                "seed_one_reservation": statistics.median(ts1[1:]),
                "jax_vmm": statistics.median(tk[1:]),
                "paired": paired_ratios(ts[1:], tk[1:]),
                "commit_drains": st["commit_drains"],
                "all": {"seed": ts[1:], "jax_vmm": tk[1:], "seed_one_reservation": ts1[1:]},
            }
        finally:
            s.close()
            s1.close()
            kv.close()


def bench_seed(
    device, repeats: int, raw, steps_to: int = 1 << 16, layout: str = "per_layer"
) -> dict | None:
    if not isinstance(raw, RawCuda):
        print("\nseed: needs a CUDA device and cuda-python; skipped")
        return None
    b = SeedBench(device, raw, layout)
    g = SEED_GEOMETRY
    print(
        f"\nagainst the seed: {g['num_layers']} layers x K,V = {b.buffers} buffers, "
        f"{g['num_kv_heads']}x{g['head_dim']} bf16, {g['max_tokens']} tokens reserved; "
        f"jax_vmm's KV layout {layout}; median of {repeats}"
    )
    out: dict = {"kv_layout": layout}
    out["fresh_bytes"] = dict(zip(("seed", "jax_vmm"), b.fresh_memory()))
    t16, t20, t64k = b.tokens(16), b.tokens(20), steps_to
    out["grow_16_20"] = b.grow([t20], t16, repeats)
    out["fill_0_16"] = b.grow([t16], 0, repeats)
    out["fill_page0_16"] = b.grow([t16], b.tokens_per_granule, repeats)
    out["steps_4096"] = b.grow(list(range(4096, t64k + 1, 4096)), 0, repeats)
    out["steps_256"] = b.grow(list(range(256, t64k + 1, 256)), 0, max(1, repeats // 2))
    out["creation"] = b.creation(repeats)
    out["from_nothing_20"] = b.from_nothing(20, repeats)
    print(SEED.header())
    ms = lambda v: f"{v * 1e3:.2f} ms"  # noqa: E731
    rows = [
        ("grow 16 -> 20 GiB, one call", "grow_16_20"),
        ("fill 0 -> 16 GiB, one call", "fill_0_16"),
        ("  from page 0 backed (the seed's start)", "fill_page0_16"),
        (f"ensure, steps of 4096 tokens, 0 -> {t64k >> 10}k, total", "steps_4096"),
        (f"ensure, steps of 256 tokens, 0 -> {t64k >> 10}k, total", "steps_256"),
        ("a new arena (later ones, median)", "creation"),
        ("a 20 GiB cache from nothing", "from_nothing_20"),
    ]
    for label, key in rows:
        r = out[key]
        print(
            SEED.row(
                label,
                ms(r["seed"]),
                ms(r["jax_vmm"]),
                f"{r['jax_vmm'] / r['seed']:.2f}x",
                paired_text(r.get("paired", {})),
            )
        )
        if "seed_one_reservation" in r:
            one_range = r["seed_one_reservation"]
            ratio_text = f"{r['jax_vmm'] / one_range:.2f}x"
            print(
                SEED.row("  the seed's calls in one reservation", ms(one_range), "", ratio_text, "")
            )
    one = out["from_nothing_20"]["one_allocation"]
    print(
        SEED.row(
            "  peer: one 20 GiB allocation (tms-style)",
            ms(one),
            "",
            f"{out['from_nothing_20']['jax_vmm'] / one:.2f}x",
            "",
        )
    )
    fb = out["fresh_bytes"]
    print(
        SEED.row(
            "physical memory of a fresh arena",
            f"{fb['seed'] / 2**20:.0f} MiB",
            f"{fb['jax_vmm'] / 2**20:.0f} MiB",
            fmt(ratio(fb["jax_vmm"], fb["seed"]), "{:.2f}x", "-"),
            "",
        ),
        flush=True,
    )
    return out


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
    p.add_argument(
        "--sections",
        default="seed,throughput,decode,creation",
        help="any of seed,throughput,decode,creation (seed runs first: it measures the "
        "memory of the first arena in the process)",
    )
    p.add_argument(
        "--kv-layout",
        choices=jax_vmm.KV_LAYOUTS,
        default="per_layer",
        help="the seed section's KV arena layout (kv_arena(layout=...)); the seed keeps its "
        "per-layer buffers",
    )
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
    if "seed" in sections:
        out["seed"] = bench_seed(device, args.repeats, raw, layout=args.kv_layout)
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
