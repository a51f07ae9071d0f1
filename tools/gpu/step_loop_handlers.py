"""Which stage of jax_vmm's handlers runs on the host at each call of a one-step-per-call
loop (bench/step_loop.py's step, issue 29), and the per-call time, arena against prealloc.

    python3 tools/gpu/step_loop_handlers.py [--layers 32] [--step write+attention] [--xla-log]

XLA re-records a command buffer whenever a buffer it uses moved, and a step's results are
new buffers at every call; its FFI calls are replayed from XLA's trace cache when their
own operands did not move (the execute stage does not run), while the initialize stage
runs at every call. The counters below (jax_vmm._core's handler statistics, differences
over the timed calls, per call) show which: e.g. ``cudnn.initialize_calls=32.00`` and no
``execute_calls`` means 32 initialize stages and no execute per call; the cuDNN handlers
also report their initialize stages' host time (``initialize_ns``).

``--xla-log`` also turns on XLA's command-buffer logging (TF_CPP_VMODULE, set before jax
starts, so only from the command line) and prints, per side, the log lines of the timed
calls per call, numbers and addresses folded: whether a custom call is re-traced, only
updated, or neither at each call (e.g. the view check of ``--step views+write``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# XLA's modules whose logs say what a command-buffer update did per command.
XLA_LOG_MODULES = "command_buffer_thunk=3,command_buffer_cmd=5,custom_call_thunk=3"
if "--xla-log" in sys.argv[1:]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0")
    os.environ.setdefault("TF_CPP_VMODULE", XLA_LOG_MODULES)
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
    flat: dict[str, float] = {}

    def add(prefix: str, values: dict) -> None:
        for name, value in values.items():
            if isinstance(value, dict):
                add(f"{prefix}.{name}", value)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                flat[f"{prefix}.{name}"] = value

    for group, values in stats.items():
        add(group, values)
    return flat


@contextlib.contextmanager
def stderr_into(path: Path) -> Iterator[None]:
    """File descriptor 2 (where XLA's C++ logging writes) redirected into ``path``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "wb") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


_LOG_PREFIX = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ ")
_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+")


def log_lines_per_call(path: Path, calls: int, top: int = 12) -> list[tuple[float, str]]:
    """The most frequent log lines in ``path``, numbers folded, as (count per call, line)."""
    counts = collections.Counter(
        _NUMBERS.sub("N", _LOG_PREFIX.sub("", line.rstrip()))
        for line in path.read_text(errors="replace").splitlines()
        if line.strip()
    )
    return [(n / calls, line) for line, n in counts.most_common(top)]


_UPDATE = re.compile(r"Updated command buffer in (\d+) .s; num_commands=(\d+)")


def command_buffer_updates(path: Path) -> tuple[int, float, int]:
    """XLA's command-buffer updates logged in ``path``: (count, median us, commands)."""
    text = path.read_text(errors="replace")
    found = [tuple(map(int, m.groups())) for m in _UPDATE.finditer(text)]
    if not found:
        return 0, 0.0, 0
    us = sorted(t for t, _ in found)
    return len(found), float(us[len(us) // 2]), found[-1][1]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--step", choices=step_loop.STEPS, default="write+attention")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--xla-log", action="store_true", help="XLA's command-buffer log lines per call")
    args = p.parse_args(argv)
    point = argparse.Namespace(kv_heads=2, head_dim=64, max_tokens=256)  # the bench's defaults
    kv, prealloc, views, step_args = step_loop.setup_point(
        args.layers, args.batch, args.step, point
    )
    print(f"{args.step}, {args.layers} layers, batch {args.batch}, {args.calls} calls")
    log_dir = Path(tempfile.mkdtemp(prefix="step_loop_xla_log_")) if args.xla_log else None
    # The prealloc side reads its own arrays: no views.
    for name, cache, side_views in (("arena", kv.cache(), views), ("prealloc", prealloc, ())):
        step = step_loop.make_step(args.layers, args.step)
        for _ in range(21):  # compile, then XLA's traces warm
            cache, out = step(cache, side_views, *step_args)
        jax.block_until_ready(out)
        log = log_dir / f"{name}.log" if log_dir else None
        capture = stderr_into(log) if log else contextlib.nullcontext()
        before = counters()
        with capture:
            t0 = time.perf_counter()
            for _ in range(args.calls):
                cache, out = step(cache, side_views, *step_args)
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
        if log:
            print(f"{'':>9}  XLA log lines per call ({log}):")
            for per_call, line in log_lines_per_call(log, args.calls):
                print(f"{'':>11}{per_call:8.2f}  {line[:160]}")
            n, median_us, commands = command_buffer_updates(log)
            if n:
                print(
                    f"{'':>9}  command-buffer updates: {n}, median {median_us:.0f} us, "
                    f"{commands} commands"
                )
    kv.check()
    kv.close()


if __name__ == "__main__":
    main()
