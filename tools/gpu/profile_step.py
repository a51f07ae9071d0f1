"""Where one decode step's time goes, over a preallocated cache and over the jax_vmm arena
(issue 29), side by side in one process.

    python tools/gpu/profile_step.py                           # 32 layers, B16 T1k
    python tools/gpu/profile_step.py --layers 8 --batch 64 --context 4096 --out DIR
    python tools/gpu/profile_step.py --no-command-buffers      # XLA_FLAGS: graphs off

The step is bench/_stack.py's (every layer: attention over the live tokens, then one new
token written; `--steps` steps in one jitted loop), for each of `--variants`
(default prealloc+cudnn, vmm+cudnn, vmm+kernel; the CPU runs the +kernel ones).

1. Wall clock, by ablation: the whole step, and the reads alone (no kv_write). Their
   difference per layer is the write's share (XLA's fused scatter on the prealloc side,
   the kv_write custom call on the arena side); the reads-alone difference between vmm
   and prealloc per layer is what reading the arena costs (ordered views and their
   check, or the token and the table read of the jax_vmm kernel).
2. Device time, from a jax.profiler trace (CUPTI) of one more call of the whole step:
   the kernels summed per part of the step (tools/gpu/trace_summary.py: kv_write vs
   XLA's DUS/scatter, cuDNN, the table read, memsets, other XLA fusions), and the device
   busy time against the span of the call: the gaps between kernels (launch gaps inside
   the command buffer) per layer. Nsight Systems is not usable on the H200 machines
   (/work/.library/device/KINDS.md), hence JAX's own profiler.

Prints two short tables; with --out writes profile.json and each variant's trace
(open the perfetto_trace.json.gz at ui.perfetto.dev).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]


def _set_xla_flags(argv: list[str] | None) -> None:
    """--no-command-buffers must reach XLA before jax starts its GPU backend."""
    args = sys.argv[1:] if argv is None else argv
    if "--no-command-buffers" in args:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_enable_command_buffer=".strip()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def main(argv: list[str] | None = None) -> dict:
    _set_xla_flags(argv)
    sys.path[:0] = [str(_ROOT / "bench"), str(Path(__file__).resolve().parent)]
    import tempfile

    import jax
    import numpy as np
    import trace_summary as TS

    import _stack as ST
    from _common import Table, write_json
    from jax_vmm.serving import model as M
    from jax_vmm.serving.attention import cudnn_unavailable

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--variants", nargs="+", choices=ST.VARIANTS)
    p.add_argument("--min-fill", type=float, default=0.25)
    p.add_argument("--no-trace", action="store_true", help="the wall-clock part only")
    p.add_argument("--no-command-buffers", action="store_true", help="XLA command buffers off")
    p.add_argument("--kernels", type=int, default=6, help="top kernels printed per variant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="directory for profile.json and the traces")
    args = p.parse_args(argv)

    device = jax.devices()[0]
    preset = "gpu" if device.platform == "gpu" else "cpu"
    cfg = dataclasses.replace(M.PRESETS[preset], num_layers=args.layers)
    no_cudnn = cudnn_unavailable(device.platform, cfg.dtype)
    gpu_default = ["prealloc+cudnn", "vmm+cudnn", "vmm+kernel"]
    variants = args.variants or (["prealloc+kernel", "vmm+kernel"] if no_cudnn else gpu_default)
    if no_cudnn and any(v in ST.CUDNN_VARIANTS for v in variants):
        raise SystemExit(f"--variants: {no_cudnn}")
    rng = np.random.default_rng(args.seed)
    lo = max(1, int(args.min_fill * args.context))
    lengths = rng.integers(lo, args.context - args.steps + 1, args.batch).astype(np.int32)
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="profile_step_"))
    flags = os.environ.get("XLA_FLAGS", "")
    print(
        f"device {device.device_kind} | model {M.config_summary(cfg)} | B={args.batch} "
        f"T={args.context} | {args.steps} steps per call, best of {args.repeats} | "
        f"XLA_FLAGS={flags or '(none)'}"
    )
    L, steps = cfg.num_layers, args.steps
    report: dict = {
        "device": device.device_kind,
        "jax": jax.__version__,
        "model": dataclasses.asdict(cfg),
        "batch": args.batch,
        "context": args.context,
        "steps": steps,
        "xla_flags": flags,
        "variants": {},
    }
    timing = dict(context=args.context, steps=steps, repeats=args.repeats)
    for variant in variants:
        trace_dir = out_dir / "traces" / variant.replace("+", "_")

        def traced() -> contextlib.AbstractContextManager:
            return jax.profiler.trace(str(trace_dir), create_perfetto_trace=True)

        whole = ST.time_variant(
            variant, cfg, device, lengths, around_call=None if args.no_trace else traced, **timing
        )
        reads = ST.time_variant(variant, cfg, device, lengths, writes=False, **timing)
        entry = {"step_ms": whole["step_ms"], "reads_ms": reads["step_ms"], "trace": None}
        if not args.no_trace:
            found = TS.trace_file(trace_dir)
            entry["trace_file"] = str(found) if found else None
            if found:
                entry["trace"] = TS.summarize(TS.load(found), steps=steps, layers=L)
        report["variants"][variant] = entry

    base = variants[0]
    b = report["variants"][base]
    t1 = Table(
        ("variant", 16, "<"),
        ("step ms", 9),
        ("reads ms", 9),
        ("write us/layer", 14),
        (f"+us/layer vs {base}", 26),
        ("reads +us/layer", 15),
    )
    print(f"\nwall clock per decode step ({L} layers); differences per layer in us")
    print(t1.header())
    print(t1.rule())
    for v, e in report["variants"].items():
        print(
            t1.row(
                v,
                f"{e['step_ms']:.3f}",
                f"{e['reads_ms']:.3f}",
                f"{1e3 * (e['step_ms'] - e['reads_ms']) / L:.2f}",
                f"{1e3 * (e['step_ms'] - b['step_ms']) / L:.2f}",
                f"{1e3 * (e['reads_ms'] - b['reads_ms']) / L:.2f}",
            )
        )

    traced_variants = {v: e["trace"] for v, e in report["variants"].items() if e["trace"]}
    if args.no_trace:
        pass
    elif not any(t["events"] for t in traced_variants.values()):
        print(
            "\nno device events in the traces (a CPU run, or CUPTI unavailable here): the "
            "wall-clock table above is the breakdown"
        )
    else:
        parts = []
        for t in traced_variants.values():
            parts += [p["part"] for p in t["parts"] if p["part"] not in parts]
        names = list(traced_variants)
        t2 = Table(("us per layer (kernels/layer)", 30, "<"), *[(v, 18) for v in names])
        print(f"\ndevice time per layer from the traces ({L} layers)")
        print(t2.header())
        print(t2.rule())

        def cell(t: dict, part: str) -> str:
            q = next((x for x in t["parts"] if x["part"] == part), None)
            return "-" if q is None else f"{q['us_per_layer']:.2f} ({q['per_step'] / L:.1f})"

        for part in parts:
            print(t2.row(part, *[cell(traced_variants[v], part) for v in names]))
        for key, label in (
            ("busy_us_per_layer", "busy (all kernels)"),
            ("gap_us_per_layer", "gaps (idle between kernels)"),
        ):
            print(t2.row(label, *[f"{traced_variants[v][key]:.2f}" for v in names]))
        for v in names:
            print(f"\n{v}: top kernels (count per step, us each)")
            for k in traced_variants[v]["kernels"][: args.kernels]:
                count, each = k["per_step"], k["us_each"]
                print(f"  {count:6.1f} x {each:8.2f} us  [{k['part']}] {k['name'][:90]}")
    if args.out:
        write_json(args.out / "profile.json", report)
        print(f"\nwrote {args.out / 'profile.json'} and the traces under {args.out / 'traces'}")
    return report


if __name__ == "__main__":
    main()
