"""Growth benchmark: grow a KV cache from 16 GiB to 20 GiB, jax_vmm vs plain JAX.

    python bench/growth.py                       # GPU: 16 -> 20 GiB; CPU: scaled 1/64
    python bench/growth.py --scale 0.125 --out out/bench_growth

Cache geometry: issue 31's (32 layers, 8 KV heads x 128, bf16: 128 KiB per token over
all 64 buffers, K and V). Methods, each in its own fresh process so that peak memory is its
own:
  jax_vmm      kv_arena sized for the final length; growth = kv.ensure(more tokens):
               commit physical memory under the existing addresses, no copy. Variants:
               "default" (the kv_arena defaults: 2 MiB chunks, allocations of up to 1 GiB
               per contiguous run, no zero fill), "+fill" (zero_fill=True), "chunk
               handles" (handle_bytes = chunk_bytes: one allocation per 2 MiB, zero fill).
               In the same process: the seed (bench/_seed.py: the simplest VMM cache, one
               cuMemCreate + cuMemMap + cuMemSetAccess per extension of a buffer) making
               the same extensions, the floor of any VMM growth.
  stacked      plain JAX, one (layers, 2, T, H, D) array: allocate the larger array and
               copy the old one into it (jit, AOT-compiled, so no compile is timed); its
               floor is the copy: (old bytes read + new bytes written) / copy bandwidth.
  per-layer    plain JAX, one array per layer and K/V, grown one at a time (old one freed
               before the next): the careful way, lower peak, same copying.
Reported: growth time (first, and median of --repeats; every repeat grows anew: plain
JAX from a freshly made old cache, jax_vmm after shrinking back), the ratio to each
plain-JAX way (goal >= 20x), jax_vmm against the seed (goal <= 1.0x), and the peak memory during
growth against the final cache size (goal <= 1.00x; a copy needs about 2x). GPU memory:
XLA allocator peak (plain JAX) or XLA bytes in use + arena backed (jax_vmm; the arena is
outside XLA's allocator). CPU memory: the cache's own bytes before growth (plain JAX: the
old arrays, fully written; jax_vmm: the arena's backed bytes, physically allocated at
commit by the host driver) plus the growth of the resident set during the growth (VmHWM,
reset just before). Data survive growth in every method (sentinel tokens) and the grown
region is writable to its end.

Scratch (--parts scratch, in its own process): the device's default graph-safe scratch
workspace grown by doubling from 1 MiB to 4 GiB (the CPU: 256 MiB; jax_vmm.ops.scratch.reserve,
default mode), time per growth, against retire-not-free (vllm.cpp's scratch: cuMemAlloc of the
new size, the old block kept), in the same process (goal <= 1 ms per growth).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from _common import GiB, Table, command_line, copy_bandwidth, two_panel_figure, write_json  # noqa: E402
from _raw import RawCuda, raw_for  # noqa: E402
from jax_vmm.serving.memory import device_memory_stats, peak_rss_bytes, reset_peak_rss, rss_bytes  # noqa: E402
from jax_vmm.serving.report import fmt_bytes  # noqa: E402

METHODS = ("jax_vmm", "stacked", "per-layer", "scratch")
#: jax_vmm variants: (label, handle_bytes (None: the KV default; 0: one per chunk), zero_fill)
VARIANTS = {"default": (None, False), "+fill": (None, True), "chunk handles": (0, True)}


def geometry(args: argparse.Namespace) -> dict:
    dt = jnp.dtype(args.dtype)
    token_layer = args.kv_heads * args.head_dim * dt.itemsize  # one layer, K or V
    token_all = 2 * args.layers * token_layer
    t_from = int(args.from_gib * args.scale * GiB) // token_all
    t_to = int(args.to_gib * args.scale * GiB) // token_all
    if not 0 < t_from < t_to:
        raise SystemExit(
            f"--from-gib {args.from_gib} / --to-gib {args.to_gib} x scale "
            f"{args.scale}: need 0 < from < to (in whole tokens)"
        )
    return dict(
        layers=args.layers,
        heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=str(dt),
        token_bytes=token_all,
        tokens_from=t_from,
        tokens_to=t_to,
        bytes_from=t_from * token_all,
        bytes_to=t_to * token_all,
    )


def _memory_probe(device: jax.Device) -> dict:
    stats = device_memory_stats(device)
    return {
        "rss": rss_bytes(),
        "xla_in_use": stats["bytes_in_use"] if stats else None,
        "xla_peak": stats.get("peak_bytes_in_use") if stats else None,
    }


def _sentinel(i: int, g: dict) -> np.ndarray:
    return np.full((g["heads"], g["head_dim"]), float(i + 1), np.float32)


# ------------------------------------------------------------------------ jax_vmm


def _write_tokens(kv, buf, token: int, values: np.ndarray) -> None:
    """Host copy into one token of a buffer (no raw view: the arena stays view-free)."""
    data = np.ascontiguousarray(values.astype(kv.dtype))
    kv.arena._handle.copy_in(buf.id, token * kv.token_bytes, data.ctypes.data, data.nbytes)


def raw_growth(raw, runs: int, run_bytes: int, handle: int, repeats: int) -> float | None:
    """Median seconds for the raw driver to commit `runs` separate runs of run_bytes with
    allocations of `handle` bytes (the same work as the arena's growth, nothing more;
    handle = run_bytes: the seed's one allocation per extension)."""
    if raw is None:
        return None
    gap = run_bytes + handle  # runs apart, as the layer buffers are
    if isinstance(raw, RawCuda):
        va = raw.reserve(runs * gap, 2 << 20)
        commit, decommit, _, _ = raw.runs_ops(
            [(va + i * gap, run_bytes) for i in range(runs)], handle
        )
    else:
        va = raw.reserve(runs * gap)
        commit, decommit, _, _ = raw.runs_ops(
            [(va + i * gap, run_bytes) for i in range(runs)], handle, base=va
        )
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        commit()
        if i:
            times.append(time.perf_counter() - t0)
        decommit()
    if isinstance(raw, RawCuda):
        raw.free(va, runs * gap)
    else:
        raw.unreserve(va, runs * gap)
    return float(np.median(times))


def run_vmm(g: dict, repeats: int, variant: str) -> dict:
    import jax_vmm

    device = jax.devices()[0]
    idle = _memory_probe(device)
    handle, fill = VARIANTS[variant]
    if handle == 0:  # one allocation per chunk: ask the driver what a chunk is
        with jax_vmm.Arena(1) as probe:  # the default device's chunk
            handle = probe.chunk_bytes
    kv = jax_vmm.kv_arena(
        num_layers=g["layers"],
        num_kv_heads=g["heads"],
        head_dim=g["head_dim"],
        max_tokens=g["tokens_to"],
        dtype=g["dtype"],
        zero_fill=fill,
        handle_bytes=handle,
    )
    t_from, t_to = g["tokens_from"], g["tokens_to"]
    kv.ensure(t_from)
    for layer in range(g["layers"]):  # sentinels at both ends of the old range
        _write_tokens(kv, kv.k_buffers[layer], 0, _sentinel(layer, g))
        _write_tokens(kv, kv.k_buffers[layer], t_from - 1, _sentinel(layer + 100, g))
    # The seed, measured now (the arena holds the old cache; the seed's extensions add the
    # growth's bytes once more, then give them back): one allocation per extension.
    run_bytes = (t_to - t_from) * kv.token_bytes
    raw = raw_for(device)
    raw_s = raw_growth(raw, 2 * g["layers"], run_bytes, run_bytes, repeats)
    before = _memory_probe(device)
    times, peak_rss, reset_ok = [], 0, True
    for i in range(repeats):
        if i:
            kv.shrink(t_from, wait=True)  # give the grown part back: the next repeat commits anew
        reset_ok &= reset_peak_rss()
        t0 = time.perf_counter()
        kv.ensure(t_to)
        times.append(time.perf_counter() - t0)
        peak_rss = max(peak_rss, peak_rss_bytes())
    after = _memory_probe(device)
    stats = kv.stats()
    # Data kept, new tail backed and writable (one token at the very end of every layer).
    ok = kv.backed_tokens() >= t_to
    for layer in range(g["layers"]):
        got = np.asarray(kv.k[layer][jnp.asarray([0, t_from - 1])], np.float32)
        ok &= bool(
            np.array_equal(got[0], _sentinel(layer, g))
            and np.array_equal(got[1], _sentinel(layer + 100, g))
        )
    for layer in range(g["layers"]):  # the grown region is writable, to its very end
        _write_tokens(kv, kv.v_buffers[layer], t_to - 1, np.full((g["heads"], g["head_dim"]), 0.25))
    ok &= bool(np.all(np.asarray(kv.v[g["layers"] - 1][t_to - 1], np.float32) == 0.25))
    out = {
        "method": "jax_vmm",
        "variant": variant,
        "chunk_bytes": stats["chunk_bytes"],
        "handle_bytes": stats["handle_bytes"],
        "zero_fill": stats["zero_fill"],
        "times_s": times,
        "raw_s": raw_s,
        "data_ok": bool(ok),
        "idle": idle,
        "before": before,
        "after": after,
        "peak_rss": peak_rss,
        "rss_peak_reset": bool(reset_ok),
        "arena_peak_backed": stats["peak_backed_bytes"],
        "commit_calls": stats["commit_calls"],
        "commit_seconds": stats["commit_seconds"],
        "chunks_created": stats["chunks_created"],
        "handles_created": stats["handles_created"],
        "commit_drains": stats["commit_drains"],
    }
    kv.close()
    return out


# ------------------------------------------------------------------------ plain JAX


def run_plain(g: dict, repeats: int, stacked: bool) -> dict:
    device = jax.devices()[0]
    idle = _memory_probe(device)
    L, H, D = g["layers"], g["heads"], g["head_dim"]
    t_from, t_to, dt = g["tokens_from"], g["tokens_to"], jnp.dtype(g["dtype"])
    shape = (L, 2, t_from, H, D) if stacked else (t_from, H, D)
    make = jax.jit(lambda: jnp.full(shape, 0.5, dt))
    # Sentinels at both ends of the old range (in the first array).
    mark = jax.jit(
        lambda a: a.at[..., 0, :, :].set(1.0).at[..., t_from - 1, :, :].set(2.0), donate_argnums=0
    )

    def old_cache() -> list[jax.Array]:
        olds = [make() for _ in range(1 if stacked else 2 * L)]
        olds[0] = mark(olds[0])
        return jax.block_until_ready(olds)

    def grow(old: jax.Array) -> jax.Array:  # allocate larger, copy the old tokens in
        new = jnp.zeros(old.shape[:-3] + (t_to, H, D), dt)
        return jax.lax.dynamic_update_slice_in_dim(new, old, 0, axis=old.ndim - 3)

    grow_c = jax.jit(grow).lower(jax.ShapeDtypeStruct(shape, dt)).compile()  # not timed
    times, peak_rss, reset_ok = [], 0, True
    news: list[jax.Array] = []
    before = after = None
    for _ in range(repeats):
        for a in news:  # each repeat starts again from an old cache only
            a.delete()
        olds = old_cache()
        before = before or _memory_probe(device)
        reset_ok &= reset_peak_rss()
        t0 = time.perf_counter()
        news = []
        for i in range(len(olds)):
            news.append(grow_c(olds[i]))
            if not stacked:  # the careful way: free each old array once it is copied
                news[-1].block_until_ready()
            olds[i].delete()
        jax.block_until_ready(news)
        times.append(time.perf_counter() - t0)
        peak_rss = max(peak_rss, peak_rss_bytes())
        after = _memory_probe(device)
    first = np.asarray(news[0][..., jnp.asarray([0, t_from - 1, t_to - 1]), :, :], np.float32)
    ok = bool(
        np.all(first[..., 0, :, :] == 1.0)
        and np.all(first[..., 1, :, :] == 2.0)
        and np.all(first[..., 2, :, :] == 0.0)
    )
    floor = None
    if stacked:  # the copy's floor: old bytes read + new bytes written at copy bandwidth
        floor = (g["bytes_from"] + g["bytes_to"]) / copy_bandwidth(device, 1 << 30)
    return {
        "method": "stacked" if stacked else "per-layer",
        "copy_floor_s": floor,
        "times_s": times,
        "data_ok": ok,
        "idle": idle,
        "before": before,
        "after": after,
        "peak_rss": peak_rss,
        "rss_peak_reset": bool(reset_ok),
    }


# ------------------------------------------------------------------------ scratch


def run_scratch(repeats: int) -> dict:
    """The default scratch workspace doubled from 1 MiB to 4 GiB (one process, once: an
    outgrown workspace is kept for the life of the process), against retire-not-free."""
    from jax_vmm.ops import scratch

    device = jax.devices()[0]
    top = 13 if device.platform == "gpu" else 9  # 4 GiB; the host commits real RAM: 256 MiB
    sizes = [(1 << 20) << k for k in range(top)]
    vmm = []
    for n in sizes:
        t0 = time.perf_counter()
        scratch.reserve(n, device)
        vmm.append(time.perf_counter() - t0)
    dev = "cpu" if device.platform == "cpu" else f"cuda:{device.id}"
    ws = [w for w in scratch.scratch_stats() if w["device"] == dev and w["stream"] == 0]
    out = {"method": "scratch", "sizes": sizes, "vmm_s": vmm, "workspaces": ws, "peer_s": None}
    raw = raw_for(device)
    if isinstance(raw, RawCuda):  # retire-not-free: a block of the new size, the old one kept
        cu, ok = raw.cu, raw._ok
        peer, kept = [], []
        for n in sizes:
            t0 = time.perf_counter()
            kept.append(ok(cu.cuMemAlloc(n)))
            peer.append(time.perf_counter() - t0)
        for p in kept:
            ok(cu.cuMemFree(p))
        out["peer_s"] = peer
    return out


SCRATCH = Table(("growth", 24, "<"), ("jax_vmm", 10), ("retire-not-free", 15), ("ratio", 7))


def print_scratch(r: dict) -> None:
    from jax_vmm.serving.report import fmt_bytes as fb

    vmm, peer = r["vmm_s"], r["peer_s"]
    print(
        f"\nscratch growth (default workspace, default mode), doubling 1 MiB -> "
        f"{fb(r['sizes'][-1])}"
    )
    print(SCRATCH.header())
    sizes = r["sizes"]
    for i in range(1, len(sizes)):
        p = peer[i] if peer else None
        print(
            SCRATCH.row(
                f"{fb(sizes[i - 1])} -> {fb(sizes[i])}",
                f"{vmm[i] * 1e3:.3f}ms",
                f"{p * 1e3:.3f}ms" if p else "-",
                f"{vmm[i] / p:.1f}x" if p else "-",
            )
        )
    mean = float(np.mean(vmm[1:]))
    pm = float(np.mean(peer[1:])) if peer else None
    print(
        SCRATCH.row(
            "per growth (mean)",
            f"{mean * 1e3:.3f}ms",
            f"{pm * 1e3:.3f}ms" if pm else "-",
            f"{mean / pm:.1f}x" if pm else "-",
        )
        + "   (goal: <= 1 ms per growth)"
    )
    for w in r["workspaces"]:
        print(
            f"  workspace gen {w['generation']} {w['mode']}: capacity {fb(w['capacity'])}, "
            f"backed {fb(w['backed_bytes'])}, retired blocks {w['retired_blocks']}"
        )


# ------------------------------------------------------------------------ driver


def peak_growth_bytes(r: dict, g: dict, platform: str) -> int:
    """Peak memory of the cache while growing: what holds the cache plus whatever else
    the growth allocated, excluding what the process held before the cache existed."""
    if platform == "gpu":
        if r["method"] == "jax_vmm":  # XLA holds nothing of the cache; the arena does
            return r["arena_peak_backed"] + r["after"]["xla_in_use"] - r["idle"]["xla_in_use"]
        return r["after"]["xla_peak"] - r["idle"]["xla_in_use"]
    # CPU: the old cache (plain JAX: resident arrays, written in full; jax_vmm: the arena's
    # physical memory, allocated by the host driver at commit, in a memfd that is
    # resident only where mapped pages were touched) + what the resident set grew by.
    extra = max(0, r["peak_rss"] - r["before"]["rss"])
    held = r["arena_peak_backed"] if r["method"] == "jax_vmm" else g["bytes_from"]
    return held + extra


def child(args: argparse.Namespace) -> None:
    g = geometry(args)
    if args.method == "jax_vmm":
        out = run_vmm(g, args.repeats, args.variant)
    elif args.method == "scratch":
        out = run_scratch(args.repeats)
    else:
        out = run_plain(g, args.repeats, stacked=args.method == "stacked")
    out["platform"] = jax.devices()[0].platform
    Path(args.child_out).write_text(json.dumps(out))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--from-gib", type=float, default=16.0)
    p.add_argument("--to-gib", type=float, default=20.0)
    p.add_argument(
        "--scale", type=float, help="multiply both sizes (default 1 on a GPU, 1/64 on the CPU)"
    )
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=list(VARIANTS),
        help="jax_vmm configurations (default: all)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--parts",
        default="growth,scratch",
        help="growth (the KV cache) and/or scratch (the scratch workspace)",
    )
    p.add_argument("--out", type=Path, help="directory for growth.json and growth.png")
    p.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--variant", default="default", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    platform = jax.devices()[0].platform  # no allocation: children own the memory
    if args.scale is None:
        args.scale = 1.0 if platform == "gpu" else 1 / 64
    if args.method:
        child(args)
        return {}
    g = geometry(args)
    print(
        f"grow {fmt_bytes(g['bytes_from'])} -> {fmt_bytes(g['bytes_to'])} "
        f"({g['tokens_from']} -> {g['tokens_to']} tokens, {g['layers']} layers, "
        f"{g['heads']}x{g['head_dim']} {g['dtype']}) on {platform}; {args.repeats} repeats"
    )
    parts = set(args.parts.split(","))
    runs = []
    if "growth" in parts:
        runs = [("stacked", "-"), ("per-layer", "-")] + [("jax_vmm", v) for v in args.variants]
    if "scratch" in parts:
        runs.append(("scratch", "-"))
    results, scratch_result = [], None
    passthrough = [
        "--from-gib",
        str(args.from_gib),
        "--to-gib",
        str(args.to_gib),
        "--scale",
        repr(args.scale),
        "--layers",
        str(args.layers),
        "--kv-heads",
        str(args.kv_heads),
        "--head-dim",
        str(args.head_dim),
        "--dtype",
        args.dtype,
        "--repeats",
        str(args.repeats),
    ]
    for method, variant in runs:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [
                sys.executable,
                __file__,
                *passthrough,
                "--method",
                method,
                "--variant",
                variant,
                "--child-out",
                f.name,
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                print(
                    f"{method} ({variant}) FAILED (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
                )
                results.append({"method": method, "variant": variant, "error": proc.stderr[-3000:]})
                continue
            r = json.loads(Path(f.name).read_text())
        if method == "scratch":
            scratch_result = r
            continue
        r["peak_growth_bytes"] = peak_growth_bytes(r, g, platform)
        results.append(r)
    report = {
        "platform": platform,
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "geometry": g,
        "repeats": args.repeats,
        "results": results,
        "scratch": scratch_result,
        "command": command_line(__file__, argv),
    }
    if results:
        print_table(report)
    if scratch_result:
        print_scratch(scratch_result)
    if args.out and results:
        write_json(args.out / "growth.json", report)
        plot(report, args.out / "growth.png")
        print(f"wrote {args.out / 'growth.json'} and {args.out / 'growth.png'}")
    return report


def _label(r: dict) -> str:
    if r["method"] != "jax_vmm":
        return f"plain JAX, {r['method']}"
    return f"jax_vmm {r['variant']} (handles {fmt_bytes(r['handle_bytes'])})"


TABLE = Table(
    ("method", 38, "<"),
    ("first", 9),
    ("median", 9),
    ("vs stacked", 10),
    ("vs per-layer", 12),
    ("seed|copy", 9),
    ("x it", 7),
    ("peak mem", 10),
    ("x final", 8),
    ("data", 0, "<"),
)


def print_table(report: dict) -> None:
    g, ok = report["geometry"], [r for r in report["results"] if "error" not in r]
    plain = {r["method"]: float(np.median(r["times_s"])) for r in ok if r["method"] != "jax_vmm"}
    print("\n" + TABLE.header())
    for r in ok:
        med = float(np.median(r["times_s"]))
        ratios = [f"{plain[m] / med:.1f}x" if m in plain else "-" for m in ("stacked", "per-layer")]
        floor = r.get("raw_s") if r["method"] == "jax_vmm" else r.get("copy_floor_s")
        print(
            TABLE.row(
                _label(r),
                f"{1e3 * r['times_s'][0]:.2f}ms",
                f"{1e3 * med:.2f}ms",
                *ratios,
                f"{1e3 * floor:.2f}ms" if floor else "-",
                f"{med / floor:.2f}x" if floor else "-",
                fmt_bytes(r["peak_growth_bytes"]),
                f"{r['peak_growth_bytes'] / g['bytes_to']:.2f}x",
                "ok" if r["data_ok"] else "BAD",
            )
        )
    if "stacked" in plain:
        print(
            f"(seed|copy: jax_vmm = the seed making the same extensions, one allocation each "
            f"(goal <= 1.0x); stacked = the copy at the device's copy bandwidth. Goal: jax_vmm "
            f"default >= 20x vs stacked = <= {1e3 * plain['stacked'] / 20:.2f} ms)"
        )


def plot(report: dict, path: Path) -> None:
    ok = [r for r in report["results"] if "error" not in r]
    labels = [_label(r).replace(", ", "\n").replace(" (", "\n(") for r in ok]
    colors = ["tab:red" if r["method"] != "jax_vmm" else "tab:blue" for r in ok]
    g = report["geometry"]
    title = (
        f"grow KV cache {fmt_bytes(g['bytes_from'])} -> {fmt_bytes(g['bytes_to'])} "
        f"({report['device']})"
    )
    with two_panel_figure(path, title) as (a1, a2):
        a1.bar(labels, [1e3 * float(np.median(r["times_s"])) for r in ok], color=colors)
        a1.set_yscale("log")
        a1.set_ylabel("growth time, ms (log)")
        a2.bar(labels, [r["peak_growth_bytes"] / GiB for r in ok], color=colors)
        a2.axhline(g["bytes_to"] / GiB, color="k", ls="--", lw=1, label="final cache size")
        a2.set_ylabel("peak memory while growing, GiB")
        a2.legend(fontsize=8)
        for a in (a1, a2):
            a.tick_params(axis="x", labelsize=7)


if __name__ == "__main__":
    main()
