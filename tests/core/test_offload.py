"""kv.offload(seq) / kv.restore(seq): a sequence's tokens move to host memory and back at
the same addresses; its device memory is free meanwhile; other sequences keep working.

The deferred (background) path runs on the host too through the testing layer
(``faults.defer_reclaim``), with the "device" held busy (``faults.hold_device``).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
from conftest import chunk_range, chunk_states, pattern, raw_bytes, write_bytes
from jax_vmm.memory.transfer import Transfer
from jax_vmm.testing import InjectedFault

H, D = 2, 64  # bfloat16: 256 bytes per token per buffer


def _kv(vm, seqs=3, chunks_per_seq=1.5, **kw):
    """Sequences of 1.5 chunks by default: neighbours share a chunk."""
    tpc = vm.chunk // (H * D * 2)
    t = int(chunks_per_seq * tpc)
    kv = vm.kv(
        num_layers=2,
        num_kv_heads=H,
        head_dim=D,
        max_tokens=t,
        max_seqs=seqs,
        dtype=jnp.bfloat16,
        **kw,
    )
    for q in range(seqs):
        kv.ensure(t, seq=q)
        for i, b in enumerate(kv.buffers):
            write_bytes(b, q * kv.seq_bytes, pattern(kv.seq_bytes, seed=10 * q + i))
    return kv, t


def _seq_bytes(kv, q):
    return [raw_bytes(b, q * kv.seq_bytes, (q + 1) * kv.seq_bytes) for b in kv.buffers]


def _backed_ranges(kv):
    out = []
    for b in kv.buffers:
        out += [chunk_range(b, i, i + 1) for i, s in enumerate(chunk_states(b)) if s]
    return out


def _assert_seq(kv, q):
    for i, got in enumerate(_seq_bytes(kv, q)):
        np.testing.assert_array_equal(got, pattern(kv.seq_bytes, seed=10 * q + i))


def test_a_neighbour_admitted_while_a_sequence_is_away_does_not_block_its_restore(vm):
    """Seq 0 shares its last chunk with seq 1, which holds nothing. The offload keeps that
    chunk backed (seq 0's bytes stay in it): the neighbour's ensure then takes it as it
    is, and the restore brings seq 0 back bit-exact. (The chunk went away with seq 0; the
    neighbour backed it again, and every restore was refused: "committed while its
    contents were away", the tokens lost but for a release.)"""
    kv, t = _kv(vm, seqs=2)
    kv.release(1, wait=True)
    kv.offload(0)
    kv.ensure(t // 2, seq=1)  # admits seq 1 into the chunk the two share
    write_bytes(kv.buffers[0], kv.seq_bytes, pattern(16, seed=77))  # seq 1's first token
    kv.restore(0)
    assert kv.stats()["offloaded_seqs"] == []
    _assert_seq(kv, 0)
    np.testing.assert_array_equal(
        raw_bytes(kv.buffers[0], kv.seq_bytes, kv.seq_bytes + 16), pattern(16, seed=77)
    )
    kv.release(0, wait=True)
    kv.release(1, wait=True)
    kv.reclaim()
    vm.assert_backed(kv.arena, [])


def test_offload_frees_the_memory_and_restore_brings_it_back_bit_exact(vm):
    kv, t = _kv(vm)
    held0 = kv.arena.stats()["held_bytes"]
    addresses = [b.address for b in kv.buffers]
    tr = kv.offload(1)
    assert tr.state == "offloaded" and tr.done and kv.stats()["offloaded_seqs"] == [1]
    kv.reclaim()  # GPU: the copied-out allocations are retired for the reclaimer
    # Seq 1 spans [1.5c, 3c): chunk 1 is shared with seq 0 and stays; chunk 2 goes.
    s = kv.arena.stats()
    assert s["held_bytes"] == held0 - 4 * vm.chunk and s["offloaded_bytes"] == 4 * vm.chunk
    vm.assert_backed(kv.arena, _backed_ranges(kv))
    assert [chunk_states(b)[2] for b in kv.buffers] == [False] * 4
    _assert_seq(kv, 0)
    _assert_seq(kv, 2)
    tr2 = kv.restore(1)
    assert tr2 is tr and tr.state == "restored" and kv.stats()["offloaded_seqs"] == []
    assert [b.address for b in kv.buffers] == addresses
    for q in range(3):
        _assert_seq(kv, q)
    assert kv.arena.stats()["held_bytes"] == held0 and kv.arena.stats()["offloaded_bytes"] == 0
    vm.assert_backed(kv.arena, _backed_ranges(kv))
    assert kv.backed_tokens(1) == t


def test_an_offloaded_sequence_is_kept_away_from(vm):
    kv, t = _kv(vm)
    tr = kv.offload(0)
    for call in (
        lambda: kv.ensure(1, seq=0),
        lambda: kv.ensure_all([1, 0, 0]),
        lambda: kv.offload(0),
        lambda: kv.shrink(1),
    ):
        with pytest.raises(ValueError, match="sequence 0 is offloaded.*restore"):
            call()
    with pytest.raises(ValueError, match="sequence 1 is not offloaded"):
        kv.restore(1)
    assert kv.ensure(t, seq=2) == 0  # the others keep working
    away = kv.stats()["offloaded_seqs"]
    kv.release(0)  # dropping an offloaded sequence frees its host copy
    assert away == [0] and kv.arena.stats()["offloaded_bytes"] == 0
    assert kv.stats()["offloaded_seqs"] == []
    assert tr.state == "released" and tr.done  # its host copy is gone with it
    kv.ensure(3, seq=0)
    with pytest.raises(ValueError, match="not offloaded"):
        kv.restore(0)


def test_a_shrink_that_leaves_an_offloaded_sequence_whole_runs(vm):
    """shrink(n) cuts every sequence past n tokens: one that is away is refused only if the
    shrink would cut it (it refused whenever any sequence was away). The away sequence's
    table entry stays 0 (a write to it is dropped and counted) and it comes back whole."""
    kv, t = _kv(vm)
    kv.release(0, wait=True)
    kv.ensure(10, seq=0)
    before = [raw_bytes(b, 0, 10 * kv.token_bytes) for b in kv.buffers]
    kv.offload(0)
    with pytest.raises(ValueError, match="sequence 0 is offloaded.*restore"):
        kv.shrink(5)
    assert kv.shrink(t // 2) > 0  # cuts sequences 1 and 2, not the 10 tokens of 0
    assert kv.stats()["offloaded_seqs"] == [0]
    one = jnp.ones((1, H, D), jnp.bfloat16)
    layer = jax_vmm.kv_write(
        kv.cache()[0], one, one, seq=jnp.zeros(1, jnp.int32), pos=jnp.zeros(1, jnp.int32)
    )
    with pytest.raises(jax_vmm.OutOfBoundsWrite):
        kv.check(layer)
    kv.restore(0)
    assert kv.ensure(10, seq=0) == 0
    for b, want in zip(kv.buffers, before):
        np.testing.assert_array_equal(raw_bytes(b, 0, 10 * kv.token_bytes), want)


@pytest.mark.parametrize("opened_by", ["done", "stats"])
def test_a_background_restore_opens_the_sequence_once_it_landed(vm, faults, opened_by):
    """restore(wait=False), then the first ``done`` that sees the copy landed (or
    ``stats()``) opens the sequence: a write right after lands and a read of all its
    tokens is not clamped. (Until wait() or an ensure, ``done`` said True while the
    sequence's writes were dropped and its reads clamped, and stats() listed it away.)"""
    kv, t = _kv(vm)
    faults.defer_reclaim(kv)
    tr = kv.offload(1)
    tr = kv.restore(1, wait=False)
    deadline = time.monotonic() + 30
    while tr.state != "restored" and time.monotonic() < deadline:
        time.sleep(0.001)  # the core's state: it does not open the sequence
    assert tr.done if opened_by == "done" else kv.stats()["offloaded_seqs"] == []
    token = jax.device_put(jnp.full((1, H, D), 3.0, jnp.bfloat16), kv.arena.device)
    layer = jax_vmm.kv_write(
        kv.cache()[0], token, token, seq=jnp.array([1]), pos=jnp.array([t - 1])
    )
    q = jax.device_put(jnp.ones((3, H, D), jnp.bfloat16), kv.arena.device)
    out = jax_vmm.decode_attention(q, layer, jnp.array([0, t, 0]))
    kv.check(out)  # neither the write dropped nor the read clamped
    got = raw_bytes(kv.k_buffers[0], 2 * kv.seq_bytes - kv.token_bytes, 2 * kv.seq_bytes)
    np.testing.assert_array_equal(got.view(jnp.bfloat16), np.full(H * D, 3.0, jnp.bfloat16))


def test_offload_and_restore_in_the_background(vm, faults):
    """The offload copies only after the device finished the work dispatched before it,
    on the reclaimer's thread: offload(wait=False) returns while the device is busy, its
    chunks leave the page table at once (writes drop), the memory goes when the copy is
    done. The restore copies in the background and publishes the chunks when it landed."""
    kv, t = _kv(vm)
    faults.defer_reclaim(kv)
    held0 = kv.arena.stats()["held_bytes"]
    with faults.hold_device(kv):
        tr = kv.offload(2, wait=False)
        assert tr.state == "offloading" and not tr.done
        assert [chunk_states(b)[3:] for b in kv.buffers] == [(False, False)] * 4
        assert kv.arena.stats()["held_bytes"] == held0  # not unmapped under the device
        assert kv.ensure(t, seq=0) == 0  # the others are not held up
        kv.release(0)
        kv.ensure(t, seq=0)
        for i, b in enumerate(kv.buffers):
            write_bytes(b, 0, pattern(kv.seq_bytes, seed=i))
    tr.wait()
    assert tr.state == "offloaded"
    kv.reclaim()
    assert kv.arena.stats()["held_bytes"] < held0
    tr = kv.restore(2, wait=False)
    tr.wait()
    assert tr.state == "restored" and kv.backed_tokens(2) == t
    kv.ensure(t, seq=2)  # settles the finished transfer
    assert kv.stats()["offloaded_seqs"] == []
    _assert_seq(kv, 1)
    _assert_seq(kv, 2)


@pytest.mark.parametrize("background", [False, True])
def test_a_failed_offload_leaves_the_sequence_in_place(vm, faults, background):
    kv, t = _kv(vm)
    if background:
        faults.defer_reclaim(kv)
    before = kv.arena.stats()["held_bytes"]
    faults.arm(kv, "copy_to_host", 1)
    if background or not vm.is_host:  # on the reclaimer's thread: wait() reports it
        with pytest.raises(jax_vmm.TransferError, match="offload failed.*stayed in place"):
            kv.offload(1)
    else:  # inline (the host driver): the error itself
        with pytest.raises(InjectedFault):
            kv.offload(1)
    assert kv.stats()["offloaded_seqs"] == []
    assert kv.backed_tokens(1) == t and kv.arena.stats()["held_bytes"] == before
    _assert_seq(kv, 1)
    assert kv.offload(1).state == "offloaded"  # and it can go now


@pytest.mark.parametrize("background", [False, True])
def test_a_failed_restore_keeps_the_host_copy_and_can_be_retried(vm, faults, background):
    kv, t = _kv(vm)
    if background:
        faults.defer_reclaim(kv)
    kv.offload(1)
    kv.reclaim()
    held = kv.arena.stats()["held_bytes"]
    faults.arm(kv, "copy_to_device", 1)
    if background:  # the copy fails on the reclaimer's thread: wait() reports it
        tr = kv.restore(1, wait=False)
        with pytest.raises(jax_vmm.TransferError, match="restore failed.*still offloaded"):
            tr.wait()
    else:  # inline: the error itself
        with pytest.raises(InjectedFault):
            kv.restore(1)
    assert kv.stats()["offloaded_seqs"] == [1]
    kv.reclaim()
    assert kv.arena.stats()["held_bytes"] == held  # the failed restore's memory went again
    kv.restore(1)
    _assert_seq(kv, 1)
    assert kv.stats()["offloaded_seqs"] == []


def test_offload_of_an_empty_sequence_and_release_while_in_flight(vm, faults):
    kv, t = _kv(vm, seqs=2, chunks_per_seq=2)
    kv.release(1)
    tr = kv.offload(1)
    assert tr.state == "offloaded" and kv.arena.stats()["offloaded_bytes"] == 0
    kv.restore(1)
    assert kv.backed_tokens(1) == 0
    faults.defer_reclaim(kv)
    with faults.hold_device(kv):
        kv.offload(0, wait=False)
    kv.release(0)  # waits for the transfer, then drops it
    assert kv.arena.stats()["offloaded_bytes"] == 0
    vm.assert_backed(kv.arena, [])


def test_a_transfer_settled_by_another_thread_meanwhile_reads_as_settled():
    """done / state / wait while another thread settles the transfer (stats, ensure or
    release drop its ticket between this thread's two looks): the settled state, not the
    core's "no transfer" error."""

    class SettledMeanwhile:
        closed = False

        def __init__(self):
            self.transfer = None

        def _settle(self):
            self.transfer._final, self.transfer._final_error = "restored", ""
            raise ValueError("Arena.transfer: no transfer 1 in this arena")

        def transfer_state(self, ticket):
            self._settle()

        def wait_transfer(self, ticket):
            self._settle()

    for look in ("done", "state", "wait"):
        core = SettledMeanwhile()
        tr = core.transfer = Transfer(core, 1, 0)
        got = tr.wait() if look == "wait" else getattr(tr, look)
        assert got is tr if look == "wait" else got in (True, "restored")
        assert tr.state == "restored"


def test_stats_of_a_closed_arena_with_sequences_away(vm):
    """stats() after close with a sequence offloaded: the stats, not the closed
    transfer's error, and nothing away (the host copy went with the arena: its transfer
    says so), as every count of a closed arena reads 0."""
    kv, t = _kv(vm)
    tr = kv.offload(1)
    kv.close()
    s = kv.stats()
    assert s["offloaded_seqs"] == [] and s["offloaded_bytes"] == 0 and s["backed_bytes"] == 0
    with pytest.raises(jax_vmm.ArenaClosedError, match="host copy"):
        tr.state  # noqa: B018
