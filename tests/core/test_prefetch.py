"""``kv.prefetch(n, seq)``: an admission's commit on the commit-ahead thread. The tokens
are backed in the background, ``ensure`` afterwards makes no call into the core, and
nothing is ensured (the table still says 0) until ``ensure``. Also the worker itself
(jax_vmm/kv/prefetch.py): oldest request first, and it survives a failing commit."""

from __future__ import annotations

import logging
import threading

import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
import jax_vmm.testing
from conftest import (
    assert_unwritable_until_ensure,
    assert_write_lands_without_the_table,
    chunk_range,
    k_tokens,
    seq_chunk_states,
    two_seq_kv,
    write_one_token,
)
from jax_vmm.kv.prefetch import CommitAhead


def _kv(vm, **kw):
    return two_seq_kv(vm, jnp.float32, **kw)


def test_a_prefetched_prompt_is_ensured_without_a_commit(vm):
    kv, tpc = _kv(vm)
    kv.prefetch(tpc + 1, 1)  # the natural call: tokens, then the sequence
    assert kv.wait_prefetch(1, timeout=30)
    assert kv.is_backed(tpc + 1, 1) and not kv.is_backed(2 * tpc + 1, 1)
    assert (
        seq_chunk_states(kv, 1) == (True, True, False, False)
        and seq_chunk_states(kv, 0) == (False,) * 4
    )
    s = kv.arena.stats()
    assert s["commits_ahead"] == len(kv.buffers)  # one core call per buffer
    assert kv.ensure(tpc + 1, 1) == 0
    assert kv.arena.stats()["commit_calls"] == s["commit_calls"], "ensure called the core"
    assert kv._core_cache.limits() == [0, tpc + 1]
    c = kv.seq_bytes // kv.arena.chunk_bytes
    vm.assert_backed(kv.arena, [chunk_range(b, c, c + 2) for b in kv.buffers])


def test_without_prefetch_the_ensure_commits(vm):
    """The control: the same ensure with no prefetch calls the core, so the test above
    would see a prefetch that did nothing."""
    kv, tpc = _kv(vm)
    calls = kv.arena.stats()["commit_calls"]
    assert not kv.is_backed(tpc + 1, 1)
    assert kv.ensure(tpc + 1, 1) > 0
    assert kv.arena.stats()["commit_calls"] == calls + 1


def test_prefetched_tokens_are_not_writable_before_ensure(vm):
    kv, tpc = _kv(vm)
    kv.prefetch(8, 0)
    assert kv.wait_prefetch(0, timeout=30) and kv.is_backed(8, 0)
    assert kv._core_cache.limits() == [0, 0]
    assert_unwritable_until_ensure(kv, 0, 8, 3)  # backed, not ensured


def test_without_the_table_the_write_would_land_in_the_prefetched_chunk(vm):
    """The switch that removes the protection: the test above would catch a prefetch
    that ensured its tokens."""
    kv, _ = _kv(vm)
    kv.prefetch(8, 0)
    assert kv.wait_prefetch(0, timeout=30)
    assert_write_lands_without_the_table(kv, 0, 3)


def test_a_sequence_released_while_its_prefetch_runs_keeps_nothing(vm):
    kv, tpc = _kv(vm)
    with kv._lock:  # the worker cannot plan until the release is done
        kv.prefetch(2 * tpc, 0)
        kv.release(0)
    assert kv.wait_prefetch(0, timeout=30)
    assert seq_chunk_states(kv, 0) == (False,) * 4
    assert kv.arena.stats()["backed_bytes"] == 0 and not kv.is_backed(1, 0)


def test_a_dropped_prefetch_leaves_the_ensure_to_commit(vm):
    """With raw views handed out a background commit is skipped; ensure then commits on
    the calling thread (and says so by returning the bytes)."""
    kv, tpc = _kv(vm)
    view = kv.k[0]
    kv.prefetch(tpc, 0)
    assert kv.wait_prefetch(0, timeout=30)
    assert not kv.is_backed(tpc, 0) and kv.stats()["commits_ahead_skipped"] == 1
    assert kv.ensure(tpc, 0) > 0
    del view


def test_prefetch_arguments_are_checked_and_change_nothing(vm):
    kv, tpc = _kv(vm)
    for bad, err in (
        (-1, ValueError),
        (4 * tpc + 1, ValueError),
        ("8", TypeError),
        (2.0, TypeError),
    ):
        with pytest.raises(err, match="num_tokens"):
            kv.prefetch(bad, 0)
    with pytest.raises(ValueError, match="seq"):  # the forgotten sequence of a batch arena
        kv.prefetch(8)
    with pytest.raises(ValueError, match="seq=2 is out of range"):
        kv.prefetch(8, 2)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="timeout must be seconds"):
            kv.wait_prefetch(0, timeout=bad)
    for bad in ("1", True):
        with pytest.raises(TypeError, match="timeout must be a number of seconds"):
            kv.wait_prefetch(0, timeout=bad)
    assert kv.wait_prefetch(0, timeout=0) and kv._ahead.idle()
    assert kv.arena.stats()["backed_bytes"] == 0 and kv.prefetch(0, 0) is None


def test_prefetch_of_a_closed_arena_says_so(vm):
    kv, _ = _kv(vm)
    kv.close()
    with pytest.raises(jax_vmm.ArenaClosedError, match="KVArena.prefetch"):
        kv.prefetch(8, 0)


def test_prefetch_of_an_offloaded_sequence_says_so(vm):
    kv, tpc = _kv(vm)
    kv.ensure(tpc, 0)
    kv.offload(0).wait()
    with pytest.raises(ValueError, match="offloaded"):
        kv.prefetch(tpc, 0)
    kv.restore(0).wait()
    kv.prefetch(tpc, 0)
    assert kv.wait_prefetch(0, timeout=30) and kv.is_backed(tpc, 0)


class _Recorder:
    """A stand-in KV arena for the worker: records the order of its commits, and blocks
    the first one until released so that the rest queue up."""

    def __init__(self, fail: set[int] = frozenset()):
        self.order: list[int] = []
        self.gate = threading.Event()
        self.fail = fail

    def _commit_ahead(self, seq: int, tokens: int, epoch: int) -> None:
        if not self.order:
            self.gate.wait(30)
        self.order.append(seq)
        if seq in self.fail:
            raise RuntimeError(f"commit of {seq} failed")


def test_the_worker_serves_the_oldest_request_first():
    kv = _Recorder()
    worker = CommitAhead(kv)
    for seq in (5, 1, 7, 3):
        worker.schedule(seq, 8, 0)
    worker.schedule(7, 16, 0)  # more for 7: it keeps its place
    kv.gate.set()
    assert worker.wait_idle(30)
    assert kv.order == [5, 1, 7, 3]
    worker.stop()


def test_the_worker_lives_on_after_a_failing_commit(caplog):
    kv = _Recorder(fail={1})
    worker = CommitAhead(kv)
    kv.gate.set()
    with caplog.at_level(logging.ERROR, logger="jax_vmm"):
        worker.schedule(1, 8, 0)
        assert worker.wait_for(1, 30)
        worker.schedule(2, 8, 0)
        assert worker.wait_idle(30)
    assert kv.order == [1, 2]
    assert "commit ahead of sequence 1 failed" in caplog.text
    worker.stop()


class _FailingCore:
    """Stands in for the core arena: the nth background commit call (one per buffer)
    raises MemoryError; `before(k)` runs before call k (1-based)."""

    def __init__(self, core, nth, before=None, keep_nothing_back=False):
        self._core, self._nth, self._before, self.calls = core, nth, before, 0
        self._keep = keep_nothing_back

    def __getattr__(self, name):
        return getattr(self._core, name)

    def commit_ahead(self, ranges):
        self.calls += 1
        if self._before is not None:
            self._before(self.calls)
        if self.calls == self._nth:
            raise MemoryError("injected: out of memory in a background commit")
        return self._core.commit_ahead(ranges)

    def decommit_ranges(self, ranges, wait):
        if self._keep:  # the switch: the partial commit is not given back
            return 0
        return self._core.decommit_ranges(ranges, wait)


def _prefetch_with(kv, core, tokens, q=0):
    real = kv.arena._handle
    kv.arena._handle = core
    try:
        kv.prefetch(tokens, q)
        assert kv.wait_prefetch(q, timeout=30)
    finally:
        kv.arena._handle = real


def test_a_background_commit_that_fails_partway_gives_back_what_it_added(vm):
    kv, tpc = _kv(vm)
    kv.ensure(8, 0)  # the first chunk of every buffer: counted on, must stay
    before = kv.arena.stats()["backed_bytes"]
    core = _FailingCore(kv.arena._handle, nth=3)  # buffers 1 and 2 get their chunk, 3 fails
    _prefetch_with(kv, core, 2 * tpc)
    assert core.calls == 3 and kv.stats()["commits_ahead_failed"] == 1
    assert kv.arena.stats()["backed_bytes"] == before
    assert seq_chunk_states(kv, 0) == (True, False, False, False)
    assert not kv.is_backed(2 * tpc, 0)
    assert kv.ensure(2 * tpc, 0) > 0  # the ensure commits on its own thread


def test_without_the_give_back_a_failed_background_commit_would_hold_memory(vm):
    """The switch: with the give-back removed, the test above sees the chunks stay."""
    kv, tpc = _kv(vm)
    kv.ensure(8, 0)
    before = kv.arena.stats()["backed_bytes"]
    _prefetch_with(kv, _FailingCore(kv.arena._handle, nth=3, keep_nothing_back=True), 2 * tpc)
    assert kv.arena.stats()["backed_bytes"] == before + 2 * vm.chunk


class _ViewMidwayCore:
    """Stands in for the core arena: just before background commit call `nth` (one per
    buffer) it hands out a raw view of the KV arena, as a thread reading the cache might
    meanwhile, so the core skips that call. Counts the decommits that reach the core from
    another thread than the test's while views are out: on a GPU each would unmap under
    the views' readers. `hide_views=True` is the switch: the give-back is told no view is
    out."""

    def __init__(self, kv, nth, hide_views=False):
        self._core, self._kv, self._nth, self._hide = kv.arena._handle, kv, nth, hide_views
        self._test_thread = threading.current_thread()
        self.calls, self.decommits_under_views, self.view = 0, 0, None

    def __getattr__(self, name):
        return getattr(self._core, name)

    @property
    def views_exported(self):
        return False if self._hide else self._core.views_exported

    def commit_ahead(self, ranges):
        self.calls += 1
        if self.calls == self._nth:
            arena = self._kv.arena
            arena._handle = self._core  # a view needs the core itself
            try:
                self.view = self._kv.k[0]
            finally:
                arena._handle = self
        return self._core.commit_ahead(ranges)

    def decommit_ranges(self, ranges, *args):
        if self._core.views_exported and threading.current_thread() is not self._test_thread:
            self.decommits_under_views += 1
        return self._core.decommit_ranges(ranges, *args)


def test_a_background_commit_stopped_by_a_view_unmaps_nothing_under_it(vm):
    """A raw view handed out while a background commit is partway stops it; what it
    backed stays backed (not counted), since on the worker thread an unmap would run under
    the view's readers. The sequence's ensure then commits the rest, and its release
    frees all of it."""
    kv, tpc = _kv(vm)
    kv.ensure(8, 0)
    before = kv.arena.stats()["backed_bytes"]
    core = _ViewMidwayCore(kv, nth=3)  # buffers 1 and 2 get their chunk, 3 is skipped
    _prefetch_with(kv, core, 2 * tpc)
    assert core.calls == 3 and core.view is not None
    assert kv.stats()["commits_ahead_skipped"] == 1
    assert core.decommits_under_views == 0
    assert kv.arena.stats()["backed_bytes"] == before + 2 * vm.chunk
    assert not kv.is_backed(2 * tpc, 0)
    assert kv.ensure(2 * tpc, 0) == len(kv.buffers) * vm.chunk - 2 * vm.chunk
    write_one_token(kv, 2 * tpc - 1, 5.0)
    kv.check()
    assert np.all(k_tokens(kv, 0)[2 * tpc - 1] == 5.0)
    kv.release(0)
    assert kv.arena.stats()["backed_bytes"] == 0


def test_without_seeing_the_view_the_give_back_would_unmap_under_it(vm):
    """The switch: a give-back that is not told of the view decommits on the worker
    thread while the view is out, and the test above would count it."""
    kv, tpc = _kv(vm)
    kv.ensure(8, 0)
    before = kv.arena.stats()["backed_bytes"]
    core = _ViewMidwayCore(kv, nth=3, hide_views=True)
    _prefetch_with(kv, core, 2 * tpc)
    assert core.calls == 3 and core.view is not None
    assert core.decommits_under_views == 1
    assert kv.arena.stats()["backed_bytes"] == before


def test_a_failed_background_commit_leaves_what_an_ensure_counted_on_meanwhile(vm):
    """An ensure on another thread backs the tokens while the background commit is
    partway; the background commit then fails: what the ensure counts on stays."""
    kv, tpc = _kv(vm)

    def ensure_meanwhile(call):
        if call == 2:
            kv.ensure(2 * tpc, 0)

    _prefetch_with(kv, _FailingCore(kv.arena._handle, nth=3, before=ensure_meanwhile), 2 * tpc)
    assert seq_chunk_states(kv, 0) == (True, True, False, False)
    assert kv.is_backed(2 * tpc, 0)
    calls = kv.arena.stats()["commit_calls"]
    assert kv.ensure(2 * tpc, 0) == 0 and kv.arena.stats()["commit_calls"] == calls
    write_one_token(kv, 2 * tpc - 1, 9.0)  # the last token of the second chunk: kept
    kv.check()
    assert np.all(k_tokens(kv, 0)[2 * tpc - 1] == 9.0)
