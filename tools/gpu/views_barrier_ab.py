"""ordered_views' optimization barrier on bench/_stack.py's vmm+cudnn loop (GPU): ms per
step and the output checksum against prealloc+cudnn, with the barrier and without it
(jax_vmm.testing.loop_views_unbarriered()), two interleaved rounds, gpu preset.

    python3 tools/gpu/views_barrier_ab.py [--layers 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import contextlib  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import _stack as ST  # noqa: E402
import jax_vmm.testing  # noqa: E402
from jax_vmm.serving import model as M  # noqa: E402

VARIANTS = (
    ("prealloc+cudnn", contextlib.nullcontext),
    ("vmm+cudnn", contextlib.nullcontext),
    ("vmm+cudnn", jax_vmm.testing.loop_views_unbarriered),
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    device = jax.devices()[0]
    cfg = dataclasses.replace(M.PRESETS["gpu"], num_layers=args.layers)
    rows = []
    for batch, context in ((16, 1024), (16, 4096), (64, 1024)):
        lengths = np.random.default_rng(0).integers(context // 2, context - 32, batch)
        for rep in range(2):
            for variant, around in VARIANTS:
                with around():  # active while the step is traced
                    r = ST.time_variant(
                        variant, cfg, device, lengths.astype(np.int32), context=context,
                        steps=16, repeats=5,
                    )  # fmt: skip
                name = variant if around is contextlib.nullcontext else variant + " no barrier"
                rows.append(
                    dict(batch=batch, context=context, rep=rep, variant=name,
                         step_ms=r["step_ms"], checksum=r["checksum"])
                )  # fmt: skip
                print(rows[-1], flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
