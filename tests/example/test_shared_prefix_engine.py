"""The example engine with a shared prefix (`Generator.run(shared_prefix=N)`, decode.py
`--shared-prefix N`): the prefix is prefilled once and shared into each request's slot
(kv.share_prefix), the rest of each prompt is appended over the cache as a chunk is
(steps.prefill_chunk_slot), and every request generates the tokens it generates unshared."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import pytest
import serving

import jax_vmm
from jax_vmm.serving import engine as E
from jax_vmm.serving import model as M
from jax_vmm.serving.cache import make_cache
from jax_vmm.serving.sleep_wake import divergences, same_tokens

SMALL, GEMMA_LIKE, CONFIGS = serving.SMALL, serving.GEMMA_LIKE, serving.CONFIGS
PREFIX = 40  # 128 bytes per token and buffer: one whole 4 KiB chunk shared, 8 tokens copied


def _requests(prefix_len: int = PREFIX) -> list[E.Request]:
    reqs = E.make_requests(SMALL, num=6, prompt_len=(3, 30), new_tokens=(1, 20), seed=4)
    prefix = np.random.default_rng(9).integers(0, SMALL.vocab, prefix_len).astype(np.int32)
    return [
        E.Request(r.id, np.concatenate([prefix, np.asarray(r.prompt, np.int32)]), r.max_new_tokens)
        for r in reqs
    ]


def _serve(reqs, *, batch, cfg=SMALL, **kw):
    return serving.serve(
        "jax_vmm",
        cfg,
        reqs,
        batch=batch,
        max_tokens=128,
        device=kw.pop("device"),
        attention="jax_vmm",
        chunk_bytes=4096,
        block=4,
        **kw,
    )


@pytest.mark.parametrize(
    ("name", "chunk", "layout"),
    [
        ("llama", None, "per_layer"),
        ("gemma2", None, "per_layer"),
        ("llama", 8, "per_layer"),
        ("gemma2", 8, "per_layer"),
        ("llama", None, "interleaved"),
        ("gemma2", 8, "interleaved"),
    ],
)
def test_shared_prefix_serving_generates_the_unshared_tokens(name, chunk, layout, cpu_device):
    """Llama and Gemma 2 (window, soft-capping, scale: through the chunk prefill the rest
    goes by); prompts whole or in chunks of 8 (then the prefix is prefilled in chunks
    too), each against unshared serving with the same prefill; per-layer buffers and
    every layer interleaved in one."""
    cfg, reqs = CONFIGS[name], _requests()
    kw = dict(device=cpu_device, cfg=cfg, record_logits=True, prefill_chunk=chunk, kv_layout=layout)
    plain, _ = _serve(reqs, batch=3, **kw)
    shared, stats = _serve(reqs, batch=4, shared_prefix=PREFIX, **kw)
    for r, a, b in zip(reqs, plain.results, shared.results, strict=True):
        assert len(b.tokens) == r.max_new_tokens
        assert b.tokens == a.tokens, f"request {r.id}"
        np.testing.assert_allclose(np.stack(b.logits), np.stack(a.logits), atol=2e-4, rtol=1e-4)
    if chunk is None:  # the prefix once, then each rest (one chunk of its padded length)
        assert shared.prefills == len(reqs) + 1
    else:
        rests = sum(-(-(len(r.prompt) - PREFIX) // chunk) for r in reqs)
        assert shared.prefills == -(-PREFIX // chunk) + rests
    if layout == "per_layer":  # 128 bytes per token and buffer: 1 chunk per buffer
        assert stats["chunks_shared"] == len(reqs) * 2 * cfg.num_layers
    else:  # 512 bytes per token of every layer: 5 chunks of the one buffer
        assert stats["chunks_shared"] == len(reqs) * PREFIX * 128 * 2 * cfg.num_layers // 4096
    # Every sharer released at the end: nothing backed, parked or shared (what was
    # released may still wait for the device, retired_bytes, given back in the background).
    assert stats["backed_bytes"] == stats["parked_bytes"] == 0 and not stats["sharing_seqs"]


@pytest.mark.parametrize("layout", ["per_layer", "interleaved"])
def test_shared_prefix_serving_is_bit_equal_to_the_same_prefills_unshared(layout, cpu_device):
    """share=False (decode.py's reference): the same schedule (the prefix slot too) and
    the prefix's prefill and then the rest's in each request's own slot, nothing shared.
    Only the memory under the prefix differs from a shared run, so the tokens and the
    logits are the same bits (a whole-prompt prefill rounds differently)."""
    reqs = _requests()
    kw = dict(device=cpu_device, cfg=CONFIGS["gemma2"], record_logits=True, kv_layout=layout)
    shared, _ = _serve(reqs, batch=4, shared_prefix=PREFIX, **kw)
    alone, stats = _serve(reqs, batch=4, shared_prefix=PREFIX, share=False, **kw)
    for r, a, b in zip(reqs, alone.results, shared.results, strict=True):
        assert b.tokens == a.tokens, f"request {r.id}"
        np.testing.assert_array_equal(np.stack(b.logits), np.stack(a.logits))
    # The prefix slot's prefill, then each request's prefix and its rest.
    assert alone.prefills == 1 + 2 * len(reqs)
    # Every step ran the same requests side by side: the prefix slot serves no request.
    assert [(t.kind, t.active) for t in alone.trace] == [(t.kind, t.active) for t in shared.trace]
    assert stats["chunks_shared"] == 0
    # Each request held its own prefix: counted at every slot, as live tokens are.
    assert all(r.held_bytes == r.live_bytes for r in alone.trace)
    assert stats["backed_bytes"] == stats["parked_bytes"] == 0


def test_divergences_name_each_requests_first_differing_token() -> None:
    """What decode.py's sharing check reports: a flip at token 0 (the prefill) reads
    differently from a late one, and a run that stopped sooner differs at its end."""

    def run(*tokens: list[int]) -> SimpleNamespace:
        return SimpleNamespace(
            results=[SimpleNamespace(id=i, tokens=t) for i, t in enumerate(tokens)]
        )

    a, b = run([1, 2, 3], [4, 5], [7], [8, 9]), run([1, 9, 3], [4, 5, 6], [7], [0, 9])
    assert same_tokens(a, b) == [0, 1, 3]
    assert divergences(a, b, [0, 1, 3]) == [
        dict(request=0, first=1, tokens=3, other=3),
        dict(request=1, first=2, tokens=2, other=3),
        dict(request=3, first=0, tokens=2, other=2),
    ]


def test_share_false_needs_a_shared_prefix_and_a_bool(cpu_device) -> None:
    with pytest.raises(ValueError, match="share=False goes with shared_prefix"):
        _serve(_requests(), batch=3, device=cpu_device, share=False)
    with pytest.raises(TypeError, match="share must be True or False"):
        _serve(_requests(), batch=3, device=cpu_device, shared_prefix=PREFIX, share="no")


def test_a_next_turn_goes_on_after_a_shared_prefix(cpu_device) -> None:
    """A conversation's next turn (follows) after a first turn that shares the prefix:
    it goes on in its parent's slot, the shared prefix included, and generates what it
    generates unshared."""
    first = _requests()
    rng = np.random.default_rng(5)
    turns = [
        E.Request(10, rng.integers(0, SMALL.vocab, 9, dtype=np.int32), 6, follows=first[0].id),
        E.Request(11, rng.integers(0, SMALL.vocab, 4, dtype=np.int32), 3, follows=first[3].id),
        E.Request(12, rng.integers(0, SMALL.vocab, 7, dtype=np.int32), 5, follows=10),
    ]
    reqs = first + turns
    plain, _ = _serve(reqs, batch=3, device=cpu_device)
    shared, stats = _serve(reqs, batch=4, device=cpu_device, shared_prefix=PREFIX)
    for r, a, b in zip(reqs, plain.results, shared.results, strict=True):
        assert len(b.tokens) == r.max_new_tokens
        assert b.tokens == a.tokens, f"request {r.id}"
    assert stats["chunks_shared"] == len(first) * 2 * SMALL.num_layers  # first turns only
    # Every sharer released at the end: nothing backed, parked or shared (what was
    # released may still wait for the device, retired_bytes, given back in the background).
    assert stats["backed_bytes"] == stats["parked_bytes"] == 0 and not stats["sharing_seqs"]


def test_the_trace_counts_the_shared_prefix_once(cpu_device) -> None:
    """StepRecord.held_bytes (decode.py's memory ratio of a shared prefix): the tokens
    cached with the prefix once, which physical memory always covers; live_bytes, which
    counts the prefix in every request, exceeds it once enough requests share."""
    reqs = _requests()
    kw = dict(device=cpu_device, kv_layout="interleaved")  # memory close to the tokens
    report, _ = _serve(reqs, batch=5, shared_prefix=PREFIX, **kw)
    bpt = SMALL.kv_bytes_per_token
    first = report.trace[0]  # the prefix's own prefill: no request yet
    assert first.kind == "prefill" and first.active == 0
    assert (first.live_bytes, first.held_bytes) == (0, PREFIX * bpt)
    for r in report.trace[1:]:
        shared = r.active * PREFIX * bpt
        prefix = PREFIX * bpt if r.kind != "end" else 0  # the prefix slot, until the end
        assert r.held_bytes == r.live_bytes - shared + prefix, r
        assert r.held_bytes <= r.backed_bytes, r
    # The check above would catch a count without the sharing: that exceeds the memory.
    assert any(r.live_bytes > r.backed_bytes for r in report.trace)
    plain, _ = _serve(reqs, batch=4, **kw)
    assert all(r.held_bytes == r.live_bytes for r in plain.trace)


def test_shared_prefix_needs_attend_chunk(cpu_device) -> None:
    """The rest of each prompt is prefilled over the cache: a Generator without the
    multi-query attention refuses before it compiles or runs anything."""
    with jax.default_device(cpu_device):
        cache = make_cache(  # 128 tokens of 128 bytes: one 16 KiB chunk per sequence
            "jax_vmm", SMALL, max_seqs=4, max_tokens=128, device=cpu_device, chunk_bytes=16384
        )
        try:
            params = M.init_params(SMALL, seed=0)
            gen = E.Generator(params, SMALL, cache, jax_vmm.decode_attention, block=4)
            with pytest.raises(ValueError, match="after a shared prefix .* needs attend_chunk"):
                gen.run(_requests(), shared_prefix=PREFIX)
            assert gen.compile_seconds == 0.0
            assert cache.backed_bytes() == 0
        finally:
            cache.close()


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
    assert summary["kv_layout"] == "interleaved"  # --kv-layout auto, with a shared prefix
    per_layer = decode.main([*args, "--shared-prefix", "100", "--kv-layout", "per_layer"])
    assert per_layer["kv_layout"] == "per_layer"
    assert per_layer["shared_prefix"]["generation_unchanged"] is True
    assert per_layer["generated_tokens"] == summary["generated_tokens"]
    # Each request's partial last chunk once, not in each of the 2L buffers.
    assert shared["peak_backed_bytes"] < per_layer["shared_prefix"]["peak_backed_bytes"]
    # One peak, physical memory: the headline counted a shared chunk at every address.
    assert summary["peak_backed_bytes"] == shared["peak_backed_bytes"]
    # The prompts served: the prefix and the rest (summary.json said 4-20).
    assert summary["serving"]["prompt_len"] == (104, 120)
    assert summary["serving"]["shared_prefix"] == 100
    assert shared["peak_backed_bytes"] < shared["unshared_peak_backed_bytes"]
    # The peak against the peak of the tokens cached (the prefix once), which it covers.
    assert 0 < shared["peak_held_bytes"] <= shared["peak_backed_bytes"]
    assert shared["memory_ratio"] == shared["peak_backed_bytes"] / shared["peak_held_bytes"]
    with pytest.raises(SystemExit, match="needs N >= 1 and --backend jax_vmm"):
        decode.main([*args, "--shared-prefix", "8", "--backend", "prealloc"])
    with pytest.raises(SystemExit, match="needs the jax_vmm backend"):
        decode.main([*args, "--kv-layout", "interleaved", "--backend", "prealloc"])
    # --tp 1: the same code on a 1-device mesh (tests/sharding: on 2 and 4 devices).
    tp = decode.main([*args, "--shared-prefix", "100", "--tp", "1"])
    assert tp["shared_prefix"]["generation_unchanged"] is True, tp["shared_prefix"]
    assert tp["generated_tokens"] == summary["generated_tokens"]
