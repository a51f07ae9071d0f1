"""Why does `bench/commit.py`'s fill 0 -> 16 GiB run slower than the seed's (issue 31)?

    python3 tools/gpu/commit_fill_probe.py [--repeats 9]

The seed backs page 0 of every buffer when it is made, so its fill maps 254 MiB per
buffer starting 2 MiB in; jax_vmm's fill maps 256 MiB per buffer starting at the buffer's
(256 MiB-aligned) base. This probe times, over the seed's geometry (64 buffers of 2 GiB
back to back in one reservation), the seed's calls (cuMemCreate + cuMemMap +
cuMemSetAccess per buffer) for both placements and a third (256 MiB from 2 MiB in), the
same calls grouped (every create, then every map, then every set-access), and
`kv.ensure` from empty and from page 0 backed. Each repeat starts with another variant
and pauses after the releases (the driver settles freed memory; docs/benchmarks.md).
If the seed's calls are slower at the aligned placement too, the bench's gap is the
placement's, not jax_vmm's.
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

MiB, GiB = 1 << 20, 1 << 30
BUFFERS, BUFFER_BYTES = 64, 2 * GiB  # 32 layers x K,V; 1M tokens of 8 x 128 bf16
TOKEN_BYTES = 8 * 128 * 2
SETTLE_S = 0.5


class RawFill:
    """The seed's calls over one reservation: `bytes_` per buffer from `offset` in, page 0
    kept mapped when offset > 0 (as the seed keeps it)."""

    def __init__(self, raw: RawCuda, offset: int, bytes_: int, grouped: bool = False):
        self.raw, self.offset, self.bytes, self.grouped = raw, offset, bytes_, grouped
        self.base = raw.reserve(BUFFERS * BUFFER_BYTES, 256 * MiB)
        self.page0 = [self._map(b, 0, offset) for b in range(BUFFERS)] if offset else []
        self.held: list = []

    def _map(self, b: int, at: int, n: int):
        cu, ok = self.raw.cu, self.raw._ok
        h = ok(cu.cuMemCreate(n, self.raw.prop, 0))
        ok(cu.cuMemMap(self.base + b * BUFFER_BYTES + at, n, 0, h, 0))
        ok(cu.cuMemSetAccess(self.base + b * BUFFER_BYTES + at, n, self.raw.rw, 1))
        return h

    def fill(self) -> None:
        cu, ok, raw = self.raw.cu, self.raw._ok, self.raw
        if not self.grouped:
            self.held = [self._map(b, self.offset, self.bytes) for b in range(BUFFERS)]
            return
        vas = [self.base + b * BUFFER_BYTES + self.offset for b in range(BUFFERS)]
        self.held = [ok(cu.cuMemCreate(self.bytes, raw.prop, 0)) for _ in vas]
        for va, h in zip(vas, self.held):
            ok(cu.cuMemMap(va, self.bytes, 0, h, 0))
        for va in vas:
            ok(cu.cuMemSetAccess(va, self.bytes, raw.rw, 1))

    def empty(self) -> None:
        cu, ok = self.raw.cu, self.raw._ok
        for b, h in enumerate(self.held):
            ok(cu.cuMemUnmap(self.base + b * BUFFER_BYTES + self.offset, self.bytes))
            ok(cu.cuMemRelease(h))
        self.held = []


class ArenaFill:
    """kv.ensure to 16 GiB, from empty or from the first chunk (1024 tokens) backed."""

    def __init__(self, base_tokens: int):
        self.kv = jax_vmm.kv_arena(
            num_layers=32, num_kv_heads=8, head_dim=128, max_tokens=1 << 20,
            dtype=jnp.bfloat16, commit_ahead_tokens=0,
        )  # fmt: skip
        self.base = base_tokens
        if base_tokens:
            self.kv.ensure(base_tokens)

    def fill(self) -> None:
        self.kv.ensure((16 * GiB) // (BUFFERS * TOKEN_BYTES))

    def empty(self) -> None:
        self.kv.shrink(self.base, wait=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("needs a CUDA device")
        return 1
    raw = RawCuda(0)
    variants = {
        "seed calls, 254 MiB from 2 MiB in (the seed)": RawFill(raw, 2 * MiB, 254 * MiB),
        "seed calls, 256 MiB from the base (jax_vmm's placement)": RawFill(raw, 0, 256 * MiB),
        "seed calls, 256 MiB from 2 MiB in": RawFill(raw, 2 * MiB, 256 * MiB),
        "grouped calls, 256 MiB from the base": RawFill(raw, 0, 256 * MiB, grouped=True),
        "kv.ensure from empty (bench/commit.py's fill)": ArenaFill(0),
        "kv.ensure from page 0 backed": ArenaFill(1024),
    }
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.repeats + 1):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            t0 = time.perf_counter()
            variants[name].fill()
            times[name].append(time.perf_counter() - t0)
            variants[name].empty()
            time.sleep(SETTLE_S)
    print(f"fill of 64 buffers to 16 GiB, ms over {args.repeats} repeats")
    print(f"{'variant':58s} {'median':>8s} {'min':>8s}")
    for n in names:
        v = times[n][1:]
        print(f"{n:58s} {statistics.median(v) * 1e3:8.2f} {min(v) * 1e3:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
