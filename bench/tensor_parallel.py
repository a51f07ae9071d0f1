"""Tokens/s of the example served tensor-parallel: `--tp 2` against `--tp 1` and one device.

    python bench/tensor_parallel.py                    # the gpu preset on 2 GPUs
    python bench/tensor_parallel.py --tp 1 2 4 --requests 96

Each configuration is one `examples/decode.py` run (its own compiled steps, the same
seeded requests; compile time excluded, as the example reports it): without `--tp` (one
device, unsharded cache), then `--tp N` for each N (heads, MLP and the KV cache split over
N devices, examples/tensor_parallel.py). Prints one row per run and writes
`out/bench/tensor_parallel.json`. Needs as many devices as the largest N (on the CPU:
`XLA_FLAGS=--xla_force_host_platform_device_count=N`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax

from _common import command_line, write_json
from jax_vmm.serving.cli import decode


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes")
    p.add_argument("--preset", default="auto")
    p.add_argument("--requests", type=int, help="override the preset's request count")
    p.add_argument("--out", type=Path, default=Path("out/bench/tensor_parallel.json"))
    args = p.parse_args(argv)
    have = len(jax.devices())
    if max(args.tp) > have:
        raise SystemExit(
            f"bench/tensor_parallel.py: --tp {max(args.tp)} needs that many devices; "
            f"{jax.devices()[0].platform} has {have}"
        )
    common = ["--preset", args.preset, "--no-plot", "--no-progress"]
    if args.requests:
        common += ["--requests", str(args.requests)]
    rows = []
    for tp in [None, *args.tp]:
        extra = [] if tp is None else ["--tp", str(tp)]
        out = args.out.parent / f"tp{tp or 0}"
        s = decode.main([*common, *extra, "--out", str(out)])
        rows.append(
            {
                "tp": tp,
                "tokens_per_second": s["tokens_per_second"],
                "generated_tokens": s["generated_tokens"],
                "seconds": s["seconds"],
                "compile_seconds": s["compile_seconds"],
                "peak_backed_bytes": s["peak_backed_bytes"],
                "device": s["device"],
            }
        )
    base = rows[1]["tokens_per_second"] if len(rows) > 1 else rows[0]["tokens_per_second"]
    print(f"\n{'run':>12} {'tokens/s':>10} {'vs --tp 1':>10} {'seconds':>8}")
    for r in rows:
        name = "one device" if r["tp"] is None else f"--tp {r['tp']}"
        print(
            f"{name:>12} {r['tokens_per_second']:>10.0f} "
            f"{r['tokens_per_second'] / base:>9.2f}x {r['seconds']:>8.2f}"
        )
    write_json(args.out, {"command": command_line(__file__, argv), "runs": rows})
    print(f"json: {args.out}")
    return rows


if __name__ == "__main__":
    main()
