"""Stale handles (#11.1): identity of arenas and buffers is a process-unique uid, never
reused, not an address (addresses are reused: a new arena of the same shapes usually
lands exactly where a destroyed one was).

* Every arena and buffer has a uid; none is ever handed out twice.
* A static destination (``kv.dest(l)``, a ``KVDest``) carries the uids of its buffers.
  A step compiled against it, run after its arena was closed or destroyed, fails with
  one documented error (docs/errors.md E19) and writes nothing, whether or not a newer
  arena now sits at the same address; the same holds for a closure over the dest after
  the user rebinds ``kv``.
* An eager call whose concrete views are not the dest's buffers raises ValueError before
  anything is written (E20).
* ``jax_vmm.testing.address_only_dests()`` removes the identity checks (a dest is
  resolved by its address alone, as before uids existed): the stale-handle tests must
  then fail, which shows they would catch the bug.

Graph replays run no host code; the GPU command-buffer tests check that a stale replay
drops its writes (tests/integration/test_command_buffer_gpu.py).
"""

from __future__ import annotations

import contextlib
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
import jax_vmm.testing
from conftest import held_at_the_host_gate, read_bytes
from jax_vmm import ops

H, D, T = 2, 8, 16

_STALE = r"dest_k is buffer uid \d+ at 0x[0-9a-f]+, which no longer exists"


def _make(vm):
    """A KV arena the test alone holds (not the harness, which would keep it alive)."""
    return jax_vmm.kv_arena(
        num_layers=2,
        num_kv_heads=H,
        head_dim=D,
        max_tokens=T,
        dtype=jnp.float32,
        initial_tokens=T,
        device=vm.device,
    )


def _put(vm, x):
    return jax.device_put(jnp.asarray(x), vm.device)


def _snapshot(kv) -> list[bytes]:
    return [read_bytes(b).tobytes() for b in kv.buffers]


def _rebirth(vm, address: int):
    """A new KV arena of the same shapes, at ``address`` when the OS gives it back (it
    usually does at once; a few tries make the test sharp without depending on it)."""
    for _ in range(8):
        kv = _make(vm)
        if kv.k_buffers[0].address == address:
            return kv, True
        kv.close()
    return _make(vm), False


def _step(dest):
    return jax.jit(lambda k, v, a, s: ops.kv_write(k, v, a, a, s, dest=dest))


# -- uids --------------------------------------------------------------------------------


def test_every_arena_and_buffer_has_a_uid_never_handed_out_again(vm):
    seen: set[int] = set()
    for _ in range(3):
        kv = _make(vm)
        uids = [kv.arena.uid] + [b.uid for b in kv.buffers]
        assert len(set(uids)) == len(uids) and all(u > 0 for u in uids)
        assert not set(uids) & seen, "a uid was handed out twice"
        seen |= set(uids)
        kv.close()
        del kv
        gc.collect()
    arena = vm.arena(4 * vm.chunk)
    buf = arena.allocate(vm.chunk, jnp.uint8)
    address, uid = buf.address, buf.uid
    buf.free()
    again = arena.allocate(vm.chunk, jnp.uint8)
    assert again.address == address, "no views: the freed range is placed again"
    assert again.uid != uid and again.uid not in seen


def test_dest_carries_the_buffer_uids(vm):
    kv = _make(vm)
    for layer in range(2):
        d = kv.dest(layer)
        assert (d.k_uid, d.v_uid) == (kv.k_buffers[layer].uid, kv.v_buffers[layer].uid)
        assert (d.k_address, d.v_address) == (
            kv.k_buffers[layer].address,
            kv.v_buffers[layer].address,
        )
    assert kv.dest(0) != kv.dest(1)
    # Any integer scalar names a layer, as for kv.k[...]; negative ones count from the end.
    assert kv.dest(jnp.int32(1)) == kv.dest(np.int64(1)) == kv.dest(-1) == kv.dest(1)
    assert kv.k[jnp.int32(1)].unsafe_buffer_pointer() == kv.k_buffers[1].address
    other = _make(vm)
    assert other.dest(0) != kv.dest(0), "dests of two arenas must differ (jit caches by dest)"


# -- stale destinations -------------------------------------------------------------------


def _compiled_step_after_close_and_rebirth(vm) -> None:
    """The issue's repro: a step compiled with kv.dest(0); kv closed and collected; a new
    arena of the same shapes; the old step run again."""
    kv = _make(vm)
    step = _step(kv.dest(0))
    plain = _put(vm, np.zeros((T, H, D), np.float32))
    one = _put(vm, np.ones((1, H, D), np.float32))
    slot = _put(vm, np.array([3], np.int32))
    jax.block_until_ready(step(plain, plain, one, slot))
    assert np.asarray(kv.k[0])[3].tolist() == np.ones((H, D)).tolist()  # it wrote kv
    address = kv.k_buffers[0].address
    kv.close()
    del kv
    gc.collect()
    kv2, same_address = _rebirth(vm, address)
    before = _snapshot(kv2)
    with pytest.raises(jax.errors.JaxRuntimeError, match=_STALE):
        jax.block_until_ready(step(plain, plain, one + 1, slot))
    assert _snapshot(kv2) == before, (
        f"the stale step wrote the new arena (same address: {same_address})"
    )


def _closure_after_rebinding(vm) -> None:
    """A closure over kv.dest(0) keeps the dest after the user rebinds kv (the old arena
    is collected without close())."""
    kv = _make(vm)
    dest = kv.dest(0)

    def write(k, v, new, slots):
        return ops.kv_write(k, v, new, new, slots, dest=dest)

    step = jax.jit(write)
    plain = _put(vm, np.zeros((T, H, D), np.float32))
    one = _put(vm, np.ones((1, H, D), np.float32))
    slot = _put(vm, np.array([5], np.int32))
    jax.block_until_ready(step(plain, plain, one, slot))
    address = kv.k_buffers[0].address
    del kv  # rebinding (`kv = kv_arena(...)`) drops the old arena without close()
    gc.collect()
    kv, same_address = _rebirth(vm, address)
    before = _snapshot(kv)
    with pytest.raises(jax.errors.JaxRuntimeError, match=_STALE):
        jax.block_until_ready(step(plain, plain, one * 7, slot))
    with pytest.raises(jax.errors.JaxRuntimeError, match=_STALE):  # eager: same error
        jax.block_until_ready(write(plain, plain, one * 7, slot))
    assert _snapshot(kv) == before, (
        f"the closure wrote the new arena (same address: {same_address})"
    )


def _eager_views_of_another_layer(vm) -> None:
    kv = _make(vm)
    before = _snapshot(kv)
    one = _put(vm, np.ones((1, H, D), np.float32))
    slot = _put(vm, np.array([2], np.int32))
    with pytest.raises(ValueError, match=r"k is a view of buffer 'k1'.*dest names buffer 'k0'"):
        ops.kv_write(kv.k[1], kv.v[1], one, one, slot, dest=kv.dest(0))
    with pytest.raises(ValueError, match=r"v is a view of buffer 'v1'.*dest names buffer 'v0'"):
        ops.kv_write_through(kv.k[0], kv.v[1], one, one, slot, dest=kv.dest(0))
    other = _make(vm)
    with pytest.raises(ValueError, match=r"k is a view of buffer 'k0' \(uid \d+\) but dest"):
        ops.kv_write(other.k[0], other.v[0], one, one, slot, dest=kv.dest(0))
    # kv.check() waits for every kv_write this thread dispatched (jax.effects_barrier()
    # itself would re-raise the refusal of an earlier case's step: JAX keeps the last
    # failed effectful computation's error until another one replaces it).
    kv.check()
    assert _snapshot(kv) == before, "a mismatched eager call wrote the arena"


STALE_CASES = {
    "compiled_step_after_close": _compiled_step_after_close_and_rebirth,
    "closure_after_rebinding": _closure_after_rebinding,
    "eager_views_of_another_layer": _eager_views_of_another_layer,
}


@pytest.mark.parametrize("case", list(STALE_CASES))
def test_stale_destination_never_writes(vm, case):
    STALE_CASES[case](vm)


@pytest.mark.parametrize("case", list(STALE_CASES))
def test_the_stale_checks_would_catch_identity_by_address(host_vm, case):
    """With the identity checks removed (a dest is its address, as before uids), every
    stale-destination case above must fail: they test the protection, not luck."""
    with jax_vmm.testing.address_only_dests():
        with pytest.raises((AssertionError, pytest.fail.Exception), match="DID NOT RAISE|wrote"):
            STALE_CASES[case](host_vm)


def test_closed_destination_fails_the_same_way_in_every_path(vm):
    """E19: a dest whose arena was closed, run eagerly, traced for the first time, or from
    the jit cache, fails with one error type (JaxRuntimeError, INVALID_ARGUMENT) and the
    same message, and writes nothing. Making a dest of a closed arena is E17."""
    kv = _make(vm)
    dest = kv.dest(1)
    cached = _step(dest)
    plain = _put(vm, np.zeros((T, H, D), np.float32))
    one = _put(vm, np.ones((1, H, D), np.float32))
    slot = _put(vm, np.array([1], np.int32))
    jax.block_until_ready(cached(plain, plain, one, slot))
    k1, v1 = kv.k[1], kv.v[1]  # views taken before close() stay readable (zeros)
    kv.close()
    want = r"dest_k is buffer 'k1' \(uid \d+\) of arena \d+, which was closed"
    calls = {
        "cached": lambda: cached(plain, plain, one, slot),
        "first_trace": lambda: _step(dest)(plain, plain, one, slot),
        "eager": lambda: ops.kv_write(plain, plain, one, one, slot, dest=dest),
        "eager_views": lambda: ops.kv_write(k1, v1, one, one, slot, dest=dest),
        "through": lambda: ops.kv_write_through(plain, plain, one, one, slot, dest=dest),
    }
    for name, call in calls.items():
        with pytest.raises(jax.errors.JaxRuntimeError, match=want):
            jax.block_until_ready(call())
            pytest.fail(f"{name}: no error")
    with pytest.raises(jax_vmm.ArenaClosedError):
        kv.dest(0)


def test_a_refused_step_does_not_break_later_checks(vm):
    """A step refused while running in the background (its error surfaces when its
    results are awaited) leaves kv.check() of another arena working: JAX's effects
    barrier would re-raise that step's error at every call."""
    kv = _make(vm)
    dest = kv.dest(0)
    kv.close()
    other = _make(vm)
    on_cpu = vm.device.platform == "cpu"
    x = _put(vm, np.full((64, 64) if on_cpu else (1500, 1500), 1e-3, np.float32))

    @jax.jit
    def step(x):
        # The refusal comes when the step runs, after its dispatch returned: on the CPU
        # the step waits at the testing host gate first, on a GPU behind matrix products.
        y = jax_vmm.testing.through_host_gate(x) if on_cpu else x
        y = jnp.sin(y @ y @ y)
        cache = jnp.zeros((T, H, D), jnp.float32) + y[0, 0]
        new = jnp.ones((1, H, D), jnp.float32)
        return ops.kv_write_through(cache, cache, new, new, jnp.array([1], jnp.int32), dest=dest)

    with jax_vmm.testing.host_gate_closed() if on_cpu else contextlib.nullcontext():
        refused = step(x)
        if on_cpu:
            held_at_the_host_gate()
    with pytest.raises(jax.errors.JaxRuntimeError, match="which was closed"):
        jax.block_until_ready(refused)
    other.check()  # nothing dropped, and no stale error
    slot = _put(vm, np.array([other.num_slots], np.int32))  # out of range: dropped
    one = _put(vm, np.ones((1, H, D), np.float32))
    ops.kv_write_through(other.k[0], other.v[0], one, one, slot, dest=other.dest(0))
    with pytest.raises(jax_vmm.OutOfBoundsWrite):
        other.check()


@pytest.mark.gpu
def test_a_dest_of_another_platform_is_refused(gpu_device):
    host = jax_vmm.kv_arena(
        num_layers=1,
        num_kv_heads=H,
        head_dim=D,
        max_tokens=T,
        dtype=jnp.float32,
        device=jax.devices("cpu")[0],
    )
    cache = jax.device_put(jnp.zeros((T, H, D), jnp.float32), gpu_device)
    one = jax.device_put(jnp.ones((1, H, D), jnp.float32), gpu_device)
    slot = jax.device_put(jnp.array([1], jnp.int32), gpu_device)
    with pytest.raises(
        jax.errors.JaxRuntimeError, match="memory of a host arena, but the call runs on cuda"
    ):
        jax.block_until_ready(ops.kv_write(cache, cache, one, one, slot, dest=host.dest(0)))
    host.close()


@pytest.mark.gpu
def test_donated_view_of_another_buffer_is_refused_on_the_gpu(gpu_device):
    """On a GPU a donated view is handed over in place: a view of layer 1 with the dest
    of layer 0 is caught by the handler (a plain write into layer 1 would skip its page
    checks), and a donated view of a closed arena too (its pages are read-only zeros)."""
    kv = jax_vmm.kv_arena(
        num_layers=2, num_kv_heads=H, head_dim=D, max_tokens=T, dtype=jnp.float32, device=gpu_device
    )
    try:
        one = jax.device_put(jnp.ones((1, H, D), jnp.float32), gpu_device)
        slot = jax.device_put(jnp.array([1], jnp.int32), gpu_device)
        step = jax.jit(
            lambda k, v, a, s, d: ops.kv_write(k, v, a, a, s, dest=d),
            donate_argnums=(0, 1),
            static_argnums=4,
        )
        with pytest.raises(
            jax.errors.JaxRuntimeError,
            match=r"cache operand k \(handed over at 0x[0-9a-f]+\) is buffer 'k1' .* "
            r"but dest names buffer 'k0'",
        ):
            jax.block_until_ready(step(kv.k[1], kv.v[1], one, slot, kv.dest(0)))
        k, v = kv.k[0], kv.v[0]
        kv.close()
        with pytest.raises(jax.errors.JaxRuntimeError, match=r"closed arena|freed buffer"):
            jax.block_until_ready(
                jax.jit(ops.kv_write, donate_argnums=(0, 1))(k, v, one, one, slot)
            )
    finally:
        kv.close()
