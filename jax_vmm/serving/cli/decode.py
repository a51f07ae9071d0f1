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
from typing import Any

# The arena commits device memory outside XLA's allocator: do not let XLA take 75% of the
# GPU up front (must be set before jax initialises its GPU backend, which importing jax
# does not do).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jax_vmm  # noqa: E402

from .. import engine as E
from .. import model as M
from .. import tensor_parallel as TP
from .._optional import require
from ..attention import ATTENTION_CHOICES, FP8_HEAD_DIMS, choose_attention, chunk_attention
from ..cache import BACKENDS, KV_DTYPES, commit_lead_tokens, make_cache
from ..report import matplotlib_missing, plot_memory
from ..sleep_wake import EngineSleeper, divergences, same_tokens
from ..summary import counters_since, print_summary, summarize, write_name
from ..take_turns import TakeTurns, budget_summary

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
SERVING["cpu_fp8"] = SERVING["cpu"]  # 16 KiB: 128 tokens of its fp8 layer buffers


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
        help="model and serving size; auto = gpu on a GPU, else cpu (cpu_fp8 with "
        "--kv-dtype fp8: heads of 64, which the fp8 kernel reads)",
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
        "--kv-layout",
        choices=("auto", *jax_vmm.KV_LAYOUTS),
        default="auto",
        help="the jax_vmm arena's layout (kv_arena(layout=...)): per_layer buffers, or every "
        "layer interleaved in one buffer, so that a request's partial last chunk is paid "
        "once instead of once per layer buffer. auto: interleaved with --shared-prefix "
        "(without --tp), else per_layer",
    )
    p.add_argument(
        "--sleep-every",
        type=int,
        metavar="K",
        help="then serve the requests again, sleeping and waking the whole engine (KV "
        "arena and weights) after every K decode blocks, with sequences in flight; "
        "checks that generation is unchanged (jax_vmm backend)",
    )
    p.add_argument(
        "--budget",
        type=int,
        metavar="BYTES",
        help="with --sleep-every: a second engine (a reference model) takes turns with the "
        "first, and all their arenas draw from one jax_vmm.MemoryBudget of BYTES "
        "(docs/sharing.md); checks that both generate unchanged",
    )
    p.add_argument(
        "--shared-prefix",
        type=int,
        metavar="N",
        help="every prompt starts with the same N tokens: prefill them once into one slot "
        "and share them into each request's slot (kv.share_prefix); then serve the "
        "requests again unshared and check that the tokens are the same (jax_vmm backend)",
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
    p.add_argument(
        "--warmup",
        action="store_true",
        help="serve the requests once before the timed run, not counted: the first "
        "execution of each program (cuDNN graph builds, XLA's autotuning) then falls "
        "outside the timing, for both backends alike",
    )
    return p.parse_args(argv)


def _reference_engine(
    cfg: Any,
    serving: dict,
    cache: Any,
    attend: Any,
    requests: list,
    args: argparse.Namespace,
    device: jax.Device,
    budget: jax_vmm.MemoryBudget,
) -> tuple:
    """A second engine of the same shape (other weights) in the budget, compiled and asleep:
    (its sleeper, its generator, its requests) for TakeTurns."""
    params = M.init_params(cfg, seed=args.seed + 1000)
    ref_cache = make_cache(
        "jax_vmm",
        cfg,
        **_cache_shape(serving, device, args),
        commit_ahead_tokens=cache.kv.commit_ahead_tokens,
        budget=budget,
        arena_name="reference KV",
    )
    sleeper = EngineSleeper(ref_cache.kv, params, device, budget=budget, name="reference weights")
    gen = E.Generator(sleeper.params, cfg, ref_cache, attend, block=args.block)
    # A stand-in for scoring the policy's sequences: the prompts (where the KV peaks) and
    # one decode block each, so a turn stays short next to the policy's serving.
    ref_requests = [
        dataclasses.replace(r, max_new_tokens=min(r.max_new_tokens, args.block))
        for r in requests[: serving["batch"]]
    ]
    gen.precompile(ref_requests)
    sleeper.sleep()
    return sleeper, gen, ref_requests


def _labels(policy: EngineSleeper, reference: EngineSleeper) -> dict[int, str]:
    arenas = (policy.kv.arena, policy.weights, reference.kv.arena, reference.weights)
    return {a.uid: a.name for a in arenas}


def with_common_prefix(requests: list[E.Request], n: int, vocab: int, seed: int) -> list[E.Request]:
    """The requests with the same n random tokens in front of each prompt."""
    prefix = np.random.default_rng(seed + 2).integers(0, vocab, n).astype(np.int32)
    return [
        E.Request(r.id, np.concatenate([prefix, np.asarray(r.prompt, np.int32)]), r.max_new_tokens)
        for r in requests
    ]


def _cache_shape(serving: dict, device: jax.Device, args: argparse.Namespace) -> dict:
    """make_cache's arguments that both engines' caches share."""
    return dict(
        max_seqs=serving["batch"],
        max_tokens=serving["max_tokens"],
        device=device,
        chunk_bytes=serving["chunk_bytes"],
        kv_dtype=args.kv_dtype,
        kv_layout=kv_layout(args),
    )


def kv_layout(args: argparse.Namespace) -> str:
    """--kv-layout resolved: auto is interleaved where sharing pays (--shared-prefix on
    the jax_vmm backend, one device), else per_layer."""
    if args.kv_layout != "auto":
        return args.kv_layout
    sharing = args.shared_prefix and args.backend == "jax_vmm" and args.tp is None
    return "interleaved" if sharing else "per_layer"


def check_sizes(args: argparse.Namespace) -> None:
    """The size flags, refused with the flag's name before anything is built."""
    for flag, value in (
        ("--batch", args.batch),
        ("--max-tokens", args.max_tokens),
        ("--requests", args.requests),
        ("--layers", args.layers),
        ("--chunk-bytes", args.chunk_bytes),
        ("--tp", args.tp),
    ):
        if value is not None and value < 1:
            raise SystemExit(f"decode.py: {flag} {value}: expected an integer >= 1")
    for flag, pair in (("--prompt-len", args.prompt_len), ("--new-tokens", args.new_tokens)):
        if pair is not None and not 1 <= pair[0] <= pair[1]:
            raise SystemExit(f"decode.py: {flag} {pair[0]} {pair[1]}: expected 1 <= MIN <= MAX")


def default_tp(argv: list[str], devices: int) -> int:
    """The --tp examples/tensor_parallel.py takes when none is given: the most of
    ``devices`` that the preset's heads and MLP width split over evenly."""
    args = parse_args(argv)
    cfg = M.PRESETS[_preset(args, resolve_device(args.device))]
    return max(n for n in range(1, devices + 1) if TP.splits_over(cfg, n))


def _preset(args: argparse.Namespace, device: jax.Device) -> str:
    """--preset, auto resolved: gpu on a GPU, else cpu (cpu_fp8 for an fp8 cache)."""
    if args.preset != "auto":
        return args.preset
    if device.platform == "gpu":
        return "gpu"
    return "cpu_fp8" if args.kv_dtype == "fp8" else "cpu"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    try:
        return _serve(args)
    except jax_vmm.OutOfMemoryError as e:
        # Too little memory for the flags' sizes is a usage error: say which flag to change.
        fix = (
            f"give a larger --budget than {args.budget}"
            if args.budget is not None and "memory budget" in str(e)
            else "lower --batch, --max-tokens or --layers"
        )
        raise SystemExit(f"decode.py: out of memory: {e}\nTo go on, {fix}.") from None


def _serve(args: argparse.Namespace) -> dict:
    device = resolve_device(args.device)
    preset = _preset(args, device)
    cfg = M.PRESETS[preset]
    check_sizes(args)
    if args.layers is not None:
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
    longest = serving["prompt_len"][1] + (args.shared_prefix or 0) + serving["new_tokens"][1] - 1
    if longest > serving["max_tokens"]:
        raise SystemExit(
            f"decode.py: --max-tokens {serving['max_tokens']}: the longest request (prompt "
            f"{serving['prompt_len'][1]}"
            + (f" + shared prefix {args.shared_prefix}" if args.shared_prefix else "")
            + f" + {serving['new_tokens'][1]} new tokens) caches {longest} tokens; raise "
            "--max-tokens or shorten --prompt-len / --new-tokens"
        )
    if args.kv_dtype == "fp8" and cfg.head_dim not in FP8_HEAD_DIMS:
        raise SystemExit(
            f"decode.py: --kv-dtype fp8: jax_vmm's fp8 attention takes head_dim in "
            f"{FP8_HEAD_DIMS}; the {preset} preset's is {cfg.head_dim} (use --preset "
            "cpu_fp8, or gpu)"
        )
    if args.sleep_every is not None and (args.sleep_every < 1 or args.backend != "jax_vmm"):
        raise SystemExit(
            f"decode.py: --sleep-every {args.sleep_every}: needs K >= 1 and --backend "
            "jax_vmm (it sleeps the jax_vmm arenas)"
        )

    if args.tp is not None and (args.sleep_every is not None or args.budget is not None):
        raise SystemExit(
            "decode.py: --tp with --sleep-every / --budget: a sharded KV arena does not "
            "sleep (docs/sharding.md); run the sleep pass without --tp"
        )
    if args.budget is not None and (args.sleep_every is None or args.budget <= 0):
        raise SystemExit(
            f"decode.py: --budget {args.budget}: needs --sleep-every K (the engines take "
            "turns at its pauses) and BYTES > 0"
        )
    if args.shared_prefix is not None and (args.shared_prefix < 1 or args.backend != "jax_vmm"):
        raise SystemExit(
            f"decode.py: --shared-prefix {args.shared_prefix}: needs N >= 1 and --backend "
            "jax_vmm (it maps one prefix into several sequences of the jax_vmm arena)"
        )
    if args.shared_prefix and serving["batch"] < 2:
        raise SystemExit(
            "decode.py: --shared-prefix needs --batch 2 or more (the prefix takes one slot)"
        )

    for flag, check, value in (
        ("--block", E.check_block, args.block),
        ("--prefill-chunk", E.check_prefill_chunk, args.prefill_chunk),
    ):
        try:
            check(value)
        except ValueError as e:
            raise SystemExit(f"decode.py: {flag}: {e}") from None
    if args.commit_ahead is not None and args.commit_ahead < 0:
        raise SystemExit(
            f"decode.py: --commit-ahead {args.commit_ahead}: expected a token count >= 0 "
            "(0 turns committing ahead off)"
        )
    # Seeds derived from it add up to 1000; jax.random.key keeps 32 bits (x64 off), so a
    # larger seed would repeat a smaller one's weights.
    if not 0 <= args.seed < 2**32 - 1000:
        raise SystemExit(f"decode.py: --seed {args.seed}: expected an integer in [0, 2**32 - 1000)")
    if args.out.exists() and not args.out.is_dir():
        raise SystemExit(f"decode.py: --out {args.out}: exists and is not a directory")
    try:  # before serving: a run must not end in a traceback for want of its folder
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"decode.py: --out {args.out}: cannot create it ({e})") from None
    if (args.out / "summary.json").is_dir():
        raise SystemExit(f"decode.py: --out {args.out}: its summary.json is a directory")

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
        budget = None if args.budget is None else jax_vmm.MemoryBudget(args.budget, device)
        if args.shared_prefix:
            requests = with_common_prefix(requests, args.shared_prefix, cfg.vocab, args.seed)
        try:
            cache = make_cache(
                args.backend,
                cfg,
                **_cache_shape(serving, device, args),
                sharding=None if mesh is None else TP.cache_sharding(mesh),
                commit_ahead_tokens=(
                    commit_lead_tokens(args.block)
                    if args.commit_ahead is None
                    else args.commit_ahead
                ),
                budget=budget,
                arena_name="policy KV",
            )
        except ValueError as e:  # the cache's own check of the flags' sizes, said as is
            flag = f"--budget {args.budget}: " if budget is not None and "budget" in str(e) else ""
            raise SystemExit(f"decode.py: {flag}{e}") from None
        try:
            attn_name, attend = choose_attention(
                args.attention,
                backend=args.backend,
                platform=device.platform,
                tail_may_be_garbage=cache.tail_may_be_garbage,
                dtype=cfg.dtype,
                kv_dtype=args.kv_dtype,
            )
            over_cache = args.prefill_chunk is not None or args.shared_prefix
            attend_chunk = chunk_attention(attn_name) if over_cache else None
        except (ValueError, RuntimeError) as e:  # a bad flag combination: say which
            cache.close()
            raise SystemExit(f"decode.py: {e}") from None
        turns = sleeper = None
        try:
            if budget is not None:  # the reference engine first: it sleeps until its turn
                turns = _reference_engine(
                    cfg, serving, cache, attend, requests, args, device, budget
                )
            if args.sleep_every is not None:  # the weights go into an arena: they sleep too
                sleeper = EngineSleeper(
                    cache.kv, params, device, budget=budget, name="policy weights"
                )
                params = sleeper.params
        except ValueError as e:  # e.g. a budget below one chunk of the weights' arena
            cache.close()
            flag = "" if args.budget is None else f"--budget {args.budget}: "
            raise SystemExit(f"decode.py: {flag}{e}") from None
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
            f"serving {len(requests)} requests (prompts "
            + (f"{args.shared_prefix} shared + " if args.shared_prefix else "")
            + f"{serving['prompt_len'][0]}-{serving['prompt_len'][1]}, new tokens "
            f"{serving['new_tokens'][0]}-"
            f"{serving['new_tokens'][1]}) on {serving['batch']} slots x "
            f"{serving['max_tokens']} tokens | backend {cache.name}, KV "
            f"{'fp8' if args.kv_dtype == 'fp8' else cfg.dtype}"
            + (f" {kv_layout(args)}" if args.backend == "jax_vmm" else "")
            + f", writes {write_name(cache)}, attention {attn_name}, device {device.platform}"
        )
        # Before the progress bar: compile time is not serving.
        try:
            gen.precompile(requests, shared_prefix=args.shared_prefix or 0)
        except ValueError as e:  # what the flags ask cannot be served: say so, no traceback
            raise SystemExit(f"decode.py: {e}") from None
        before = {}
        if args.warmup:
            warm = gen.run(requests, shared_prefix=args.shared_prefix or 0)
            print(f"warm-up run: {warm.seconds:.1f} s (not counted)")
            before = cache.stats()
        total = sum(r.max_new_tokens for r in requests)
        bar = None
        if not args.no_progress:
            tqdm = require("tqdm", "the progress bar (or pass --no-progress)").tqdm
            bar = tqdm(total=total, unit="tok", desc="generating", dynamic_ncols=True)
        try:
            report = gen.run(
                requests,
                progress=bar.update if bar else None,
                shared_prefix=args.shared_prefix or 0,
            )
        finally:
            if bar is not None:
                bar.close()
        stats = counters_since(cache.stats(), before)
        summary = summarize(report, stats, cache, cfg, serving, device, attn_name)
        if args.warmup:  # the same run twice: whether this device generates repeatably
            summary["warmup_tokens_equal"] = not same_tokens(warm, report)
        differ = None
        if args.shared_prefix:
            lo, hi = serving["prompt_len"]  # the prompts served: the prefix and the rest
            n = args.shared_prefix
            summary["serving"] = dict(serving, prompt_len=(lo + n, hi + n), shared_prefix=n)
            # The same schedule and prefills (the prefix, then the rest over the cache)
            # without the sharing, so only the memory under the prefix differs: a
            # whole-prompt prefill rounds differently (bfloat16 on a GPU), and greedy
            # tokens of a run this long flip.
            unshared = gen.run(requests, shared_prefix=n, share=False)
            differ = same_tokens(report, unshared)
            # issue 32's measure: the backed peak against the peak of the tokens cached, the
            # prefix once. (Several trace points may reach the backed peak, which one first
            # depending on background commits, so both sides are peaks.)
            peak_backed = max(r.backed_bytes for r in report.trace)
            peak_held = max(r.held_bytes for r in report.trace)
            summary["shared_prefix"] = dict(
                tokens=args.shared_prefix,
                chunks_shared=stats["chunks_shared"],
                peak_backed_bytes=peak_backed,
                peak_held_bytes=peak_held,
                memory_ratio=peak_backed / max(peak_held, 1),
                unshared_peak_backed_bytes=max(s.backed_bytes for s in unshared.trace),
                generation_unchanged=not differ,
                differing_requests=divergences(report, unshared, differ),
            )
        if sleeper is not None:
            pause = sleeper.pause
            if turns is not None:
                turns = TakeTurns(sleeper, *turns)
                pause = turns.pause
            slept = gen.run(requests, pause_every=args.sleep_every, pause=pause)
            slept_differ = same_tokens(report, slept)
            summary["sleep"] = dict(
                sleeper.stats.summary(),
                every_blocks=args.sleep_every,
                generation_unchanged=not slept_differ,
            )
            differ = list(differ or []) + list(slept_differ or [])
            if isinstance(turns, TakeTurns):
                summary["budget"] = dict(
                    budget_summary(budget, _labels(sleeper, turns.reference)),
                    reference_turns=turns.turns,
                    reference_unchanged=not turns.changed,
                )
                differ = differ or [f"reference {i}" for i in turns.changed]
                turns.reference.kv.close()
                turns.reference.close()
            sleeper.close()
        cache.close()

    if differ is not None:
        # Where two runs of the same requests already differ (cuDNN's attention does not
        # repeat itself run to run on the H100), a difference is no evidence either way.
        summary["token_checks_decisive"] = summary.get("warmup_tokens_equal") is not False
    print_summary(summary)
    try:  # written before a failed check too: its record says where the runs parted
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    except OSError as e:  # removed or made read-only while the run went on
        raise SystemExit(f"decode.py: --out {args.out}: cannot write summary.json ({e})") from None
    if differ and not summary["token_checks_decisive"]:
        print(
            f"token checks not decisive on this device: {len(differ)} of {len(requests)} "
            "requests differ, and so do the warm-up run and the timed run of the same "
            "requests; JAX_VMM_ATTENTION=kernels (jax_vmm's own attention kernels) repeats "
            "itself and makes the checks exact"
        )
    elif differ:
        what = " and ".join(
            w
            for w, on in (("sharing the prefix", args.shared_prefix), ("sleep/wake", sleeper))
            if on
        )
        where = ""
        if args.shared_prefix and summary["shared_prefix"]["differing_requests"]:
            parted = summary["shared_prefix"]["differing_requests"]
            where = "; sharing: first differing token " + ", ".join(
                f"request {d['request']} at {d['first']} of {d['tokens']}" for d in parted[:5]
            )
        if summary.get("warmup_tokens_equal"):
            where += "; the warm-up run and the timed run generated the same tokens"
        raise SystemExit(
            f"decode.py: generation changed across {what} ({len(differ)} of "
            f"{len(requests)} requests: {differ[:10]}{where}; summary.json has the details)"
        )
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
