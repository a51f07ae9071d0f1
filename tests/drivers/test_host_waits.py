"""On the CPU "wait for the device" waits too: memory goes only after the XLA:CPU work
dispatched before it finished.

XLA:CPU runs a jitted computation on its own threads after the dispatching call returned.
A release, close, sleep or offload right after dispatching a step over the arena must not
take the memory from under it (the contract the GPU keeps by waiting for the compute
stream): the step's result is the one it would have had without the call. With the wait
removed (``jax_vmm.testing.host_device_waits_skipped``) the same scenarios read zeros or
partial sums, which shows the tests catch it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
import jax_vmm.testing
from conftest import held_at_the_host_gate, write_bytes

TOKENS, HEADS, DIM = 8192, 8, 128  # one sequence of one layer: 32 MiB of float32
REPEATS = 2


def _kv(vm, **kw) -> jax_vmm.KVArena:
    """Two sequences; sequence 0's K and V of layer 0 filled with a known pattern."""
    kv = vm.kv(
        num_layers=1,
        num_kv_heads=HEADS,
        head_dim=DIM,
        max_tokens=TOKENS,
        max_seqs=2,
        dtype=jnp.float32,
        **kw,
    )
    kv.ensure(TOKENS, seq=0)
    data = np.linspace(0.5, 1.5, TOKENS * HEADS * DIM, dtype=np.float32)
    for b in (kv.k_buffers[0], kv.v_buffers[0]):
        write_bytes(b, 0, data)
    return kv


def _reduction(kv: jax_vmm.KVArena) -> Callable[[], jax.Array]:
    f = jax.jit(lambda x: jnp.sum(jnp.sin(x[0]) ** 2 + x[0]))
    return lambda: f(kv.k[0])


def _attention(kv: jax_vmm.KVArena) -> Callable[[], jax.Array]:
    """Attention over sequence 0, after a long computation that the query depends on (so
    that the attention itself runs well after the dispatch returned)."""
    dev = kv.arena.device
    busy = jax.device_put(jnp.linspace(0.0, 1.0, TOKENS * HEADS * DIM, dtype=jnp.float32), dev)
    lengths = jax.device_put(jnp.array([TOKENS, 0], jnp.int32), dev)

    def step(c, busy):
        q = jnp.ones((2, 4 * HEADS, DIM), jnp.float32) + 0 * jnp.sum(jnp.sin(busy) ** 2)
        return jax_vmm.decode_attention(q, c[0], lengths)

    f = jax.jit(step)
    return lambda: f(kv.cache(), busy)


#: What gives memory back right after the dispatch.
_RELEASES = {
    "release": lambda kv: kv.release(0),
    "release_wait": lambda kv: kv.release(0, wait=True),
    "shrink": lambda kv: kv.shrink(0),
    "close": lambda kv: kv.close(),
    "sleep": lambda kv: kv.sleep(),
    "sleep_discard": lambda kv: kv.sleep("discard"),
    "offload": lambda kv: kv.offload(0),
    "decommit": lambda kv: kv.k_buffers[0].decommit(wait=True),
    "free": lambda kv: kv.k_buffers[0].free(),
}

_STEPS = {"reduction": _reduction, "attention": _attention}


def _results_after(host_vm, step: str, release: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """(expected, seen) per repeat: the step's result once it ran alone, and its result
    when the release ran right after its dispatch."""
    out = []
    for _ in range(REPEATS):
        kv = _kv(host_vm)
        run = _STEPS[step](kv)
        want = np.asarray(run())
        got = run()  # in flight...
        _RELEASES[release](kv)  # ...when the memory goes
        out.append((want, np.asarray(got)))
        if not kv.closed:
            if kv.asleep:
                kv.wake()
            kv.close()
    return out


@pytest.mark.parametrize("release", sorted(_RELEASES))
def test_a_reduction_in_flight_finishes_before_the_memory_goes(host_vm, release):
    for want, got in _results_after(host_vm, "reduction", release):
        assert want != 0
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("release", ["release", "close", "sleep", "offload"])
def test_an_attention_call_in_flight_finishes_before_the_memory_goes(host_vm, release):
    for want, got in _results_after(host_vm, "attention", release):
        assert np.abs(want[0]).min() > 0
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("step", sorted(_STEPS))
def test_without_the_wait_the_memory_goes_under_the_running_step(host_vm, step):
    """The protection removed: at least one of the repeats reads released memory (the
    check above would fail)."""
    with jax_vmm.testing.host_device_waits_skipped():
        results = _results_after(host_vm, step, "release")
    assert any(not np.array_equal(got, want) for want, got in results)


@pytest.mark.parametrize("release", ["release", "close"])
def test_the_wait_sees_the_cpu_work_when_another_backend_is_the_default(
    host_vm, release, monkeypatch
):
    """On a machine with a GPU, ``jax.live_arrays()`` lists the GPU's arrays only: a CPU
    arena asked it for its work in flight, found none, and gave memory back under a
    running step (the GPU machine's runs of the tests above). Here the default backend's
    list is made to hold nothing of the CPU's, as there: the wait must still see the
    step."""
    listed = jax.live_arrays

    def default_backend_is_elsewhere(platform=None):
        return [] if platform is None else listed(platform)

    monkeypatch.setattr(jax, "live_arrays", default_backend_is_elsewhere)
    for want, got in _results_after(host_vm, "reduction", release):
        np.testing.assert_array_equal(got, want)


# -- a release does not wait: the step in flight is held at a gate ----------------------
#
# The steps below pass their query through jax_vmm.testing.through_host_gate, so they
# cannot read the cache before the test opens the gate: they are certainly in flight
# across the calls that follow their dispatch, and no timing is involved. A release that
# waited for such a step would wait until the gate's guard (60 s) opened it, and the
# step would then be done.


GATE_GUARD_S = 60.0  # the gate's own guard (host_gate_cpu.cc)


def _gated_attention(kv: jax_vmm.KVArena, returns_cache: bool = False):
    """jit (cache) -> attention over both sequences (and the cache, ``returns_cache``),
    its query held at the host gate."""
    lengths = jax.device_put(np.array([TOKENS, 0], np.int32), kv.arena.device)
    busy = jax.device_put(np.ones(8192, np.float32), kv.arena.device)  # queued, not inline

    def step(c, busy):
        q = jnp.ones((2, 4 * HEADS, DIM), jnp.float32) + 0 * jnp.sum(jnp.sin(busy))
        q = jax_vmm.testing.through_host_gate(q)
        out = jax_vmm.decode_attention(q, c[0], lengths)
        return (out, c) if returns_cache else out

    f = jax.jit(step)
    return lambda c: f(c, busy)


def _held(x: jax.Array) -> bool:
    """Whether the step that computes x is still held at the gate (in flight)."""
    return not x.is_ready() and jax_vmm.testing.host_gate_held() > 0


def _reaches_gate(x: jax.Array) -> jax.Array:
    """x, once the step that computes it waits at the gate (it has started)."""
    held_at_the_host_gate()
    assert _held(x), "the step at the gate is not the one that computes x"
    return x


def _attention_now(kv: jax_vmm.KVArena, cache: jax_vmm.KVCache) -> jax.Array:
    """Attention over both sequences, dispatched without waiting. XLA:CPU runs a
    computation under ~1000 flops inline, after the work queued before it: nothing here is
    computed outside the jitted step, and the step is given the flops to be queued."""
    dev = kv.arena.device
    lengths = jax.device_put(np.array([TOKENS, 0], np.int32), dev)
    busy = jax.device_put(np.ones(8192, np.float32), dev)

    def step(c, busy):
        q = jnp.ones((2, 4 * HEADS, DIM), jnp.float32) + 0 * jnp.sum(jnp.sin(busy))
        return jax_vmm.decode_attention(q, c[0], lengths)

    return jax.jit(step)(cache, busy)


@pytest.mark.parametrize("release", ["release", "shrink", "release_keep"])
def test_a_release_does_not_wait_for_the_step_in_flight(host_vm, release):
    """The release returns while the gated step still waits, the step then computes what
    it would have without the release (it reads the table and the memory of its
    dispatch), and the memory goes once the step is done."""
    kv = _kv(host_vm)
    step = _gated_attention(kv)
    want = np.asarray(step(kv.cache()))
    before = kv.arena.stats()["handles_released"]
    with jax_vmm.testing.host_gate_closed():
        got = _reaches_gate(step(kv.cache()))
        {
            "release": lambda: kv.release(0),
            "shrink": lambda: kv.shrink(0),
            "release_keep": lambda: kv.release(0, keep_tokens=TOKENS // 2),
        }[release]()
        in_flight = _held(got)
    assert in_flight, "the release waited for the step in flight"
    np.testing.assert_array_equal(np.asarray(got), want)
    assert np.abs(want[0]).min() > 0
    assert jax_vmm.testing.wait_for_host_reclaims()
    if release != "release_keep":  # (keep: the allocation keeps the kept chunks)
        assert kv.arena.stats()["handles_released"] > before  # unmapped once it was done
    kv.check()  # the step read within its tokens: nothing clamped


def test_a_step_dispatched_after_the_release_reads_the_lowered_table(host_vm):
    """While a step from before the release is still in flight, a step dispatched after
    it -- with a new cache, or with the cache the earlier step returns -- reads sequence
    0 as released: clamped to 0 tokens and counted."""
    kv = _kv(host_vm)
    with jax_vmm.testing.host_reclaims_paused():  # the earlier step's table stays kept
        with jax_vmm.testing.host_gate_closed():
            earlier, returned = _gated_attention(kv, returns_cache=True)(kv.cache())
            _reaches_gate(earlier)
            kv.release(0)
            fresh = _attention_now(kv, kv.cache())
            after = _attention_now(kv, returned)  # ordered after the earlier step's writes
            assert _held(earlier)
        for x in (fresh, after):
            np.testing.assert_array_equal(np.asarray(x)[0], 0)
        assert np.abs(np.asarray(earlier)[0]).min() > 0  # the earlier step read its tokens
        with pytest.raises(jax_vmm.OutOfBoundsRead, match="2 attention reads"):
            kv.check(fresh, earlier, after)  # the two later reads, clamped and counted


def test_a_write_dispatched_after_the_release_is_dropped(host_vm):
    kv = _kv(host_vm)
    dev = kv.arena.device
    new = jax.device_put(np.ones((1, HEADS, DIM), np.float32), dev)
    busy = jax.device_put(np.ones(8192, np.float32), dev)
    seq, pos = (
        jax.device_put(np.array([0], np.int32), dev),
        jax.device_put(np.array([3], np.int32), dev),
    )
    with jax_vmm.testing.host_gate_closed():
        earlier, returned = _gated_attention(kv, returns_cache=True)(kv.cache())
        _reaches_gate(earlier)
        kv.release(0)
        write = jax.jit(
            lambda c, busy: jax_vmm.kv_write(
                c[0], new + 0 * jnp.sum(jnp.sin(busy)), new, seq=seq, pos=pos
            )
        )
        written = write(returned, busy)
        assert _held(earlier)
    with pytest.raises(jax_vmm.OutOfBoundsWrite):
        kv.check(earlier, written)


def test_without_renewed_epochs_a_later_step_reads_the_old_table(host_vm):
    """The protection removed (``read_epochs_kept``): the step fed the earlier step's
    cache reads the table kept for that step, so its read of the released sequence is
    not clamped (and not counted) -- the check above would fail."""
    kv = _kv(host_vm)
    with jax_vmm.testing.read_epochs_kept(), jax_vmm.testing.host_reclaims_paused():
        with jax_vmm.testing.host_gate_closed():
            earlier, returned = _gated_attention(kv, returns_cache=True)(kv.cache())
            _reaches_gate(earlier)
            kv.release(0)
            after = _attention_now(kv, returned)
        jax.block_until_ready((earlier, after))
    assert np.abs(np.asarray(after)[0]).min() > 0  # read the released sequence
    kv.check(after)  # and nothing counted it


def test_without_the_wait_a_held_step_reads_the_released_sequence_as_gone(host_vm):
    """The protection removed (``host_device_waits_skipped``): the release lowers the
    table and unmaps under the held step, which then reads the released sequence wrong."""
    kv = _kv(host_vm)
    step = _gated_attention(kv)
    want = np.asarray(step(kv.cache()))
    with jax_vmm.testing.host_device_waits_skipped():
        with jax_vmm.testing.host_gate_closed():
            got = _reaches_gate(step(kv.cache()))
            kv.release(0)
        got = np.asarray(got)
    assert not np.array_equal(got, want)


# -- memory taken back while a step still reads it: a full budget, the first view --------


def _budget_for_one_sequence(vm) -> jax_vmm.MemoryBudget:
    """Room for sequence 0's K and V of layer 0 (and a chunk), not for a second sequence."""
    return jax_vmm.MemoryBudget(2 * TOKENS * HEADS * DIM * 4 + (4 << 20), device=vm.device)


def _after_release(kv: jax_vmm.KVArena, take: Callable[[], object]) -> tuple:
    """(expected, seen, took_while_held): the gated step over sequence 0 run alone, and
    run with ``release(0)`` then ``take()`` (on another thread) right after its dispatch;
    whether ``take`` finished while the step was still held at the gate."""
    step = _gated_attention(kv)
    want = np.asarray(step(kv.cache()))
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            take()
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            errors.append(e)
        done.set()

    with jax_vmm.testing.host_gate_closed():
        got = _reaches_gate(step(kv.cache()))
        kv.release(0)
        worker = threading.Thread(target=run)
        worker.start()
        took_while_held = done.wait(0.5) and _held(got)
    worker.join(GATE_GUARD_S)
    if errors:
        raise errors[0]
    return want, np.asarray(got), took_while_held


_TAKES = {
    # Sequence 1 needs the memory sequence 0 released: over the budget until it is back.
    "budget": lambda kv: kv.ensure(TOKENS, seq=1),
    # The first raw view gives every deferred release back at once.
    "first_view": lambda kv: kv.k[0].block_until_ready(),
}


@pytest.mark.parametrize("take", sorted(_TAKES))
def test_memory_a_step_in_flight_reads_is_taken_back_only_after_it(host_vm, take):
    """A commit that needs released memory (a full budget) and the first raw view wait for
    the step still reading it, on the CPU as on a GPU: its result is the one it would have
    had alone, and the waiting call then succeeds."""
    kv = _kv_with(host_vm, take)
    want, got, took_while_held = _after_release(kv, lambda: _TAKES[take](kv))
    assert np.abs(want[0]).min() > 0
    np.testing.assert_array_equal(got, want)
    assert not took_while_held, "it took the memory while the step still read it"


@pytest.mark.parametrize("take", sorted(_TAKES))
def test_taking_released_memory_unwaited_changes_the_step_in_flight(host_vm, take):
    """The protection removed (``commits_take_releases_unwaited``, and for the view
    ``host_device_waits_skipped``): the memory goes from under the held step, which then
    reads the released sequence wrong -- the test above would fail."""
    kv = _kv_with(host_vm, take)
    unwaited = (
        jax_vmm.testing.commits_take_releases_unwaited
        if take == "budget"
        else jax_vmm.testing.host_device_waits_skipped
    )
    with unwaited():
        want, got, _ = _after_release(kv, lambda: _TAKES[take](kv))
    assert not np.array_equal(got, want)


def _kv_with(vm, take: str) -> jax_vmm.KVArena:
    return _kv(vm, budget=_budget_for_one_sequence(vm)) if take == "budget" else _kv(vm)


def test_a_wake_over_the_budget_waits_for_the_step_in_flight(host_vm):
    """Another arena of the budget wakes while a step still reads the memory a release
    just gave up: the wake waits for the step (then fits), and the step reads its tokens."""
    budget = _budget_for_one_sequence(host_vm)
    kv = _kv(host_vm, budget=budget)
    other = host_vm.kv(
        num_layers=1, num_kv_heads=HEADS, head_dim=DIM, max_tokens=TOKENS, max_seqs=1,
        dtype=jnp.float32, budget=budget,
    )  # fmt: skip
    kv.release(0)
    other.ensure(TOKENS, seq=0)  # the budget's room moves to the other arena, then back
    other.sleep()
    kv.ensure(TOKENS, seq=0)
    for b in (kv.k_buffers[0], kv.v_buffers[0]):
        write_bytes(b, 0, np.linspace(0.5, 1.5, TOKENS * HEADS * DIM, dtype=np.float32))
    want, got, took_while_held = _after_release(kv, other.wake)
    np.testing.assert_array_equal(got, want)
    assert not took_while_held, "the wake took the memory while the step still read it"
    assert not other.asleep
