"""Commit ahead of need (jax_vmm/kv/prefetch.py): once a sequence is close to the end of its
backed chunks, a background thread backs the next chunk, so the decode loop's ensure()
finds it backed and makes no driver call; it pauses while raw views are alive, and a
sequence released meanwhile keeps nothing."""

from __future__ import annotations

import logging
import threading

import jax.numpy as jnp

from conftest import (
    chunk_range,
    hold_commit_ahead,
    k_tokens,
    seq_chunk_states,
    two_seq_kv,
    write_one_token,
)
from jax_vmm.testing import uncounted_view

H, D = 2, 64  # bfloat16: 256 bytes per token per buffer


def _kv(vm, **kw):
    tpc = vm.chunk // (H * D * 2)
    kw.setdefault("commit_ahead_tokens", tpc // 4)
    return two_seq_kv(vm, jnp.bfloat16, **kw)


def test_the_next_chunk_is_backed_before_the_decode_loop_needs_it(vm):
    kv, tpc = _kv(vm)
    kv.ensure(tpc // 2, seq=0)
    assert kv._ahead.wait_idle() and seq_chunk_states(kv, 0) == (
        True,
        False,
        False,
        False,
    )  # far away
    kv.ensure(tpc - tpc // 8, seq=0)  # within a quarter chunk of the end: commit ahead
    assert kv._ahead.wait_idle()
    assert seq_chunk_states(kv, 0) == (True, True, False, False)
    s = kv.arena.stats()
    assert s["commits_ahead"] == len(kv.buffers)  # one core call per buffer
    calls = s["commit_calls"]
    for n in range(tpc - tpc // 8, tpc + tpc // 2):  # the decode loop crosses the boundary
        assert kv.ensure(n + 1, seq=0) == 0
    assert kv.arena.stats()["commit_calls"] == calls, "the crossing ensure() called the core"
    assert seq_chunk_states(kv, 1) == (False,) * 4  # the other sequence is untouched
    o = [chunk_range(b, 0, 2) for b in kv.buffers]
    vm.assert_backed(kv.arena, o)


def test_ensure_all_commits_ahead_for_every_sequence(vm):
    kv, tpc = _kv(vm)
    kv.ensure_all([tpc, tpc - 1])
    assert kv._ahead.wait_idle()
    assert seq_chunk_states(kv, 0)[:2] == (True, True) and seq_chunk_states(kv, 1)[:2] == (
        True,
        True,
    )
    calls = kv.arena.stats()["commit_calls"]
    assert kv.ensure_all([tpc + 1, tpc + 1]) == 0
    assert kv.arena.stats()["commit_calls"] == calls


def test_commit_ahead_stops_once_raw_views_were_handed_out(vm):
    kv, tpc = _kv(vm)
    view = kv.k[0]  # a raw view: a background commit could swap pages under its readers
    kv.ensure(tpc, seq=0)
    assert kv._ahead.wait_idle()
    assert seq_chunk_states(kv, 0) == (True, False, False, False)
    assert kv.stats()["commits_ahead_skipped"] == 1
    kv.ensure(tpc, seq=0)  # not scheduled again while nothing changed
    assert kv._ahead.wait_idle() and kv.stats()["commits_ahead_skipped"] == 1
    assert kv.ensure(tpc + 1, seq=0) > 0  # the decode thread commits itself
    del view
    kv.ensure(2 * tpc, seq=0)  # the view is gone, arrays made from it may not be
    assert kv._ahead.wait_idle() and seq_chunk_states(kv, 0)[2] is False


def test_views_that_stand_for_jax_vmm_ops_do_not_stop_it(vm):
    kv, tpc = _kv(vm)
    u = uncounted_view(kv.k_buffers[0])
    kv.ensure(tpc, seq=0)
    assert kv._ahead.wait_idle() and seq_chunk_states(kv, 0)[:2] == (True, True)
    del u


def _release_before_the_core_call(kv, start, seq: int, **release_kw) -> None:
    """Releases ``seq`` (``release_kw``) after ``start`` made the worker begin a background
    commit and before that commit's core call (the race these tests need, made
    deterministic), then waits for the worker."""
    released = threading.Event()
    held = hold_commit_ahead(kv, start, 0.0, after=released)
    kv.release(seq, **release_kw)
    released.set()
    held.go.set()
    assert kv._ahead.wait_idle()


def test_a_sequence_released_while_its_commit_is_on_the_way_keeps_nothing(vm):
    kv, tpc = _kv(vm)
    kv.ensure(tpc // 2, seq=0)
    # ensure(tpc) schedules the next chunk; the release overtakes it.
    _release_before_the_core_call(kv, lambda: kv.ensure(tpc, seq=0), 0)
    assert kv.arena.stats()["commits_ahead"] == 1  # it did commit ...
    assert seq_chunk_states(kv, 0) == (False,) * 4  # ... and gave it back
    vm.assert_backed(kv.arena, [])


def test_a_slot_released_with_keep_tokens_while_its_commit_is_on_the_way_keeps_them(vm):
    """The engine's admission into a held slot: release(keep_tokens=) while the old
    sequence's next chunk is being committed ahead, wait for the worker, ensure, write.
    The void commit gives back only its own chunk; the kept one still backs the prompt."""
    kv, tpc = _kv(vm)
    kv.ensure(tpc - tpc // 8, seq=0)  # near the end of chunk 0: chunk 1 is committed ahead
    assert kv._ahead.wait_idle()
    kv.release(0)
    _release_before_the_core_call(
        kv, lambda: kv.ensure(tpc - tpc // 8, seq=0), 0, keep_tokens=tpc // 2
    )
    assert kv.wait_prefetch(0, timeout=30)
    assert seq_chunk_states(kv, 0) == (True, False, False, False)
    calls = kv.arena.stats()["commit_calls"]
    assert kv.ensure(tpc // 2, seq=0) == 0 and kv.arena.stats()["commit_calls"] == calls
    write_one_token(kv, tpc // 2 - 1, 3.0)
    assert (k_tokens(kv, 0)[tpc // 2 - 1] == 3.0).all()
    kv.check()  # no write was dropped
    vm.assert_backed(kv.arena, [chunk_range(b, 0, 1) for b in kv.buffers])


def _hold_next_commit_ahead(kv, tpc: int) -> threading.Event:
    """Has the commit ahead of sequence 0's chunk 1 hold inside the core after its first
    buffer, until the returned event is set (at most 1 s); returns once it is there."""
    # Near the end of chunk 0: chunk 1 is committed ahead.
    return hold_commit_ahead(kv, lambda: kv.ensure(tpc - tpc // 8, seq=0), hold_s=1.0).go


def test_a_sleep_waits_for_a_commit_ahead_inside_the_core(vm, caplog):
    """kv.sleep() while a commit ahead of a sequence's next chunk is inside the core (held
    up to 1 s): the sleep waits for it, so the commit ends whole (the next chunk in every
    buffer, counted for the sequence, slept and woken with it, gone with its release) and
    the worker logged no failure. Without the wait the commit's later buffers fail while
    the arena sleeps, it cannot give back what it backed, and the wake brings that chunk
    back in one buffer only."""
    kv, tpc = _kv(vm)
    kv.ensure(tpc // 2, seq=0)
    assert kv._ahead.wait_idle()
    go = _hold_next_commit_ahead(kv, tpc)
    with caplog.at_level(logging.ERROR, logger="jax_vmm"):
        kv.sleep()
        go.set()
        assert kv._ahead.wait_idle()
        kv.wake()
    assert not [r for r in caplog.records if "commit ahead" in r.getMessage()]
    assert seq_chunk_states(kv, 0) == (True, True, False, False)
    vm.assert_backed(kv.arena, [chunk_range(b, 0, 2) for b in kv.buffers])
    kv.check()
    kv.release(0)
    vm.assert_backed(kv.arena, [])


def test_an_offload_waits_for_a_commit_ahead_inside_the_core(vm):
    """kv.offload(0) while a commit ahead of its next chunk is inside the core (held up to
    1 s): the offload waits for it, so the host copy and the restore hold that chunk in
    every buffer, and the release gives everything back. Without the wait the offload
    copies the chunk of the one buffer the commit had reached, and the restore brings it
    back there only."""
    kv, tpc = _kv(vm)
    kv.ensure(tpc // 2, seq=0)
    assert kv._ahead.wait_idle()
    go = _hold_next_commit_ahead(kv, tpc)
    try:
        t = kv.offload(0, wait=False)
    finally:
        go.set()
    t.wait()
    assert kv._ahead.wait_idle()
    kv.restore(0).wait()
    assert seq_chunk_states(kv, 0) == (True, True, False, False)
    kv.release(0)
    vm.assert_backed(kv.arena, [])


def test_a_reused_slot_gets_its_first_chunk_back_in_the_background(vm):
    kv, tpc = _kv(vm)
    kv.ensure(tpc // 2, seq=0)
    kv.release(0, reuse=True)
    assert kv._ahead.wait_idle()
    assert seq_chunk_states(kv, 0) == (True, False, False, False)
    calls = kv.arena.stats()["commit_calls"]
    assert kv.ensure(1, seq=0) == 0 and kv.arena.stats()["commit_calls"] == calls
    kv.release(0)  # without reuse: nothing stays
    assert kv._ahead.wait_idle()
    vm.assert_backed(kv.arena, [])


def test_commit_ahead_off(vm):
    kv, tpc = _kv(vm, commit_ahead_tokens=0)
    kv.ensure(tpc, seq=0)
    assert kv._ahead.idle() and kv.arena.stats()["commits_ahead"] == 0
    assert seq_chunk_states(kv, 0) == (True, False, False, False)
