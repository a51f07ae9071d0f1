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
from pathlib import Path

# The arena commits device memory outside XLA's allocator: do not let XLA take 75% of the
# GPU up front (must be set before jax initialises its GPU backend, which importing jax
# does not do).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

from .. import engine as E
from .. import model as M
from .. import tensor_parallel as TP
from .._optional import require
from ..attention import ATTENTION_CHOICES, FP8_HEAD_DIMS, choose_attention, chunk_attention
from ..cache import BACKENDS, KV_DTYPES, commit_lead_tokens, make_cache
from ..report import matplotlib_missing, plot_memory
from ..sleep_wake import EngineSleeper, same_tokens
from ..summary import print_summary, summarize, write_name

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
        "--prefill-chunk",
        type=int,
        metavar="N",
        help="prefill prompts in chunks of N tokens, each attending over the cache "
        "(jax_vmm.attention); default: each prompt whole, in one pass",
    )
    p.add_argument(
        "--commit-ahead",
        type=int,
        metavar="TOKENS",
        help="jax_vmm: commit a sequence's next chunk in the background once it is this "
        "close to its backed end (default: two blocks, jax_vmm.serving.cache.commit_lead_tokens)",
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
        "KV heads (jax_vmm.serving.tensor_parallel); --tp 1 runs that code on one device",
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
    if args.prefill_chunk is not None and args.kv_dtype == "fp8":
        raise SystemExit(
            "decode.py: --prefill-chunk with --kv-dtype fp8: jax_vmm.attention reads an fp8 "
            "arena for decode only (one query per sequence); drop one of them"
        )
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

    for flag, check, value in (
        ("--block", E.check_block, args.block),
        ("--prefill-chunk", E.check_prefill_chunk, args.prefill_chunk),
    ):
        try:
            check(value)
        except ValueError as e:
            raise SystemExit(f"decode.py: {flag}: {e}") from None
    if args.prefill_chunk is not None and args.tp is not None:
        raise SystemExit(
            "decode.py: --prefill-chunk with --tp: jax_vmm.attention serves a sharded arena "
            "for decode only (one query per sequence); drop one of them"
        )
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
            attend_chunk = None if args.prefill_chunk is None else chunk_attention(attn_name)
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
                attend_chunk=attend_chunk,
                prefill_chunk=args.prefill_chunk,
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
            f"{'fp8' if args.kv_dtype == 'fp8' else cfg.dtype}, writes {write_name(cache)}, "
            f"attention {attn_name}, device {device.platform}"
        )
        gen.precompile(requests)  # before the progress bar: compile time is not serving
        total = sum(r.max_new_tokens for r in requests)
        bar = None
        if not args.no_progress:
            tqdm = require("tqdm", "the progress bar (or pass --no-progress)").tqdm
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
