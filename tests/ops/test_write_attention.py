"""jax_vmm.kv_write_attention: a layer's kv_write and the attention over it, in one call.

Its contract is ``kv_write`` followed by ``attention`` (``decode_attention`` for a 3-D q).
Every test runs both on twin arenas and compares outputs and arena contents, on the CPU
(where the call is those two calls) and on a GPU (where a 16-bit arena layer that jax_vmm
serves with cuDNN takes the one-call target: the lowering shows it). Then the same
counters, warnings and refusals as the two calls.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
from jax_vmm.ops import cudnn_attention as ca

B, T, HKV, HQ, D = 3, 64, 2, 4, 64
ENSURED = 40
ONE_CALL = "jax_vmm_cudnn_attention_cache_write"
WRITE = "jax_vmm_kv_cache_write"


def _dtype(device) -> jnp.dtype:
    return jnp.bfloat16 if device.platform != "cpu" else jnp.float32


def _one_call_expected(device) -> bool:
    return device.platform != "cpu" and ca.cudnn_available()


def _twins(device, layers: int = 2):
    """Two arenas with the same first 20 tokens in every sequence."""
    out = []
    rng = np.random.default_rng(0)
    first = rng.standard_normal((layers, B * 20, HKV, D)).astype(np.float32)
    for _ in range(2):
        kv = jax_vmm.kv_arena(
            num_layers=layers,
            num_kv_heads=HKV,
            head_dim=D,
            max_tokens=T,
            max_seqs=B,
            dtype=_dtype(device),
            device=device,
        )
        for s in range(B):
            kv.ensure(ENSURED, s)
        cache = kv.cache()
        seq = jnp.repeat(jnp.arange(B, dtype=jnp.int32), 20)
        pos = jnp.tile(jnp.arange(20, dtype=jnp.int32), B)
        for layer in range(layers):
            new = jax.device_put(jnp.asarray(first[layer], _dtype(device)), device)
            cache = cache.replace(layer, jax_vmm.kv_write(cache[layer], new, new, seq=seq, pos=pos))
        out.append(kv)
    return out


def _arena_tokens(kv, layers: int) -> list[np.ndarray]:
    kv.check()
    return [np.asarray(kv.k[l].astype(jnp.float32)) for l in range(layers)] + [
        np.asarray(kv.v[l].astype(jnp.float32)) for l in range(layers)
    ]


def _steps(form: str, device):
    """(one-call step, two-call step) over every layer: S new tokens per sequence at
    `start`, then attention over `start + S` tokens."""
    rows = form != "decode"
    S = 3 if rows else 1
    opts = dict(q_lengths=jnp.array([3, 2, 0], jnp.int32), window=8, softcap=20.0) if rows else {}
    if form == "decode_options":
        opts, S, rows = dict(window=5, softcap=10.0), 1, False

    def places(start):
        seq = jnp.repeat(jnp.arange(B, dtype=jnp.int32), S)
        pos = jnp.tile(jnp.arange(S, dtype=jnp.int32), B) + jnp.repeat(start, S)
        return seq, pos

    def q_of(x):
        return x if rows else x[:, 0]

    def one(cache, x, new, start):
        seq, pos = places(start)
        outs = []
        for l in range(len(cache)):
            o, layer = jax_vmm.kv_write_attention(
                q_of(x), cache[l], new, new, seq=seq, pos=pos, lengths=start + S, **opts
            )
            cache = cache.replace(l, layer)
            outs.append(o)
        return cache, jnp.stack(outs)

    def two(cache, x, new, start):
        seq, pos = places(start)
        outs = []
        for l in range(len(cache)):
            layer = jax_vmm.kv_write(cache[l], new, new, seq=seq, pos=pos)
            if rows or opts:
                qq = x if rows else x[:, :1]
                o = jax_vmm.attention(qq, layer, start + S, **opts)
                o = o if rows else o[:, 0]
            else:
                o = jax_vmm.decode_attention(q_of(x), layer, start + S)
            cache = cache.replace(l, layer)
            outs.append(o)
        return cache, jnp.stack(outs)

    return jax.jit(one, donate_argnums=0), jax.jit(two, donate_argnums=0), S


@pytest.mark.parametrize("form", ["decode", "decode_options", "rows"])
def test_one_call_equals_the_write_then_the_attention(form, device):
    """Three steps of a 2-layer stack: outputs bit for bit, and every token in the arenas."""
    kv_one, kv_two = _twins(device)
    one, two, S = _steps(form, device)
    rng = np.random.default_rng(1)
    c1, c2 = kv_one.cache(), kv_two.cache()
    start = jnp.array([20, 24, 30], jnp.int32)
    for step in range(3):
        x = jax.device_put(jnp.asarray(rng.standard_normal((B, S, HQ, D)), _dtype(device)), device)
        new = jax.device_put(
            jnp.asarray(rng.standard_normal((B * S, HKV, D)), _dtype(device)), device
        )
        c1, o1 = one(c1, x, new, start)
        c2, o2 = two(c2, x, new, start)
        np.testing.assert_array_equal(
            np.asarray(o1.astype(jnp.float32)), np.asarray(o2.astype(jnp.float32)), f"step {step}"
        )
        assert np.isfinite(np.asarray(o1.astype(jnp.float32))).all()
        start = start + S
    for got, want in zip(_arena_tokens(kv_one, 2), _arena_tokens(kv_two, 2), strict=True):
        np.testing.assert_array_equal(got, want)
    for kv in (kv_one, kv_two):
        kv.close()


def test_a_gpu_arena_layer_takes_the_one_call_target(device):
    """The lowering: one custom call per layer where jax_vmm runs cuDNN (no separate
    write), else the write's own target."""
    kv, _ = _twins(device, layers=1)
    one, _, _ = _steps("decode", device)
    x = jnp.zeros((B, 1, HQ, D), _dtype(device))
    new = jnp.zeros((B, HKV, D), _dtype(device))
    text = one.lower(kv.cache(), x, new, jnp.array([20, 20, 20], jnp.int32)).as_text()
    if _one_call_expected(device):
        assert text.count(ONE_CALL) == 1 and WRITE not in text
    else:
        assert ONE_CALL not in text and text.count(WRITE) == 1
    kv.close()


def test_writes_past_the_ensured_tokens_are_dropped_and_counted_alike(device):
    """A token past what its sequence ensured: dropped by both forms, and kv.check()
    raises OutOfBoundsWrite for each; the reads are clamped and counted alike too."""
    kv_one, kv_two = _twins(device, layers=1)
    one, two, _ = _steps("decode", device)
    x = jnp.ones((B, 1, HQ, D), _dtype(device))
    new = jnp.full((B, HKV, D), 7.0, _dtype(device))
    start = jnp.array([20, ENSURED, 20], jnp.int32)  # sequence 1 writes past its tokens
    outs = []
    for kv, step in ((kv_one, one), (kv_two, two)):
        _, o = step(kv.cache(), x, new, start)
        outs.append(np.asarray(o.astype(jnp.float32)))
        with pytest.raises(jax_vmm.OutOfBoundsWrite):
            kv.check()
    np.testing.assert_array_equal(outs[0], outs[1])
    for kv in (kv_one, kv_two):
        kv.close()


def test_a_call_whose_results_go_unused_warns_and_still_writes(device):
    """The forgotten argument: the step uses neither the output nor the written layer. The
    write runs anyway (kv.check() waits for it), and the warning of a kv_write whose
    layer nothing uses says what was forgotten, on either form."""
    kv, _ = _twins(device, layers=1)

    def step(cache, x, new):
        jax_vmm.kv_write_attention(
            x,
            cache[0],
            new,
            new,
            seq=jnp.arange(B),
            pos=jnp.full((B,), 20),
            lengths=jnp.full((B,), 21),
        )
        return x * 2

    x = jnp.ones((B, HQ, D), _dtype(device))
    new = jnp.full((B, HKV, D), 3.0, _dtype(device))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.block_until_ready(jax.jit(step)(kv.cache(), x, new))
    assert any(issubclass(w.category, jax_vmm.KVWriteResultUnusedWarning) for w in caught)
    kv.check()
    assert np.all(np.asarray(kv.k[0][:, 20].astype(jnp.float32)) == 3.0)
    kv.close()


def test_bad_calls_are_refused_before_anything_runs(cpu_device):
    kv, _ = _twins(cpu_device, layers=1)
    layer = kv.cache()[0]
    q = jnp.zeros((B, HQ, D), jnp.float32)
    new = jnp.zeros((B, HKV, D), jnp.float32)
    n = jnp.full((B,), 21, jnp.int32)
    seq, pos = jnp.arange(B), jnp.full((B,), 20)
    with pytest.raises(TypeError, match="either as seq= and pos= or as flat slots"):
        jax_vmm.kv_write_attention(q, layer, new, new, lengths=n)
    with pytest.raises(TypeError, match="either as seq= and pos= or as flat slots"):
        jax_vmm.kv_write_attention(q, layer, new, new, seq * T + pos, seq=seq, pos=pos, lengths=n)
    with pytest.raises(TypeError, match="layer must be a KVLayer"):
        jax_vmm.kv_write_attention(q, kv.k[0], new, new, seq=seq, pos=pos, lengths=n)
    with pytest.raises(ValueError, match=r"q must be \(B, H_q, D\)"):
        jax_vmm.kv_write_attention(q[0], layer, new, new, seq=seq, pos=pos, lengths=n)
    with pytest.raises(TypeError):
        jax_vmm.kv_write_attention(q, layer, new, new, seq=seq, pos=pos)  # lengths forgotten
    before = kv.stats()
    assert before == kv.stats()
    kv.check()
    kv.close()


def test_under_vmap_of_a_jitted_step_the_one_call_is_refused_clearly(device):
    """vmap over a jitted step batches its traced calls: the one-call target says to use
    the two calls there. Where the call is the two calls already (the CPU), vmap of the
    new tokens works as kv_write's does."""
    kv, _ = _twins(device, layers=1)

    @jax.jit
    def step(cache, x, new):
        o, layer = jax_vmm.kv_write_attention(
            x,
            cache[0],
            new,
            new,
            seq=jnp.arange(B),
            pos=jnp.full((B,), 20),
            lengths=jnp.full((B,), 21),
        )
        return cache.replace(0, layer), o

    xs = jnp.ones((2, B, HQ, D), _dtype(device))
    new = jnp.ones((B, HKV, D), _dtype(device))
    batched = jax.vmap(step, in_axes=(None, 0, None), out_axes=(None, 0))
    if _one_call_expected(device):
        with pytest.raises(NotImplementedError, match="kv_write_attention under vmap"):
            batched(kv.cache(), xs, new)
    else:
        cache, o = batched(kv.cache(), xs, new)
        assert o.shape == (2, B, HQ, D)
    kv.close()
