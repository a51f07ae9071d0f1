"""The engine's decode steps with each layer's write and attention in one call
(`jax_vmm.kv_write_attention`, `write_attention("jax_vmm", "jax_vmm")`): the same tokens and
logits as the write followed by the attention, for a Llama- and a Gemma 2-like model
(soft-capping, a sliding-window layer). bf16 with head_dim 64, so that on a GPU the arena
layers run cuDNN inside jax_vmm and take the one-call target; on the CPU it is the two
calls."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import serving

from jax_vmm.serving import engine as E
from jax_vmm.serving.attention import write_attention

CONFIGS = {
    name: dataclasses.replace(cfg, dtype="bfloat16", head_dim=64)
    for name, cfg in serving.CONFIGS.items()
}


def _requests(cfg) -> list[E.Request]:
    return [
        E.Request(i, np.random.default_rng(i).integers(0, cfg.vocab, n, dtype=np.int32), new)
        for i, (n, new) in enumerate([(3, 9), (12, 7), (5, 12)])
    ]


def test_only_the_jax_vmm_pair_has_a_one_call_form():
    assert write_attention("jax_vmm", "jax_vmm") is not None
    assert write_attention("jax_vmm", "prealloc") is None
    assert write_attention("reference", "prealloc") is None


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_one_call_decode_gives_the_tokens_of_the_two_calls(name, device):
    cfg = CONFIGS[name]
    reqs = _requests(cfg)
    runs = []
    for one_call in (False, True):
        with jax.default_matmul_precision("highest"):
            report, _ = serving.serve(
                "jax_vmm",
                cfg,
                reqs,
                batch=2,
                max_tokens=64,
                device=device,
                attention="jax_vmm",
                block=4,
                record_logits=True,
                one_call_writes=one_call,
                chunk_bytes=4096 if device.platform == "cpu" else None,
            )
        runs.append(report)
    for r, a, b in zip(reqs, runs[0].results, runs[1].results, strict=True):
        assert b.tokens == a.tokens, f"request {r.id}"
        np.testing.assert_array_equal(np.stack(b.logits), np.stack(a.logits))
