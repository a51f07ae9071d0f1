"""Decode benchmark: what the memory backend costs, side by side in one process.

    python bench/decode.py                  # GPU grid on a GPU, a tiny grid on the CPU
    python bench/decode.py --quick          # one point, few steps, a small budget
    python bench/decode.py --out out/bench_decode   # + decode.json and decode.png
    python bench/decode.py --grid layers32  # the per-layer cost grid (also layers8)

1. Step time (bench/_stack.py): the attention-and-write stack of a decode step (every
   layer of the model's geometry: attention over each sequence's live tokens, then one
   new token written), `--steps` steps in one jitted loop, for five variants with the
   same batch, capacity and lengths:
     prealloc+cudnn   jnp.zeros cache + cuDNN (`jax.nn.dot_product_attention(...,
                      key_value_seq_lengths=lengths, implementation="cudnn")`): what a
                      JAX user would pick; the baseline of every ratio
     prealloc+kernel  the same cache + jax_vmm.decode_attention
     vmm+cudnn        the jax_vmm arena + cuDNN over its views (`jax_vmm.ordered_views`)
     vmm+kernel       the jax_vmm arena + jax_vmm.decode_attention
     prealloc+xla     jnp.zeros cache + masked plain-XLA attention over all T (the floor
                      a naive cache starts from)
   plus the physical floor: the KV bytes a step must move (live tokens read once, new ones
   written) at --peak-tbps (by default the device's: H200 4.8 TB/s, H100 3.35). Goal: vmm+X
   / prealloc+X <= 1.02 for X = cudnn and kernel; "+us/layer" is (vmm - prealloc) / layers
   with the same attention (cuDNN where both ran), the fixed cost per layer that --grid
   layers32 and layers8 (B 1/4/16/64 x T 1k/4k on a GPU, step time only) pin down. Each
   sequence's live length is uniform in [--min-fill * context, context - steps]; tokens are
   pre-ensured (commits are measured by bench/commit.py and the example) and filled with
   one pattern, so that the
   variants' output checksums must agree ("chk": the largest relative difference from
   the baseline's; bf16 rounding differs between the attentions). prealloc+X and vmm+X
   run as a pair, their calls interleaved round by round (both alive at once; timed
   apart where the pair does not fit), and the median [IQR] of the per-round ratios is
   printed under each row. On the CPU the cuDNN variants are skipped (cuDNN is GPU-only)
   and ratios are against prealloc+kernel.
2. Equal memory (bench/_equal_memory.py): at a fixed KV budget (--budget, GPU 16 GiB),
   the largest batch each backend serves with the example's request mix
   (examples/decode.py's preset), and its tokens/s through the example's engine.
   Goal: jax_vmm >= 2x prealloc's tokens/s.
3. Does not fit: a case where the preallocated cache cannot be allocated (attempted in a
   child process) and jax_vmm serves it (on the CPU not attempted: a host OOM kills the
   process; jax_vmm memory only).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

# The arena commits device memory outside XLA's allocator: keep XLA from taking 75% of
# the GPU up front (must be set before jax initialises its GPU backend).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import _equal_memory as EQ  # noqa: E402
import _stack as ST  # noqa: E402
import jax_vmm  # noqa: E402
from _common import (  # noqa: E402
    Table,
    command_line,
    hbm_tbps,
    parse_size,
    two_panel_figure,
    write_json,
)
from jax_vmm.serving import model as M  # noqa: E402
from jax_vmm.serving.attention import cudnn_unavailable, vmm_kernel_available  # noqa: E402
from jax_vmm.serving.cache import PreallocatedCache, VmmCache, capacity_bytes  # noqa: E402
from jax_vmm.serving.memory import physical_memory_bytes  # noqa: E402
from jax_vmm.serving.report import fmt_bytes  # noqa: E402

GRIDS = {
    "gpu": dict(
        batches=(16, 32, 64),
        contexts=(1024, 4096, 16384),
        steps=16,
        repeats=5,
        budget=16 << 30,
        oom=(64, 131072),
        oom_fill=(2048, 8192),
    ),
    "cpu": dict(
        batches=(2, 8),
        contexts=(256, 1024),
        steps=8,
        repeats=3,
        budget=2 << 20,
        oom=(8, 1 << 22),
        oom_fill=(1024, 4096),
    ),
}
# The per-layer cost grids (issue 29): the step-time part only, at a fixed layer count,
# with the rows that compare the memory backends under one attention, side by side.
LAYER_VARIANTS = ("prealloc+cudnn", "vmm+cudnn", "vmm+kernel")
LAYER_GRIDS = {
    "gpu": dict(batches=(1, 4, 16, 64), contexts=(1024, 4096), steps=8, repeats=21),
    "cpu": dict(batches=(1, 4), contexts=(256,), steps=4, repeats=3),
}
GRID_LAYERS = {"layers32": 32, "layers8": 8}
QUICK = {
    "gpu": dict(batches=(64,), contexts=(4096,), steps=8, repeats=3, budget=4 << 30),
    "cpu": dict(batches=(4,), contexts=(256,), steps=4, repeats=2, budget=1 << 20),
}


def live_lengths(
    rng: np.random.Generator, batch: int, context: int, headroom: int, min_fill: float
) -> np.ndarray:
    lo = max(1, int(min_fill * context))
    hi = context - headroom
    if hi < lo:
        raise ValueError(
            f"context {context} too small for {headroom} decode steps at min fill {min_fill}"
        )
    return rng.integers(lo, hi + 1, batch).astype(np.int32)


def measure_point(
    cfg: M.ModelConfig,
    device: jax.Device,
    batch: int,
    context: int,
    lengths: np.ndarray,
    timing: dict,
    *,
    peak_bytes_per_s: float,
    variants: tuple[str, ...],
) -> dict:
    """Every variant at one (batch, context, lengths) point (ST.time_all), and the floor.
    timing: steps, repeats, chunk_bytes (ST.time_variant's)."""
    steps = timing["steps"]
    moved = ST.bytes_per_step(cfg, lengths, steps)
    point = {
        "batch": batch,
        "context": context,
        "live_bytes": int((lengths + steps).sum()) * cfg.kv_bytes_per_token,
        "capacity_bytes": capacity_bytes(cfg, batch, context),
        "bytes_per_step": moved,
        "floor_ms": 1e3 * moved / peak_bytes_per_s,
        "cases": {},
        "skipped": {},
    }
    no_cudnn = cudnn_unavailable(device.platform, cfg.dtype)
    skip = {v: no_cudnn for v in variants if v in ST.CUDNN_VARIANTS and no_cudnn}
    point["cases"], point["skipped"], point["paired"] = ST.time_all(
        variants, cfg, device, lengths, context=context, skip=skip, **timing
    )
    return point


def baseline_of(point: dict) -> str | None:
    for name in (ST.BASELINE, "prealloc+kernel"):
        if name in point["cases"]:
            return name
    return None


def step_table(variants: tuple[str, ...]) -> Table:
    """The step-time table: one column per variant run, the floor, the two vmm/prealloc
    ratios (same attention), the extra time per layer and the checksum spread."""
    return Table(
        ("B", 4),
        ("T", 6),
        ("live", 10),
        *[(v, 16) for v in variants],
        ("floor", 9),
        ("vmm/pre cudnn", 13),
        ("vmm/pre kernel", 14),
        ("+us/layer", 9),
        ("chk", 8),
    )


def checksum_spread(pt: dict) -> float | None:
    """The largest |checksum - baseline's| / |baseline's| over the variants."""
    base = baseline_of(pt)
    if base is None:
        return None
    ref = pt["cases"][base]["checksum"]
    return max(abs(c["checksum"] - ref) for c in pt["cases"].values()) / max(abs(ref), 1e-30)


def extra_us_per_layer(pt: dict, layers: int) -> float | None:
    """(vmm - prealloc) step time per layer, in us, with the same attention: cuDNN where
    both ran, else the jax_vmm kernel."""
    for x in ("cudnn", "kernel"):
        a, b = pt["cases"].get(f"vmm+{x}"), pt["cases"].get(f"prealloc+{x}")
        if a and b:
            return 1e3 * (a["step_ms"] - b["step_ms"]) / layers
    return None


def step_row(pt: dict, layers: int, variants: tuple[str, ...] = ST.VARIANTS) -> str:
    base = baseline_of(pt)
    ref = pt["cases"][base]["step_ms"] if base else None
    cells = []
    for v in variants:
        c = pt["cases"].get(v)
        if c is None:
            cells.append("skipped")
        else:
            cells.append(f"{c['step_ms']:.3f} ({c['step_ms'] / ref:.2f})" if ref else "n/a")

    def vs(x: str) -> str:
        a, b = pt["cases"].get(f"vmm+{x}"), pt["cases"].get(f"prealloc+{x}")
        return f"{a['step_ms'] / b['step_ms']:.3f}" if a and b else "n/a"

    return step_table(variants).row(
        pt["batch"],
        pt["context"],
        fmt_bytes(pt["live_bytes"]),
        *cells,
        f"{pt['floor_ms']:.4f}",
        vs("cudnn"),
        vs("kernel"),
        "n/a" if (extra := extra_us_per_layer(pt, layers)) is None else f"{extra:.2f}",
        "n/a" if checksum_spread(pt) is None else f"{checksum_spread(pt):.1e}",
    )


def paired_text(pt: dict) -> str:
    return ", ".join(
        f"{kind} {p['median']:.3f} [{p['q1']:.3f}-{p['q3']:.3f}] over {p['rounds']}"
        for kind, p in pt["paired"].items()
    )


def try_prealloc(cfg: M.ModelConfig, batch: int, context: int, device: jax.Device) -> dict:
    """Attempts the preallocated cache that should not fit; reports what happened."""
    need = capacity_bytes(cfg, batch, context)
    if device.platform == "cpu" and need > 0.5 * physical_memory_bytes():
        return {
            "attempted": False,
            "needs_bytes": need,
            "why": f"needs {fmt_bytes(need)} of {fmt_bytes(physical_memory_bytes())} RAM: "
            "a host OOM would kill the process instead of raising",
        }
    # In a child process: XLA's allocator keeps whatever it grabbed before failing, which
    # would starve the jax_vmm arena that runs next in this process.
    cmd = [
        sys.executable,
        __file__,
        "--try-prealloc",
        str(batch),
        str(context),
        "--layers",
        str(cfg.num_layers),
        "--preset",
        _preset_of(cfg),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode == 0:
        return {"attempted": True, "fits": True, "needs_bytes": need}
    lines = [
        ln for ln in proc.stderr.splitlines() if "RESOURCE_EXHAUSTED" in ln or "Error" in ln
    ] or proc.stderr.splitlines()[-1:]
    return {
        "attempted": True,
        "fits": False,
        "needs_bytes": need,
        "error": (lines[-1] if lines else f"exit {proc.returncode}")[:300],
    }


def _preset_of(cfg: M.ModelConfig) -> str:
    return next(
        name
        for name, p in M.PRESETS.items()
        if dataclasses.replace(p, num_layers=cfg.num_layers) == cfg
    )


def child_try_prealloc(cfg: M.ModelConfig, batch: int, context: int) -> None:
    cache = PreallocatedCache(cfg, max_seqs=batch, max_tokens=context)
    jax.block_until_ready(jax.tree_util.tree_leaves(cache.cache()))
    cache.close()


def print_oom(oom: dict) -> None:
    pre, vmm = oom["prealloc"], oom["jax_vmm"]
    print(
        f"\ndoes-not-fit case: B={oom['batch']} T={oom['context']}: preallocated cache "
        f"needs {fmt_bytes(oom['capacity_bytes'])}, live tokens "
        f"{fmt_bytes(oom['live_bytes'])}"
    )
    if not pre.get("attempted"):
        print(f"  prealloc: not attempted ({pre['why']})")
    elif pre["fits"]:
        print("  prealloc: FITS on this device (pick a larger --oom-case)")
    else:
        print(f"  prealloc: failed: {pre['error']}")
    timing = f"{vmm['step_ms']:.2f} ms/step" if "step_ms" in vmm else "memory only, not timed"
    print(
        f"  jax_vmm ({vmm['variant']}): reserved {fmt_bytes(vmm['reserved_bytes'])}, backed "
        f"{fmt_bytes(vmm['held_bytes'])} ({vmm['held_bytes'] / oom['live_bytes']:.2f}x "
        f"live), {timing}"
    )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=("auto", *M.PRESETS), default="auto")
    p.add_argument("--quick", action="store_true", help="one point, few steps, small budget")
    p.add_argument("--batches", type=int, nargs="+")
    p.add_argument("--contexts", type=int, nargs="+")
    p.add_argument("--steps", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument(
        "--grid",
        choices=tuple(GRID_LAYERS),
        help="the per-layer cost grid at 32 or 8 layers: B 1/4/16/64 x T 1k/4k (GPU), step "
        f"time only, variants {', '.join(LAYER_VARIANTS)}",
    )
    p.add_argument("--variants", nargs="+", choices=ST.VARIANTS)
    p.add_argument(
        "--min-fill",
        type=float,
        default=0.25,
        help="live length of a sequence >= this fraction of the context",
    )
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--chunk-bytes", type=int, help="jax_vmm arena chunk size")
    p.add_argument(
        "--kv-layout",
        choices=jax_vmm.KV_LAYOUTS,
        default="per_layer",
        help="the jax_vmm arena's layout (kv_arena(layout=...)); interleaved drops vmm+cudnn "
        "(it reads layer views; vmm+kernel reads through the cache, cuDNN's route included)",
    )
    p.add_argument(
        "--peak-tbps",
        type=float,
        help="HBM bandwidth of the floor (default: the device's, _common.HBM_TBPS)",
    )
    p.add_argument("--budget", type=parse_size, help="KV budget of the equal-memory case")
    p.add_argument("--block", type=int, help="decode block of the equal-memory runs")
    p.add_argument("--no-equal-memory", action="store_true")
    p.add_argument("--oom-case", type=int, nargs=2, metavar=("BATCH", "CONTEXT"))
    p.add_argument("--no-oom-case", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="directory for decode.json and decode.png")
    p.add_argument("--try-prealloc", type=int, nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    device = jax.devices()[0]
    if args.peak_tbps is None:
        args.peak_tbps = hbm_tbps(device)
    preset = (
        args.preset if args.preset != "auto" else ("gpu" if device.platform == "gpu" else "cpu")
    )
    grid = dict(GRIDS[preset])
    if args.grid:
        grid.update(LAYER_GRIDS[preset])
        args.layers = args.layers or GRID_LAYERS[args.grid]
        args.no_equal_memory = args.no_oom_case = True
    if args.quick:
        grid.update(QUICK[preset])
    variants = tuple(args.variants or (LAYER_VARIANTS if args.grid else ST.VARIANTS))
    cfg = M.PRESETS[preset]
    if args.layers:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    if args.try_prealloc:  # child of try_prealloc()
        child_try_prealloc(cfg, *args.try_prealloc)
        return {}
    batches = args.batches or grid["batches"]
    contexts = args.contexts or grid["contexts"]
    steps, repeats = args.steps or grid["steps"], args.repeats or grid["repeats"]
    budget = args.budget or grid["budget"]
    if not vmm_kernel_available():
        raise SystemExit("bench/decode.py needs jax_vmm.decode_attention")
    rng = np.random.default_rng(args.seed)
    print(f"device {device.device_kind} ({device.platform}) | model {M.config_summary(cfg)}")
    print(
        f"KV bytes/token {cfg.kv_bytes_per_token} | {steps} steps per call, best of "
        f"{repeats} calls | live length per sequence uniform in [{args.min_fill:.2f} x "
        f"context, context - {steps}] | floor at {args.peak_tbps} TB/s"
    )
    timing = dict(
        steps=steps, repeats=repeats, chunk_bytes=args.chunk_bytes, kv_layout=args.kv_layout
    )
    if args.kv_layout != "per_layer" and "vmm+cudnn" in variants:  # it reads layer views
        variants = tuple(v for v in variants if v != "vmm+cudnn")
        print(f"note: --kv-layout {args.kv_layout}: no layer views, so no vmm+cudnn")
    no_cudnn = cudnn_unavailable(device.platform, cfg.dtype)
    if args.grid and no_cudnn and not args.variants:  # the same comparison, kernel only
        variants = ("prealloc+kernel", "vmm+kernel")
    if no_cudnn:
        print(f"note: {no_cudnn}: the cuDNN variants are skipped; ratios are vs prealloc+kernel")

    results: list[dict] = []
    report: dict = {
        "device": device.device_kind,
        "platform": device.platform,
        "jax": jax.__version__,
        "model": dataclasses.asdict(cfg),
        "steps": steps,
        "repeats": repeats,
        "min_fill": args.min_fill,
        "grid": args.grid,
        "peak_tbps": args.peak_tbps,
        "points": results,
        "equal_memory": None,
        "oom": None,
        "complete": False,
        "command": command_line(__file__, argv),
    }

    def save(final: bool) -> None:  # after every part: a later crash keeps the results
        report["complete"] = final
        if not args.out:
            return
        write_json(args.out / "decode.json", report)
        if final and results:
            plot(report, args.out / "decode.png")
            print(f"wrote {args.out / 'decode.json'} and {args.out / 'decode.png'}")

    print("\nstep time, ms per decode step (ratio to the baseline) | floor | vmm/prealloc")
    table = step_table(variants)
    print(table.header())
    print(table.rule())
    for batch in batches:
        for context in contexts:
            lengths = live_lengths(rng, batch, context, steps, args.min_fill)
            point = measure_point(
                cfg,
                device,
                batch,
                context,
                lengths,
                timing,
                peak_bytes_per_s=args.peak_tbps * 1e12,
                variants=variants,
            )
            point["checksum_spread"] = checksum_spread(point)
            results.append(point)
            print(step_row(point, cfg.num_layers, variants), flush=True)
            if point["paired"]:
                print("     paired vmm/prealloc, median [IQR] of the rounds: " + paired_text(point))
            for name, c in point["cases"].items():
                if c["temp_bytes"] >= point["capacity_bytes"] // 2:
                    print(
                        f"     note: {name} needs {fmt_bytes(c['temp_bytes'])} of XLA temp "
                        "memory: the cache is copied, not updated in place"
                    )
            save(final=False)

    if not args.no_equal_memory:
        report["equal_memory"] = EQ.run(
            preset,
            cfg,
            device,
            budget,
            block=args.block,
            seed=args.seed,
            quick=args.quick,
            chunk_bytes=args.chunk_bytes,
            peak_bytes_per_s=args.peak_tbps * 1e12,
            kv_layout=args.kv_layout,
        )
        EQ.print_result(report["equal_memory"])
        save(final=False)

    if not args.no_oom_case and not args.quick:
        batch, context = args.oom_case or grid["oom"]
        lo, hi = grid["oom_fill"]
        lengths = rng.integers(lo, hi + 1, batch).astype(np.int32)
        oom = {
            "batch": batch,
            "context": context,
            "live_bytes": int((lengths + steps).sum()) * cfg.kv_bytes_per_token,
            "capacity_bytes": capacity_bytes(cfg, batch, context),
            "prealloc": try_prealloc(cfg, batch, context, device),
        }
        if device.platform == "gpu":  # timed: the live-tokens-only kernel over the arena
            oom["jax_vmm"] = ST.time_variant(
                "vmm+kernel", cfg, device, lengths, context=context, **timing
            )
        else:  # memory only (the grid's times are the CPU's measurement)
            oom["jax_vmm"] = vmm_memory_only(cfg, device, lengths, context, steps, args.chunk_bytes)
        report["oom"] = oom
        print_oom(oom)
    save(final=True)
    return report


def vmm_memory_only(
    cfg: M.ModelConfig,
    device: jax.Device,
    lengths: np.ndarray,
    context: int,
    steps: int,
    chunk_bytes: int | None,
) -> dict:
    cache = VmmCache(
        cfg, max_seqs=len(lengths), max_tokens=context, device=device, chunk_bytes=chunk_bytes
    )
    try:
        for seq, n in enumerate(lengths):
            cache.ensure(seq, int(n) + steps)
        return {
            "variant": "vmm (memory only)",
            "held_bytes": cache.backed_bytes(),
            "reserved_bytes": cache.reserved_bytes(),
        }
    finally:
        cache.close()


def plot(report: dict, path: Path) -> None:
    pts = report["points"]
    labels = [f"B{p['batch']}\nT{p['context']}" for p in pts]
    kinds = [v for v in ST.VARIANTS if any(v in p["cases"] for p in pts)]
    x = np.arange(len(pts))
    w = 0.8 / max(len(kinds) + 1, 1)
    with two_panel_figure(
        path, f"decode step: memory backends x attention ({report['device']})"
    ) as (
        a1,
        a2,
    ):
        for i, kind in enumerate(kinds):
            a1.bar(
                x + i * w,
                [p["cases"][kind]["step_ms"] if kind in p["cases"] else 0 for p in pts],
                w,
                label=kind,
            )
        a1.bar(x + len(kinds) * w, [p["floor_ms"] for p in pts], w, label="floor", color="k")
        a1.set_xticks(x + w * len(kinds) / 2, labels, fontsize=8)
        a1.set_ylabel("ms per decode step (attention + KV write, all layers)")
        a1.set_title("step time", fontsize=10)
        a1.legend(fontsize=7)
        big = max((p["capacity_bytes"] for p in pts), default=0) >= 1 << 30
        unit, div = ("GiB", 1024.0**3) if big else ("MiB", 1024.0**2)
        vmm = next((k for k in ("vmm+kernel", "vmm+cudnn") if k in kinds), None)
        a2.bar(x - 0.2, [p["capacity_bytes"] / div for p in pts], 0.2, label="prealloc holds")
        if vmm:
            a2.bar(
                x,
                [p["cases"][vmm]["held_bytes"] / div if vmm in p["cases"] else 0 for p in pts],
                0.2,
                label="jax_vmm backed",
            )
        a2.bar(x + 0.2, [p["live_bytes"] / div for p in pts], 0.2, label="live tokens")
        a2.set_xticks(x, labels, fontsize=8)
        a2.set_ylabel(unit)
        a2.set_title("KV memory held", fontsize=10)
        a2.legend(fontsize=8)


if __name__ == "__main__":
    main()
