"""The kv_write CUDA kernel's own time per call, by Nsight Compute, at decode and prefill sizes.

    python bench/kv_write_kernel_times.py [--sizes 1,8,64,4096,32768] [--json OUT.json]

Runs itself under `ncu --clock-control none --metrics gpu__time_duration.sum`, profiling
only the kv_write kernels, for `--calls` eager `jax_vmm.kv_write` calls per size on a plain
(T, 8, 128) bfloat16 cache, scattered slots: the tiled kernel (`KvBulkKernel`, production)
and its fallback, the token kernel (`KvKernel`, one thread group per token, forced through
`jax_vmm.testing.token_kernel_kv_writes`). Prints the median kernel time per size, its
bandwidth (bytes read + written) and the physical floor (bytes / 4.8 TB/s).
Kernel time only: no launch, no host code, no graph (what a command buffer replays).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

H, D, T = 8, 128, 65536
KERNELS = {"tiled": "KvBulkKernel", "token": "KvKernel"}
DATASHEET = 4.8e12


def child(sizes: list[int], calls: int) -> None:
    """The profiled process: `calls` writes per size, in order."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_vmm
    import jax_vmm.testing

    rng = np.random.default_rng(0)
    k = jnp.zeros((T, H, D), jnp.bfloat16)
    v = jnp.zeros((T, H, D), jnp.bfloat16)
    for n in sizes:
        new = jnp.asarray(rng.standard_normal((n, H, D)), jnp.bfloat16)
        slots = jnp.asarray(rng.permutation(T)[:n].astype(np.int32))
        jax.block_until_ready((new, slots))
        for _ in range(calls):
            k, v = jax_vmm.kv_write(k, v, new, new, slots)
            jax.block_until_ready((k, v))
        with jax_vmm.testing.token_kernel_kv_writes():
            for _ in range(calls):
                k, v = jax_vmm.kv_write(k, v, new, new, slots)
                jax.block_until_ready((k, v))


def parse(text: str, sizes: list[int], calls: int) -> list[dict]:
    """Median kernel time per size and kernel (launch order: `calls` of each per size)."""
    start = text.find('"ID"')
    if start < 0:
        raise SystemExit(f"no ncu CSV in its output:\n{text[-2000:]}")
    rows = [
        r
        for r in csv.DictReader(io.StringIO(text[start:]))
        if r.get("Metric Name") == "gpu__time_duration.sum"
    ]
    scale = {"nsecond": 1e-9, "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3, "ms": 1e-3}
    times = {
        name: [
            float(r["Metric Value"].replace(",", "")) * scale[r["Metric Unit"]]
            for r in rows
            if re.search(rf"\b{kernel}\b", r.get("Kernel Name", ""))
        ]
        for name, kernel in KERNELS.items()
    }
    for name, t in times.items():
        if len(t) != len(sizes) * calls:
            raise SystemExit(f"expected {len(sizes) * calls} {name} launches, ncu saw {len(t)}")
    out = []
    for i, n in enumerate(sizes):
        moved = 2 * 2 * n * H * D * 2  # k and v, read and written, bfloat16
        row = {"tokens": n, "floor_us": 1e6 * moved / DATASHEET}
        for name, t in times.items():
            med = statistics.median(t[i * calls : (i + 1) * calls])
            row[f"{name}_us"] = 1e6 * med
            row[f"{name}_gbps"] = moved / med / 1e9
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,8,64,4096,32768")
    p.add_argument("--calls", type=int, default=16)
    p.add_argument("--json", type=Path)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.child:
        child(sizes, args.calls)
        return
    ncu = shutil.which("ncu")
    if ncu is None:
        raise SystemExit("ncu (Nsight Compute) is not on PATH")
    cmd = [
        ncu,
        "--clock-control",
        "none",
        "--metrics",
        "gpu__time_duration.sum",
        "--kernel-name",
        "regex:" + "|".join(KERNELS.values()),
        "--csv",
        sys.executable,
        __file__,
        "--child",
        "--sizes",
        args.sizes,
        "--calls",
        str(args.calls),
    ]
    env = dict(os.environ, XLA_FLAGS="--xla_gpu_enable_command_buffer=")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"ncu exited {done.returncode}:\n{done.stderr[-3000:]}")
    rows = parse(done.stdout, sizes, args.calls)
    print(f"kv_write kernel time by ncu, median of {args.calls} calls, {H}x{D} bfloat16 tokens")
    print(f"{'tokens':>7} {'tiled us':>9} {'GB/s':>7} {'token us':>9} {'GB/s':>7} {'floor us':>9}")
    for r in rows:
        print(
            f"{r['tokens']:>7} {r['tiled_us']:>9.2f} {r['tiled_gbps']:>7.0f}"
            f" {r['token_us']:>9.2f} {r['token_gbps']:>7.0f} {r['floor_us']:>9.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
