"""The example's tensor parallelism (``examples/decode.py --tp N``,
``jax_vmm.serving.tensor_parallel``) on 4 host devices, run
in one child process (tests/sharding/multidevice.py).

The oracle is the same model on one device with an unsharded jax_vmm cache: prefill and
teacher-forced decode steps must give the same logits (up to float32 summation order:
the split projections are summed by an all-reduce).
"""

from __future__ import annotations

import contextlib
import functools
import io
import sys
import tempfile

# Run as a script (multidevice.child_results): this folder is on sys.path, jax_vmm on
# the PYTHONPATH the parent gives.
import jax
import multidevice
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_vmm
from jax_vmm.serving import model as M
from jax_vmm.serving import tensor_parallel as TP
from jax_vmm.serving.cache import VmmCache
from jax_vmm.serving.cli import decode

CFG = M.ModelConfig(num_q_heads=8, num_kv_heads=4, head_dim=32, ffn_dim=384)
B, T = 4, 128
SCENARIOS = {}


def attend(q, layer, lengths):
    import jax_vmm

    return jax_vmm.decode_attention(q, layer, lengths)


def run(params, cache, prompts, steps):
    """Prefill each prompt into slot i, then ``steps`` decode steps feeding back the
    tokens of ``steps`` (B, n) (teacher forcing). Returns every step's logits."""
    prefill = jax.jit(functools.partial(M.prefill, cfg=CFG, write=cache.write))
    step = jax.jit(functools.partial(M.decode_step, cfg=CFG, write=cache.write, attend=attend))
    out = []
    for seq, prompt in enumerate(prompts):
        cache.ensure(seq, len(prompt) + steps.shape[1])
        padded = np.zeros(64, np.int32)
        padded[: len(prompt)] = prompt
        logits, c = prefill(params, cache.cache(), padded, np.int32(len(prompt)), np.int32(seq))
        cache.update(c)
        out.append(np.asarray(logits))
    positions = np.array([len(p) for p in prompts], np.int32)
    for i in range(steps.shape[1]):
        logits, _, c = step(params, cache.cache(), steps[:, i], positions + i)
        cache.update(c)
        out.append(np.asarray(logits))
    cache.check()
    return out


def tp_logits_equal_single_device(n: int, platform: str = "cpu", tol: float = 2e-5) -> None:
    """--tp n (heads, MLP and the cache split over n devices of ``platform``) against one
    device with an unsharded cache: the same logits at every prefill and decode step."""
    rng = np.random.default_rng(n)
    prompts = [rng.integers(0, CFG.vocab, size=k).astype(np.int32) for k in (5, 17, 9, 30)]
    steps = rng.integers(0, CFG.vocab, size=(B, 6)).astype(np.int32)
    params = M.init_params(CFG, seed=3)
    ref_cache = VmmCache(CFG, max_seqs=B, max_tokens=T, device=jax.devices(platform)[0])
    want = run(params, ref_cache, prompts, steps)
    mesh = TP.tp_mesh(n, platform)
    sharded = TP.shard_params(params, CFG, mesh)
    assert sharded.layers[0].wq.sharding.spec == P(None, "tp")
    assert sharded.layers[0].w_down.sharding.spec == P("tp", None)
    cache = VmmCache(CFG, max_seqs=B, max_tokens=T, sharding=TP.cache_sharding(mesh))
    assert [s.num_kv_heads for s in cache.kv.shards] == [CFG.num_kv_heads // n] * n
    got = run(sharded, cache, prompts, steps)
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=f"call {i}")
    # Each device backs its heads of every token: the same bytes on each.
    per_device = {s.backed_bytes for s in cache.kv.shards}
    assert len(per_device) == 1 and per_device.pop() > 0, per_device
    cache.close()
    ref_cache.close()


for _n in (1, 2, 4):
    SCENARIOS[f"tp{_n}_logits_equal_single_device"] = lambda n=_n: tp_logits_equal_single_device(n)


def run_chunked(params, cache, prompts, chunk: int = 8):
    """Each prompt prefilled into slot i in chunks of ``chunk`` tokens over the cache
    (several queries per sequence: jax_vmm.attention). Returns each prompt's last logits."""
    step = jax.jit(
        functools.partial(
            M.prefill_chunk, cfg=CFG, write=cache.write, attend_chunk=jax_vmm.attention
        )
    )
    out = []
    for seq, prompt in enumerate(prompts):
        cache.ensure(seq, len(prompt))
        for start in range(0, len(prompt), chunk):
            piece = prompt[start : start + chunk]
            padded = np.zeros(chunk, np.int32)
            padded[: len(piece)] = piece
            logits, c = step(
                params, cache.cache(), padded, np.int32(start), np.int32(len(piece)), np.int32(seq)
            )
            cache.update(c)
        out.append(np.asarray(logits))
    cache.check()
    return out


def tp_chunked_prefill_equals_whole_prompt(n: int, tol: float = 2e-5) -> None:
    """--tp n with prompts prefilled in chunks over the sharded cache (jax_vmm.attention
    per device) against whole-prompt prefill on one device: the same last logits."""
    rng = np.random.default_rng(10 + n)
    prompts = [rng.integers(0, CFG.vocab, size=k).astype(np.int32) for k in (5, 17, 9, 30)]
    params = M.init_params(CFG, seed=3)
    ref_cache = VmmCache(CFG, max_seqs=B, max_tokens=T, device=jax.devices("cpu")[0])
    want = run(params, ref_cache, prompts, np.zeros((B, 0), np.int32))
    mesh = TP.tp_mesh(n, "cpu")
    cache = VmmCache(CFG, max_seqs=B, max_tokens=T, sharding=TP.cache_sharding(mesh))
    got = run_chunked(TP.shard_params(params, CFG, mesh), cache, prompts)
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=f"prompt {i}")
    cache.close()
    ref_cache.close()


for _n in (2, 4):
    SCENARIOS[f"tp{_n}_chunked_prefill_equals_whole_prompt"] = lambda n=_n: (
        tp_chunked_prefill_equals_whole_prompt(n)
    )


def cli(*argv: str) -> dict:
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):
        return decode.main([*argv, "--requests", "4", "--no-plot", "--no-progress", "--out", out])


def decode_cli_tp2_serves_the_same_requests() -> None:
    one, two = cli(), cli("--tp", "2")
    assert two["generated_tokens"] == one["generated_tokens"] > 0
    assert two["final_backed_bytes"] == 0  # every sequence released on both devices
    # Prompts in chunks over the sharded cache, and a prefix shared into each sequence.
    chunked = cli("--tp", "2", "--prefill-chunk", "8")
    assert chunked["generated_tokens"] == one["generated_tokens"]
    assert chunked["final_backed_bytes"] == 0
    shared = cli("--tp", "2", "--shared-prefix", "16")
    assert shared["shared_prefix"]["generation_unchanged"], shared["shared_prefix"]
    assert shared["final_backed_bytes"] == 0
    # An fp8 cache: its scale leaves came back from the prefill replicated, and the
    # decode block compiled for them split over the heads refused them.
    fp8_one, fp8 = cli("--kv-dtype", "fp8"), cli("--tp", "2", "--kv-dtype", "fp8")
    assert fp8["generated_tokens"] == fp8_one["generated_tokens"] > 0
    assert fp8["final_backed_bytes"] == 0


def decode_cli_refuses_bad_tp() -> None:
    for argv, words in ((("--tp", "3"), "not divisible by 3"), (("--tp", "8"), "needs 8 devices")):
        try:
            cli(*argv)
        except SystemExit as e:
            assert words in str(e), e
        else:
            raise AssertionError(f"{argv} was accepted")
    try:
        cli("--tp", "2", "--backend", "prealloc")
    except (SystemExit, ValueError) as e:
        assert "jax_vmm backend" in str(e), e
    else:
        raise AssertionError("--tp with the prealloc backend was accepted")


def tensor_parallel_example_picks_a_tp_the_model_splits_over() -> None:
    """examples/tensor_parallel.py without --tp on 4 host devices: the CPU preset's 2 KV
    heads split over 2, not 4 (it took every device and stopped: not divisible by 4)."""
    assert decode.default_tp([], 4) == 2
    assert decode.default_tp(["--preset", "gpu"], 4) == 4
    assert decode.default_tp([], 1) == 1


SCENARIOS["decode_cli_tp2_serves_the_same_requests"] = decode_cli_tp2_serves_the_same_requests
SCENARIOS["tensor_parallel_example_picks_a_tp_the_model_splits_over"] = (
    tensor_parallel_example_picks_a_tp_the_model_splits_over
)
SCENARIOS["decode_cli_refuses_bad_tp"] = decode_cli_refuses_bad_tp

if __name__ == "__main__":
    sys.exit(multidevice.main(SCENARIOS, sys.argv[1:]))
