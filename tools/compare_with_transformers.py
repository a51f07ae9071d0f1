#!/usr/bin/env python3
"""Runs examples/generate.py and transformers on the same checkpoint and prompts, greedy,
float32, and compares them token for token. Needs jax (+ jax_vmm for --backend jax_vmm)
and torch + transformers in one environment; the tests do the same against committed
outputs without torch.

    python tools/compare_with_transformers.py --model DIR [--prompt TEXT ...] \\
        [--max-new-tokens 16] [--backend jax_vmm|prealloc] [--device cpu|gpu]

Per prompt: whether the prompt ids agree, how many generated tokens agree, the largest
top-1 logit difference over them, and at a divergence transformers' margin there. Exit 1
unless every divergence is a near-tie: transformers' top-1 leads by at most TIE_REL of
its largest logit (float32 noise: ~1e-6 relative).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import make_hf_fixtures as F  # this folder (run as a script): torch + transformers
import numpy as np

from jax_vmm.serving import generate as G
from jax_vmm.serving.cli.decode import resolve_device
from jax_vmm.serving.hf.checkpoint import load_checkpoint

TIE_REL = 1e-4


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--prompt", action="append", help=f"default: the fixtures' {F.PROMPTS}")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--backend", choices=("jax_vmm", "prealloc"), default="jax_vmm")
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    args = p.parse_args(argv)
    prompts = tuple(args.prompt or F.PROMPTS)
    n = args.max_new_tokens

    ref = F.reference_outputs(args.model, prompts, n)
    device = resolve_device(args.device)
    ckpt = load_checkpoint(args.model, dtype="float32", device=device)
    ours = G.generate(
        ckpt,
        list(prompts),
        max_new_tokens=n,
        device=device,
        record_logits=True,
        opts=G.ServeOptions(backend=args.backend),
    )
    ok = True
    for i, (want, got) in enumerate(zip(ref, ours["requests"], strict=True)):
        if got["prompt_ids"] != want["prompt_ids"]:
            print(
                f"[{i}] prompt ids differ: ours {got['prompt_ids'][:8]}..., transformers "
                f"{want['prompt_ids'][:8]}..."
            )
            ok = False
            continue
        agree = next(
            (
                s
                for s, (a, b) in enumerate(
                    zip(got["generated_ids"], want["generated_ids"], strict=True)
                )
                if a != b
            ),
            n,
        )
        steps = min(agree + 1, n)  # the diverging step had the same context: compare it too
        tops = got["logits"][np.arange(steps), want["generated_ids"][:steps]]
        err = float(np.max(np.abs(tops - np.asarray(want["top1_logits"][:steps]))))
        line = f"[{i}] {agree}/{n} tokens equal, top-1 logits within {err:.3g}"
        if agree < n:
            margin = want["margins"][agree]
            tie = margin <= TIE_REL * abs(want["top1_logits"][agree])
            ok &= tie
            line += (
                f"; step {agree}: ours {got['generated_ids'][agree]}, transformers "
                f"{want['generated_ids'][agree]} by a margin of {margin:.3g} "
                f"({'a near-tie' if tie else 'NOT a near-tie'})"
            )
        print(line)
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
