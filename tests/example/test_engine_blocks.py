"""The example engine's decode blocks (jax_vmm.serving.steps, jax_vmm.serving.engine): N decode
steps per host call in one device loop, finished sequences masked inside a block, stop
tokens on the device, block k+1 dispatched before block k is read, and (GPU) the block's
custom calls replayed from a captured graph across blocks and across growth."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import serving

import jax_vmm
from jax_vmm.serving import engine as E
from jax_vmm.serving import model as M
from jax_vmm.serving import steps as S
from jax_vmm.serving.attention import choose_attention
from jax_vmm.serving.cache import make_cache

SMALL = M.ModelConfig(
    vocab=256, d_model=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=128
)


def serve(backend: str, reqs: list[E.Request], *, block: int, device: jax.Device, **kw):
    """The example tests' `serving.serve` with this file's defaults: SMALL, 3 slots of
    128 tokens, 4 KiB chunks on the CPU, the jax_vmm kernel on either backend."""
    kw.setdefault("cfg", SMALL)
    kw.setdefault("batch", 3)
    kw.setdefault("max_tokens", 128)
    kw.setdefault("chunk_bytes", 4096 if device.platform == "cpu" else None)
    cfg = kw.pop("cfg")
    return serving.serve(backend, cfg, reqs, block=block, device=device, attention="jax_vmm", **kw)[
        0
    ]


def _requests(num: int = 7, new_tokens: tuple[int, int] = (1, 30)) -> list[E.Request]:
    reqs = E.make_requests(SMALL, num=num, prompt_len=(3, 40), new_tokens=new_tokens, seed=3)
    # A request of one new token (prefill only) and one that ends exactly on a block edge.
    reqs[1] = E.Request(reqs[1].id, reqs[1].prompt, 1)
    reqs[2] = E.Request(reqs[2].id, reqs[2].prompt, 11)
    return reqs


@pytest.mark.parametrize("backend", ["jax_vmm", "prealloc"])
def test_blocks_generate_what_single_steps_generate(backend: str, cpu_device) -> None:
    """Token for token the same output at block 1, 5 (finishes fall inside blocks) and
    16 (larger than most requests), logits within float32 rounding; every request gets
    exactly its tokens, and no write was dropped (the run's kv.check())."""
    reqs = _requests()
    one = serve(backend, reqs, block=1, device=cpu_device, record_logits=True)
    assert one.blocks == one.decode_steps and one.block == 1
    for block in (5, 16):
        got = serve(backend, reqs, block=block, device=cpu_device, record_logits=True)
        assert got.block == block and got.decode_steps == block * got.blocks
        assert got.blocks < one.blocks
        for r, a, b in zip(reqs, one.results, got.results, strict=True):
            assert len(a.tokens) == r.max_new_tokens
            assert b.tokens == a.tokens, f"block {block}, request {r.id}"
            np.testing.assert_allclose(np.stack(b.logits), np.stack(a.logits), atol=1e-4)
        assert got.generated_tokens == sum(r.max_new_tokens for r in reqs)


def test_stop_token_ends_a_sequence_inside_a_block(cpu_device) -> None:
    """A stop token generated mid-block ends its sequence there (kept as its last
    token); the steps after it are masked: with max_tokens cut to the requests' needs,
    the arena's write check sees no write past a sequence's ensured tokens."""
    reqs = _requests(new_tokens=(20, 30))
    full = serve("jax_vmm", reqs, block=1, device=cpu_device)
    # A token that some request generates at step >= 3 (inside a block of 8), not first.
    counts: dict[int, int] = {}
    for res in full.results:
        for t in set(res.tokens[3:]) - set(res.tokens[:3]):
            counts[t] = counts.get(t, 0) + 1
    stop = max(counts, key=counts.get)
    got = serve("jax_vmm", reqs, block=8, device=cpu_device, stop_tokens=(stop,))
    cut = 0
    for a, b in zip(full.results, got.results, strict=True):
        n = a.tokens.index(stop) + 1 if stop in a.tokens else len(a.tokens)
        cut += n < len(a.tokens)
        assert b.tokens == a.tokens[:n]
    assert cut >= 1 and got.generated_tokens < full.generated_tokens
    # The host stops sequences too when it picks the tokens (one step per call).
    forced = {r.id: r.tokens for r in full.results}
    host = serve(
        "jax_vmm", reqs, block=8, device=cpu_device, stop_tokens=(stop,), force_tokens=forced
    )
    assert [r.tokens for r in host.results] == [r.tokens for r in got.results]
    assert host.block == 1


def _arena_state(batch: int, remaining: list[int], positions: list[int]):
    return S.DecodeState(
        jnp.arange(batch, dtype=jnp.int32) + 5,
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(remaining, jnp.int32),
    )


@pytest.mark.parametrize("ensure_short", [False, True])
def test_a_block_masks_every_slot_past_its_steps(cpu_device, ensure_short: bool) -> None:
    """One block of 6 steps over slots with 2, 0 and 6 steps to go: each slot steps
    exactly that often (tokens -1 afterwards, positions advanced by its steps), and with
    each slot's memory ensured to exactly the tokens it writes, nothing is dropped. The
    same check with one token too few ensured raises: it sees a write the mask let
    through."""
    batch, steps = 3, 6
    remaining, positions = [2, 0, 6], [4, 9, 7]
    with jax.default_device(cpu_device):
        params = M.init_params(SMALL, seed=0)
        cache = make_cache("jax_vmm", SMALL, max_seqs=batch, max_tokens=32, device=cpu_device)
        try:
            for seq in range(batch):
                need = positions[seq] + remaining[seq] - (ensure_short and seq == 2)
                cache.kv.ensure(need, seq)  # exact: no chunk rounding claimed
            fn = jax.jit(
                lambda p, c, s, ctl: S.decode_block(
                    p,
                    c,
                    s,
                    ctl,
                    num_steps=steps,
                    cfg=SMALL,
                    write=cache.write,
                    attend=jax_vmm.decode_attention,
                    stop_tokens=(),
                    with_logits=False,
                )
            )
            control = jnp.full(batch, S.KEEP, jnp.int32)
            out, _, c, state = fn(
                params, cache.cache(), _arena_state(batch, remaining, positions), control
            )
            out = np.asarray(out)
            for seq in range(batch):
                assert (out[: remaining[seq], seq] >= 0).all()
                assert (out[remaining[seq] :, seq] == -1).all()
            np.testing.assert_array_equal(
                np.asarray(state.positions), np.asarray(positions) + np.asarray(remaining)
            )
            assert (np.asarray(state.remaining) == 0).all()
            if ensure_short:
                with pytest.raises(jax_vmm.OutOfBoundsWrite):
                    cache.kv.check(c, out)
            else:
                cache.kv.check(c, out)
        finally:
            cache.close()


def test_control_stops_and_feeds_slots(cpu_device) -> None:
    """The host's per-call control: STOP idles a slot for the block, a token >= 0 is the
    slot's next input (what sampling and teacher forcing use)."""
    batch = 2
    with jax.default_device(cpu_device):
        params = M.init_params(SMALL, seed=0)
        cache = make_cache("prealloc", SMALL, max_seqs=batch, max_tokens=32, device=cpu_device)
        fn = jax.jit(
            lambda p, c, s, ctl: S.decode_block(
                p,
                c,
                s,
                ctl,
                num_steps=1,
                cfg=SMALL,
                write=cache.write,
                attend=jax_vmm.decode_attention,
                stop_tokens=(),
                with_logits=False,
            )
        )
        state = _arena_state(batch, [3, 3], [0, 0])
        fed = fn(params, cache.cache(), state, jnp.asarray([S.STOP, 17], jnp.int32))
        kept = fn(params, cache.cache(), state, jnp.asarray([S.KEEP, S.KEEP], jnp.int32))
        assert int(fed[0][0, 0]) == -1 and int(fed[3].remaining[0]) == 0
        assert int(fed[3].positions[1]) == 1 and int(fed[3].remaining[1]) == 2
        # Feeding 17 instead of the state's token 6 changes slot 1's output.
        ref = M.decode_step(
            params,
            cache.cache(),
            jnp.asarray([0, 17], jnp.int32),
            jnp.asarray([-1, 0], jnp.int32),
            cfg=SMALL,
            write=cache.write,
            attend=jax_vmm.decode_attention,
        )[1]
        assert int(fed[0][0, 1]) == int(ref[1])
        assert int(kept[0][0, 0]) >= 0
        cache.close()


class _Watched:
    """A block's token array that logs when the host reads it."""

    def __init__(self, x: jax.Array, k: int, log: list) -> None:
        self.x, self.k, self.log = x, k, log

    def __array__(self, dtype=None, copy=None):
        self.log.append(("read", self.k))
        return np.asarray(self.x, dtype)

    def is_ready(self) -> bool:  # asks whether the device is done; reads nothing
        return self.x.is_ready()


def test_the_next_block_is_dispatched_before_the_last_is_read(cpu_device, monkeypatch) -> None:
    """Double buffering: the host reads block k's tokens only after it dispatched
    block k+1 (except at the end, or where no slot is live: then it drains)."""
    log: list = []
    orig = E.Generator._block_fn

    def watched(self, *a, **kw):
        fn = orig(self, *a, **kw)

        def call(*args):
            k = sum(1 for e in log if e[0] == "dispatch")
            log.append(("dispatch", k))
            tokens, logits, out, state = fn(*args)
            return _Watched(tokens, k, log), logits, out, state

        return call

    monkeypatch.setattr(E.Generator, "_block_fn", watched)
    reqs = _requests(num=5, new_tokens=(12, 30))
    serve("jax_vmm", reqs, block=4, device=cpu_device)
    blocks = sum(1 for e in log if e[0] == "dispatch")
    assert blocks >= 4
    overlapped = 0
    for k in range(blocks - 1):
        read_at = log.index(("read", k))
        overlapped += log.index(("dispatch", k + 1)) < read_at
    # Here some slot is always live until the end: every block but the last overlaps.
    assert overlapped == blocks - 1, log


def test_block_and_pause_arguments_are_checked(cpu_device) -> None:
    with jax.default_device(cpu_device):
        params = M.init_params(SMALL, seed=0)
        cache = make_cache("prealloc", SMALL, max_seqs=1, max_tokens=16, device=cpu_device)
        for bad in (0, -1, 2.0, True):
            with pytest.raises(ValueError, match="block .* must be an integer >= 1"):
                E.Generator(params, SMALL, cache, jax_vmm.decode_attention, block=bad)
        with pytest.raises(ValueError, match="not token ids"):
            E.Generator(params, SMALL, cache, jax_vmm.decode_attention, stop_tokens=(256,))
        for bad in ("release", 0, None):
            with pytest.raises(ValueError, match="keep_slot_memory must be True or False"):
                E.Generator(params, SMALL, cache, jax_vmm.decode_attention, keep_slot_memory=bad)
        gen = E.Generator(params, SMALL, cache, jax_vmm.decode_attention)
        req = [E.Request(0, np.arange(3, dtype=np.int32), 2)]
        with pytest.raises(ValueError, match="pause_every and pause go together"):
            gen.run(req, pause_every=2)
        with pytest.raises(ValueError, match="pause_every must be an integer >= 1"):
            gen.run(req, pause_every=0, pause=lambda: None)
        cache.close()


def test_host_chosen_tokens_are_checked(cpu_device) -> None:
    """select_token / force_tokens feed tokens back: one outside the vocabulary (or the
    engine's own -1/-2 codes, which hung or were recorded but not fed) is refused, naming
    the request; force_tokens short of a request or both options together are refused
    before anything runs; the Generator serves again afterwards, its memory all back."""
    with jax.default_device(cpu_device):
        params = M.init_params(SMALL, seed=0)
        cache = make_cache("jax_vmm", SMALL, max_seqs=2, max_tokens=16, device=cpu_device)
        gen = E.Generator(
            params, SMALL, cache, jax_vmm.decode_attention, stop_tokens=(np.int64(3),)
        )
        assert gen.stop_tokens == (3,)
        reqs = [E.Request(i, np.arange(1, 4, dtype=np.int32), 4) for i in range(2)]
        for bad in (-2, -1, SMALL.vocab, 2.0):
            with pytest.raises(ValueError, match=f"select_token returned {bad!r} for request"):
                gen.run(reqs, select_token=lambda rid, logits, bad=bad: bad)
            assert cache.kv.stats()["backed_bytes"] == 0
        with pytest.raises(ValueError, match="request 1 needs 4, got none"):
            gen.run(reqs, force_tokens={0: [1, 2, 3, 4]})
        with pytest.raises(ValueError, match="request 0 needs 4, got 2"):
            gen.run(reqs, force_tokens={0: [1, 2], 1: [1, 2, 3, 4]})
        with pytest.raises(ValueError, match=r"force_tokens\[1\] holds values that are not"):
            gen.run(reqs, force_tokens={0: [1, 2, 3, 4], 1: [1, 2, 3, 9999]})
        with pytest.raises(ValueError, match="give one"):
            gen.run(reqs, force_tokens={0: [1] * 4, 1: [1] * 4}, select_token=lambda r, x: 1)
        with pytest.raises(TypeError, match="stop_tokens must be a sequence"):
            E.Generator(params, SMALL, cache, jax_vmm.decode_attention, stop_tokens=3)
        picked = gen.run(reqs, select_token=lambda rid, logits: int(np.argmax(logits)))
        assert picked.results[0].tokens == picked.results[0].greedy
        assert cache.kv.stats()["backed_bytes"] == 0
        cache.close()


@pytest.mark.parametrize(
    "request_,match",
    [
        (E.Request(0, np.array([600, 3], np.int32), 2), r"prompt token ids \[600\] are not"),
        (E.Request(0, np.array([-1, 3], np.int32), 2), r"prompt token ids \[-1\] are not"),
        (E.Request(0, np.array([1.5, 3.0]), 2), "prompt token ids must be integers"),
        (E.Request(0, np.zeros(0, np.int32), 2), "the prompt is empty"),
        (
            E.Request(0, np.ones((2, 3), np.int32), 2),
            r"1-D sequence of token ids, got shape \(2, 3\)",
        ),
        (E.Request(0, np.int32(5), 2), r"1-D sequence of token ids, got shape \(\)"),
        (E.Request(0, np.array([1, 3], np.int32), 0), "max_new_tokens must be >= 1"),
        (E.Request(0, np.array([1, 3], np.int32), -3), "max_new_tokens must be >= 1"),
        (E.Request(0, np.array([1, 3], np.int32), 2.0), "max_new_tokens must be an integer"),
        (
            E.Request(0, np.arange(10, dtype=np.int32), 8),
            "needs 17 cached tokens; the cache holds 16",
        ),
    ],
)
def test_a_bad_request_is_refused_by_what_is_wrong(cpu_device, request_, match) -> None:
    """Each wrong request says what is wrong with it (an out-of-vocabulary id was clamped by
    the embedding and served silently; an empty prompt or max_new_tokens 0 were reported as
    a cache too small), before anything is dispatched."""
    with jax.default_device(cpu_device):
        params = M.init_params(SMALL, seed=0)
        cache = make_cache("jax_vmm", SMALL, max_seqs=2, max_tokens=16, device=cpu_device)
        gen = E.Generator(params, SMALL, cache, jax_vmm.decode_attention)
        with pytest.raises(ValueError, match=match):
            gen.run([request_])
        assert cache.kv.stats()["backed_bytes"] == 0
        cache.close()


def test_a_shared_prefix_with_pauses_is_refused_before_any_work(cpu_device) -> None:
    """The arena cannot sleep while a prefix is shared: the run refuses the pair up front
    (it failed at its first pause, leaving the prefix shared and read-only, so the next
    run's prefill writes were dropped)."""
    with jax.default_device(cpu_device):
        params = M.init_params(SMALL, seed=0)
        cache = make_cache(
            "jax_vmm", SMALL, max_seqs=3, max_tokens=64, device=cpu_device, chunk_bytes=4096
        )
        gen = E.Generator(
            params, SMALL, cache, jax_vmm.decode_attention, attend_chunk=jax_vmm.attention
        )
        prefix = np.arange(10, dtype=np.int32)
        reqs = [
            E.Request(i, np.concatenate([prefix, [20 + i]]).astype(np.int32), 4) for i in (0, 1)
        ]
        with pytest.raises(ValueError, match="shared_prefix and pause_every go separately"):
            gen.run(reqs, shared_prefix=10, pause_every=1, pause=lambda: None)
        stats = cache.kv.stats()
        assert stats["backed_bytes"] == 0 and stats["shared_prefixes"] == []
        assert len(gen.run(reqs, shared_prefix=10).results) == 2
        cache.kv.check()
        cache.close()


@pytest.mark.gpu
def test_blocks_replay_the_captured_step_across_blocks_and_growth(gpu_device) -> None:
    """On the GPU the decode block's custom calls (kv_write and decode_attention on the
    cache) are recorded into a command buffer once and then replayed: after two warm-up
    blocks their host handlers are never called again (calls and captured_calls frozen),
    across blocks and while sequences grow into new chunks."""
    import dataclasses

    from jax_vmm import ops

    cfg = dataclasses.replace(M.PRESETS["gpu"], num_layers=2, vocab=1024, dtype="bfloat16")
    # Long generations: every sequence crosses chunk boundaries (1024 tokens per 2 MiB).
    reqs = E.make_requests(cfg, num=4, prompt_len=(900, 1000), new_tokens=(400, 400), seed=5)
    snaps: list[tuple] = []

    def snapshot() -> None:
        w = ops.kv_write_stats()["kv_cache_write"]
        a = jax_vmm.ops.attention.attention_stats()
        snaps.append((w["calls"], w["captured_calls"], a["cuda_execute_calls"]))

    report = serve(
        "jax_vmm",
        reqs,
        block=16,
        device=gpu_device,
        batch=4,
        max_tokens=2048,
        cfg=cfg,
        pause_every=1,
        pause=snapshot,
    )
    assert report.blocks >= 20 and len(snaps) == report.blocks
    assert snaps[1][1] > snaps[0][1] or snaps[0][1] > 0, f"never captured: {snaps}"
    assert snaps[-1] == snaps[2], (
        f"the block's handlers were called again after warm-up (re-recorded, not replayed): "
        f"{snaps[2]} -> {snaps[-1]}"
    )


# -- sleep/wake of the whole engine, fp8 KV ------------------------------------------------


def test_sleep_and_wake_in_flight_leave_generation_unchanged(cpu_device) -> None:
    """The engine sleeps (KV arena and the weights' arena) and wakes after every other
    block with sequences in flight: the same tokens as without sleeping, and nothing
    held while asleep. The same run with a sleep that drops the cache's contents
    (keep="discard") changes the tokens: the comparison sees a broken wake."""
    from jax_vmm.serving.sleep_wake import EngineSleeper, same_tokens

    reqs = _requests(new_tokens=(10, 30))
    with jax.default_device(cpu_device):
        params = M.init_params(SMALL, seed=0)
        cache = make_cache("jax_vmm", SMALL, max_seqs=3, max_tokens=128, device=cpu_device)
        try:
            sleeper = EngineSleeper(cache.kv, params, cpu_device)
            gen = E.Generator(sleeper.params, SMALL, cache, jax_vmm.decode_attention, block=4)
            plain = gen.run(reqs)
            slept = gen.run(reqs, pause_every=2, pause=sleeper.pause)
            assert slept.pauses == slept.blocks // 2 >= 3
            assert sleeper.stats.cycles == slept.pauses
            assert sleeper.stats.asleep_backed_bytes == 0
            assert same_tokens(plain, slept) == []

            def lossy() -> None:
                cache.kv.sleep("discard")
                cache.kv.wake()

            broken = gen.run(reqs, pause_every=2, pause=lossy)
            assert same_tokens(plain, broken) != []
            sleeper.close()
        finally:
            cache.close()


def test_decode_cli_sleep_every_checks_generation(tmp_path: Path) -> None:
    from jax_vmm.serving.cli import decode

    args = ["--device", "cpu", "--requests", "4", "--batch", "2", "--max-tokens", "128",
            "--prompt-len", "4", "20", "--new-tokens", "10", "30", "--block", "4",
            "--no-plot", "--no-progress", "--out", str(tmp_path)]  # fmt: skip
    summary = decode.main([*args, "--sleep-every", "2"])
    assert summary["sleep"]["generation_unchanged"] is True
    assert summary["sleep"]["cycles"] >= 2 and summary["sleep"]["asleep_backed_bytes"] == 0
    with pytest.raises(SystemExit, match="needs K >= 1 and --backend jax_vmm"):
        decode.main([*args, "--sleep-every", "2", "--backend", "prealloc"])
    with pytest.raises(SystemExit, match="fp8 attention takes head_dim in"):
        decode.main([*args, "--preset", "cpu", "--kv-dtype", "fp8"])
    with pytest.raises(SystemExit, match="block .* must be an integer >= 1"):
        decode.main([*args, "--block", "0"])  # the last one counts


FP8_CFG = M.ModelConfig(
    vocab=256, d_model=128, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64,
    ffn_dim=256, dtype="bfloat16",
)  # fmt: skip


def test_fp8_kv_on_both_backends(cpu_device) -> None:
    """--kv-dtype fp8: an arena of float8_e4m3fn and a preallocated fp8 cache hold the
    same quantized tokens, so they generate the same tokens; against the bf16 cache the
    logits move by quantization error only (far below their spread), and the fp8 cache
    holds half the bytes."""
    reqs = E.make_requests(FP8_CFG, num=4, prompt_len=(3, 30), new_tokens=(5, 20), seed=2)
    runs = {}
    for backend, kv_dtype in (("jax_vmm", "fp8"), ("prealloc", "fp8"), ("jax_vmm", "model")):
        with jax.default_device(cpu_device):
            params = M.init_params(FP8_CFG, seed=0)
            cache = make_cache(
                backend, FP8_CFG, max_seqs=2, max_tokens=64, device=cpu_device, kv_dtype=kv_dtype
            )
            _, attend = choose_attention(
                "auto", backend=backend, platform="cpu", dtype=FP8_CFG.dtype, kv_dtype=kv_dtype
            )
            try:
                assert cache.token_bytes == (1 if kv_dtype == "fp8" else 2) * 2 * 2 * 2 * 64
                gen = E.Generator(params, FP8_CFG, cache, attend, block=4)
                runs[backend, kv_dtype] = gen.run(reqs, record_logits=True)
            finally:
                cache.close()
    a, b, ref = runs["jax_vmm", "fp8"], runs["prealloc", "fp8"], runs["jax_vmm", "model"]
    assert [r.tokens for r in a.results] == [r.tokens for r in b.results]
    first = np.stack([r.logits[0] for r in ref.results])  # step 0: the same prefill input
    got = np.stack([r.logits[1] for r in a.results])
    want = np.stack([r.logits[1] for r in ref.results])
    spread = float(np.std(first))
    forced = [x.tokens[0] == y.tokens[0] for x, y in zip(a.results, ref.results, strict=True)]
    assert all(forced)  # prefill does not read the cache: same first token
    assert float(np.max(np.abs(got - want))) < 0.25 * spread


def test_fp8_needs_the_dequantizing_kernel() -> None:
    with pytest.raises(ValueError, match="fp8 cache holds fp8.*--attention jax_vmm"):
        choose_attention("reference", backend="prealloc", platform="cpu", kv_dtype="fp8")
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        make_cache("jax_vmm", SMALL, max_seqs=1, max_tokens=8, kv_dtype="int8")


def test_generate_cli_checks_block_before_loading(tmp_path: Path) -> None:
    from jax_vmm.serving.cli import generate as G

    # An empty directory: the block is refused before the checkpoint is read.
    with pytest.raises(SystemExit, match=r"generate\.py: block .* must be an integer >= 1"):
        G.main(["--model", str(tmp_path), "--prompt", "x", "--max-new-tokens", "2",
                "--block", "0", "--device", "cpu"])  # fmt: skip
    # so are --max-new-tokens 0 and a --json that is a directory
    with pytest.raises(SystemExit, match=r"--max-new-tokens must be an integer >= 1, got 0"):
        G.main(["--model", str(tmp_path), "--prompt", "x", "--max-new-tokens", "0",
                "--device", "cpu"])  # fmt: skip
    with pytest.raises(SystemExit, match=r"--json .*: is a directory; give a file"):
        G.main(["--model", str(tmp_path), "--prompt", "x", "--max-new-tokens", "2",
                "--json", str(tmp_path), "--device", "cpu"])  # fmt: skip


@pytest.mark.parametrize("ensure_blocks", [2, 1], ids=["default", "control-every-block"])
def test_one_table_update_serves_ensure_blocks_blocks(
    cpu_device, monkeypatch, ensure_blocks: int
) -> None:
    """One request of 41 new tokens (the prefill's, then 40 decode steps: 10 blocks of 4
    that write): the engine calls ensure_all once per ENSURE_BLOCKS of those blocks, and
    no write is dropped (the run's kv.check()); the control with ENSURE_BLOCKS = 1 calls
    it every block."""
    monkeypatch.setattr(E, "ENSURE_BLOCKS", ensure_blocks)
    reqs = [E.Request(0, np.arange(1, 9, dtype=np.int32), 41)]
    got = serve("jax_vmm", reqs, block=4, device=cpu_device)
    assert len(got.results[0].tokens) == 41
    assert got.host_calls["ensure_all"][0] == -(-10 // ensure_blocks)


def test_decode_cli_two_engines_take_turns_in_one_budget(tmp_path: Path) -> None:
    """--sleep-every K --budget BYTES: a reference engine runs at every pause while the
    policy sleeps, inside one budget smaller than the sum of the two engines' peaks."""
    from jax_vmm.serving.cli import decode

    args = ["--device", "cpu", "--requests", "4", "--batch", "2", "--max-tokens", "128",
            "--prompt-len", "4", "20", "--new-tokens", "10", "30", "--block", "4",
            "--no-plot", "--no-progress", "--out", str(tmp_path), "--sleep-every", "2"]  # fmt: skip
    roomy = decode.main([*args, "--budget", str(1 << 30)])["budget"]
    peaks = roomy["arena_peak_bytes"]
    policy = peaks["policy KV"] + peaks["policy weights"]
    reference = peaks["reference KV"] + peaks["reference weights"]
    # One engine at a time even with room for both: the reference sleeps from its start.
    assert roomy["peak_bytes"] == max(policy, reference)
    cap = max(policy, reference) + min(policy, reference) // 2
    summary = decode.main([*args, "--budget", str(cap)])
    b = summary["budget"]
    assert b["budget_below_sum_of_peaks"] and b["sum_of_engine_peaks_bytes"] == policy + reference
    assert b["peak_bytes"] <= cap and b["reference_turns"] >= 2
    assert b["reference_unchanged"] and summary["sleep"]["generation_unchanged"]
    with pytest.raises(SystemExit, match="--budget 4096: needs --sleep-every K"):
        decode.main([*args[:-2], "--budget", "4096"])
    with pytest.raises(SystemExit, match="--budget 0: needs --sleep-every K .* BYTES > 0"):
        decode.main([*args, "--budget", "0"])
    # Too small for the engines: a usage error naming the flag, not a traceback.
    with pytest.raises(SystemExit, match=r"(?s)out of memory: .*memory budget of 300000 .*"
                       r"To go on, give a larger --budget than 300000\."):  # fmt: skip
        decode.main([*args, "--budget", "300000"])


def test_a_run_that_fails_midway_gives_its_slots_memory_back(cpu_device) -> None:
    """A commit past the budget in the middle of a run with a shared prefix raises, and the
    cache is left as before the run: nothing backed, nothing shared, the budget empty; so
    the next run on the same cache serves (it held the failed run's slots, and its share
    into a slot still holding memory was refused)."""
    with jax.default_device(cpu_device):
        params = M.init_params(SMALL, seed=0)
        # a token is 128 B per buffer (2 heads x 16 x fp32): a 4 KiB chunk holds 32
        budget = jax_vmm.MemoryBudget(3 * 4 * 4096, cpu_device)  # 3 chunks per buffer
        cache = make_cache(
            "jax_vmm",
            SMALL,
            max_seqs=3,
            max_tokens=128,
            device=cpu_device,
            chunk_bytes=4096,
            budget=budget,
            commit_ahead_tokens=0,  # what each run holds is then exact
        )
        gen = E.Generator(
            params,
            SMALL,
            cache,
            jax_vmm.decode_attention,
            block=4,
            attend_chunk=jax_vmm.attention,
        )
        prefix = np.arange(1, 33, dtype=np.int32)  # one whole chunk, shared

        def reqs(new_tokens: int) -> list[E.Request]:
            return [
                E.Request(i, np.concatenate([prefix, [40 + i]]).astype(np.int32), new_tokens)
                for i in (0, 1)
            ]

        with pytest.raises(jax_vmm.OutOfMemoryError, match="memory budget"):
            gen.run(reqs(60), shared_prefix=32)  # two sharers past 64 tokens: 5 chunks
        stats = cache.kv.stats()
        assert stats["backed_bytes"] == 0 and stats["shared_prefixes"] == [], stats
        assert budget.stats()["used_bytes"] == 0
        got = gen.run(reqs(8), shared_prefix=32)
        fresh = make_cache(
            "jax_vmm", SMALL, max_seqs=3, max_tokens=128, device=cpu_device, chunk_bytes=4096
        )
        want = E.Generator(
            params,
            SMALL,
            fresh,
            jax_vmm.decode_attention,
            block=4,
            attend_chunk=jax_vmm.attention,
        ).run(reqs(8), shared_prefix=32)
        assert [r.tokens for r in got.results] == [r.tokens for r in want.results]
        assert cache.kv.stats()["backed_bytes"] == 0
        cache.close()
        fresh.close()


def _small_4k_chunk_engine(device, max_seqs: int, max_tokens: int, block: int):
    """(Generator, cache): SMALL over a jax_vmm cache of 4 KiB chunks (every sequence
    starts on a chunk, as shared prefixes need), next turns prefilled by jax_vmm.attention."""
    params = M.init_params(SMALL, seed=0)
    cache = make_cache(
        "jax_vmm", SMALL, max_seqs=max_seqs, max_tokens=max_tokens, device=device, chunk_bytes=4096
    )
    gen = E.Generator(
        params, SMALL, cache, jax_vmm.decode_attention, block=block, attend_chunk=jax_vmm.attention
    )
    return gen, cache


def test_a_finished_slot_is_not_held_for_next_turns(cpu_device) -> None:
    """keep_slot_memory holds a finished slot's memory only for a queued first turn: next
    turns (follows) run in their parent's slot. With only next turns queued, request 1's
    slot goes back when it finishes (it stayed backed to the end of the run)."""
    with jax.default_device(cpu_device):
        gen, cache = _small_4k_chunk_engine(cpu_device, max_seqs=2, max_tokens=256, block=4)
        rng = np.random.default_rng(0)
        reqs = [
            E.Request(0, rng.integers(0, SMALL.vocab, 40, dtype=np.int32), 120),
            E.Request(1, rng.integers(0, SMALL.vocab, 30, dtype=np.int32), 2),
            E.Request(2, np.array([1, 2, 3], np.int32), 4, follows=0),
            E.Request(3, np.array([4, 5], np.int32), 4, follows=2),
        ]
        seen = []
        gen.run(reqs, progress=lambda n: seen.append(cache.kv.stats()["backed_tokens"][1]))
        assert seen[-1] == 0, seen[-5:]  # slot 1 gave its tokens back while 0 decoded on
        assert cache.kv.stats()["backed_tokens"] == [0, 0]
        cache.close()


def test_numpy_ints_for_shared_prefix_and_pause_every(cpu_device) -> None:
    """shared_prefix and pause_every take NumPy integers, as block and prefill_chunk do."""
    with jax.default_device(cpu_device):
        gen, cache = _small_4k_chunk_engine(cpu_device, max_seqs=3, max_tokens=64, block=2)
        reqs = [E.Request(i, np.arange(1, 6, dtype=np.int32), 3) for i in range(2)]
        paused = []
        plain = gen.run(reqs)
        again = gen.run(reqs, pause_every=np.int64(1), pause=lambda: paused.append(1))
        assert paused and [r.tokens for r in again.results] == [r.tokens for r in plain.results]
        shared = gen.run(reqs, shared_prefix=np.int64(2))
        assert [r.tokens for r in shared.results] == [r.tokens for r in plain.results]
        assert cache.kv.stats()["backed_tokens"] == [0, 0, 0]
        cache.close()


def test_take_turns_wakes_the_policy_when_the_reference_run_fails() -> None:
    """A failing reference run (out of budget, say) still puts the reference back to sleep
    and wakes the policy, whose own run then raises with slots it can release (a policy
    left asleep refused every release and kept its memory after a later wake)."""
    from jax_vmm.serving.take_turns import TakeTurns

    calls = []

    class Sleeper:
        def __init__(self, name):
            self.name = name

        def sleep(self):
            calls.append(f"{self.name}.sleep")

        def wake(self):
            calls.append(f"{self.name}.wake")

    class FailingRun:
        def run(self, requests):
            calls.append("reference.run")
            raise jax_vmm.OutOfMemoryError("out of the budget")

    turns = TakeTurns(Sleeper("policy"), Sleeper("reference"), FailingRun(), [])
    with pytest.raises(jax_vmm.OutOfMemoryError, match="out of the budget"):
        turns.pause()
    assert calls == [
        "policy.sleep",
        "reference.wake",
        "reference.run",
        "reference.sleep",
        "policy.wake",
    ]
