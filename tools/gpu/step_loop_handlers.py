"""Which stage of jax_vmm's handlers runs on the host at each call of a one-step-per-call
loop (bench/step_loop.py's step, issue 29), and the per-call time, arena against prealloc.

    python3 tools/gpu/step_loop_handlers.py [--layers 32] [--step write+attention]

XLA re-records a command buffer whenever a buffer it uses moved, and a step's results are
new buffers at every call; its FFI calls are replayed from XLA's trace cache when their
own operands did not move (the execute stage does not run), while the initialize stage
runs at every call. The counters below (jax_vmm._core's handler statistics, differences
over the timed calls, per call) show which: e.g. ``cudnn.initialize_calls=32.00`` and no
``execute_calls`` means 32 initialize stages and no execute per call; the cuDNN handlers
also report their initialize stages' host time (``initialize_ns``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import jax  # noqa: E402

import step_loop  # noqa: E402
from jax_vmm import _core  # noqa: E402


def counters() -> dict[str, float]:
    """Every numeric handler counter, flattened: "cudnn.execute_calls", ..."""
    cudnn = getattr(_core, "cudnn_attention_stats", dict)  # absent from builds without cuDNN
    stats = {
        "cudnn": cudnn(),
        "attention": _core.attention_stats(),
        "kv_write": _core.kv_write_stats(),
    }
    return {
        f"{group}.{name}": value
        for group, values in stats.items()
        for name, value in values.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--step", choices=step_loop.STEPS[:2], default="write+attention")
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args(argv)
    point = argparse.Namespace(kv_heads=2, head_dim=64, max_tokens=256)  # the bench's defaults
    kv, prealloc, _, step_args = step_loop.setup_point(args.layers, args.batch, args.step, point)
    step_args = ((), *step_args)  # no views: neither step reads them
    print(f"{args.step}, {args.layers} layers, batch {args.batch}, {args.calls} calls")
    for name, cache in (("arena", kv.cache()), ("prealloc", prealloc)):
        step = step_loop.make_step(args.layers, args.step)
        for _ in range(21):  # compile, then XLA's traces warm
            cache, out = step(cache, *step_args)
        jax.block_until_ready(out)
        before, t0 = counters(), time.perf_counter()
        for _ in range(args.calls):
            cache, out = step(cache, *step_args)
        jax.block_until_ready(out)
        us = (time.perf_counter() - t0) / args.calls * 1e6
        after = counters()
        moved = {k: (after[k] - v) / args.calls for k, v in before.items() if after[k] != v}
        print(f"{name:>9}: {us:7.1f} us/call; per call: " + ", ".join(
            f"{k}={v:.2f}" for k, v in sorted(moved.items())
        ))  # fmt: skip
        if moved.get("cudnn.initialize_calls"):
            stage_us = moved["cudnn.initialize_ns"] / moved["cudnn.initialize_calls"] / 1e3
            print(
                f"{'':>9}  cuDNN initialize stages: {moved['cudnn.initialize_ns'] / 1e3:.1f} us "
                f"per call, {stage_us:.2f} us each"
            )
    kv.check()
    kv.close()


if __name__ == "__main__":
    main()
