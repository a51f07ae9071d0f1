"""The kv_write CUDA kernel's own time per call, by Nsight Compute, at decode and prefill sizes.

    python tools/gpu/kv_write_kernel_times.py [--sizes 1,8,64,4096,32768] [--json OUT.json]

Runs itself under `ncu --clock-control none --metrics gpu__time_duration.sum`, profiling
only the tiled kernel (`KvBulkKernel`), for `--calls` eager `jax_vmm.kv_write` calls per
size on a plain (T, 8, 128) bfloat16 cache, scattered slots; prints the median kernel time
per size, its bandwidth (bytes read + written) and the physical floor (bytes / 4.8 TB/s).
Kernel time only: no launch, no host code, no graph (what a command buffer replays).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
H, D, T = 8, 128, 65536
KERNEL = "KvBulkKernel"
DATASHEET = 4.8e12


def child(sizes: list[int], calls: int) -> None:
    """The profiled process: `calls` writes per size, in order."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(ROOT))
    import jax_vmm

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


def parse(text: str, sizes: list[int], calls: int) -> list[dict]:
    """Kernel durations in launch order, `calls` per size."""
    start = text.find('"ID"')
    if start < 0:
        raise SystemExit(f"no ncu CSV in its output:\n{text[-2000:]}")
    rows = [
        r
        for r in csv.DictReader(io.StringIO(text[start:]))
        if r.get("Metric Name") == "gpu__time_duration.sum" and KERNEL in r.get("Kernel Name", "")
    ]
    if len(rows) != len(sizes) * calls:
        raise SystemExit(f"expected {len(sizes) * calls} {KERNEL} launches, ncu saw {len(rows)}")
    scale = {"nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0}
    out = []
    for i, n in enumerate(sizes):
        mine = rows[i * calls : (i + 1) * calls]
        t = statistics.median(float(r["Metric Value"]) * scale[r["Metric Unit"]] for r in mine)
        moved = 2 * 2 * n * H * D * 2  # k and v, read and written, bfloat16
        out.append(
            {
                "tokens": n,
                "kernel_us": 1e6 * t,
                "gbps": moved / t / 1e9,
                "floor_us": 1e6 * moved / DATASHEET,
            }
        )
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
        f"regex:{KERNEL}",
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
    print(f"{'tokens':>7} {'kernel us':>10} {'GB/s':>8} {'floor us':>9} {'x floor':>8}")
    for r in rows:
        print(
            f"{r['tokens']:>7} {r['kernel_us']:>10.2f} {r['gbps']:>8.0f} {r['floor_us']:>9.2f}"
            f" {r['kernel_us'] / r['floor_us']:>8.1f}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
