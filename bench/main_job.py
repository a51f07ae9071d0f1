"""The main job (examples/decode.py) on jax_vmm and on the preallocated cache, side by side.

    python bench/main_job.py                       # batch 16 and 64 on a GPU, 4 on the CPU
    python bench/main_job.py --batch 16 --rounds 3 --json out/main_job.json
    python bench/main_job.py -- --kv-dtype fp8      # flags after -- go to every run

Each round serves the same requests once per backend (`jax_vmm.serving.cli.decode.main`,
3 requests per slot, as tools/gpu/run.sh's example steps), in one process, the order
alternating from round to round; the first round of each backend adds `--warmup`, so no
timed run compiles or builds cuDNN graphs. Goal (issue 29): jax_vmm's tokens/s >= 1.0x
prealloc + cuDNN's. Printed per batch: each round's tokens/s and ratio, and the median
of the per-round ratios. Run one process per side instead (`examples/decode.py
--backend ...`), the ratio also carries whatever differs between the two processes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import jax

from jax_vmm.serving.cli import decode

BACKENDS = ("jax_vmm", "prealloc")


def serve(backend: str, batch: int, warmup: bool, extra: list[str], out: Path) -> dict:
    """One run of the example: its summary (tokens_per_second and the rest)."""
    argv = [
        "--backend", backend, "--batch", str(batch), "--requests", str(3 * batch),
        "--no-progress", "--no-plot", "--out", str(out / f"{backend}_b{batch}"),
        *(["--warmup"] if warmup else []), *extra,
    ]  # fmt: skip
    return decode.main(argv)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", help="slots (default: 16 64 on a GPU, 4)")
    p.add_argument("--rounds", type=int, default=3, help="runs per backend and batch")
    p.add_argument("--json", type=Path, help="write the rounds and ratios here")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    gpu = jax.devices()[0].platform == "gpu"
    batches = args.batch or ([16, 64] if gpu else [4])
    report = {"device": jax.devices()[0].device_kind, "extra": extra, "batches": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for batch in batches:
            rounds = []
            for r in range(args.rounds):
                order = BACKENDS if r % 2 == 0 else BACKENDS[::-1]
                got = {b: serve(b, batch, r == 0, extra, Path(tmp)) for b in order}
                tps = {b: got[b]["tokens_per_second"] for b in BACKENDS}
                ratio = tps["jax_vmm"] / tps["prealloc"]
                rounds.append({"order": list(order), "tokens_per_second": tps, "ratio": ratio})
                print(
                    f"batch {batch} round {r + 1}: jax_vmm {tps['jax_vmm']:,.0f}, prealloc "
                    f"{tps['prealloc']:,.0f} tokens/s, ratio {ratio:.4f} "
                    f"(order {', '.join(order)})",
                    flush=True,
                )
            ratios = [x["ratio"] for x in rounds]
            median = statistics.median(ratios)
            report["batches"][batch] = {"rounds": rounds, "median_ratio": median}
            print(
                f"batch {batch}: jax_vmm / prealloc tokens/s, median of {len(ratios)} rounds "
                f"{median:.4f} (range {min(ratios):.4f}-{max(ratios):.4f}; goal >= 1.0)"
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
