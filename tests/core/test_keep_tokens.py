"""``kv.release(seq, keep_tokens=n)``: a slot handed to its next sequence keeps the memory
that backs the next prompt instead of releasing it and committing it again, while its
table of ensured tokens still says 0 (nothing writes the kept bytes before ``ensure``)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import jax_vmm
import jax_vmm.testing
from conftest import (
    assert_unwritable_until_ensure,
    assert_write_lands_without_the_table,
    chunk_range,
    chunk_states,
    k_tokens,
    seq_chunk_states,
    two_seq_kv,
    write_one_token,
)

H, D = 2, 64  # float32: 512 bytes per token per buffer


def _kv(vm, chunks_per_seq=4, **kw):
    # One allocation per chunk (handle_bytes): nothing parks.
    kw.setdefault("handle_bytes", vm.chunk)
    return two_seq_kv(vm, jnp.float32, chunks_per_seq, **kw)


def _ranges(kv, per_seq):
    """Arena byte ranges of chunks [0, n) of each sequence q, per_seq[q] = n."""
    c = kv.seq_bytes // kv.arena.chunk_bytes
    return [chunk_range(b, q * c, q * c + n) for q, n in enumerate(per_seq) for b in kv.buffers]


def _commit_calls(kv):
    return kv.arena.stats()["commit_calls"]


def test_the_next_prompt_finds_its_chunks_backed(vm):
    kv, tpc = _kv(vm)
    kv.ensure(3 * tpc, 0)
    kv.ensure(tpc, 1)
    released = kv.release(0, keep_tokens=tpc + 1)  # the next prompt: a chunk and a token
    assert released == len(kv.buffers) * vm.chunk  # the third chunk went
    assert seq_chunk_states(kv, 0) == (True, True, False, False)
    assert kv._core_cache.limits() == [0, tpc]  # nothing may write the kept bytes yet
    calls = _commit_calls(kv)
    assert kv.ensure(tpc + 1, 0) == 0 and _commit_calls(kv) == calls
    assert kv._core_cache.limits() == [tpc + 1, tpc]
    vm.assert_backed(kv.arena, _ranges(kv, [2, 1]))


def test_without_keep_tokens_the_next_prompt_commits_again(vm):
    """The control: a plain release gives everything back, so the same ensure calls the
    core; the test above would see a keep_tokens that kept nothing."""
    kv, tpc = _kv(vm)
    kv.ensure(3 * tpc, 0)
    kv.release(0)
    assert seq_chunk_states(kv, 0) == (False,) * 4
    calls = _commit_calls(kv)
    assert kv.ensure(tpc + 1, 0) > 0 and _commit_calls(kv) == calls + 1


def test_kept_bytes_are_not_written_before_ensure(vm):
    kv, tpc = _kv(vm)
    kv.ensure(8, 0)
    write_one_token(kv, 3, 1.0)
    kv.check()
    kv.release(0, keep_tokens=8)
    assert k_tokens(kv, 0)[3][0, 0] == 1.0
    assert_unwritable_until_ensure(kv, 0, 8, 3)  # the table says 0 tokens, the chunk is backed


def test_without_the_table_the_write_would_land_in_the_kept_chunk(vm):
    """The switch that removes the protection: the test above would catch a release that
    left the old table in place."""
    kv, _ = _kv(vm)
    kv.ensure(8, 0)
    kv.release(0, keep_tokens=8)
    assert_write_lands_without_the_table(kv, 0, 3)


def test_more_than_the_old_sequence_had_is_backed_ahead(vm):
    kv, tpc = _kv(vm, commit_ahead_tokens=tpc_quarter(vm))
    kv.ensure(tpc // 2, 0)
    kv.release(0, keep_tokens=2 * tpc + 1)  # a longer prompt: three chunks
    assert kv._ahead.wait_idle()
    assert seq_chunk_states(kv, 0) == (True, True, True, False)
    calls = _commit_calls(kv)
    assert kv.ensure(2 * tpc + 1, 0) == 0 and _commit_calls(kv) == calls


def tpc_quarter(vm):
    return vm.chunk // (H * D * 4) // 4


def test_with_commit_ahead_off_ensure_commits_the_rest(vm):
    kv, tpc = _kv(vm)
    kv.ensure(tpc // 2, 0)
    kv.release(0, keep_tokens=2 * tpc + 1)
    assert seq_chunk_states(kv, 0) == (True, False, False, False)
    assert kv.ensure(2 * tpc + 1, 0) == 2 * len(kv.buffers) * vm.chunk
    vm.assert_backed(kv.arena, _ranges(kv, [3, 0]))


def test_a_chunk_shared_with_a_neighbour_stays_for_it(vm):
    """Sequences of 1.5 chunks: the middle chunk holds the end of sequence 0 and the start
    of sequence 1. Keeping a token of sequence 0 keeps its first chunk; the shared chunk
    stays because sequence 1 holds tokens in it."""
    tpc = vm.chunk // (H * D * 4)
    kv, _ = _kv(vm, max_tokens=tpc + tpc // 2)
    kv.ensure(kv.max_tokens, 0)
    kv.ensure(4, 1)
    kv.release(0, keep_tokens=1)
    states = [chunk_states(b) for b in kv.buffers]
    assert all(s == (True, True, False) for s in states), states
    kv.release(1)
    kv.release(0)
    vm.assert_backed(kv.arena, [])


def test_a_kept_chunk_shared_with_a_neighbour_survives_the_neighbours_release(vm):
    """Sequence 0 keeps tokens that reach into the chunk it shares with sequence 1; that
    chunk must stay when sequence 1 goes, although sequence 0 has 0 tokens ensured: its
    next ensure finds the chunk backed without a driver call, so its writes need it."""
    tpc = vm.chunk // (H * D * 4)
    kv, _ = _kv(vm, max_tokens=tpc + tpc // 2)
    kv.ensure(kv.max_tokens, 0)
    kv.ensure(4, 1)
    kv.release(0, keep_tokens=tpc + 10)
    kv.release(1)
    states = [chunk_states(b) for b in kv.buffers]
    assert all(s == (True, True, False) for s in states), states
    calls = _commit_calls(kv)
    assert kv.ensure(tpc + 10, 0) == 0 and _commit_calls(kv) == calls
    write_one_token(kv, tpc + 5, 3.0)
    kv.check()  # landed: the chunk is there
    kv.release(0)
    vm.assert_backed(kv.arena, [])


def test_parked_chunks_of_a_larger_allocation_count_as_held(vm):
    """With the kv_arena default (large allocations), chunks past keep_tokens that share an
    allocation with kept ones stay held (parked) and come back without a driver call."""
    kv, tpc = _kv(vm, handle_bytes=None)
    kv.ensure(3 * tpc, 0)  # one allocation of three chunks per buffer
    kv.release(0, keep_tokens=tpc)
    assert seq_chunk_states(kv, 0) == (True, False, False, False)
    assert kv.arena.stats()["parked_bytes"] == 2 * len(kv.buffers) * vm.chunk
    vm.assert_backed(kv.arena, _ranges(kv, [1, 0]), held=_ranges(kv, [3, 0]))
    calls = kv.arena.stats()["chunks_revived"]
    kv.ensure(3 * tpc, 0)
    assert kv.arena.stats()["chunks_revived"] == calls + 2 * len(kv.buffers)
    kv.release(0)
    vm.assert_backed(kv.arena, [])


@pytest.mark.parametrize(
    "keep, error, match",
    [
        (-1, ValueError, "keep_tokens"),
        (10**9, ValueError, "exceeds max_tokens"),
        ("8", TypeError, "keep_tokens"),
        (2.5, TypeError, "keep_tokens"),
    ],
    ids=["negative", "past_max_tokens", "string", "float"],
)
def test_bad_keep_tokens_are_refused_and_change_nothing(vm, keep, error, match):
    kv, tpc = _kv(vm)
    kv.ensure(tpc, 0)
    with pytest.raises(error, match=match):
        kv.release(0, keep_tokens=keep)
    assert kv._core_cache.limits() == [tpc, 0]
    vm.assert_backed(kv.arena, _ranges(kv, [1, 0]))


def test_a_zero_filling_arena_refuses_keep_tokens(vm):
    kv, tpc = _kv(vm, zero_fill=True)
    kv.ensure(tpc, 0)
    with pytest.raises(ValueError, match="zero-fills"):
        kv.release(0, keep_tokens=4)
    assert kv._core_cache.limits() == [tpc, 0]
    vm.assert_backed(kv.arena, _ranges(kv, [1, 0]))
    kv.release(0)  # without keep_tokens: fine
    vm.assert_backed(kv.arena, [])


def test_a_closed_arena_refuses_it(vm):
    kv, _ = _kv(vm)
    kv.ensure(4, 0)
    kv.close()
    with pytest.raises(jax_vmm.ArenaClosedError):
        kv.release(0, keep_tokens=4)
