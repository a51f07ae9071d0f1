"""A NaN reaching the scores comes out as NaN, on every platform and kernel.

A model that diverged has NaN queries (and keys). softmax turns a NaN logit into a NaN
row; attention that gave zeros instead would make the diverged sequence look empty, a
silent wrong result. Rows without a live token keep their contract: exact zeros. Every
other row is unaffected.

On the CPU: the split-K handler and the streaming kernel's emulation; on a GPU (params
marked gpu): every split-K kernel, the streaming kernels, and the route ``jax_vmm.attention``
takes over an arena layer (cuDNN where the build has it).

The other way round: NaN or inf in the tokens past a sequence's length (stale or fresh
bytes of memory backed but not written for it) never reaches the output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention_semantics import variants  # every split-K kernel, per platform

import jax_vmm
import jax_vmm.testing
from jax_vmm.ops.general_attention import reference_attention

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
B, T, HQ, HKV, D = 4, 48, 4, 2, 64
LENGTHS = np.array([40, 0, 48, 17], np.int32)
NAN_SEQ, CLEAN_SEQS = 2, [0, 3]


def inputs(device, dtype, S, *, nan_in):
    """q (B, S, H_q, D), k, v, lengths, with NaN in q's rows of sequence NAN_SEQ (nan_in
    "q") or in K at every token of it (nan_in "k"); sequence 1 (length 0) has NaN
    queries too, and must still give zeros."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((B, S, HQ, D)).astype(np.float32)
    k = rng.standard_normal((B, T, HKV, D)).astype(np.float32)
    v = rng.standard_normal((B, T, HKV, D)).astype(np.float32)
    q[1] = np.nan
    if nan_in == "q":
        q[NAN_SEQ] = np.nan
    else:
        k[NAN_SEQ] = np.nan
    return [jax.device_put(jnp.asarray(x, dtype), device) for x in (q, k, v)] + [
        jax.device_put(jnp.asarray(LENGTHS), device)
    ]


def check(out, clean_ref, S, q_lengths, what):
    out = np.asarray(jnp.asarray(out).astype(F32))
    live = S if q_lengths is None else q_lengths[NAN_SEQ]
    assert np.isnan(out[NAN_SEQ, :live]).all(), (
        f"{what}: the live rows of the sequence with NaN scores must be NaN"
    )
    if q_lengths is not None and q_lengths[NAN_SEQ] < S:
        dead = out[NAN_SEQ, q_lengths[NAN_SEQ] :]
        assert (dead == 0).all(), f"{what}: rows past q_lengths must stay zeros"
    assert (out[1] == 0).all(), f"{what}: a sequence of length 0 must give zeros, NaN q or not"
    got, ref = out[CLEAN_SEQS], np.asarray(clean_ref.astype(F32))[CLEAN_SEQS]
    assert np.isfinite(got).all(), f"{what}: NaN leaked into other sequences"
    np.testing.assert_allclose(got, ref, rtol=3e-2, atol=3e-2, err_msg=what)


@pytest.mark.parametrize("nan_in", ["q", "k"])
@pytest.mark.parametrize(
    "S,options,splits",
    [
        (1, {}, 1),
        (1, {}, 3),
        (3, dict(window=5, softcap=30.0), 2),
        (3, dict(q_lengths=[3, 3, 2, 1]), 4),
    ],
    ids=["decode-1split", "decode-3splits", "S3-window-softcap", "S3-ragged"],
)
def test_split_k_kernels_give_nan_rows(device, nan_in, S, options, splits):
    q_lengths = options.get("q_lengths")
    if q_lengths is not None:
        options = dict(options, q_lengths=jax.device_put(jnp.asarray(q_lengths, jnp.int32), device))
    for dtype, impl in variants(device):
        q, k, v, n = inputs(device, dtype, S, nan_in=nan_in)
        out = jax_vmm.testing.decode_attention(
            q, k, v, n, out_init=jnp.full(q.shape, 7, q.dtype), impl=impl, chunk=16,
            splits=splits, **options,
        )  # fmt: skip
        ref = reference_attention(q, k, v, n, **options)
        check(out, ref, S, q_lengths, f"{np.dtype(dtype)} {impl} NaN in {nan_in}")


@pytest.mark.parametrize("nan_in", ["q", "k"])
@pytest.mark.parametrize("impl", ["stream", "stream_combine", "stream_tma"])
def test_streaming_kernels_give_nan_rows(device, nan_in, impl):
    q, k, v, n = inputs(device, BF16, 1, nan_in=nan_in)
    out = jax_vmm.testing.decode_attention(q[:, 0], k, v, n, impl=impl, ctas=3, min_tiles=1)
    check(out[:, None], reference_attention(q, k, v, n), 1, None, f"{impl} NaN in {nan_in}")


@pytest.mark.parametrize("S", [1, 3])
def test_attention_over_an_arena_layer_gives_nan_rows(vm, S):
    """The public call over an arena layer, as a model runs it (cuDNN's route on a GPU)."""
    dev = vm.device
    kv = vm.kv(num_layers=1, num_kv_heads=HKV, head_dim=D, max_tokens=T, max_seqs=B, dtype=BF16)
    for b, n in enumerate(LENGTHS):
        kv.ensure(int(n), b)
    q, k, v, n = inputs(dev, BF16, S, nan_in="q")
    slots = np.concatenate([b * T + np.arange(m) for b, m in enumerate(LENGTHS)]).astype(np.int32)
    flat = [x.reshape(B * T, HKV, D)[slots] for x in (k, v)]
    layer = jax_vmm.kv_write(kv.cache()[0], *flat, jax.device_put(jnp.asarray(slots), dev))
    out = jax.jit(lambda c, q, n: jax_vmm.attention(q, c, n))(layer, q, n)
    kv.check(out)
    check(out, reference_attention(q, k, v, n), S, None, "jax_vmm.attention over an arena layer")


@pytest.mark.parametrize("garbage", ["nan", "inf"])
@pytest.mark.parametrize("S", [1, 3])
def test_keys_and_values_past_the_lengths_never_reach_the_output(vm, S, garbage):
    """Every token past each length holds NaN (or +inf keys and -inf values), in arrays
    and in an arena layer whose sequences are ensured to the end, so the bytes are
    backed and readable: cuDNN's route reads whole 128-token tiles and masks only the
    scores (a masked score times a NaN value would still be NaN), so over an arena layer
    it first turns the NaN and inf of that tile into +0; the kernels stop at the length.
    The output equals the reference over the clean tokens."""
    dev = vm.device
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in
               [(B, S, HQ, D), (B, T, HKV, D), (B, T, HKV, D)])  # fmt: skip
    k_bad, v_bad = k.copy(), v.copy()
    for b, n in enumerate(LENGTHS):
        k_bad[b, n:], v_bad[b, n:] = (np.nan, np.nan) if garbage == "nan" else (np.inf, -np.inf)
    q, k, v, k_bad, v_bad = (
        jax.device_put(jnp.asarray(x, BF16), dev) for x in (q, k, v, k_bad, v_bad)
    )
    n = jax.device_put(jnp.asarray(LENGTHS), dev)
    want = np.asarray(reference_attention(q, k, v, n).astype(F32))
    assert (want[1] == 0).all() and np.isfinite(want).all()

    kv = vm.kv(num_layers=1, num_kv_heads=HKV, head_dim=D, max_tokens=T, max_seqs=B, dtype=BF16)
    for b in range(B):
        kv.ensure(T, b)
    slots = jax.device_put(jnp.arange(B * T, dtype=jnp.int32), dev)
    flat = [x.reshape(B * T, HKV, D) for x in (k_bad, v_bad)]
    layer = jax_vmm.kv_write(kv.cache()[0], *flat, slots)
    over_layer = jax.jit(lambda c, q, n: jax_vmm.attention(q, c, n))(layer, q, n)
    kv.check(over_layer)
    for out, what in [
        (over_layer, "an arena layer"),
        (jax_vmm.attention(q, k_bad, v_bad, n), "arrays"),
    ]:
        got = np.asarray(out.astype(F32))
        assert np.isfinite(got).all(), f"{garbage} past the lengths reached the output ({what})"
        np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2, err_msg=what)


def test_reference_attention_gives_nan_rows(cpu_device):
    q, k, v, n = inputs(cpu_device, F32, 2, nan_in="q")
    out = np.asarray(reference_attention(q, k, v, n))
    assert np.isnan(out[NAN_SEQ]).all() and (out[1] == 0).all()
    assert np.isfinite(out[CLEAN_SEQS]).all()
