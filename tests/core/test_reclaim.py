"""Releases that never wait for the device on the releasing thread, and commits that wait
only while raw views are alive (docs/design.md, "Commits, releases and the device").

The testing layer makes the host driver defer releases like the CUDA driver
(``faults.defer_reclaim``) and holds the "device" busy (``faults.hold_device``: every
device wait blocks until the hold is lifted), so the same tests run on the CPU and the
GPU. Physical memory is checked by the oracle (the kernel's maps and the memfd on the
host, the CUDA driver on a GPU), never by the arena's counters alone.
"""

from __future__ import annotations

import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
from conftest import (
    BackgroundCall,
    chunk_range,
    chunk_states,
    held_at_the_host_gate,
    pattern,
    raw_bytes,
    read_bytes,
    wait_until,
    write_bytes,
)
from jax_vmm.memory import host_wait
from jax_vmm.testing import uncounted_view


def _deferring(vm, faults, chunks: int = 16, **kw) -> jax_vmm.Arena:
    arena = vm.arena(chunks * vm.chunk, **kw)
    faults.defer_reclaim(arena)  # the host defers as the CUDA driver does
    return arena


def _held(vm, arena) -> list[tuple[int, int]]:
    """What the oracle says physically holds memory (host only; None elsewhere)."""
    o = vm.oracle(arena)
    return None if o is None or not vm.is_host else o.backed_ranges()


# -- releases are deferred ------------------------------------------------------------


def test_release_returns_while_the_device_is_busy(vm, faults):
    c = vm.chunk
    arena = _deferring(vm, faults)
    buf = arena.allocate((4 * c,), jnp.uint8)
    buf.commit()
    write_bytes(buf, 0, pattern(4 * c, seed=1))
    syncs = faults.device_syncs(arena)
    with faults.hold_device(arena):
        call = BackgroundCall(lambda: buf.decommit(c, 3 * c))
        assert call.join() == 2 * c  # returned although the device never finished
        s = arena.stats()
        assert (s["backed_bytes"], s["retired_bytes"], s["held_bytes"]) == (2 * c, 2 * c, 4 * c)
        assert s["deferred_releases"] == 2
        assert chunk_states(buf) == (True, False, False, True)  # the page table: at once
        if vm.is_host:
            assert _held(vm, arena) == [chunk_range(buf, 0, 4)], "unmapped under the device"
        # Work launched before the release may still read the old bytes: they are there.
        np.testing.assert_array_equal(raw_bytes(buf, c, 3 * c), pattern(4 * c, seed=1)[c : 3 * c])
        wait_until(lambda: faults.device_syncs(arena) > syncs, "the reclaimer's device wait")
    arena.reclaim()  # lets whatever the reclaimer has not finished yet finish here
    s = arena.stats()
    assert (s["retired_bytes"], s["held_bytes"], s["chunks_released"]) == (0, 2 * c, 2)
    vm.assert_backed(arena, [chunk_range(buf, 0, 1), chunk_range(buf, 3, 4)])


def test_reclaimer_gives_memory_back_on_its_own(vm, faults):
    c = vm.chunk
    arena = _deferring(vm, faults)
    buf = arena.allocate((4 * c,), jnp.uint8)
    buf.commit()
    buf.decommit()
    wait_until(lambda: arena.stats()["held_bytes"] == 0, "the background reclaim")
    s = arena.stats()
    assert s["retired_bytes"] == 0 and s["reclaim_syncs"] >= 1 and s["chunks_released"] == 4
    o = vm.oracle(arena)
    if o is not None:
        o.assert_released()


@pytest.mark.parametrize("how", ["reclaim", "wait"])
def test_waiting_release_returns_once_the_memory_is_back(vm, faults, how):
    c = vm.chunk
    arena = _deferring(vm, faults)
    buf = arena.allocate((4 * c,), jnp.uint8)
    buf.commit()
    with faults.hold_device(arena):
        if how == "reclaim":
            buf.decommit()
            syncs = faults.device_syncs(arena)
            call = BackgroundCall(arena.reclaim)
        else:
            syncs = faults.device_syncs(arena)
            call = BackgroundCall(lambda: buf.decommit(wait=True))
        wait_until(lambda: faults.device_syncs(arena) > syncs, "a device wait")
        assert not call.done, "the waiting call returned before the device was done"
    call.join()
    assert arena.stats()["held_bytes"] == 0
    vm.assert_backed(arena, [])


def _written_arena(vm, faults, zero_fill: bool):
    """A deferring arena with one 4-chunk buffer, committed and filled (pattern seed 2)."""
    c = vm.chunk
    arena = _deferring(vm, faults, zero_fill=zero_fill)
    buf = arena.allocate((4 * c,), jnp.uint8)
    buf.commit()
    write_bytes(buf, 0, pattern(4 * c, seed=2))
    return arena, buf, c


def test_retired_chunks_are_taken_back_without_driver_calls(vm, faults):
    """Without zero fill (the KV default) a commit takes retired memory back at once: no
    driver call and no device wait, and the memory still holds what it held."""
    arena, buf, c = _written_arena(vm, faults, zero_fill=False)
    with faults.hold_device(arena):
        buf.decommit(0, 2 * c)
        before = arena.stats()
        assert before["retired_bytes"] == 2 * c
        assert BackgroundCall(lambda: buf.commit(0, 2 * c)).join() == 2 * c  # the device is busy
        after = arena.stats()
        assert after["chunks_created"] == before["chunks_created"]  # no cuMemCreate
        assert after["chunks_revived"] == before["chunks_revived"] + 2
        assert after["retired_bytes"] == 0 and after["backed_bytes"] == 4 * c
        np.testing.assert_array_equal(raw_bytes(buf, 0, 2 * c), pattern(4 * c, seed=2)[: 2 * c])
    vm.assert_backed(arena, [chunk_range(buf, 0, 4)])


def test_zero_filling_arena_waits_before_it_zeroes_retired_memory(vm, faults):
    """Work launched before the release may still read the retired chunks: a zero-filling
    arena takes them back only after waiting for the device, then zeroes them."""
    arena, buf, c = _written_arena(vm, faults, zero_fill=True)
    with faults.hold_device(arena):
        buf.decommit(0, 2 * c)
        syncs = faults.device_syncs(arena)
        call = BackgroundCall(lambda: buf.commit(0, 2 * c))
        wait_until(lambda: faults.device_syncs(arena) > syncs, "the commit's device wait")
        assert not call.done, "retired memory was zeroed while the device was busy"
        np.testing.assert_array_equal(raw_bytes(buf, 0, 2 * c), pattern(4 * c, seed=2)[: 2 * c])
    assert call.join() == 2 * c
    assert not raw_bytes(buf, 0, 2 * c).any()
    vm.assert_backed(arena, [chunk_range(buf, 0, 4)])


def test_memory_pressure_reclaims_retired_memory_first(vm, faults):
    c = vm.chunk
    arena = _deferring(vm, faults)
    old = arena.allocate((4 * c,), jnp.uint8)
    new = arena.allocate((2 * c,), jnp.uint8)
    old.commit()
    with faults.hold_device(arena):
        old.decommit()  # retired: the device is busy
        assert arena.stats()["retired_bytes"] == 4 * c
        faults.arm(arena, "create", 1, out_of_memory=True)
        syncs = faults.device_syncs(arena)
        call = BackgroundCall(new.commit)
        # The commit ran out of memory, and now waits for the device to take the retired
        # memory back before trying again.
        wait_until(lambda: faults.device_syncs(arena) > syncs, "the commit's device wait")
        assert not call.done
    assert call.join() == 2 * c
    s = arena.stats()
    assert s["failed_commits"] == 1 and faults.injected(arena) == 1
    assert s["retired_bytes"] == 0 and s["held_bytes"] == 2 * c
    vm.assert_backed(arena, [chunk_range(new, 0, 2)])


def test_out_of_memory_with_nothing_to_reclaim_raises(vm, faults):
    c = vm.chunk
    arena = _deferring(vm, faults)
    buf = arena.allocate((2 * c,), jnp.uint8)
    faults.arm(arena, "create", 1, out_of_memory=True)
    syncs = faults.device_syncs(arena)
    with pytest.raises(MemoryError):
        buf.commit()
    assert faults.device_syncs(arena) == syncs  # nothing retired: no reason to wait
    vm.assert_backed(arena, [])


def test_free_defers_and_the_placement_is_reused(vm, faults):
    c = vm.chunk
    arena = _deferring(vm, faults, chunks=4, zero_fill=False)
    a = arena.allocate((4 * c,), jnp.uint8)
    a.commit()
    write_bytes(a, 0, pattern(4 * c, seed=5))
    with faults.hold_device(arena):
        a.free()
        assert arena.stats()["retired_bytes"] == 4 * c
        b = arena.allocate((4 * c,), jnp.uint8)  # the same range, its memory still retired
        assert b.offset == a.offset
        assert b.commit() == 4 * c
        assert arena.stats()["chunks_revived"] == 4
        # Without zero fill the new buffer sees the old one's bytes (documented).
        np.testing.assert_array_equal(raw_bytes(b), pattern(4 * c, seed=5))
    vm.assert_backed(arena, [chunk_range(b, 0, 4)])


# -- raw views --------------------------------------------------------------------------


def test_commits_drain_once_a_view_was_handed_out(vm, faults):
    """A view lets XLA read any byte; once one was handed out JAX may keep arrays over the
    memory past the view (a donated view's output aliases it), so every commit that maps
    new memory from then on waits for the device, whether the view lives or not."""
    c = vm.chunk
    arena = _deferring(vm, faults)
    buf = arena.allocate((8 * c,), jnp.uint8)
    buf.commit(0, c)
    assert arena.stats()["commit_drains"] == 0 and not arena.stats()["views_exported"]
    view = buf.array
    s = arena.stats()
    assert s["live_views"] == 1 and s["views_exported"]
    buf.commit(c, 2 * c)
    assert arena.stats()["commit_drains"] == 1
    del view
    assert arena.stats()["live_views"] == 0
    buf.commit(2 * c, 3 * c)
    buf.commit(3 * c, 4 * c)
    assert arena.stats()["commit_drains"] == 3
    buf.commit(0, 4 * c)  # nothing new to map: no drain
    assert arena.stats()["commit_drains"] == 3


def test_uncounted_views_do_not_count(vm, faults):
    arena = _deferring(vm, faults)
    buf = arena.allocate((vm.chunk,), jnp.uint8)
    v = uncounted_view(buf)
    assert arena.stats()["live_views"] == 0
    buf.commit()
    assert arena.stats()["commit_drains"] == 0
    assert int(jnp.sum(v.astype(jnp.int32))) == 0


@pytest.mark.parametrize("view_alive", [True, False])
def test_releases_wait_on_the_calling_thread_once_views_were_handed_out(vm, faults, view_alive):
    """A view lets XLA read anywhere: a release must then not leave the unmap to the
    reclaimer (a reader dispatched after the release would race it), also after the view
    died (arrays made from it may live on)."""
    c = vm.chunk
    arena = _deferring(vm, faults)
    buf = arena.allocate((4 * c,), jnp.uint8)
    buf.commit()
    view = buf.array
    if not view_alive:
        del view
        view = uncounted_view(buf)
    with faults.hold_device(arena):
        syncs = faults.device_syncs(arena)
        call = BackgroundCall(lambda: buf.decommit(0, 2 * c))
        wait_until(lambda: faults.device_syncs(arena) > syncs, "the release's device wait")
        assert not call.done, "the release did not wait for the device"
    assert call.join() == 2 * c
    s = arena.stats()
    assert s["retired_bytes"] == 0 and s["deferred_releases"] == 0 and s["held_bytes"] == 2 * c
    assert not np.asarray(view[: 2 * c]).any()  # reads zeros at once
    vm.assert_backed(arena, [chunk_range(buf, 2, 4)])


def test_a_new_view_finishes_deferred_releases_first(vm, faults):
    c = vm.chunk
    arena = _deferring(vm, faults)
    buf = arena.allocate((4 * c,), jnp.uint8)
    buf.commit()
    write_bytes(buf, 0, pattern(4 * c, seed=3))
    with faults.hold_device(arena):
        buf.decommit(0, 2 * c)
        syncs = faults.device_syncs(arena)
        call = BackgroundCall(lambda: buf.array)
        wait_until(lambda: faults.device_syncs(arena) > syncs, "the view's device wait")
        assert not call.done, "a view was handed out over memory still to be unmapped"
    view = call.join()
    assert arena.stats()["retired_bytes"] == 0
    got = np.asarray(view)
    assert not got[: 2 * c].any()
    np.testing.assert_array_equal(got[2 * c :], pattern(4 * c, seed=3)[2 * c :])


@pytest.mark.parametrize("handles", [1, 4])
def test_parked_chunks_read_zeros_through_views_with_zero_fill(vm, faults, handles):
    """Chunks released inside a still-used allocation stay mapped (parked); a zero-filling
    arena zeroes them before any view can read them."""
    c = vm.chunk
    arena = _deferring(vm, faults, handle_bytes=handles * c)
    buf = arena.allocate((4 * c,), jnp.uint8)
    buf.commit()
    write_bytes(buf, 0, pattern(4 * c, seed=4))
    buf.decommit(c, 3 * c)
    got = read_bytes(buf)
    assert not got[c : 3 * c].any()
    np.testing.assert_array_equal(got[:c], pattern(4 * c, seed=4)[:c])
    assert arena.stats()["parked_bytes"] == (2 * c if handles == 4 else 0)


# -- the switch that removes the protection -------------------------------------------


def test_skipping_device_waits_unmaps_under_a_busy_device(vm, faults):
    """The testing switch the GPU tests use to show that the deferral is what keeps a
    running kernel's pages mapped: with it, a release unmaps at once although the device
    never said it was done."""
    c = vm.chunk
    arena = _deferring(vm, faults)
    buf = arena.allocate((4 * c,), jnp.uint8)
    buf.commit()
    faults.skip_device_waits(arena)
    with faults.hold_device(arena):
        call = BackgroundCall(buf.decommit)
        call.join()
        assert arena.stats()["held_bytes"] == 0  # gone while the device was "busy"
        o = vm.oracle(arena)
        if o is not None and vm.is_host:
            o.assert_released()


# -- readers in flight (the CPU analogue of a kernel running over the pages) -------------


def _kv_with_two_sequences(vm, tokens_per_chunk_factor: int = 2):
    tpc = vm.chunk // (2 * 64 * 2)
    t = tokens_per_chunk_factor * tpc
    kv = vm.kv(
        num_layers=2, num_kv_heads=2, head_dim=64, max_tokens=t, max_seqs=2, dtype=jnp.bfloat16
    )
    kv.ensure(t, seq=0)
    kv.ensure(t, seq=1)
    for q in range(2):
        for i, b in enumerate(kv.buffers):
            write_bytes(b, q * kv.seq_bytes, pattern(kv.seq_bytes, seed=10 * q + i))
    return kv, t


def _checksum(x: jax.Array) -> jax.Array:
    """A position-weighted sum over the bytes of a sequence, repeated so that the
    computation runs a while (the stand-in for a long kernel)."""
    u = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32).reshape(-1)
    w = (jnp.arange(u.shape[0], dtype=jnp.uint32) * jnp.uint32(2654435761)) | 1

    def body(i, acc):
        return acc + jnp.sum(u * w + i.astype(jnp.uint32))

    return jax.lax.fori_loop(0, 64, body, jnp.uint32(0))


def test_reader_in_flight_keeps_its_pages_until_it_is_done(vm, faults):
    """A computation over sequence 0 is dispatched; sequence 0 is released and sequence
    1's neighbour pages are re-committed while it may still run. With the deferral the
    reader sees exactly the old tokens; the memory goes once the device is done."""
    kv, t = _kv_with_two_sequences(vm)
    faults.defer_reclaim(kv)
    k0 = uncounted_view(kv.k_buffers[0])  # what jax_vmm's ops reach by identity
    f = jax.jit(lambda k: _checksum(k[0]))
    want = int(f(k0))
    with faults.hold_device(kv):
        out = f(k0)  # in flight (or done) ...
        kv.release(0)  # ... while its pages are released
        kv.ensure(t // 2, seq=0)
        kv.release(0)
        assert int(out) == want, "the reader saw the pages change under it"
        assert kv.arena.stats()["retired_bytes"] > 0
    kv.reclaim()
    assert kv.arena.stats()["retired_bytes"] == 0


@pytest.mark.parametrize("counted", [True, False], ids=["views", "no_views"])
def test_neighbour_readers_see_exact_data_while_others_churn(vm, faults, counted):
    """Readers of sequence 1 run in a loop while another thread grows and releases
    sequence 0 (which shares no chunk with it): every result is exact."""
    kv, t = _kv_with_two_sequences(vm)
    faults.defer_reclaim(kv)
    view = kv.k_buffers[0].array if counted else uncounted_view(kv.k_buffers[0])
    f = jax.jit(lambda k: _checksum(k[1]))
    want = int(f(view))
    stop = threading.Event()
    results: list[int] = []

    def churn():
        rng = np.random.default_rng(0)
        try:
            for _ in range(30):
                kv.ensure(int(rng.integers(1, t + 1)), seq=0)
                kv.release(0)
        finally:
            stop.set()

    worker = BackgroundCall(churn)
    while not stop.is_set():
        results.append(int(f(view)))
    worker.join()
    results.append(int(f(view)))
    assert results and all(r == want for r in results), "a reader of seq 1 saw wrong data"


def test_a_release_right_before_exit_does_not_abort_the_process():
    """A release with a step still running queues a job on the reclaim thread; at exit the
    thread is stopped after serving it. (Killed as a daemon inside its wait for the step,
    the process aborted with SIGABRT; that depends on the step still running at exit,
    which the 24 large matrix products make likely, so the control is not certain.)"""
    from conftest import run_cpu_script

    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, jax_vmm
        kv = jax_vmm.kv_arena(num_layers=1, num_kv_heads=2, head_dim=8, max_tokens=16,
                              max_seqs=2, dtype=jnp.float32)
        kv.ensure(4, seq=0)

        @jax.jit
        def step(cache, big):
            x = big
            for _ in range(24):
                x = jnp.tanh(x @ x)
            new = jnp.zeros((1, 2, 8)) + x[0, 0]
            layer = jax_vmm.kv_write(cache[0], new, new, seq=jnp.array([0]), pos=jnp.array([0]))
            return cache.replace(0, layer)

        big = jnp.ones((1500, 1500))
        jax.block_until_ready(step(kv.cache(), big))
        cache = step(kv.cache(), big)  # dispatched, still running
        kv.release(0)
        print("released")
        """
    )
    proc = run_cpu_script(script)
    assert proc.returncode == 0 and "released" in proc.stdout, (
        proc.returncode,
        proc.stderr[-2000:],
    )


def _small_kv(vm):
    return vm.kv(
        num_layers=1, num_kv_heads=2, head_dim=8, max_tokens=16, max_seqs=4, dtype=jnp.float32
    )


def _gated_write(seq, pos, result):
    """A jitted step(cache, new, busy): a kv_write of ``new`` at (seq, pos) into layer 0,
    behind the testing host gate; returns ``result(cache, layer)``. Inside
    ``host_gate_closed()`` the step stays in flight across the test's calls, however fast
    the machine (``busy``: enough work that XLA:CPU queues the step instead of inlining
    it)."""

    @jax.jit
    def step(cache, new, busy):
        new = jax_vmm.testing.through_host_gate(new + 0 * jnp.sum(jnp.sin(busy)))
        layer = jax_vmm.kv_write(cache[0], new, new, seq=seq, pos=pos)
        return result(cache, layer)

    return step


@pytest.mark.parametrize("how", ["neighbour", "keep_tokens", "ensure_all"])
def test_a_write_in_flight_at_a_release_never_lands_in_the_next_sequence(host_vm, how):
    """A step still in flight (held at the testing host gate) writes the old sequence of
    slot 3; the slot is released and ensured for the next sequence, whose chunk stayed
    backed (a neighbour's tokens share it, or the release kept tokens). The ensure waits
    for the step, whose write is dropped and counted: the next sequence's tokens stay as
    they were (a fast ensure that raised the table first let it land there, uncounted)."""
    kv = _small_kv(host_vm)
    kv.ensure(4, seq=2)
    kv.ensure(4, seq=3)
    step = _gated_write(
        jnp.array([3, 3]), jnp.array([0, 1]), lambda cache, layer: cache.replace(0, layer)
    )
    busy = jnp.ones(8192)
    jax.block_until_ready(step(kv.cache(), jnp.zeros((2, 2, 8)), busy))
    kv.check()

    def ensure_next():
        if how == "ensure_all":
            kv.ensure_all([0, 0, 0, 4])
        else:
            kv.ensure(4, seq=3)

    with jax_vmm.testing.host_gate_closed():
        out = step(kv.cache(), jnp.full((2, 2, 8), 9.0), busy)  # in flight
        held_at_the_host_gate()
        kv.release(3, keep_tokens=4 if how == "keep_tokens" else 0)
        ensuring = BackgroundCall(ensure_next)
        ensuring.wait_inside(host_wait.wait_for, "the ensure's wait")  # or its return
        waited = not ensuring.done
    ensuring.join()
    jax.block_until_ready(out)
    assert waited, "the next sequence's ensure did not wait for the write in flight"
    with pytest.raises(jax_vmm.OutOfBoundsWrite) as info:
        kv.check()
    assert info.value.count == 4  # 2 tokens, K and V
    k = raw_bytes(kv.k_buffers[0]).view(np.float32).reshape(4, 16, 2, 8)
    assert not (k[3, :2] == 9.0).any(), "the old sequence's write landed in the next one"


def test_a_release_that_declares_no_writes_in_flight_does_not_wait(host_vm):
    """writes_in_flight=False (the serving engine's releases: its finished slots' rows are
    idle): the slot's next ensure returns while the step still runs. The step is held at
    the testing host gate, so no timing is involved: an ensure that waited for it would
    wait for the gate's 60 s guard, and the step would then be done."""
    kv = _small_kv(host_vm)
    kv.ensure(4, seq=2)
    kv.ensure(4, seq=3)
    busy = jnp.ones(8192)  # enough work that XLA:CPU queues the step instead of inlining it

    @jax.jit
    def step(cache, new, busy):
        new = jax_vmm.testing.through_host_gate(new + 0 * jnp.sum(jnp.sin(busy)))
        idle = jnp.array([-1, -1])
        return cache.replace(0, jax_vmm.kv_write(cache[0], new, new, seq=idle, pos=idle + 1))

    jax.block_until_ready(step(kv.cache(), jnp.zeros((2, 2, 8)), busy))
    with jax_vmm.testing.host_gate_closed():
        out = step(kv.cache(), jnp.zeros((2, 2, 8)), busy)  # idle rows, in flight
        held_at_the_host_gate()
        kv.release(3, keep_tokens=4, writes_in_flight=False)
        kv.ensure(4, seq=3)
        held = not out[0].token.is_ready() and jax_vmm.testing.host_gate_held() > 0
    assert held, "the ensure waited for the step"
    jax.block_until_ready(out)
    kv.check()


@pytest.mark.parametrize("waited", [True, False], ids=["waited", "control"])
def test_check_waits_for_a_step_that_returns_only_what_it_read(host_vm, waited):
    """A step writes a layer (one token past the ensured ones: dropped), reads it and
    returns only the attention output: kv.check() right after the dispatch waits for it
    and reports the drop (it returned 0, and the drop surfaced at a later check). The step
    is held at the testing host gate; the control (the wait for live results off) misses
    the drop."""
    kv = _small_kv(host_vm)
    kv.ensure(4, seq=0)
    q = jnp.ones((4, 2, 8))
    step = _gated_write(
        jnp.array([0]),
        jnp.array([9]),
        lambda cache, layer: jax_vmm.decode_attention(q, layer, jnp.array([4, 0, 0, 0])),
    )
    busy = jnp.ones(8192)
    jax.block_until_ready(step(kv.cache(), jnp.ones((1, 2, 8)), busy))
    with pytest.raises(jax_vmm.OutOfBoundsWrite):
        kv.check()  # the compile run's drop
    with jax_vmm.testing.host_gate_closed():
        out = step(kv.cache(), jnp.ones((1, 2, 8)), busy)
        held_at_the_host_gate()
        if not waited:
            with jax_vmm.testing.live_results_unwaited():
                kv.check()  # too early: the step has not run, nothing counted yet
        else:
            checking = BackgroundCall(kv.check)
            checking.wait_inside(host_wait.wait_for_live_arrays, "check()'s wait")
            blocked = not checking.done
    jax.block_until_ready(out)
    if not waited:
        return
    with pytest.raises(jax_vmm.OutOfBoundsWrite) as info:
        checking.join()
    assert blocked, "kv.check() did not wait for the step in flight"
    assert info.value.count == 2  # K and V
