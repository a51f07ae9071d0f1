"""Decode-step benchmark: jax_vmm KV cache vs the plain-JAX preallocated cache.

    python bench/decode.py                 # tiny grid on CPU, GPU grid on a GPU
    python bench/decode.py --out out/bench_decode   # + JSON and a plot

One process, side by side, same model (examples/model.py), same batch and per-sequence
capacity (context). Each sequence holds a live length drawn uniformly from
[--min-fill * context, context - steps]; the timed loop decodes --steps tokens for every
sequence (jitted step, cache donated, jax_vmm commits as sequences cross chunk
boundaries). Cache contents are not prefilled by the model: step time does not depend on
the values, only on shapes, lengths and where the memory lives.

Per grid point (every cache a `jax_vmm.KVCache` taken and returned by the jitted step,
written by `jax_vmm.kv_write(layer, ...)`):
  prealloc         jnp.zeros cache (array layers, donated scatter), plain-XLA masked
                   attention (reads all T)
  prealloc+kernel  the same cache, jax_vmm.decode_attention over its arrays (live tokens
                   only)
  vmm+kernel       the jax_vmm arena cache (arena layers: written in place, nothing
                   copied) + jax_vmm.decode_attention over the arena: against
                   prealloc+kernel only the cache differs
Reported: step time (best of --repeats passes; JSON has the median too) and ratio to
prealloc (goal <= 1.0);
KV memory held (prealloc: all of it; jax_vmm: peak backed) against the bytes of the
tokens actually held (goal: jax_vmm <= 1.1x); the step's XLA temp bytes.
Plus one case where the preallocated cache does not fit in device memory but the jax_vmm
one does (on CPU it is not attempted: a host OOM kills the process; jax_vmm memory only).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import subprocess
import sys
import time
from pathlib import Path

# The arena commits device memory outside XLA's allocator: keep XLA from taking 75% of
# the GPU up front (must be set before jax initialises its GPU backend).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from _common import command_line, two_panel_figure, write_json  # noqa: E402
from examples import engine as E  # noqa: E402
from examples import model as M  # noqa: E402
from examples.attention import reference_over_layer, vmm_kernel_available  # noqa: E402
from examples.cache import PreallocatedCache, VmmCache, capacity_bytes  # noqa: E402
from examples.memory import device_memory_stats, physical_memory_bytes, rss_bytes  # noqa: E402
from examples.report import fmt_bytes  # noqa: E402

GRIDS = {
    "gpu": dict(
        batches=(8, 32, 64),
        contexts=(1024, 4096, 16384),
        steps=20,
        repeats=3,
        oom=(64, 131072),
        oom_fill=(2048, 8192),
    ),
    "cpu": dict(
        batches=(2, 8),
        contexts=(256, 1024),
        steps=16,
        repeats=5,
        oom=(8, 1 << 22),
        oom_fill=(1024, 4096),
    ),
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


def time_decode(gen: E.Generator, lengths: np.ndarray, steps: int, repeats: int) -> dict:
    """Median per-step time of `steps` decode steps (all sequences active), after one
    untimed pass (compile, commits). Every pass starts from the same lengths."""
    cache = gen.cache
    positions = [jnp.asarray(lengths + i, jnp.int32) for i in range(steps)]
    tokens = jnp.zeros(cache.max_seqs, jnp.int32)
    t0 = time.perf_counter()
    gen.precompile([])  # the decode step only
    compile_s = time.perf_counter() - t0

    def one_pass() -> None:
        nonlocal tokens
        for i in range(steps):
            for seq in range(cache.max_seqs):  # memory follows the work: commit first
                cache.ensure(seq, int(lengths[seq]) + i + 1)
            _, tokens = gen.decode(tokens, positions[i])
        tokens.block_until_ready()

    one_pass()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        one_pass()
        times.append((time.perf_counter() - t0) / steps)
    cache.check()
    # Best pass: the machine's other load only ever adds time (median kept alongside).
    return {
        "step_ms": 1e3 * min(times),
        "step_ms_median": 1e3 * float(np.median(times)),
        "step_ms_all": [1e3 * t for t in times],
        "compile_s": compile_s,
        "temp_bytes": gen.decode_temp_bytes(),
    }


def run_case(
    kind: str,
    cfg: M.ModelConfig,
    params: M.Params,
    device: jax.Device,
    batch: int,
    context: int,
    lengths: np.ndarray,
    steps: int,
    repeats: int,
    chunk_bytes: int | None,
    time_it: bool = True,
) -> dict:
    """kind: prealloc | prealloc+kernel | vmm+kernel."""
    before = device_memory_stats(device)
    out: dict = {"kind": kind}
    t0 = time.perf_counter()
    if kind.startswith("prealloc"):
        cache = PreallocatedCache(cfg, max_seqs=batch, max_tokens=context, device=device)
    else:
        cache = VmmCache(
            cfg, max_seqs=batch, max_tokens=context, device=device, chunk_bytes=chunk_bytes
        )
    if kind.endswith("kernel"):
        import jax_vmm

        attend = jax_vmm.decode_attention
    else:
        attend = functools.partial(
            reference_over_layer, tail_may_be_garbage=cache.tail_may_be_garbage
        )
    out["setup_s"] = time.perf_counter() - t0
    out["writes"] = "arrays (donated scatter)" if kind.startswith("prealloc") else "arena"
    try:
        if time_it:
            out.update(
                time_decode(E.Generator(params, cfg, cache, attend), lengths, steps, repeats)
            )
        else:  # memory only: commit what the sequences hold
            for seq, n in enumerate(lengths):
                cache.ensure(seq, int(n) + steps)
        stats = cache.stats()
        after = device_memory_stats(device)
        out["held_bytes"] = int(stats.get("peak_backed_bytes", cache.backed_bytes()))
        out["reserved_bytes"] = cache.reserved_bytes()
        out["commit_calls"] = int(stats.get("commit_calls", 0))
        out["commit_seconds"] = float(stats.get("commit_seconds", 0.0))
        out["returned_cache_bytes"] = int(stats.get("returned_cache_bytes", 0))
        if before and after:  # XLA-allocator view; the arena is outside it
            out["xla_bytes_in_use_delta"] = after["bytes_in_use"] - before["bytes_in_use"]
            out["xla_peak_bytes_in_use"] = after.get("peak_bytes_in_use")
        out["rss_bytes"] = rss_bytes()
    finally:
        cache.close()
        gc.collect()
    return out


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
    jax.block_until_ready(cache.arrays())
    cache.close()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=("auto", *M.PRESETS), default="auto")
    p.add_argument("--batches", type=int, nargs="+")
    p.add_argument("--contexts", type=int, nargs="+")
    p.add_argument("--steps", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument(
        "--min-fill",
        type=float,
        default=0.25,
        help="live length of a sequence >= this fraction of the context",
    )
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--chunk-bytes", type=int, help="jax_vmm arena chunk size")
    p.add_argument("--oom-case", type=int, nargs=2, metavar=("BATCH", "CONTEXT"))
    p.add_argument("--no-oom-case", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="directory for decode.json and decode.png")
    p.add_argument("--try-prealloc", type=int, nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    device = jax.devices()[0]
    preset = (
        args.preset if args.preset != "auto" else ("gpu" if device.platform == "gpu" else "cpu")
    )
    grid = dict(GRIDS[preset])
    cfg = M.PRESETS[preset]
    if args.layers:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    if args.try_prealloc:  # child of try_prealloc()
        child_try_prealloc(cfg, *args.try_prealloc)
        return {}
    batches = args.batches or grid["batches"]
    contexts = args.contexts or grid["contexts"]
    steps, repeats = args.steps or grid["steps"], args.repeats or grid["repeats"]
    if not vmm_kernel_available():
        raise SystemExit("bench/decode.py needs jax_vmm.decode_attention")
    kinds = ["prealloc", "prealloc+kernel", "vmm+kernel"]
    rng = np.random.default_rng(args.seed)
    params = M.init_params(cfg, seed=args.seed)
    print(f"device {device.device_kind} ({device.platform}) | model {M.config_summary(cfg)}")
    print(
        f"KV bytes/token {cfg.kv_bytes_per_token} | {steps} steps x {repeats} passes | "
        f"live length per sequence uniform in [{args.min_fill:.2f} x context, "
        f"context - {steps}]"
    )

    results: list[dict] = []
    oom = None

    def save(final: bool) -> None:  # after every point: a later crash keeps the results
        if not args.out:
            return
        report = {
            "device": device.device_kind,
            "platform": device.platform,
            "jax": jax.__version__,
            "model": dataclasses.asdict(cfg),
            "steps": steps,
            "repeats": repeats,
            "min_fill": args.min_fill,
            "points": results,
            "oom": oom,
            "complete": final,
            "command": command_line(__file__, argv),
        }
        write_json(args.out / "decode.json", report)
        if final and results:
            plot(report, args.out / "decode.png")
            print(f"wrote {args.out / 'decode.json'} and {args.out / 'decode.png'}")

    for batch in batches:
        for context in contexts:
            lengths = live_lengths(rng, batch, context, steps, args.min_fill)
            live = int((lengths + steps).sum()) * cfg.kv_bytes_per_token
            point = {
                "batch": batch,
                "context": context,
                "live_bytes": live,
                "capacity_bytes": capacity_bytes(cfg, batch, context),
                "cases": {},
            }
            for kind in kinds:
                point["cases"][kind] = run_case(
                    kind,
                    cfg,
                    params,
                    device,
                    batch,
                    context,
                    lengths,
                    steps,
                    repeats,
                    args.chunk_bytes,
                )
            results.append(point)
            print_point(point)
            save(final=False)

    if not args.no_oom_case:
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
        # Timed on a GPU (the live-tokens-only kernel; the arena written in place); on the
        # CPU memory only (the grid's times are the CPU's measurement).
        can_time = device.platform == "gpu"
        oom["jax_vmm"] = run_case(
            "vmm+kernel",
            cfg,
            params,
            device,
            batch,
            context,
            lengths,
            steps,
            repeats,
            args.chunk_bytes,
            time_it=can_time,
        )
        print_oom(oom)
    save(final=True)
    return {"points": results, "oom": oom}


def print_point(pt: dict) -> None:
    base = pt["cases"]["prealloc"]
    live = pt["live_bytes"]
    head = f"B={pt['batch']:<3} T={pt['context']:<6} live {fmt_bytes(live):>10}"
    parts = [
        f"prealloc {base['step_ms']:8.2f} ms, holds {fmt_bytes(base['held_bytes'])} "
        f"({base['held_bytes'] / live:.2f}x live)"
    ]
    for kind, c in pt["cases"].items():
        if kind == "prealloc":
            continue
        parts.append(
            f"{kind} {c['step_ms']:8.2f} ms (x{c['step_ms'] / base['step_ms']:.2f}), "
            f"holds {fmt_bytes(c['held_bytes'])} ({c['held_bytes'] / live:.2f}x live)"
        )
    print(head + " | " + " | ".join(parts), flush=True)


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
        f"  jax_vmm ({vmm['kind']}): reserved {fmt_bytes(vmm['reserved_bytes'])}, backed "
        f"{fmt_bytes(vmm['held_bytes'])} ({vmm['held_bytes'] / oom['live_bytes']:.2f}x "
        f"live), {timing}"
    )


def plot(report: dict, path: Path) -> None:
    pts = report["points"]
    labels = [f"B{p['batch']}\nT{p['context']}" for p in pts]
    kinds = list(pts[0]["cases"]) if pts else []
    x = np.arange(len(pts))
    w = 0.8 / max(len(kinds), 1)
    with two_panel_figure(path, f"decode step, jax_vmm vs preallocated ({report['device']})") as (
        a1,
        a2,
    ):
        for i, kind in enumerate(kinds):
            a1.bar(x + i * w, [p["cases"][kind]["step_ms"] for p in pts], w, label=kind)
        a1.set_xticks(x + w * (len(kinds) - 1) / 2, labels, fontsize=8)
        a1.set_ylabel("decode step (ms)")
        a1.set_title("step time", fontsize=10)
        a1.legend(fontsize=8)
        big = max((p["capacity_bytes"] for p in pts), default=0) >= 1 << 30
        unit, div = ("GiB", 1024.0**3) if big else ("MiB", 1024.0**2)
        a2.bar(x - 0.2, [p["capacity_bytes"] / div for p in pts], 0.2, label="prealloc holds")
        a2.bar(
            x,
            [p["cases"]["vmm+kernel"]["held_bytes"] / div for p in pts],
            0.2,
            label="jax_vmm backed (peak)",
        )
        a2.bar(x + 0.2, [p["live_bytes"] / div for p in pts], 0.2, label="live tokens")
        a2.set_xticks(x, labels, fontsize=8)
        a2.set_ylabel(unit)
        a2.set_title("KV memory held", fontsize=10)
        a2.legend(fontsize=8)


if __name__ == "__main__":
    main()
