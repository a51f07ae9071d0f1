"""The example engine with a shared prefix (`Generator.run(shared_prefix=N)`, decode.py
`--shared-prefix N`): the prefix is prefilled once and shared into each request's slot
(kv.share_prefix), and every request generates the tokens it generates unshared."""

from __future__ import annotations

import numpy as np
import pytest
import serving

from jax_vmm.serving import engine as E
from jax_vmm.serving import model as M

SMALL = M.ModelConfig(
    vocab=256, d_model=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=128
)
PREFIX = 40  # 128 bytes per token and buffer: one whole 4 KiB chunk shared, 8 tokens copied


def _requests(prefix_len: int = PREFIX) -> list[E.Request]:
    reqs = E.make_requests(SMALL, num=6, prompt_len=(3, 30), new_tokens=(1, 20), seed=4)
    prefix = np.random.default_rng(9).integers(0, SMALL.vocab, prefix_len).astype(np.int32)
    return [
        E.Request(r.id, np.concatenate([prefix, np.asarray(r.prompt, np.int32)]), r.max_new_tokens)
        for r in reqs
    ]


def _serve(reqs, *, batch, **kw):
    return serving.serve(
        "jax_vmm",
        SMALL,
        reqs,
        batch=batch,
        max_tokens=128,
        device=kw.pop("device"),
        attention="jax_vmm",
        chunk_bytes=4096,
        block=4,
        **kw,
    )


def test_shared_prefix_serving_generates_the_unshared_tokens(cpu_device) -> None:
    reqs = _requests()
    plain, _ = _serve(reqs, batch=3, device=cpu_device, record_logits=True)
    shared, stats = _serve(
        reqs, batch=4, device=cpu_device, record_logits=True, shared_prefix=PREFIX
    )
    for r, a, b in zip(reqs, plain.results, shared.results, strict=True):
        assert len(b.tokens) == r.max_new_tokens
        assert b.tokens == a.tokens, f"request {r.id}"
        np.testing.assert_allclose(np.stack(b.logits), np.stack(a.logits), atol=1e-4)
    assert shared.prefills == len(reqs) + 1  # the prefix once, then each rest
    assert stats["chunks_shared"] == len(reqs) * 2 * SMALL.num_layers  # 1 chunk per buffer
    assert stats["held_bytes"] == 0  # every sharer released at the end


def test_shared_prefix_needs_a_common_prefix_and_the_vmm_backend(cpu_device) -> None:
    reqs = _requests()
    reqs[2] = E.Request(reqs[2].id, reqs[2].prompt[::-1].copy(), reqs[2].max_new_tokens)
    with pytest.raises(ValueError, match="same 40 tokens"):
        _serve(reqs, batch=4, device=cpu_device, shared_prefix=PREFIX)
    with pytest.raises(ValueError, match="jax_vmm cache backend"):
        serving.serve(
            "prealloc",
            SMALL,
            _requests(),
            batch=4,
            max_tokens=128,
            device=cpu_device,
            attention="jax_vmm",
            shared_prefix=PREFIX,
        )
    with pytest.raises(ValueError, match="integer >= 0"):
        _serve(_requests(), batch=4, device=cpu_device, shared_prefix=-1)


def test_decode_cli_shared_prefix_checks_generation(tmp_path) -> None:
    from jax_vmm.serving.cli import decode

    args = ["--device", "cpu", "--requests", "4", "--batch", "3", "--max-tokens", "256",
            "--prompt-len", "4", "20", "--new-tokens", "10", "30", "--block", "4",
            "--no-plot", "--no-progress", "--out", str(tmp_path)]  # fmt: skip
    summary = decode.main([*args, "--shared-prefix", "100"])
    shared = summary["shared_prefix"]
    assert shared["generation_unchanged"] is True and shared["chunks_shared"] > 0, shared
    with pytest.raises(SystemExit, match="needs N >= 1 and --backend jax_vmm"):
        decode.main([*args, "--shared-prefix", "8", "--backend", "prealloc"])
