"""Prompts prefilled in chunks over the cache, and a conversation's next turn appended to
its cache (jax_vmm.serving.engine's prefill_chunk and Request.follows): both run
`jax_vmm.attention` with several queries per sequence over the cached tokens, and give
the tokens of a whole-prompt prefill and of the model recomputed without a cache."""

from __future__ import annotations

import dataclasses
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import serving

import jax_vmm
from conftest import hold_commit_ahead
from jax_vmm.serving import engine as E
from jax_vmm.serving import model as M
from jax_vmm.serving.attention import choose_attention, chunk_attention
from jax_vmm.serving.cache import make_cache

SMALL, GEMMA_LIKE, CONFIGS = serving.SMALL, serving.GEMMA_LIKE, serving.CONFIGS
CONTEXT = 96  # tokens per sequence slot
BACKENDS = ("jax_vmm", "prealloc")


def _requests(cfg: M.ModelConfig) -> list[E.Request]:
    # Prompt lengths around the chunk (5): shorter, equal, several chunks and a partial one.
    return [
        E.Request(i, np.random.default_rng(i).integers(0, cfg.vocab, n, dtype=np.int32), new)
        for i, (n, new) in enumerate([(3, 6), (5, 9), (23, 12), (11, 1), (17, 7)])
    ]


def _conversations(cfg: M.ModelConfig) -> list[E.Request]:
    """Two conversations of two and three turns plus a single request (30, which takes
    a slot another request finished in): each turn's prompt and length from _requests."""
    base = _requests(cfg)

    def turn(i: int, follows: int | None, src: int) -> E.Request:
        return E.Request(i, base[src].prompt, base[src].max_new_tokens, follows)

    return [
        turn(10, None, 0),
        turn(20, None, 1),
        turn(11, 10, 2),  # 23 new tokens after 3 + 6
        E.Request(30, base[3].prompt, 4),
        turn(21, 20, 4),
        turn(12, 11, 1),
    ]


def _serve(backend: str, cfg: M.ModelConfig, reqs: list[E.Request], device, **kw) -> E.RunReport:
    """Two slots, blocks of 4, the jax_vmm kernel on either backend, float32 matmuls at
    full precision (no TF32 on a GPU)."""
    kw.setdefault("chunk_bytes", 4096 if device.platform == "cpu" else None)
    with jax.default_matmul_precision("highest"):
        report, _ = serving.serve(
            backend,
            cfg,
            reqs,
            batch=2,
            max_tokens=CONTEXT,
            device=device,
            attention="jax_vmm",
            block=4,
            record_logits=True,
            **kw,
        )
    return report


@functools.cache
def _forward(cfg: M.ModelConfig):
    params = M.init_params(cfg, seed=0)
    return jax.jit(lambda t: M.forward_no_cache(params, t, cfg=cfg))


def _no_cache_greedy(
    cfg: M.ModelConfig, context: list[int], steps: int, device: jax.Device
) -> list[int]:
    """Greedy tokens recomputed from scratch at every step (no cache at all). The input
    is padded at the end to one length (one compile): causal, so nothing earlier sees it."""
    out: list[int] = []
    with jax.default_device(device), jax.default_matmul_precision("highest"):
        for _ in range(steps):
            seq = context + out
            padded = np.zeros(CONTEXT, np.int32)
            padded[: len(seq)] = seq
            logits = _forward(cfg)(jnp.asarray(padded))
            out.append(int(jnp.argmax(logits[len(seq) - 1])))
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_gives_the_whole_prompt_tokens(backend, name, device) -> None:
    """Chunks of 5 over the cache: token for token the whole-prompt prefill's output and
    the model recomputed without a cache; logits within float32 rounding."""
    cfg = CONFIGS[name]
    reqs = _requests(cfg)
    whole = _serve(backend, cfg, reqs, device)
    chunked = _serve(backend, cfg, reqs, device, prefill_chunk=5)
    assert chunked.prefills == sum(-(-len(r.prompt) // 5) for r in reqs) > len(reqs)
    for r, a, b in zip(reqs, whole.results, chunked.results, strict=True):
        assert b.tokens == a.tokens, f"request {r.id}"
        np.testing.assert_allclose(np.stack(b.logits), np.stack(a.logits), atol=2e-4, rtol=1e-4)
        assert b.tokens == _no_cache_greedy(cfg, r.prompt.tolist(), r.max_new_tokens, device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_chunk_that_ignores_the_earlier_chunks_is_caught(backend, cpu_device) -> None:
    """The check above sees a chunk that attends only to itself (not to the cache)."""
    cfg, reqs = SMALL, _requests(SMALL)[2:3]  # 23 tokens: five chunks
    with jax.default_device(cpu_device):
        params = M.init_params(cfg, seed=0)
        cache = make_cache(backend, cfg, max_seqs=2, max_tokens=96, device=cpu_device)
        try:
            name, attend = choose_attention("jax_vmm", backend=backend, platform="cpu")
            own = chunk_attention(name)

            def own_chunk_only(q, layer, lengths, *, q_lengths, **options):
                # The chunk's own tokens only: a window as long as the chunk, at its end.
                return own(q, layer, lengths, q_lengths=q_lengths, window=q.shape[1], **options)

            gen = E.Generator(
                params, cfg, cache, attend, attend_chunk=own_chunk_only, prefill_chunk=5
            )
            wrong = gen.run(reqs).results[0].tokens
        finally:
            cache.close()
    right = _no_cache_greedy(cfg, reqs[0].prompt.tolist(), reqs[0].max_new_tokens, cpu_device)
    assert wrong != right


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_next_turn_continues_on_its_cache(backend, name, device) -> None:
    """Two conversations of two and three turns plus a single request on two slots:
    each next turn is appended to its conversation's cache (the previous turn's last
    token, then the new prompt, prefilled over the cache) and generates what the model
    recomputed without a cache over the whole conversation generates; a next turn alone
    (without its history) generates something else."""
    cfg = CONFIGS[name]
    reqs = _conversations(cfg)
    for chunk in (None, 5):
        report = _serve(backend, cfg, reqs, device, prefill_chunk=chunk)
        got = {r.id: r for r in report.results}
        for r in reqs:
            if r.follows is None:
                continue
            history, parent = [], r.follows
            while parent is not None:  # the conversation before this turn
                req = next(q for q in reqs if q.id == parent)
                history = req.prompt.tolist() + got[parent].tokens + history
                parent = req.follows
            context = history + r.prompt.tolist()
            want = _no_cache_greedy(cfg, context, r.max_new_tokens, device)
            assert got[r.id].tokens == want, f"turn {r.id}, chunk {chunk}"
            if r.max_new_tokens > 4:
                alone = _no_cache_greedy(cfg, r.prompt.tolist(), r.max_new_tokens, device)
                assert got[r.id].tokens != alone, f"turn {r.id}: its history changed nothing"


class _CommitInFlightAtAdmission:
    """Stages the race behind a slot's next request losing its writes: when the engine hands
    slot `seq` to its next request (``release(seq, keep_tokens=n)``), a background commit of
    the old sequence's next chunk is inside the core, and it ends only after that release.
    The engine meets this when an admission overtakes a commit ahead that the slot's last
    block scheduled; here it is staged at every such admission, not left to timing."""

    def __init__(self, seq: int):
        self.seq, self.staged = seq, 0

    def install(self, monkeypatch) -> None:
        real_release = jax_vmm.KVArena.release

        def release(kv, seq=None, **kw):
            if seq != self.seq or not kw.get("keep_tokens"):
                return real_release(kv, seq, **kw)
            go = self._commit_in_flight(kv)
            try:
                return real_release(kv, seq, **kw)
            finally:
                go.set()

        monkeypatch.setattr(jax_vmm.KVArena, "release", release)

    def _commit_in_flight(self, kv) -> threading.Event:
        """Schedules a commit ahead of the slot's next chunk, waits until it is inside the
        core and returns the event that lets it end."""
        q = self.seq
        with kv._lock:
            tokens, epoch = kv._covered_tokens(q, int(kv._covered[q]) + 1), kv._epoch[q]
        held = hold_commit_ahead(kv, lambda: kv._ahead.schedule(q, tokens, epoch), hold_s=30)
        self.staged += 1
        return held.go


def test_an_admission_that_overtakes_a_commit_ahead_keeps_the_prompts_memory(
    monkeypatch, cpu_device
) -> None:
    """The next turns' requests on two slots, with a commit ahead of slot 1's old sequence
    in flight when request 30 takes the slot with keep_tokens: the commit, made void by
    that release, gives back only what it backed, so request 30's prompt and decode writes
    land (one that gave back the whole sequence would take the kept chunk too:
    OutOfBoundsWrite, 56 writes dropped) and every request generates what it generates
    without the staged race."""
    cfg = CONFIGS["llama"]
    reqs = _conversations(cfg)
    plain = _serve("jax_vmm", cfg, reqs, cpu_device, prefill_chunk=5)
    stage = _CommitInFlightAtAdmission(seq=1)
    stage.install(monkeypatch)
    staged = _serve("jax_vmm", cfg, reqs, cpu_device, prefill_chunk=5)  # raises on drops
    assert stage.staged == 1, "request 30 did not take slot 1 through release(keep_tokens=)"
    assert [r.tokens for r in staged.results] == [r.tokens for r in plain.results]


def test_bad_chunk_and_turn_arguments_are_refused(cpu_device) -> None:
    cfg = SMALL
    reqs = _requests(cfg)[:2]
    with jax.default_device(cpu_device):
        params = M.init_params(cfg, seed=0)
        cache = make_cache("jax_vmm", cfg, max_seqs=2, max_tokens=32, device=cpu_device)
        try:
            attend = jax_vmm.decode_attention
            for bad in (0, -3, 2.0, True):
                with pytest.raises(ValueError, match="prefill_chunk .* integer >= 1"):
                    E.Generator(
                        params,
                        cfg,
                        cache,
                        attend,
                        attend_chunk=jax_vmm.attention,
                        prefill_chunk=bad,
                    )
            with pytest.raises(ValueError, match="prefill_chunk needs attend_chunk"):
                E.Generator(params, cfg, cache, attend, prefill_chunk=4)
            gen = E.Generator(params, cfg, cache, attend)
            follow = E.Request(5, reqs[1].prompt, 2, follows=0)
            with pytest.raises(ValueError, match="needs attend_chunk"):
                gen.run([reqs[0], follow])
            gen = E.Generator(params, cfg, cache, attend, attend_chunk=jax_vmm.attention)
            with pytest.raises(ValueError, match="not an earlier request"):
                gen.run([follow, reqs[0]])
            with pytest.raises(ValueError, match="not an earlier request"):
                gen.run([reqs[0], E.Request(5, reqs[1].prompt, 2, follows=99)])
            with pytest.raises(ValueError, match="used twice"):
                gen.run([reqs[0], E.Request(0, reqs[1].prompt, 2)])
            with pytest.raises(ValueError, match="followed more than once"):
                gen.run([reqs[0], follow, E.Request(6, reqs[1].prompt, 2, follows=0)])
            # The whole conversation must fit a sequence: 3 + 6 - 1 + 1 + 23 + 12 - 1 > 32.
            long = E.Request(7, _requests(cfg)[2].prompt, 12, follows=0)
            with pytest.raises(ValueError, match="9 tokens of earlier turns"):
                gen.run([reqs[0], long])
            # Nothing ran: the cache holds nothing.
            assert cache.backed_bytes() == 0
        finally:
            cache.close()
    with pytest.raises(ValueError, match="unknown attention 'flash'"):
        chunk_attention("flash")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_cache_chunks_see_what_token_by_token_sees(backend, device) -> None:
    """Over an fp8 cache a chunk attends to quantized tokens (its own too: written, then
    read), so chunks of 5 give what chunks of 1 do (each prompt token alone over the
    cache, as decode reads it), not what a whole-prompt prefill (exact own tokens) does.
    Same tokens, logits within bf16 rounding of the queries."""
    cfg = dataclasses.replace(SMALL, head_dim=64)  # the fp8 decode kernel's head_dim
    reqs = _requests(cfg)

    def serve(chunk: int) -> E.RunReport:
        with jax.default_device(device), jax.default_matmul_precision("highest"):
            params = M.init_params(cfg, seed=0)
            cache = make_cache(
                backend, cfg, max_seqs=2, max_tokens=CONTEXT, device=device, kv_dtype="fp8",
                chunk_bytes=4096 if device.platform == "cpu" else None,
            )  # fmt: skip
            try:
                name, attend = choose_attention(
                    "jax_vmm", backend=backend, platform=device.platform, kv_dtype="fp8"
                )
                gen = E.Generator(
                    params, cfg, cache, attend, block=4,
                    attend_chunk=chunk_attention(name), prefill_chunk=chunk,
                )  # fmt: skip
                return gen.run(reqs, record_logits=True)
            finally:
                cache.close()

    one, five = serve(1), serve(5)
    for r, a, b in zip(reqs, one.results, five.results, strict=True):
        assert b.tokens == a.tokens, f"request {r.id}"
        np.testing.assert_allclose(np.stack(b.logits), np.stack(a.logits), atol=2e-3, rtol=2e-3)
