"""The committed Hugging Face fixtures (tests/fixtures/hf/, written by
tools/make_hf_fixtures.py with transformers) and helpers shared by their tests.

Each fixture directory is a checkpoint (config.json, safetensors, tokenizer.json) plus
expected.json: per prompt, the ids transformers' tokenizer gave, the ids transformers'
greedy `generate` produced in float32, the decoded text, the top-1 logit and its margin
over the top-2 at every step, and transformers' own bfloat16 error on those logits.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jax

from jax_vmm.serving.hf.checkpoint import Checkpoint, load_checkpoint

REPO = Path(__file__).resolve().parents[2]

FIXTURE_DIR = REPO / "tests" / "fixtures" / "hf"
NAMES = sorted(p.name for p in FIXTURE_DIR.iterdir() if (p / "expected.json").is_file())
# float32 top-1 logits of the example vs transformers: measured <= 1e-4 on the CPU;
# the smallest greedy margin of any fixture step is >= 0.02 (asserted by the script).
F32_LOGIT_TOL = 1e-3


@functools.cache
def expected(name: str) -> dict[str, Any]:
    return json.loads((FIXTURE_DIR / name / "expected.json").read_text())


@functools.cache
def checkpoint(name: str, dtype: str, device: jax.Device) -> Checkpoint:
    """Loaded once per session (read-only: nothing mutates Params in place)."""
    return load_checkpoint(FIXTURE_DIR / name, dtype=dtype, device=device)


def mixed_prompts(exp: dict[str, Any]) -> list[str | list[int]]:
    """The fixture's prompts as text, except the third as token ids: both input paths
    in one batch."""
    return [r["prompt_ids"] if i == 2 else r["prompt"] for i, r in enumerate(exp["requests"])]
