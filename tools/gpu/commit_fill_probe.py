"""Why does `bench/commit.py`'s fill 0 -> 16 GiB run slower than the seed's (issue 31)?

    python3 tools/gpu/commit_fill_probe.py [--repeats 9]

The seed backs page 0 of every buffer when it is made, so its fill maps 254 MiB per
buffer starting 2 MiB in, one buffer's create + map + set-access after the other;
jax_vmm's fill maps 256 MiB per buffer starting at the buffer's (256 MiB-aligned) base.
Over the seed's geometry (64 buffers of 2 GiB back to back in one reservation) this
times the seed itself (bench/_seed.py), the raw calls of `RawCuda.runs_ops` (create + map
of every run, then a set-access per run) at jax_vmm's placement and 2 MiB further in, and
`kv.ensure` from empty and from page 0 backed. The two raw rows differ only in placement;
the seed and the raw row 2 MiB in differ in call order. Each repeat starts with another
variant and pauses after the releases (the driver settles freed memory; docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_vmm  # noqa: E402
from _raw import RawCuda  # noqa: E402
from _seed import SeedKV  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
BUFFERS, BUFFER_BYTES = 64, 2 * GiB  # 32 layers x K,V; 1M tokens of 8 x 128 bf16
TOKEN_BYTES = 8 * 128 * 2
FILL_BYTES = 256 * MiB  # per buffer: 16 GiB in all
SETTLE_S = 0.5


def seed_fill(raw: RawCuda):
    """(fill, empty) of the seed, its buffers in one reservation, page 0 backed."""
    seed = SeedKV(raw, BUFFERS, BUFFER_BYTES, one_reservation=True)
    return (lambda: seed.grow_to(FILL_BYTES)), (lambda: seed.shrink_to(0))


def raw_fill(raw: RawCuda, offset: int):
    """(fill, empty) of FILL_BYTES per buffer from `offset` into each, one handle a run."""
    base = raw.reserve(BUFFERS * BUFFER_BYTES, 256 * MiB)
    runs = [(base + b * BUFFER_BYTES + offset, FILL_BYTES) for b in range(BUFFERS)]
    fill, empty, _, _ = raw.runs_ops(runs, FILL_BYTES)
    return fill, empty


def arena_fill(base_tokens: int):
    """(fill, empty) of kv.ensure to 16 GiB from `base_tokens` backed."""
    kv = jax_vmm.kv_arena(
        num_layers=32, num_kv_heads=8, head_dim=128, max_tokens=1 << 20,
        dtype=jnp.bfloat16, commit_ahead_tokens=0,
    )  # fmt: skip
    if base_tokens:
        kv.ensure(base_tokens)

    def fill() -> None:
        kv.ensure(FILL_BYTES // TOKEN_BYTES)

    def empty() -> None:
        kv.shrink(base_tokens, wait=True)

    return fill, empty


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("needs a CUDA device")
        return 1
    raw = RawCuda(0)
    variants = {
        "the seed: 254 MiB from 2 MiB in, buffer by buffer": seed_fill(raw),
        "raw runs, 256 MiB from the base (jax_vmm's placement)": raw_fill(raw, 0),
        "raw runs, 256 MiB from 2 MiB in": raw_fill(raw, 2 * MiB),
        "kv.ensure from empty (bench/commit.py's fill)": arena_fill(0),
        "kv.ensure from page 0 backed": arena_fill(1024),
    }
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.repeats + 1):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            fill, empty = variants[name]
            t0 = time.perf_counter()
            fill()
            times[name].append(time.perf_counter() - t0)
            empty()
            time.sleep(SETTLE_S)
    print(f"fill of 64 buffers to 16 GiB, ms over {args.repeats} repeats")
    print(f"{'variant':58s} {'median':>8s} {'min':>8s}")
    for n in names:
        v = times[n][1:]
        print(f"{n:58s} {statistics.median(v) * 1e3:8.2f} {min(v) * 1e3:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
