"""``kv_write(layer, new_k, new_v, *, seq, pos)`` (issue 30, item 9): writes addressed by
sequence and position, checked per sequence, so that no position can reach another live
sequence (a flat slot computed with a wrong stride could). The oracle reads the arena's
memory without JAX (conftest.raw_bytes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
from conftest import raw_bytes

S, T, H, D = 3, 16, 2, 8
DT = np.float32


def _kv(vm):
    kv = vm.kv(
        num_layers=1,
        num_kv_heads=H,
        head_dim=D,
        max_tokens=T,
        max_seqs=S,
        dtype=DT,
        zero_fill=True,
    )
    for s in range(S):
        kv.ensure(T, s)  # every position of every sequence ensured
    return kv


def _arena_k(kv) -> np.ndarray:
    buf = kv.k_buffers[0]
    return raw_bytes(buf).view(DT).reshape(S, T, H, D)


def _new(n: int, value: float = 1.0):
    x = np.full((n, H, D), value, DT)
    x += np.arange(n, dtype=DT)[:, None, None]
    return jnp.asarray(x)


def _write(layer, new, seq, pos, jit: bool):
    seq, pos = jnp.asarray(seq, jnp.int32), jnp.asarray(pos, jnp.int32)
    if not jit:
        return jax_vmm.kv_write(layer, new, new, seq=seq, pos=pos)
    step = jax.jit(lambda c, n, s, p: jax_vmm.kv_write(c, n, n, seq=s, pos=p))
    return step(layer, new, seq, pos)


@pytest.mark.parametrize("jit", [False, True])
def test_tokens_land_at_their_sequence_and_position(vm, jit):
    kv = _kv(vm)
    new = _new(3)
    layer = _write(kv.cache()[0], new, [2, 0, 1], [5, 0, T - 1], jit)
    kv.check(layer)
    k = _arena_k(kv)
    np.testing.assert_array_equal(k[2, 5], np.asarray(new[0]))
    np.testing.assert_array_equal(k[0, 0], np.asarray(new[1]))
    np.testing.assert_array_equal(k[1, T - 1], np.asarray(new[2]))
    assert np.count_nonzero(k.any(axis=(2, 3))) == 3  # nothing else written


@pytest.mark.parametrize("jit", [False, True])
def test_a_position_past_the_sequence_never_reaches_the_next(vm, jit):
    """pos = T for sequence 0 is, as a flat slot, sequence 1's first token: dropped and
    counted instead; so are pos < 0 and seq >= max_seqs."""
    kv = _kv(vm)
    layer = _write(kv.cache()[0], _new(4), [0, 1, S, 0], [T, -1, 0, T + 3], jit)
    with pytest.raises(jax_vmm.OutOfBoundsWrite) as info:
        kv.check(layer)
    assert info.value.count == 2 * 4  # K and V of each
    assert not _arena_k(kv).any()


def test_the_flat_slot_with_a_wrong_stride_would_land_in_the_next_sequence(vm):
    """What the (seq, pos) form protects against: the slot form takes seq * T + T as
    sequence 1's first token, silently."""
    kv = _kv(vm)
    slots = jnp.array([0 * T + T], jnp.int32)
    layer = jax_vmm.kv_write(kv.cache()[0], _new(1), _new(1), slots)
    kv.check(layer)  # nothing to report
    assert _arena_k(kv)[1, 0].any()


@pytest.mark.parametrize("jit", [False, True])
def test_idle_rows_are_skipped_and_not_counted(vm, jit):
    kv = _kv(vm)
    new = _new(3)
    layer = _write(kv.cache()[0], new, [-1, 1, -1], [0, 2, T + 5], jit)
    kv.check(layer)  # idle rows: not counted, whatever their pos
    k = _arena_k(kv)
    np.testing.assert_array_equal(k[1, 2], np.asarray(new[1]))
    assert np.count_nonzero(k.any(axis=(2, 3))) == 1


def test_past_the_ensured_tokens_is_dropped_and_counted(vm):
    kv = vm.kv(num_layers=1, num_kv_heads=H, head_dim=D, max_tokens=T, max_seqs=S, dtype=DT)
    kv.ensure(4, 1)
    layer = _write(kv.cache()[0], _new(2), [1, 1], [3, 4], jit=True)
    with pytest.raises(jax_vmm.OutOfBoundsWrite) as info:
        kv.check(layer)
    assert info.value.count == 2  # position 4 of sequence 1, K and V


def test_under_scan_every_step_writes_its_position(vm):
    kv = _kv(vm)
    steps = 6
    news = jnp.stack([_new(S, 10.0 * i) for i in range(steps)])

    @jax.jit
    def run(cache, news):
        def body(cache, xs):
            i, new = xs
            seq = jnp.arange(S, dtype=jnp.int32)
            pos = jnp.full((S,), i, jnp.int32)
            layer = jax_vmm.kv_write(cache[0], new, new, seq=seq, pos=pos)
            return cache.replace(0, layer), None

        return jax.lax.scan(body, cache, (jnp.arange(steps, dtype=jnp.int32), news))[0]

    cache = run(kv.cache(), news)
    kv.check()  # waits through the returned cache's tokens
    k = _arena_k(kv)
    for i in range(steps):
        for s in range(S):
            np.testing.assert_array_equal(k[s, i], np.asarray(news[i, s]))
    del cache


def test_array_layer_takes_seq_pos_too(cpu_device):
    k = jnp.zeros((S, T, H, D), DT)
    layer = jax_vmm.KVLayer.from_arrays(k, k)
    out = jax_vmm.kv_write(
        layer, _new(3), _new(3), seq=jnp.array([1, 0, -1]), pos=jnp.array([2, T, 0])
    )
    got = np.asarray(out.k)
    np.testing.assert_array_equal(got[1, 2], np.asarray(_new(3)[0]))
    assert np.count_nonzero(got.any(axis=(2, 3))) == 1  # pos = T and seq -1 dropped


def test_bad_calls_say_what_to_pass(cpu_device):
    kv = jax_vmm.kv_arena(num_layers=1, num_kv_heads=H, head_dim=D, max_tokens=T, max_seqs=S)
    try:
        layer, new = kv.cache()[0], _new(2).astype(jnp.bfloat16)
        seq = pos = jnp.array([0, 1])
        slots = jnp.array([0, 1], jnp.int32)
        with pytest.raises(TypeError, match="either as seq=/pos= or as flat slots, not both"):
            jax_vmm.kv_write(layer, new, new, slots, seq=seq, pos=pos)
        with pytest.raises(TypeError, match="needs seq= and pos="):
            jax_vmm.kv_write(layer, new, new)
        with pytest.raises(TypeError, match="pos= is missing"):
            jax_vmm.kv_write(layer, new, new, seq=seq)
        with pytest.raises(ValueError, match=r"seq must have shape \(2,\)"):
            jax_vmm.kv_write(layer, new, new, seq=jnp.array([0]), pos=pos)
        with pytest.raises(TypeError, match="pos must hold integers"):
            jax_vmm.kv_write(layer, new, new, seq=seq, pos=jnp.array([0.0, 1.0]))
        with pytest.raises(TypeError, match="seq=/pos= are for the cache form"):
            jax_vmm.kv_write(kv.k[0], kv.v[0], new, new, slots, seq=seq)
    finally:
        kv.close()
