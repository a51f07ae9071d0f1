"""XLA's FFI record stage for ordered_views' check, on a GPU (jax_vmm/base/record_stages.py).

The check's recorded variant runs its host check when XLA records or updates the step's
command buffer and adds no command to it. These tests show that it is registered, that the
CUDA lowering names it, that a step of several layers over it (a command buffer) reads the
arena's tokens, that its record stage runs (a counter of its entries moves) in the calls
that refuse a wrong view, and that the step runs again after a refusal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
import jax_vmm.testing
from conftest import cuda_vmm_device
from jax_vmm.base import ffi as _ffi
from jax_vmm.base import record_stages
from jax_vmm.base.loader import core as _core

pytestmark = pytest.mark.gpu

L, B, T, H, D = 8, 2, 32, 2, 64
RECORDED = "jax_vmm_kv_cache_check_views_recorded"
PLAIN = "jax_vmm_kv_cache_check_views"


def _registered_gpu() -> jax.Device:
    dev, why = cuda_vmm_device()
    if dev is None:
        pytest.skip(f"needs a CUDA GPU with VMM support: {why}")
    _ffi.register()  # runs the bootstrap
    state = record_stages.status()
    if state.startswith(("unavailable", "off")):  # a jaxlib without it; switched off
        pytest.skip(state)
    assert state == "registered", state
    return dev


def _filled_kv(dev: jax.Device) -> jax_vmm.KVArena:
    """L layers, both sequences' T tokens written with distinct values per layer."""
    kv = jax_vmm.kv_arena(
        num_layers=L,
        num_kv_heads=H,
        head_dim=D,
        max_tokens=T,
        max_seqs=B,
        dtype=jnp.float32,
        device=dev,
    )
    kv.ensure(T, 0)
    kv.ensure(T, 1)
    seq = jnp.repeat(jnp.arange(B, dtype=jnp.int32), T)
    pos = jnp.tile(jnp.arange(T, dtype=jnp.int32), B)
    rows = jnp.arange(B * T, dtype=jnp.float32)[:, None, None] * jnp.ones((1, H, D), jnp.float32)

    @jax.jit
    def write(cache):
        for l in range(L):
            k = jnp.cos(rows * (l + 1))
            cache = cache.replace(l, jax_vmm.kv_write(cache[l], k, -0.5 * k, seq=seq, pos=pos))
        return cache

    kv.check(write(kv.cache()))
    return kv


def _step():
    """A fresh jitted step (the lowering picks the target when it is traced): per layer the
    check, a few separate kernels (XLA forms command buffers of a minimum size only)."""

    def step(cache, ks, vs, x):
        acc = x
        for l in range(L):
            k, v = jax_vmm.ordered_views(cache[l], ks[l], vs[l])
            acc = jnp.tanh(acc) * 1.5 + jnp.sum(k, axis=(0, 1, 2))[None, :]
            acc = acc - jnp.max(v, axis=(0, 1, 2))[None, :]
        return acc

    return jax.jit(step)


def _reference(kv: jax_vmm.KVArena, x: jax.Array) -> np.ndarray:
    acc = np.asarray(x, np.float32)
    for l in range(L):
        k, v = np.asarray(kv.k[l]), np.asarray(kv.v[l])
        acc = np.tanh(acc) * 1.5 + k.sum(axis=(0, 1, 2))[None, :]
        acc = acc - v.max(axis=(0, 1, 2))[None, :]
    return acc


def _args(kv):
    return kv.cache(), tuple(kv.k[l] for l in range(L)), tuple(kv.v[l] for l in range(L))


def test_the_gpu_lowering_names_the_recorded_check():
    dev = _registered_gpu()
    kv = _filled_kv(dev)
    x = jax.device_put(jnp.zeros((1, D), jnp.float32), dev)
    text = _step().lower(*_args(kv), x).as_text()
    assert text.count(RECORDED) == L
    with jax_vmm.testing.record_stages_off():
        plain = _step().lower(*_args(kv), x).as_text()
    assert RECORDED not in plain and plain.count(PLAIN) == L


def test_the_recorded_check_reads_right_and_refuses_a_wrong_view_in_the_record_stage():
    dev = _registered_gpu()
    kv = _filled_kv(dev)
    step = _step()
    cache, ks, vs = _args(kv)
    before = _core.check_views_record_calls()
    for i in range(4):  # a new x each call: XLA updates the command buffer
        x = jax.device_put(jnp.full((1, D), 0.1 * i, jnp.float32), dev)
        np.testing.assert_allclose(
            np.asarray(step(cache, ks, vs, x)), _reference(kv, x), rtol=1e-5, atol=1e-4
        )
    recorded = _core.check_views_record_calls() - before
    assert recorded >= L, f"the record stage ran {recorded} times for {L} checks"

    wrong = list(ks)
    wrong[3] = kv.k[4]  # another layer's view
    before = _core.check_views_record_calls()
    with pytest.raises(jax.errors.JaxRuntimeError, match="not KV cache .* layer 3's k buffer"):
        jax.block_until_ready(step(cache, tuple(wrong), vs, x))
    assert _core.check_views_record_calls() > before  # the record stage ran in this call

    copy = list(vs)
    copy[0] = jax.device_put(jnp.zeros((B, T, H, D), jnp.float32), dev)
    with pytest.raises(jax.errors.JaxRuntimeError, match="memory outside the arena"):
        jax.block_until_ready(step(cache, ks, tuple(copy), x))

    # The same executable runs again with the right views.
    np.testing.assert_allclose(
        np.asarray(step(cache, ks, vs, x)), _reference(kv, x), rtol=1e-5, atol=1e-4
    )
    kv.close()


def test_without_the_record_stage_the_same_step_traces_the_check():
    """The control: with the plain target the record stage never runs, and the step reads
    the same values."""
    dev = _registered_gpu()
    kv = _filled_kv(dev)
    with jax_vmm.testing.record_stages_off():
        step = _step()
        cache, ks, vs = _args(kv)
        x = jax.device_put(jnp.ones((1, D), jnp.float32), dev)
        before = _core.check_views_record_calls()
        out = np.asarray(step(cache, ks, vs, x))
    assert _core.check_views_record_calls() == before
    np.testing.assert_allclose(out, _reference(kv, x), rtol=1e-5, atol=1e-4)
    kv.close()
