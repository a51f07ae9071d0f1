"""Generate text with a Hugging Face checkpoint (Llama, Mistral, Qwen2, Gemma 2) on the
jax_vmm cache.

    python examples/generate.py --model DIR --prompt "text" [--prompt "text2" ...] \\
        [--prompt-ids 1,2,3 ...] --max-new-tokens N [--dtype float32|bfloat16] \\
        [--backend jax_vmm|prealloc] [--stop-at-eos] [--prefill-chunk N] \\
        [--next-turn "text" | --next-turn-ids 4,5 ...] [--json OUT.json]

Greedy by default; --temperature > 0 samples (with --top-k, --top-p, --seed). The
prompts are served together on --batch sequence slots with continuous batching, by the
same engine, cache backends and attention as examples/decode.py. Without --stop-at-eos
exactly N tokens are generated per prompt; with it, a sequence ends at its first EOS
token (kept in the ids, not in the text). --next-turn adds a user message to every
prompt's conversation, prefilled over that conversation's cache once its previous turn
is done. The library side: `jax_vmm.serving.generate`.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import jax

from .. import engine as E
from .. import model as M
from ..attention import ATTENTION_CHOICES
from ..cache import BACKENDS
from ..generate import (
    DEFAULT_MAX_SLOTS,
    ServeOptions,
    checked_max_new_tokens,
    generate,
    num_slots,
)
from ..hf.checkpoint import DTYPES, CheckpointError, load_checkpoint
from ..sampling import SamplingConfig
from .decode import resolve_device


class _PromptAction(argparse.Action):
    """--prompt and --prompt-ids (--next-turn and --next-turn-ids) append to one list, so
    prompts keep their order."""

    def __call__(self, parser, namespace, value, option_string=None):
        prompts = getattr(namespace, self.dest) or []
        if option_string.endswith("-ids"):
            try:
                value = [int(t) for t in value.split(",") if t.strip()]
            except ValueError:
                parser.error(f"{option_string} {value!r}: expected comma-separated integers")
        prompts.append(value)
        setattr(namespace, self.dest, prompts)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        type=Path,
        required=True,
        help="checkpoint directory: config.json, model*.safetensors, tokenizer.json",
    )
    p.add_argument(
        "--prompt",
        "--prompt-ids",
        dest="prompts",
        action=_PromptAction,
        metavar="TEXT|IDS",
        help="a prompt (repeatable); --prompt-ids takes comma-separated token ids",
    )
    p.add_argument(
        "--next-turn",
        "--next-turn-ids",
        dest="next_turns",
        action=_PromptAction,
        metavar="TEXT|IDS",
        help="a further user message appended to every prompt's conversation, on its cache "
        "(repeatable: turn 2, 3, ...)",
    )
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--backend", choices=BACKENDS, default="jax_vmm")
    p.add_argument("--stop-at-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--batch", type=int, help=f"sequence slots (default: min(prompts, {DEFAULT_MAX_SLOTS}))"
    )
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    p.add_argument("--attention", choices=ATTENTION_CHOICES, default="auto")
    p.add_argument(
        "--block",
        type=int,
        default=E.DEFAULT_BLOCK,
        help="decode steps per host call, on the device (greedy only; sampling decides "
        f"each token on the host); default {E.DEFAULT_BLOCK}",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        metavar="N",
        help="prefill prompts in chunks of N tokens, each attending over the cache "
        "(jax_vmm.attention); default: each prompt whole, in one pass",
    )
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if not args.prompts:
        raise SystemExit("generate.py: give at least one --prompt or --prompt-ids")
    device = resolve_device(args.device)
    if args.json is not None:  # before a long load and run, not after them
        if args.json.is_dir():
            raise SystemExit(f"generate.py: --json {args.json}: is a directory; give a file")
        try:
            args.json.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SystemExit(f"generate.py: --json {args.json}: {e.strerror}") from None
        if not os.access(args.json.parent, os.W_OK):
            raise SystemExit(f"generate.py: --json {args.json}: its folder is not writable")
    try:
        sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed)
        opts = ServeOptions(
            backend=args.backend,
            batch=args.batch,
            attention=args.attention,
            block=args.block,
            prefill_chunk=args.prefill_chunk,
        )
        num_slots(opts, len(args.prompts))  # bad options fail before a long load
        checked_max_new_tokens(args.max_new_tokens, "--max-new-tokens")
        E.check_block(opts.block)
        E.check_prefill_chunk(opts.prefill_chunk)
        with jax.default_device(device):
            ckpt = load_checkpoint(args.model, dtype=args.dtype, device=device)
        print(f"model: {ckpt.spec.architecture}, {M.config_summary(ckpt.config)}")
        result = generate(
            ckpt,
            args.prompts,
            max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            stop_at_eos=args.stop_at_eos,
            device=device,
            opts=opts,
            next_turns=args.next_turns or (),
        )
    except (CheckpointError, ImportError, ValueError, RuntimeError) as e:
        raise SystemExit(f"generate.py: {e}") from None
    for i, r in enumerate(result["requests"]):
        shown = r["prompt"] if r["prompt"] is not None else r["prompt_ids"]
        # Ids the tokenizer does not know decode to nothing (a random model's): show ids.
        body = r["text"] if r["text"] else r["generated_ids"]
        print(f"[{i}] {shown!r} -> {body!r}")
        for t, turn in enumerate(r.get("turns", ()), start=2):
            shown = turn["prompt"] if turn["prompt"] is not None else turn["prompt_ids"]
            body = turn["text"] if turn["text"] else turn["generated_ids"]
            print(f"[{i}] turn {t}: {shown!r} -> {body!r}")
    print(
        f"{result['generated_tokens']} tokens in {result['seconds']:.2f} s = "
        f"{result['tokens_per_second']:.1f} tokens/s ({result['slots']} slots, backend "
        f"{result['backend']}, {result['dtype']}, {result['device']}; compile "
        f"{result['compile_seconds']:.1f} s, not counted)"
    )
    if args.json:
        try:
            args.json.write_text(json.dumps(result, indent=2))
        except OSError as e:
            raise SystemExit(f"generate.py: --json {args.json}: {e.strerror}") from None
    return result
