"""kv_arena: layouts, ensure/shrink/release, chunk sharing between sequences, stats,
all-or-nothing growth under injected faults, close."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
from conftest import pattern, read_bytes, write_bytes
from jax_vmm.testing import InjectedFault

H, D = 2, 64  # bfloat16: 256 bytes per token per buffer


def _tpc(vm) -> int:
    """Tokens per chunk on this device."""
    return vm.chunk // (H * D * 2)


def _make(vm, **kw):
    kw.setdefault("num_layers", 3)
    kw.setdefault("num_kv_heads", H)
    kw.setdefault("head_dim", D)
    kw.setdefault("dtype", jnp.bfloat16)
    return vm.kv(**kw)


def _buffer_ranges(kv, stop_bytes_per_seq):
    """Arena-relative ranges backed when each sequence q has bytes
    [q*seq_bytes, q*seq_bytes + stop_bytes_per_seq[q]) committed (rounded out)."""
    c = kv.arena.chunk_bytes
    out = []
    for b in kv.buffers:
        for q, n in enumerate(stop_bytes_per_seq):
            if n:
                lo = q * kv.seq_bytes // c * c
                hi = min(math.ceil((q * kv.seq_bytes + n) / c) * c, math.ceil(b.nbytes / c) * c)
                out.append((b.offset + lo, b.offset + hi))
    return out


def _write_tokens(kv, seq, first, count, seed):
    """Distinct bytes into tokens [first, first+count) of sequence seq in every buffer."""
    tb = kv.token_bytes
    base = (0 if seq is None else seq) * kv.seq_bytes
    for i, b in enumerate(kv.buffers):
        write_bytes(b, base + first * tb, pattern(count * tb, seed=seed * 100 + i))


def _assert_tokens(kv, seq, first, count, seed):
    tb = kv.token_bytes
    base = (0 if seq is None else seq) * kv.seq_bytes
    for i, b in enumerate(kv.buffers):
        got = read_bytes(b, base + first * tb, base + (first + count) * tb)
        np.testing.assert_array_equal(
            got, pattern(count * tb, seed=seed * 100 + i), err_msg=f"{b.name} seq={seq}"
        )


# -- layout ------------------------------------------------------------------------------


def test_single_sequence_layout(vm):
    t = 4 * _tpc(vm)
    kv = _make(vm, max_tokens=t)
    assert (kv.num_layers, kv.max_tokens, kv.max_seqs) == (3, t, None)
    assert len(kv.k) == len(kv.v) == 3 and len(kv.k_buffers) == len(kv.v_buffers) == 3
    addresses = set()
    for l in range(3):
        for views, bufs in ((kv.k, kv.k_buffers), (kv.v, kv.v_buffers)):
            x = views[l]
            assert x.shape == (t, H, D) and x.dtype == jnp.bfloat16
            assert x.devices() == {vm.device}
            assert x.unsafe_buffer_pointer() == bufs[l].address  # zero-copy
            addresses.add(bufs[l].address)
    assert len(addresses) == 6
    assert kv.backed_tokens() == 0 and kv.arena.backed_bytes == 0
    vm.assert_backed(kv.arena, [])


def test_multi_sequence_layout(vm):
    t = 2 * _tpc(vm)
    kv = _make(vm, max_tokens=t, max_seqs=3, num_layers=2)
    assert kv.max_seqs == 3
    assert kv.k[0].shape == (3, t, H, D) and kv.v[1].shape == (3, t, H, D)
    assert [kv.backed_tokens(q) for q in range(3)] == [0, 0, 0]
    assert kv.k[-1].unsafe_buffer_pointer() == kv.k_buffers[1].address


# -- ensure / shrink / release ------------------------------------------------------------------


def test_ensure_backs_every_layer(vm):
    tpc = _tpc(vm)
    # zero_fill: the count below expects the unwritten tokens to read zero.
    kv = _make(vm, max_tokens=4 * tpc, zero_fill=True)
    c = vm.chunk
    assert kv.ensure(tpc + 1) == 6 * 2 * c  # 6 buffers, 2 chunks each
    assert kv.backed_tokens() == 2 * tpc  # chunk rounding backs whole chunks
    vm.assert_backed(kv.arena, _buffer_ranges(kv, [(tpc + 1) * kv.token_bytes]))
    assert kv.ensure(tpc + 1) == 0 and kv.ensure(5) == 0  # already backed
    assert kv.ensure(4 * tpc) == 6 * 2 * c
    assert kv.backed_tokens() == 4 * tpc
    assert kv.ensure(0) == 0
    # The views see the new memory at the same address.
    _write_tokens(kv, None, 3 * tpc, 2, seed=1)
    assert int(jnp.count_nonzero(kv.k[0])) == 2 * H * D  # NaN bit patterns count too


@pytest.mark.parametrize("max_seqs", [None, 3])
def test_initial_tokens(vm, max_seqs):
    tpc = _tpc(vm)
    kv = _make(vm, max_tokens=2 * tpc + tpc // 2, max_seqs=max_seqs, initial_tokens=tpc + 3)
    seqs = [None] if max_seqs is None else range(max_seqs)
    for q in seqs:
        assert kv.backed_tokens(q) >= tpc + 3
    if max_seqs is None:
        assert kv.backed_tokens() == 2 * tpc
        vm.assert_backed(kv.arena, _buffer_ranges(kv, [(tpc + 3) * kv.token_bytes]))
    else:
        vm.assert_backed(kv.arena, _buffer_ranges(kv, [(tpc + 3) * kv.token_bytes] * 3))


@pytest.mark.parametrize("handles", ["chunk", "large"])
def test_shrink_single_sequence_keeps_the_first_tokens(vm, handles):
    """One allocation per chunk: the released chunks' memory goes. One allocation for the
    whole commit (the KV default): they are parked, still held, until the rest goes."""
    tpc = _tpc(vm)
    c = vm.chunk
    kv = _make(vm, max_tokens=4 * tpc, handle_bytes=c if handles == "chunk" else None)
    kv.ensure(3 * tpc + 10)  # one commit of 4 chunks per buffer
    _write_tokens(kv, None, 0, tpc + 5, seed=2)
    assert kv.shrink(tpc + 5) == 6 * 2 * c  # chunks 2 and 3 go; chunk 1 holds kept tokens
    assert kv.backed_tokens() == 2 * tpc
    _assert_tokens(kv, None, 0, tpc + 5, seed=2)
    held = None if handles == "chunk" else _buffer_ranges(kv, [4 * c])
    vm.assert_backed(kv.arena, _buffer_ranges(kv, [2 * c]), held=held)
    assert kv.stats()["parked_bytes"] == (0 if handles == "chunk" else 6 * 2 * c)
    assert kv.shrink(tpc + 5) == 0
    # Chunk 2 again: a new allocation each, or the parked chunk taken back (no driver call).
    before = kv.stats()
    assert kv.ensure(3 * tpc) == 6 * c
    after = kv.stats()
    new = after["chunks_created"] - before["chunks_created"]
    revived = after["chunks_revived"] - before["chunks_revived"]
    assert (new, revived) == ((6, 0) if handles == "chunk" else (0, 6))
    assert kv.shrink(0) == 6 * 3 * c
    vm.assert_backed(kv.arena, [])


def test_shrink_multi_sequence_keeps_the_first_tokens(vm):
    tpc = _tpc(vm)
    kv = _make(vm, max_tokens=4 * tpc, max_seqs=2)
    kv.ensure(3 * tpc, seq=0)
    _write_tokens(kv, 0, 0, tpc + 5, seed=3)
    kv.shrink(tpc + 5)
    assert kv.backed_tokens(0) >= tpc + 5
    _assert_tokens(kv, 0, 0, tpc + 5, seed=3)


def test_shrink_to_zero_frees_the_chunks_sequences_share(vm):
    """Sequences of 1.5 chunks share every other chunk; shrink(0) gives back all of it at
    once (each shared chunk was kept for a neighbour whose tokens the same call dropped)."""
    tpc = _tpc(vm)
    kv = _make(vm, max_tokens=tpc + tpc // 2, max_seqs=4)
    for q in range(4):
        kv.ensure(tpc + tpc // 2, seq=q)
    kv.shrink(0, wait=True)
    kv.reclaim()
    assert [kv.backed_tokens(q) for q in range(4)] == [0] * 4
    assert kv.stats()["backed_bytes"] == 0
    vm.assert_backed(kv.arena, [])
    kv.ensure(5, seq=2)  # and the sequences work on from there
    _write_tokens(kv, 2, 0, 5, seed=4)
    _assert_tokens(kv, 2, 0, 5, seed=4)


def test_release_single_sequence(vm):
    tpc = _tpc(vm)
    kv = _make(vm, max_tokens=3 * tpc + 1)  # the buffers end in a partial chunk
    kv.ensure(3 * tpc + 1)
    assert kv.release() == 6 * 4 * vm.chunk
    assert kv.backed_tokens() == 0
    vm.assert_backed(kv.arena, [])
    assert not read_bytes(kv.k_buffers[0]).any()


def test_release_never_frees_what_another_sequence_uses(vm):
    """Sequences of 1.5 chunks: chunk 1 holds the end of seq 0 and the start of seq 1."""
    tpc = _tpc(vm)
    t = tpc + tpc // 2
    kv = _make(vm, max_tokens=t, max_seqs=3, num_layers=2)
    c, tb = vm.chunk, kv.token_bytes
    for q in range(3):
        kv.ensure(t, seq=q)
        _write_tokens(kv, q, 0, t, seed=10 + q)
    # Seq 1 spans bytes [1.5c, 3c): chunk 1 is shared with seq 0, chunk 2 is its own.
    assert kv.release(1) == 4 * c
    assert kv.backed_tokens(0) == t and kv.backed_tokens(2) == t
    _assert_tokens(kv, 0, 0, t, seed=10)
    _assert_tokens(kv, 2, 0, t, seed=12)
    vm.assert_backed(kv.arena, _buffer_ranges(kv, [t * tb, 0, t * tb]))
    # Seq 1 takes a few tokens again (inside chunk 1), then seq 0 goes: chunk 0 is freed,
    # chunk 1 stays for seq 1.
    kv.ensure(3, seq=1)
    assert kv.release(0) == 4 * c
    assert kv.backed_tokens(1) >= 3 and kv.backed_tokens(0) == 0
    _assert_tokens(kv, 2, 0, t, seed=12)
    vm.assert_backed(kv.arena, _buffer_ranges(kv, [0, 3 * tb, t * tb]))
    # Now seq 1 alone holds chunk 1: releasing it frees the chunk.
    assert kv.release(1) == 4 * c
    vm.assert_backed(kv.arena, _buffer_ranges(kv, [0, 0, t * tb]))
    assert kv.release(2) == 4 * 2 * c
    vm.assert_backed(kv.arena, [])


def test_ensure_of_one_sequence_keeps_neighbour_data(vm):
    tpc = _tpc(vm)
    t = tpc + tpc // 2
    # zero_fill: seq 1's tokens must still read zero, so its ensure rewrote nothing.
    kv = _make(vm, max_tokens=t, max_seqs=2, num_layers=1, zero_fill=True)
    kv.ensure(t, seq=0)
    _write_tokens(kv, 0, 0, t, seed=20)
    kv.ensure(t, seq=1)  # shares chunk 1 with seq 0: already backed, untouched
    _assert_tokens(kv, 0, 0, t, seed=20)
    assert not read_bytes(kv.k_buffers[0], kv.seq_bytes, 2 * kv.seq_bytes).any()


# -- stats -----------------------------------------------------------------------------------


def test_stats(vm):
    tpc = _tpc(vm)
    kv = _make(vm, max_tokens=4 * tpc, max_seqs=2, num_layers=2)
    c = vm.chunk
    s = kv.stats()
    for key in (
        "reserved_bytes",
        "backed_bytes",
        "peak_backed_bytes",
        "commit_calls",
        "decommit_calls",
        "commit_seconds",
        "decommit_seconds",
        "driver",
        "granularity",
        "chunk_bytes",
        "num_buffers",
        "backed_tokens",
    ):
        assert key in s, key
    assert s["driver"] == ("host" if vm.is_host else "cuda")
    assert s["granularity"] == kv.arena.granularity and s["chunk_bytes"] == c
    assert s["reserved_bytes"] >= 4 * 2 * kv.seq_bytes and s["num_buffers"] == 4
    assert (s["backed_bytes"], s["commit_calls"], s["decommit_calls"]) == (0, 0, 0)
    kv.ensure(2 * tpc, seq=0)
    kv.ensure(tpc, seq=1)
    kv.release(0)
    s = kv.stats()
    assert s["backed_bytes"] == 4 * c and s["peak_backed_bytes"] == 4 * 3 * c
    assert s["commit_calls"] == 2 and s["decommit_calls"] == 1  # one call for every buffer
    assert s["commit_seconds"] > 0 and s["decommit_seconds"] > 0
    assert s["backed_tokens"] == [0, tpc]
    assert isinstance(s, dict)


# -- faults and close ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "handles,op,nth",
    [
        ("chunk", "create", 1),
        ("chunk", "create", 4),
        ("chunk", "create", 12),
        ("chunk", "map", 2),
        ("chunk", "map", 11),
        ("chunk", "set_access", 1),
        ("chunk", "set_access", 6),
        ("large", "create", 1),
        ("large", "create", 6),
        ("large", "map", 4),
        ("large", "set_access", 6),
    ],
)
def test_ensure_is_all_or_nothing(vm, faults, handles, op, nth):
    """ensure(3*tpc) of seq 0 adds 2 chunks per buffer: 12 allocations and 12 map pieces
    with one allocation per chunk, 6 of each with the KV default (one per run)."""
    tpc = _tpc(vm)
    kv = _make(
        vm, max_tokens=4 * tpc, max_seqs=2, handle_bytes=vm.chunk if handles == "chunk" else None
    )  # 6 buffers
    kv.ensure(tpc // 2, seq=0)
    kv.ensure(tpc, seq=1)
    _write_tokens(kv, 0, 0, tpc // 2, seed=30)
    before = vm.snapshot(kv.arena, kv.buffers)
    tokens = [kv.backed_tokens(0), kv.backed_tokens(1)]
    faults.arm(kv, op, nth)
    with pytest.raises(InjectedFault):
        kv.ensure(3 * tpc, seq=0)
    assert faults.injected(kv) == 1
    assert [kv.backed_tokens(0), kv.backed_tokens(1)] == tokens
    assert vm.snapshot(kv.arena, kv.buffers) == before
    assert kv.ensure(3 * tpc, seq=0) == 6 * 2 * vm.chunk
    _assert_tokens(kv, 0, 0, tpc // 2, seed=30)


def test_a_failed_ensure_all_changes_nothing_a_later_ensure_relies_on(vm, faults):
    """ensure_all of a sequence within its backed chunk (seq 0) and one that must commit
    (seq 1), with the commit failing: the device table, the bookkeeping and the memory
    stay as they were, so the ensure that follows publishes seq 0's tokens (a table
    raised in the bookkeeping but never copied would make it skip the copy, and the
    kernels would drop seq 0's writes)."""
    tpc = _tpc(vm)
    kv = _make(vm, max_tokens=4 * tpc, max_seqs=2)
    kv.ensure(tpc // 4, seq=0)
    before = vm.snapshot(kv.arena, kv.buffers)
    faults.arm(kv, "create", 1)
    with pytest.raises(InjectedFault):
        kv.ensure_all(np.array([tpc // 2, 2 * tpc], np.int64))
    assert faults.injected(kv) == 1
    assert kv._core_cache.limits() == [tpc // 4, 0]
    assert kv._ensured.tolist() == [tpc // 4, 0]
    assert vm.snapshot(kv.arena, kv.buffers) == before
    assert kv.ensure(tpc // 2, seq=0) == 0  # within the backed chunk
    assert kv._core_cache.limits() == [tpc // 2, 0]
    assert kv.ensure_all([tpc // 2, 2 * tpc]) > 0  # the same call, unarmed
    assert kv._core_cache.limits() == [tpc // 2, 2 * tpc]


def test_ensure_out_of_memory(vm, faults):
    tpc = _tpc(vm)
    kv = _make(vm, max_tokens=2 * tpc)
    before = vm.snapshot(kv.arena, kv.buffers)
    faults.arm(kv, "create", 5, out_of_memory=True)
    with pytest.raises(MemoryError, match="XLA_PYTHON_CLIENT_PREALLOCATE"):
        kv.ensure(2 * tpc)
    assert vm.snapshot(kv.arena, kv.buffers) == before
    assert kv.backed_tokens() == 0


def test_close(vm):
    tpc = _tpc(vm)
    kv = _make(vm, max_tokens=2 * tpc, initial_tokens=tpc)
    _write_tokens(kv, None, 0, tpc, seed=40)
    k0 = kv.k[0]
    assert int(jnp.count_nonzero(k0)) == tpc * H * D
    kv.close()
    assert kv.arena.closed and kv.arena.backed_bytes == 0
    o = vm.oracle(kv.arena)
    if o is not None:
        o.assert_released()
    for call in (lambda: kv.ensure(1), lambda: kv.shrink(0), lambda: kv.release()):
        with pytest.raises(jax_vmm.ArenaClosedError):
            call()
    assert int(jnp.count_nonzero(k0)) == 0  # the old view reads zeros
    assert kv.backed_tokens() == 0
    with jax_vmm.kv_arena(
        num_layers=1, num_kv_heads=1, head_dim=8, max_tokens=8, device=vm.device
    ) as kv2:
        kv2.ensure(8)
    assert kv2.arena.closed


def test_small_refusals_say_what_to_do(vm):
    """Inputs that were taken in silence or answered with an unrelated error."""
    from jax_vmm.ops import scratch

    for bad in (True, 1.5):
        with pytest.raises(TypeError, match="scratch.reserve: nbytes must be an integer"):
            scratch.reserve(bad)
    with pytest.raises(TypeError, match="scratch.set_reserve_bytes: nbytes must be an integer"):
        scratch.set_reserve_bytes(1.9)
    with pytest.raises(TypeError, match="device must be a jax.Device"):
        scratch.reserve(4096, device="cpu")
    with pytest.raises(TypeError, match="scratch.reserve is a host call .* outside jit"):
        jax.jit(lambda n: scratch.reserve(n))(4096)
    if not jax.config.jax_enable_x64:
        with pytest.raises(TypeError, match="dtype float64 needs jax_enable_x64"):
            vm.kv(num_layers=1, num_kv_heads=1, head_dim=4, max_tokens=8, dtype=jnp.float64)
    one = _make(vm, max_tokens=_tpc(vm))
    one.ensure(4)
    assert one.wait_prefetch(timeout=float("inf"))  # as long as it takes, not OverflowError
    t = one.offload()
    with pytest.raises(ValueError, match=r"call kv.restore\(\) and wait"):
        one.ensure(8)
    one.close()
    with pytest.raises(jax_vmm.ArenaClosedError, match="was closed"):
        t.state  # noqa: B018 - the query is what raises
    with pytest.raises(jax_vmm.ArenaClosedError, match="was closed"):
        t.wait()


@pytest.mark.parametrize("how", ["release", "shrink", "ensure_all"])
def test_a_zero_filling_arena_gives_a_reused_slot_zeros(vm, how):
    """zero_fill=True: tokens read zeros until written. A fresh commit zero-fills whole
    chunks, but a release keeps a chunk the neighbour holds tokens in, and a shrink keeps
    its last partial chunk: their rows kept the earlier sequence's bytes, which the next
    ensure of those rows handed out as if never written. Now they read zeros, and the
    neighbour's tokens stay."""
    tpc = _tpc(vm)
    t = tpc + tpc // 2  # neighbours share a chunk
    kv = _make(vm, num_layers=1, max_tokens=t, max_seqs=3, zero_fill=True, commit_ahead_tokens=0)
    for q in range(3):
        kv.ensure(t, seq=q)
        for b in kv.buffers:
            write_bytes(b, q * kv.seq_bytes, pattern(kv.seq_bytes, seed=q + 1))
    cut = tpc // 4
    if how == "release":
        kv.release(1, wait=True)
        kv.ensure(t, seq=1)
    elif how == "shrink":
        kv.shrink(cut, wait=True)
        kv.ensure(t, seq=1)
    else:
        kv.shrink(cut, wait=True)
        kv.ensure_all([cut, t, cut])
    lo = 0 if how == "release" else cut * kv.token_bytes
    for b in kv.buffers:
        seq1 = read_bytes(b, kv.seq_bytes + lo, 2 * kv.seq_bytes)
        assert not seq1.any(), f"{how}: {np.count_nonzero(seq1)} stale bytes in sequence 1"
        keep = cut * kv.token_bytes if how != "release" else kv.seq_bytes
        for q in (0, 2):  # the neighbours' tokens are theirs still
            np.testing.assert_array_equal(
                read_bytes(b, q * kv.seq_bytes, q * kv.seq_bytes + keep),
                pattern(kv.seq_bytes, seed=q + 1)[:keep],
            )
