"""Where the main job's device time goes: one serving run of `examples/decode.py` under
JAX's profiler, split by part of a step and by the device's idle gaps.

    python tools/gpu/profile_serving.py --out DIR -- --batch 64 --block 16
    python tools/gpu/profile_serving.py --out DIR -- --batch 64 --block 16 --backend prealloc

Everything after `--` goes to examples/decode.py (`jax_vmm.serving.cli.decode`) as is.
Compilation (`Generator.precompile`) runs before the trace starts; the trace covers the
first `Generator.run`, the one whose tokens/s the main job prints. Run each backend in
its own process, as the main job does, and compare the two reports (all from
tools/gpu/trace_summary.py): the kernel time per part and the top kernels of the whole
run; the device busy time against its span (the difference is time the device waited,
negative where kernels overlapped); the idle gaps (nothing running on any stream),
grouped by the kernels on either side, which say where in the run the device waited;
and, when the trace has XLA's "XLA Modules" line, the same per program (prefill, decode
block). With jax 0.11.2 on the H200 it had none: every kernel is counted "outside a
program" there.

The profiler slows the run (CUPTI records every kernel), so read the split, not the
tokens/s. Writes DIR/serving_profile.json and keeps the trace under DIR/trace.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> dict:
    args_in = sys.argv[1:] if argv is None else argv
    own, rest = (
        (args_in[: args_in.index("--")], args_in[args_in.index("--") + 1 :])
        if ("--" in args_in)
        else (args_in, [])
    )
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory for the report and trace")
    p.add_argument("--parts", type=int, default=8, help="parts printed per program")
    p.add_argument("--kernels", type=int, default=25, help="top kernels printed (whole run)")
    p.add_argument("--gap-us", type=float, default=10.0, help="idle gaps counted from this long")
    args = p.parse_args(own)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.path[:0] = [str(Path(__file__).resolve().parent)]
    import jax
    import trace_summary as TS

    from jax_vmm.serving import engine as E
    from jax_vmm.serving.cli import decode

    trace_dir = args.out / "trace"
    plain_run = E.Generator.run
    traced = {"done": False}

    def run_traced(self, *a, **kw):
        if traced["done"]:
            return plain_run(self, *a, **kw)
        traced["done"] = True
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            return plain_run(self, *a, **kw)

    E.Generator.run = run_traced
    try:
        summary = decode.main(["--no-progress", *rest])
    finally:
        E.Generator.run = plain_run
    found = TS.trace_file(trace_dir)
    if found is None:
        raise SystemExit(f"profile_serving: no trace under {trace_dir}")
    trace = TS.load(found)
    split = TS.by_module(trace)
    whole = TS.summarize(trace, steps=1, layers=1)
    gaps = TS.idle_gaps(trace, min_us=args.gap_us)
    report = {
        "argv": rest,
        "backend": summary.get("backend"),
        "tokens_per_second_traced": summary.get("tokens_per_second"),
        "seconds_traced": summary.get("seconds"),
        "trace_file": str(found),
        "kernels": whole["events"],
        "busy_ms": whole["busy_us"] / 1e3,
        "span_ms": whole["span_us"] / 1e3,
        "parts_ms": {q["part"]: q["us_per_step"] / 1e3 for q in whole["parts"]},
        "kernels_ms": {
            k["name"]: [k["per_step"], k["us_per_step"] / 1e3] for k in whole["kernels"]
        },
        "idle_gaps": gaps,
        **split,
    }
    busy, span = report["busy_ms"], report["span_ms"]
    print(
        f"\n{report['backend']}: device busy {busy:.1f} ms of a {span:.1f} ms span "
        f"({span - busy:.1f} ms idle); {report['kernels']} kernels, "
        f"{split['kernels_outside_modules']} outside a program"
    )
    for part, ms in report["parts_ms"].items():
        print(f"  {part:40s} {ms:9.2f} ms")
    print(f"  top {args.kernels} kernels (count, ms):")
    for name, (count, ms) in list(report["kernels_ms"].items())[: args.kernels]:
        print(f"    {count:8.0f} {ms:9.2f}  {name[:100]}")
    print(
        f"  idle gaps >= {gaps['min_us']:g} us: {gaps['count']} of them, {gaps['ms']:.1f} ms; "
        "the largest groups (kernel before -> kernel after):"
    )
    for g in gaps["top"]:
        print(
            f"    {g['count']:6d} x, {g['ms']:8.2f} ms (longest {g['longest_us']:7.0f} us)  "
            f"{g['before'][:50]} -> {g['after'][:50]}"
        )
    for name, row in split["modules"].items():
        print(
            f"  {name[:60]:60s} x{row['executions']:5d}  span {row['span_ms']:9.2f} ms  "
            f"kernels {row['busy_ms']:9.2f} ms  gaps {row['gap_ms']:8.2f} ms"
        )
        parts = sorted(row["parts"].items(), key=lambda kv: -kv[1])[: args.parts]
        for part, ms in parts:
            print(f"      {part:40s} {ms:9.2f} ms")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving_profile.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
