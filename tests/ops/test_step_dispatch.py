"""Issue 29: a jitted step with an arena ``kv_write`` takes JAX's C++ fast dispatch path
(no JAX effect), the write is never removed, and ``kv.check()`` still waits for it.

The fast-path check counts calls of ``pxla.ExecuteReplicated.__call__``, the Python
executor of JAX's slow dispatch path: once a step is compiled, the C++ fast path runs it
without it. No timing."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import pxla

import jax_vmm
import jax_vmm.testing
from conftest import BackgroundCall, held_at_the_host_gate, raw_bytes
from jax_vmm.memory import host_wait

S, T, H, D, L = 2, 16, 2, 8, 2
DT = np.float32


@pytest.fixture
def slow_path_calls(monkeypatch):
    """A counter of computations run through JAX's Python (slow) dispatch path."""
    calls = [0]
    original = pxla.ExecuteReplicated.__call__

    def counted(self, *args):
        calls[0] += 1
        return original(self, *args)

    monkeypatch.setattr(pxla.ExecuteReplicated, "__call__", counted)
    return calls


def _kv(vm):
    kv = vm.kv(num_layers=L, num_kv_heads=H, head_dim=D, max_tokens=T, max_seqs=S, dtype=DT)
    for s in range(S):
        kv.ensure(T, s)
    return kv


def _args(pos: int):
    new = jnp.full((S, H, D), float(pos + 1), DT)
    return new, jnp.arange(S, dtype=jnp.int32), jnp.full((S,), pos, jnp.int32)


@jax.jit
def _step(cache, new, seq, pos):
    out = jnp.zeros((S, H, D), DT)
    for layer in range(L):
        written = jax_vmm.kv_write(cache[layer], new, new, seq=seq, pos=pos)
        cache = cache.replace(layer, written)
        q = jnp.ones((S, H, D), DT)
        out = out + jax_vmm.decode_attention(q, written, pos + 1)
    return cache, out


def _k(kv, layer: int) -> np.ndarray:
    return raw_bytes(kv.k_buffers[layer]).view(DT).reshape(S, T, H, D)


def test_the_cache_step_has_no_jax_effect(vm):
    kv = _kv(vm)
    jaxpr = jax.make_jaxpr(_step)(kv.cache(), *_args(0))
    assert not jaxpr.effects


def test_a_step_per_call_takes_the_fast_path_and_writes(vm, slow_path_calls):
    kv = _kv(vm)
    cache = kv.cache()
    cache, out = _step(cache, *_args(0))  # compiles (may run through Python once)
    jax.block_until_ready(out)
    before = slow_path_calls[0]
    for pos in range(1, 8):
        cache, out = _step(cache, *_args(pos))
    kv.check()  # waits through the returned cache's tokens; nothing dropped
    assert slow_path_calls[0] == before, "the step went through JAX's slow dispatch path"
    for layer in range(L):
        k = _k(kv, layer)
        for pos in range(8):
            np.testing.assert_array_equal(k[:, pos], pos + 1.0)


def test_an_effectful_step_is_seen_by_the_counter(vm, slow_path_calls):
    """The counter catches the slow path: the same step with the write's JAX effect (what
    ffi_call(has_side_effect=True) gives) goes through Python at every call."""
    kv = _kv(vm)

    @jax.jit
    def effectful(cache, new, seq, pos):
        layer = jax_vmm.ops.layer_ops.write(cache[0], new, new, seq * T + pos, effectful=True)
        return cache.replace(0, layer)

    cache = effectful(kv.cache(), *_args(0))
    before = slow_path_calls[0]
    for pos in range(1, 4):
        cache = effectful(cache, *_args(pos))
    kv.check()
    assert slow_path_calls[0] - before == 3


def _check_waits_for_a_step_in_flight(vm) -> None:
    """kv.check() right after dispatching a step that drops 2 * S writes must report them.
    On the CPU the step waits at the testing host gate until check() waits for it (or
    has returned), so it is in flight however fast the machine; on a GPU large matrix
    products keep it running. Fails with pytest's "DID NOT RAISE" when check() misses the
    drop."""
    kv = _kv(vm)
    on_cpu = vm.device.platform == "cpu"
    x = jnp.full((64, 64) if on_cpu else (1500, 1500), 1e-3, DT)

    @jax.jit
    def slow_dropping_step(cache, x):
        y = jax_vmm.testing.through_host_gate(x) if on_cpu else x
        for _ in range(3):
            y = jnp.sin(y @ y)
        late = (y[0, 0] > 2).astype(jnp.int32)  # 0, known only after the work
        new = jnp.ones((S, H, D), DT)
        seq = jnp.arange(S, dtype=jnp.int32)
        pos = jnp.full((S,), T, jnp.int32) + late  # past every sequence: dropped
        return cache.replace(0, jax_vmm.kv_write(cache[0], new, new, seq=seq, pos=pos))

    cache = slow_dropping_step(kv.cache(), x)
    jax.block_until_ready(cache)
    with pytest.raises(jax_vmm.OutOfBoundsWrite):
        kv.check()
    if not on_cpu:
        cache = slow_dropping_step(cache, x)  # dispatched on the fast path; still computing
        with pytest.raises(jax_vmm.OutOfBoundsWrite) as info:
            kv.check()
        assert info.value.count == 2 * S
        return
    with jax_vmm.testing.host_gate_closed():
        cache = slow_dropping_step(cache, x)  # dispatched on the fast path; held
        held_at_the_host_gate()
        checking = BackgroundCall(kv.check)
        # Let go once check() waits on the step's live results, or has returned (the
        # control's check, which waits for nothing).
        checking.wait_inside(host_wait.wait_for_live_arrays, "check()'s wait")
    jax.block_until_ready(cache)
    with pytest.raises(jax_vmm.OutOfBoundsWrite) as info:
        checking.join()
    assert info.value.count == 2 * S


def test_check_waits_for_the_steps_it_was_not_given(vm):
    """kv.check() with no arguments sees a drop of a step still in flight: it waits for
    the latest returned cache tokens (the fast path leaves JAX no runtime token)."""
    _check_waits_for_a_step_in_flight(vm)


def test_the_wait_would_be_missed_without_noting_tokens(host_vm):
    """With the returned tokens not noted (and the wait for live results off, which
    covers the returned cache too), check() reads the counters while the step still runs
    and misses its drop: the test above tests the wait, not luck."""
    with jax_vmm.testing.tokens_unnoted(), jax_vmm.testing.live_results_unwaited():
        with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
            _check_waits_for_a_step_in_flight(host_vm)


def test_a_forgotten_return_still_writes_warns_and_is_awaited(vm, slow_path_calls):
    """The forgotten argument: a step writes but does not return the cache. The write is
    not dropped (it runs; kv.check() waits for it and sees its drops), and the user is
    told at trace time. That step alone leaves the fast path."""
    kv = _kv(vm)

    @jax.jit
    def forgetful(cache, new, seq, pos):
        jax_vmm.kv_write(cache[0], new, new, seq=seq, pos=pos)  # result not returned
        return new.sum()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        forgetful(kv.cache(), *_args(3))
    assert any(issubclass(w.category, jax_vmm.KVWriteResultUnusedWarning) for w in caught)
    kv.check()
    np.testing.assert_array_equal(_k(kv, 0)[:, 3], 4.0)
    new, seq, _ = _args(0)
    before = slow_path_calls[0]
    forgetful(kv.cache(), new, seq, jnp.full((S,), T, jnp.int32))  # past the sequences
    with pytest.raises(jax_vmm.OutOfBoundsWrite):
        kv.check()
    assert slow_path_calls[0] == before + 1


def test_vmap_over_new_tokens_writes_them_in_order(vm):
    kv = _kv(vm)
    news = jnp.stack([jnp.full((1, H, D), float(i + 1), DT) for i in range(3)])
    pos = jnp.arange(3, dtype=jnp.int32)[:, None]
    seq = jnp.zeros((3, 1), jnp.int32)

    def write(layer, new, s, p):
        return jax_vmm.kv_write(layer, new, new, seq=s, pos=p)

    layer = jax.jit(jax.vmap(write, in_axes=(None, 0, 0, 0)))(kv.cache()[0], news, seq, pos)
    kv.check(layer)
    k = _k(kv, 0)
    for i in range(3):
        np.testing.assert_array_equal(k[0, i], i + 1.0)


def _views_step(cache, views, q, new, seq, pos):
    """The "arena + cuDNN" step: every layer read through its ordered views (plain XLA
    attention here, cuDNN on a GPU), then written; the cache returned."""
    out = q
    for layer in range(L):
        k, v = jax_vmm.ordered_views(cache[layer], *views[layer])
        lengths = pos + 1
        out = out + jax_vmm.ops.attention.reference_decode_attention(out, k, v, lengths)
        cache = cache.replace(layer, jax_vmm.kv_write(cache[layer], new, new, seq=seq, pos=pos))
    return cache, out


def test_an_ordered_views_step_takes_the_fast_path_and_still_checks(vm, slow_path_calls):
    """The views' run-time check has no JAX effect either: such a step runs without
    Python dispatch, and the check still runs (a copy of the arena fails the step)."""
    kv = _kv(vm)
    views = tuple((kv.k[layer], kv.v[layer]) for layer in range(L))
    step = jax.jit(_views_step)
    q = jnp.ones((S, H, D), DT)
    assert not jax.make_jaxpr(step)(kv.cache(), views, q, *_args(0)).effects
    cache, out = step(kv.cache(), views, q, *_args(0))
    jax.block_until_ready(out)
    before = slow_path_calls[0]
    for pos in range(1, 6):
        cache, out = step(cache, views, q, *_args(pos))
    kv.check()
    assert slow_path_calls[0] == before, "the step went through JAX's slow dispatch path"
    np.testing.assert_array_equal(_k(kv, 1)[:, 5], 6.0)
    copy = tuple((jnp.array(k, copy=True), v) for k, v in views)
    with pytest.raises(jax.errors.JaxRuntimeError, match="memory outside the arena"):
        jax.block_until_ready(step(cache, copy, q, *_args(6)))
