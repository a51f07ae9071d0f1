"""Serve a batch of requests with a small transformer whose KV cache lives in jax_vmm.

    python examples/decode.py                     # CPU-sized, jax_vmm cache
    python examples/decode.py --backend prealloc  # the plain-JAX preallocated baseline
    python examples/decode.py --preset gpu        # realistic size (default on a GPU)

Prefill, then greedy decode in blocks of --block steps, each one jitted device loop that
takes and returns the cache (a `jax_vmm.KVCache` pytree; donated), with continuous
batching: each of --batch slots serves requests one after another; a finished sequence
releases its KV memory and its slot takes the next request. The host dispatches the next
block before it reads the last one's tokens. Prints a progress bar and a summary, and writes a plot
of backed KV memory per step next to what a preallocated cache of the same capacity
holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

# The arena commits device memory outside XLA's allocator: do not let XLA take 75% of the
# GPU up front (must be set before jax initialises its GPU backend).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from examples import engine as E  # noqa: E402
from examples import model as M  # noqa: E402
from examples import tensor_parallel as TP  # noqa: E402
from examples.attention import ATTENTION_CHOICES, FP8_HEAD_DIMS, choose_attention  # noqa: E402
from examples.cache import (  # noqa: E402
    BACKENDS,
    KV_DTYPES,
    capacity_bytes,
    commit_lead_tokens,
    make_cache,
)
from examples.report import fmt_bytes, matplotlib_missing, plot_memory  # noqa: E402
from examples.sleep_wake import EngineSleeper, same_tokens  # noqa: E402

# Serving defaults per preset: batch (slots), per-sequence max_tokens, requests, prompt and
# new-token length ranges, arena chunk size.
# chunk_bytes: the arena's commit unit. On the CPU 16 KiB = 64 tokens of a layer buffer
# of the cpu preset; on the GPU None = the driver's 2 MiB = 1024 tokens of the gpu preset.
SERVING = {
    "cpu": dict(
        batch=8,
        max_tokens=512,
        requests=32,
        prompt_len=(8, 128),
        new_tokens=(8, 192),
        chunk_bytes=16384,
    ),
    "gpu": dict(
        batch=16,
        max_tokens=8192,
        requests=48,
        prompt_len=(128, 2048),
        new_tokens=(64, 1024),
        chunk_bytes=None,
    ),
}


def resolve_device(name: str) -> jax.Device:
    if name == "auto":
        return jax.devices()[0]  # jax's default: the GPU when there is one
    try:
        return jax.devices(name)[0]
    except RuntimeError as e:
        raise SystemExit(
            f"--device {name}: no such JAX platform here ({e}); available: {jax.devices()}"
        ) from e


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="jax_vmm",
        help="KV cache: jax_vmm arena, or the plain-JAX preallocated baseline",
    )
    p.add_argument(
        "--preset",
        choices=("auto", *M.PRESETS),
        default="auto",
        help="model and serving size; auto = gpu on a GPU, else cpu",
    )
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    p.add_argument(
        "--attention",
        choices=ATTENTION_CHOICES,
        default="auto",
        help="auto = jax_vmm.decode_attention for the jax_vmm backend; for prealloc cuDNN "
        "on a GPU (bf16), else the plain-XLA reference",
    )
    p.add_argument("--batch", type=int, help="sequence slots decoded together")
    p.add_argument(
        "--block",
        type=int,
        default=E.DEFAULT_BLOCK,
        help=f"decode steps per host call, in one device loop (default {E.DEFAULT_BLOCK})",
    )
    p.add_argument(
        "--commit-ahead",
        type=int,
        metavar="TOKENS",
        help="jax_vmm: commit a sequence's next chunk in the background once it is this "
        "close to its backed end (default: two blocks, examples/cache.commit_lead_tokens)",
    )
    p.add_argument(
        "--slot-memory",
        choices=("keep", "release"),
        default="keep",
        help="a finished sequence whose slot a queued request takes: keep the memory of "
        "the new prompt's tokens, or release all of it and commit the prompt again in the "
        "background (Generator.keep_slot_memory)",
    )
    p.add_argument("--max-tokens", type=int, help="per-sequence cache capacity")
    p.add_argument("--requests", type=int, help="number of requests to serve")
    p.add_argument("--prompt-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--new-tokens", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        default="model",
        help="KV storage: the model's dtype, or fp8 (float8_e4m3fn, scales 1.0; read by "
        "the jax_vmm kernel)",
    )
    p.add_argument(
        "--sleep-every",
        type=int,
        metavar="K",
        help="then serve the requests again, sleeping and waking the whole engine (KV "
        "arena and weights) after every K decode blocks, with sequences in flight; "
        "checks that generation is unchanged (jax_vmm backend)",
    )
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--chunk-bytes", type=int, help="arena commit granularity (jax_vmm)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tp",
        type=int,
        help="tensor parallel over N devices: heads and MLP split, the KV cache split over "
        "KV heads (examples/tensor_parallel.py); --tp 1 runs that code on one device",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("out/decode"),
        help="directory for the memory plot and summary.json",
    )
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = resolve_device(args.device)
    preset = args.preset
    if preset == "auto":
        preset = "gpu" if device.platform == "gpu" else "cpu"
    cfg = M.PRESETS[preset]
    if args.layers:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    serving = dict(SERVING[preset])
    overrides = {
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "requests": args.requests,
        "prompt_len": tuple(args.prompt_len) if args.prompt_len else None,
        "new_tokens": tuple(args.new_tokens) if args.new_tokens else None,
        "chunk_bytes": args.chunk_bytes,
    }
    serving.update({k: v for k, v in overrides.items() if v is not None})
    if args.kv_dtype == "fp8" and cfg.head_dim not in FP8_HEAD_DIMS:
        raise SystemExit(
            f"decode.py: --kv-dtype fp8: jax_vmm's fp8 attention takes head_dim in "
            f"{FP8_HEAD_DIMS}; the {preset} preset's is {cfg.head_dim} (use --preset gpu)"
        )
    if args.sleep_every is not None and (args.sleep_every < 1 or args.backend != "jax_vmm"):
        raise SystemExit(
            f"decode.py: --sleep-every {args.sleep_every}: needs K >= 1 and --backend "
            "jax_vmm (it sleeps the jax_vmm arenas)"
        )

    try:
        E.check_block(args.block)
    except ValueError as e:
        raise SystemExit(f"decode.py: --block: {e}") from None
    if args.commit_ahead is not None and args.commit_ahead < 0:
        raise SystemExit(
            f"decode.py: --commit-ahead {args.commit_ahead}: expected a token count >= 0 "
            "(0 turns committing ahead off)"
        )

    with jax.default_device(device):
        params = M.init_params(cfg, seed=args.seed)
        try:
            mesh = None if args.tp is None else TP.tp_mesh(args.tp, device.platform)
            params = params if mesh is None else TP.shard_params(params, cfg, mesh)
        except ValueError as e:
            raise SystemExit(f"decode.py: {e}") from None
        requests = E.make_requests(
            cfg,
            num=serving["requests"],
            prompt_len=serving["prompt_len"],
            new_tokens=serving["new_tokens"],
            seed=args.seed + 1,
        )
        cache = make_cache(
            args.backend,
            cfg,
            max_seqs=serving["batch"],
            max_tokens=serving["max_tokens"],
            device=device,
            chunk_bytes=serving["chunk_bytes"],
            kv_dtype=args.kv_dtype,
            sharding=None if mesh is None else TP.cache_sharding(mesh),
            commit_ahead_tokens=(
                commit_lead_tokens(args.block) if args.commit_ahead is None else args.commit_ahead
            ),
        )
        try:
            attn_name, attend = choose_attention(
                args.attention,
                backend=args.backend,
                platform=device.platform,
                tail_may_be_garbage=cache.tail_may_be_garbage,
                dtype=cfg.dtype,
                kv_dtype=args.kv_dtype,
            )
        except (ValueError, RuntimeError) as e:  # a bad flag combination: say which
            cache.close()
            raise SystemExit(f"decode.py: {e}") from None
        sleeper = None
        if args.sleep_every is not None:  # the weights go into an arena: they sleep too
            sleeper = EngineSleeper(cache.kv, params, device)
            params = sleeper.params
        try:
            gen = E.Generator(
                params,
                cfg,
                cache,
                attend,
                block=args.block,
                keep_slot_memory=args.slot_memory == "keep",
            )
        except ValueError as e:  # --block was checked above; this is anything else
            cache.close()
            raise SystemExit(f"decode.py: {e}") from None
        print(f"model: {M.config_summary(cfg)}")
        print(
            f"serving {len(requests)} requests (prompts {serving['prompt_len'][0]}-"
            f"{serving['prompt_len'][1]}, new tokens {serving['new_tokens'][0]}-"
            f"{serving['new_tokens'][1]}) on {serving['batch']} slots x "
            f"{serving['max_tokens']} tokens | backend {cache.name}, KV "
            f"{'fp8' if args.kv_dtype == 'fp8' else cfg.dtype}, writes {_write_name(cache)}, "
            f"attention {attn_name}, device {device.platform}"
        )
        gen.precompile(requests)  # before the progress bar: compile time is not serving
        total = sum(r.max_new_tokens for r in requests)
        bar = None
        if not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="tok", desc="generating", dynamic_ncols=True)
        try:
            report = gen.run(requests, progress=bar.update if bar else None)
        finally:
            if bar is not None:
                bar.close()
        stats = cache.stats()
        summary = summarize(report, stats, cache, cfg, serving, device, attn_name)
        differ = None
        if sleeper is not None:
            slept = gen.run(requests, pause_every=args.sleep_every, pause=sleeper.pause)
            differ = same_tokens(report, slept)
            summary["sleep"] = dict(
                sleeper.stats.summary(),
                every_blocks=args.sleep_every,
                generation_unchanged=not differ,
            )
            sleeper.close()
        cache.close()

    print_summary(summary)
    if differ:
        raise SystemExit(
            f"decode.py: generation changed across sleep/wake (requests {differ[:10]})"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    missing = None if args.no_plot else matplotlib_missing()
    if missing:
        print(missing)
    elif not args.no_plot:
        path = args.out / f"decode_memory_{cache.name}.png"
        plot_memory(
            report.trace,
            summary["capacity_bytes"],
            path,
            title=f"KV memory per step ({cache.name}, {device.platform}, "
            f"{serving['batch']} slots x {serving['max_tokens']} tokens)",
        )
        print(f"plot: {path}")
    return summary


def _write_name(cache) -> str:
    if cache.name == "prealloc":
        return "kv_write on array layers (donated scatter)"
    return "kv_write on arena layers (in place)"


def summarize(
    report: E.RunReport,
    stats: dict,
    cache,
    cfg: M.ModelConfig,
    serving: dict,
    device: jax.Device,
    attention: str,
) -> dict:
    capacity = capacity_bytes(cfg, serving["batch"], serving["max_tokens"], cache.kv_dtype)
    peak_backed = max(
        max((r.backed_bytes for r in report.trace), default=0),
        int(stats.get("peak_backed_bytes", 0)),
    )
    return {
        "backend": cache.name,
        "kv_dtype": cache.kv_dtype,
        "writes": _write_name(cache),
        "attention": attention,
        "device": device.platform,
        "model": dataclasses.asdict(cfg),
        "serving": serving,
        "generated_tokens": report.generated_tokens,
        "seconds": report.seconds,
        "tokens_per_second": report.generated_tokens / max(report.seconds, 1e-9),
        "compile_seconds": report.compile_seconds,
        "decode_steps": report.decode_steps,
        "decode_blocks": report.blocks,
        "block": report.block,
        "prefills": report.prefills,
        "host_memory_seconds": report.ensure_seconds,
        "host_memory_share": report.ensure_seconds / max(report.seconds, 1e-9),
        "host_memory_calls": {
            k: {"calls": c, "seconds": t, "longest_seconds": m}
            for k, (c, t, m) in sorted(report.host_calls.items())
        },
        "memory_wait_seconds": report.memory_wait_seconds,
        "memory_wait_idle_seconds": report.memory_wait_idle_seconds,
        "capacity_bytes": capacity,
        "reserved_bytes": cache.reserved_bytes(),
        "peak_backed_bytes": peak_backed,
        "final_backed_bytes": report.trace[-1].backed_bytes if report.trace else 0,
        "peak_live_bytes": max((r.live_bytes for r in report.trace), default=0),
        "commit_calls": int(stats.get("commit_calls", 0)),
        "commit_seconds": float(stats.get("commit_seconds", 0.0)),
        "commits_ahead": int(stats.get("commits_ahead", 0)),
        "decommit_calls": int(stats.get("decommit_calls", 0)),
        "decommit_seconds": float(stats.get("decommit_seconds", 0.0)),
        "returned_cache_bytes": int(stats.get("returned_cache_bytes", 0)),
        "trace": [dataclasses.asdict(r) for r in report.trace],
    }


def print_summary(s: dict) -> None:
    cap = s["capacity_bytes"]
    print(
        f"\n{s['generated_tokens']} tokens in {s['seconds']:.2f} s = "
        f"{s['tokens_per_second']:.0f} tokens/s ({s['decode_steps']} decode steps in "
        f"{s['decode_blocks']} blocks of {s['block']}, {s['prefills']} prefills; compile "
        f"{s['compile_seconds']:.1f} s, not counted)"
    )
    print(
        f"host time in ensure/release: {1e3 * s['host_memory_seconds']:.1f} ms of "
        f"{s['seconds']:.2f} s ({100 * s['host_memory_share']:.2f}% of the serving time)"
    )
    if s["host_memory_calls"]:
        print(
            "  by call: "
            + ", ".join(
                f"{k} {v['calls']} x {1e6 * v['seconds'] / v['calls']:.0f} us "
                f"(longest {1e3 * v['longest_seconds']:.2f} ms)"
                for k, v in s["host_memory_calls"].items()
            )
        )
    if s["backend"] == "jax_vmm":
        print(
            f"waited for prompts' memory (committed in the background): "
            f"{1e3 * s['memory_wait_seconds']:.1f} ms, of which "
            f"{1e3 * s['memory_wait_idle_seconds']:.1f} ms with nothing queued on the device "
            f"({100 * s['memory_wait_idle_seconds'] / max(s['seconds'], 1e-9):.2f}%)"
        )
    print(
        f"KV memory: reserved {fmt_bytes(s['reserved_bytes'])} | backed peak "
        f"{fmt_bytes(s['peak_backed_bytes'])} ({100 * s['peak_backed_bytes'] / cap:.0f}% of "
        f"a preallocated cache: {fmt_bytes(cap)}) | live tokens peak "
        f"{fmt_bytes(s['peak_live_bytes'])} | backed at end "
        f"{fmt_bytes(s['final_backed_bytes'])}"
    )
    if s["backend"] == "jax_vmm":
        print(
            f"commits: {s['commit_calls']} calls ({s['commits_ahead']} ahead of need, off the "
            f"decode thread), {1e3 * s['commit_seconds']:.1f} ms | "
            f"decommits: {s['decommit_calls']} calls, "
            f"{1e3 * s['decommit_seconds']:.1f} ms"
        )
        print(
            f"each step returned a cache of {s['returned_cache_bytes']} bytes (the arena is "
            "the state: nothing of it is copied)"
        )
    if "sleep" in s:
        z = s["sleep"]
        print(
            f"sleep/wake (KV arena + weights) every {z['every_blocks']} blocks, sequences in "
            f"flight: {z['cycles']} cycles, sleep {z['sleep_ms_median']:.1f} ms / wake "
            f"{z['wake_ms_median']:.1f} ms (median), held while asleep "
            f"{fmt_bytes(z['asleep_backed_bytes'])}; generation unchanged: "
            f"{'yes' if z['generation_unchanged'] else 'NO'}"
        )


if __name__ == "__main__":
    main()
