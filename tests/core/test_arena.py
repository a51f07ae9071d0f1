"""Arena and Buffer: placement, commit/decommit semantics, zero reads, views, close,
fault-injection rollback and out-of-memory. Backing is checked by the harness's oracle
(/proc/self/maps + memfd blocks on the host; see conftest.Harness.assert_backed)."""

from __future__ import annotations

import gc
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
import jax_vmm.testing
import maps_oracle as mo
from conftest import chunk_range, pattern, raw_bytes, read_bytes, stable_stats, write_bytes
from jax_vmm.testing import InjectedFault

# -- placement and views ------------------------------------------------------------------


def test_reserve_and_place(vm):
    c = vm.chunk
    arena = vm.arena(10 * c + 1)
    assert arena.chunk_bytes == c
    assert arena.reserved_bytes == 11 * c  # rounded up to whole chunks
    assert arena.granularity > 0 and c % arena.granularity == 0
    assert arena.driver == ("host" if vm.is_host else "cuda")
    a = arena.allocate((3, c // 4), jnp.float32, name="a")  # 3 chunks
    b = arena.allocate((c // 2 + 1,), jnp.uint8)  # 1 chunk (rounded up)
    d = arena.allocate(7 * c // 2, jnp.int8, name="d")  # 3.5 chunks -> 4
    assert (a.nbytes, b.nbytes, d.nbytes) == (3 * c, c // 2 + 1, 7 * c // 2)
    spans = sorted((x.offset, x.offset + math.ceil(x.nbytes / c) * c) for x in (a, b, d))
    for (_, hi), (lo, _) in zip(spans, spans[1:]):
        assert hi <= lo, "buffers overlap"
    for x in (a, b, d):
        assert x.offset % c == 0 and x.address == arena.base + x.offset
        assert x.backed_bytes == 0
    assert a.name == "a" and b.name and b.name != d.name
    assert arena.backed_bytes == 0 and arena.stats()["placed_bytes"] == 8 * c
    vm.assert_backed(arena, [])  # placement backs nothing


def test_views_are_zero_copy_at_a_fixed_address(vm):
    c = vm.chunk
    arena = vm.arena(8 * c)
    buf = arena.allocate((4, c // 2), jnp.bfloat16)  # 4 chunks
    x = buf.array
    assert x.shape == (4, c // 2) and x.dtype == jnp.bfloat16
    assert x.devices() == {vm.device}
    assert x.unsafe_buffer_pointer() == buf.address
    buf.commit(0, c)
    buf.commit(2 * c, 3 * c + 1)
    buf.decommit(0, c)
    for view in (buf.array, buf.view((c,), jnp.uint8), buf.view((c // 4,), jnp.int32)):
        assert view.unsafe_buffer_pointer() == buf.address  # never moves, never copies
    assert x.unsafe_buffer_pointer() == buf.address  # the old view too


# -- commit / decommit ------------------------------------------------------------------------


def test_commit_rounds_out_to_chunks(vm):
    c = vm.chunk
    arena = vm.arena(8 * c)
    buf = arena.allocate(5 * c // 2, jnp.uint8)  # 2.5 chunks
    assert buf.commit(1, 2) == c  # one byte backs its whole chunk
    vm.assert_backed(arena, [chunk_range(buf, 0, 1)])
    assert buf.commit(c - 1, c + 1) == c  # straddles chunks 0 and 1: only 1 is new
    vm.assert_backed(arena, [chunk_range(buf, 0, 2)])
    assert buf.commit(2 * c + 1, buf.nbytes) == c  # the partial tail chunk is a whole chunk
    assert buf.backed_bytes == 3 * c
    vm.assert_backed(arena, [chunk_range(buf, 0, 3)])
    assert buf.commit(5, 5) == 0  # empty range


def test_decommit_rounds_in_except_the_buffer_tail(vm):
    c = vm.chunk
    arena = vm.arena(8 * c)
    buf = arena.allocate(7 * c // 2, jnp.uint8)  # 3.5 chunks
    assert buf.commit() == 4 * c
    assert buf.decommit(1, 2 * c - 1) == 0  # no chunk lies fully inside
    assert buf.decommit(c - 1, 2 * c + 1) == c  # only chunk 1 lies fully inside
    vm.assert_backed(arena, [chunk_range(buf, 0, 1), chunk_range(buf, 2, 4)])
    assert buf.decommit(3 * c + 1, buf.nbytes) == 0  # tail chunk still holds [3c, 3c+1)
    assert buf.decommit(3 * c, buf.nbytes) == c  # a range reaching the end frees the tail
    vm.assert_backed(arena, [chunk_range(buf, 0, 1), chunk_range(buf, 2, 3)])
    assert buf.decommit() == 2 * c
    vm.assert_backed(arena, [])


def test_commit_and_decommit_are_idempotent_and_count(vm):
    c = vm.chunk
    arena = vm.arena(8 * c)
    buf = arena.allocate(4 * c, jnp.uint8)
    s0 = arena.stats()
    assert buf.commit(0, 3 * c) == 3 * c
    s1 = arena.stats()
    assert buf.commit(0, 3 * c) == 0 and buf.commit(c, 2 * c) == 0
    assert stable_stats(arena) == {k: s1[k] for k in stable_stats(arena)}  # no-ops
    assert s1["commit_calls"] == s0["commit_calls"] + 1
    assert s1["chunks_created"] == s0["chunks_created"] + 3
    assert s1["set_access_calls"] == s0["set_access_calls"] + 1  # one contiguous run
    assert buf.decommit(0, 3 * c, wait=True) == 3 * c  # GPU: released in the background
    assert buf.decommit(0, 3 * c) == 0
    s2 = arena.stats()
    assert s2["decommit_calls"] == 1 and s2["chunks_released"] == 3
    assert s2["backed_bytes"] == 0 and s2["peak_backed_bytes"] == 3 * c
    vm.assert_backed(arena, [])


def test_overlapping_ranges(vm):
    c = vm.chunk
    arena = vm.arena(16 * c)
    a = arena.allocate(6 * c, jnp.uint8)
    b = arena.allocate(3 * c, jnp.uint8)
    assert a.commit(0, 3 * c) == 3 * c
    assert a.commit(2 * c, 5 * c) == 2 * c  # overlaps the backed part
    vm.assert_backed(arena, [chunk_range(a, 0, 5)])
    assert a.decommit(c, 4 * c) == 3 * c
    vm.assert_backed(arena, [chunk_range(a, 0, 1), chunk_range(a, 4, 5)])
    # One all-or-nothing call with ranges overlapping each other and what is backed.
    added = arena._handle.commit_ranges(
        [
            (a.id, 0, 2 * c),
            (a.id, c + 1, 3 * c),
            (b.id, 0, c),
            (a.id, 2 * c, 3 * c),
            (b.id, 1, 2 * c),
        ]
    )
    assert added == 4 * c  # a: chunks 1, 2; b: chunks 0, 1
    vm.assert_backed(arena, [chunk_range(a, 0, 3), chunk_range(a, 4, 5), chunk_range(b, 0, 2)])
    runs = arena.stats()["set_access_calls"]
    assert a.commit() == 2 * c  # chunks 3 and 5: two runs
    assert arena.stats()["set_access_calls"] == runs + 2  # access is set once per run
    assert b.commit() == c
    vm.assert_backed(arena, [chunk_range(a, 0, 6), chunk_range(b, 0, 3)])


def test_data_survives_neighbouring_commits_and_decommits(vm):
    c = vm.chunk
    arena = vm.arena(16 * c)
    buf = arena.allocate(8 * c, jnp.uint8)
    other = arena.allocate(2 * c, jnp.uint8)
    buf.commit(2 * c, 6 * c)
    data = pattern(2 * c, seed=1)
    write_bytes(buf, 3 * c, data)  # chunks 3 and 4
    buf.commit(0, 2 * c)
    buf.commit(6 * c, 8 * c)
    other.commit()
    buf.decommit(2 * c, 3 * c)
    buf.decommit(5 * c, 6 * c)
    other.decommit()
    buf.commit(2 * c, 3 * c)
    got = read_bytes(buf)
    np.testing.assert_array_equal(got[3 * c : 5 * c], data)
    assert not got[: 3 * c].any() and not got[5 * c :].any()
    vm.assert_backed(arena, [chunk_range(buf, 0, 5), chunk_range(buf, 6, 8)])


def test_unbacked_memory_reads_zeros(vm):
    c = vm.chunk
    arena = vm.arena(8 * c)
    buf = arena.allocate((4 * c // 4,), jnp.float32)
    buf.commit(c, 2 * c)  # one backed chunk among unbacked ones
    x = buf.array
    assert float(jnp.abs(x).sum()) == 0.0
    assert not read_bytes(buf).any()


def test_decommitted_data_reads_zeros_after_recommit(vm):
    c = vm.chunk
    arena = vm.arena(8 * c)
    buf = arena.allocate(4 * c, jnp.uint8)
    buf.commit()
    write_bytes(buf, 0, pattern(4 * c, seed=2))
    assert read_bytes(buf).all()
    buf.decommit(c, 3 * c)
    got = read_bytes(buf)
    assert not got[c : 3 * c].any() and got[:c].all() and got[3 * c :].all()
    buf.commit(c, 3 * c)  # new physical memory must not show old (or foreign) bytes
    got = read_bytes(buf)
    assert not got[c : 3 * c].any(), "recommitted memory is not zero"


def test_full_array_ops_over_a_mostly_unbacked_1gib_buffer(vm):
    gib = 1 << 30
    arena = vm.arena(gib)
    n = gib // 4
    buf = arena.allocate((n,), jnp.int32)
    c = arena.chunk_bytes
    # Back three chunks (first, middle, last) and put a few known values there.
    spots = {0: 5, (gib // 2) // 4: 7, n - 1: 11}
    for i, value in spots.items():
        buf.commit(i * 4, i * 4 + 4)
        write_bytes(buf, i * 4, np.array([value], np.int32))
    assert arena.backed_bytes == 3 * c
    x = buf.array
    total = sum(spots.values())
    assert int(jnp.sum(x)) == total
    assert int(jnp.max(x)) == 11
    assert int(jnp.count_nonzero(x)) == 3


# -- chunk size knob -----------------------------------------------------------------------


@pytest.mark.parametrize("pages", [1, 3, 16])
def test_chunk_bytes_knob(host_vm, pages):
    page = 4096
    c = pages * page
    arena = host_vm.arena(64 * page, chunk_bytes=c)
    assert arena.chunk_bytes == c and arena.granularity == page
    buf = arena.allocate(20 * page, jnp.uint8)
    assert buf.offset % c == 0
    assert buf.commit(page + 1, page + 2) == c  # one byte costs one chunk
    first = (page + 1) // c
    host_vm.assert_backed(arena, [(buf.offset + first * c, buf.offset + (first + 1) * c)])


# -- free and reuse ----------------------------------------------------------------------------


def test_free_releases_memory_and_placement(vm):
    c = vm.chunk
    arena = vm.arena(4 * c)
    a = arena.allocate(2 * c, jnp.uint8)
    b = arena.allocate(2 * c, jnp.uint8)
    a.commit()
    b.commit()
    write_bytes(b, 0, pattern(2 * c, seed=3))
    with pytest.raises(jax_vmm.ReservationFullError):
        arena.allocate(c, jnp.uint8)
    a.free()
    vm.assert_backed(arena, [chunk_range(b, 0, 2)])
    assert arena.stats()["num_buffers"] == 1
    a2 = arena.allocate(2 * c, jnp.uint8)  # the freed range is reused
    assert a2.offset == a.offset and a2.backed_bytes == 0
    assert not read_bytes(a2).any()
    np.testing.assert_array_equal(read_bytes(b), pattern(2 * c, seed=3))


# -- close semantics ---------------------------------------------------------------------------


def test_close_releases_everything_and_refuses_work(vm):
    c = vm.chunk
    arena = vm.arena(8 * c)
    buf = arena.allocate(4 * c, jnp.uint8)
    buf.commit(0, 3 * c)
    arena.close()
    assert arena.closed and arena.stats()["closed"]
    assert arena.backed_bytes == 0 and buf.backed_bytes == 0
    o = vm.oracle(arena)
    if o is not None:
        o.assert_released()  # physical memory gone, the reservation still reads zeros
    calls = {
        "allocate": lambda: arena.allocate(8, jnp.uint8),
        "commit": lambda: buf.commit(),
        "decommit": lambda: buf.decommit(),
        "array": lambda: buf.array,
        "view": lambda: buf.view((8,), jnp.uint8),
        "free": lambda: buf.free(),
    }
    for call in calls.values():
        with pytest.raises(jax_vmm.ArenaClosedError, match="closed"):
            call()
    arena.close()  # idempotent


def test_views_outlive_close_and_read_zeros(vm):
    c = vm.chunk
    arena = vm.arena(8 * c)
    buf = arena.allocate((2 * c // 4,), jnp.float32)
    buf.commit()
    write_bytes(buf, 0, np.ones(2 * c // 4, np.float32))
    x = buf.array
    f = jax.jit(lambda a: a.sum())
    assert float(f(x)) == 2 * c // 4
    arena.close()
    for _ in range(2):  # the view keeps working, reading zeros
        assert float(f(x)) == 0.0
        assert float(jnp.max(x + 1)) == 1.0
    assert x.unsafe_buffer_pointer() == buf.address


def test_context_manager_closes(vm):
    with vm.arena(4 * vm.chunk) as arena:
        arena.allocate(vm.chunk, jnp.uint8).commit()
        assert arena.backed_bytes == vm.chunk
    assert arena.closed and arena.backed_bytes == 0


def test_arena_is_destroyed_after_its_last_view(cpu_device):
    # Not through the harness: it would keep the arena alive.
    before = mo.jax_vmm_memfds()
    arena = jax_vmm.Arena(1 << 20, device=cpu_device)
    oracle = mo.HostOracle(
        arena.base, arena.reserved_bytes, mo.MemfdProbe.between(before, mo.jax_vmm_memfds())
    )
    buf = arena.allocate((1 << 16,), jnp.float32)
    buf.commit()
    write_bytes(buf, 0, np.full(1 << 16, 2, np.float32))
    view = buf.array
    del arena, buf
    gc.collect()
    # The view holds the arena: memory and reservation are intact, data readable.
    assert oracle.probe.is_open()
    oracle.assert_backed_exactly([(0, 1 << 18)])
    assert float(jnp.sum(view)) == 2 * (1 << 16)
    del view
    gc.collect()
    oracle.assert_gone()


def test_closed_arena_is_destroyed_after_its_last_view(cpu_device):
    before = mo.jax_vmm_memfds()
    arena = jax_vmm.Arena(1 << 20, device=cpu_device)
    oracle = mo.HostOracle(
        arena.base, arena.reserved_bytes, mo.MemfdProbe.between(before, mo.jax_vmm_memfds())
    )
    buf = arena.allocate((1 << 10,), jnp.float32)
    buf.commit()
    views = [buf.array, buf.view((4096,), jnp.uint8)]
    arena.close()
    oracle.assert_released()
    del arena, buf
    gc.collect()
    assert oracle.probe.is_open()  # still reserved: the views may be read
    assert all(float(jnp.sum(v)) == 0 for v in views)
    views.pop()
    gc.collect()
    assert oracle.probe.is_open()
    views.clear()
    gc.collect()
    oracle.assert_gone()


# -- fault injection: rollback ---------------------------------------------------------------


def _multi_run_setup(vm):
    """Two buffers with some chunks backed and holding data, and the commit to break:
    12 new chunks in 5 contiguous runs (so 12 creates, 12 maps, 5 set_access calls)."""
    c = vm.chunk
    arena = vm.arena(32 * c)
    a = arena.allocate(16 * c, jnp.uint8, name="a")
    b = arena.allocate(8 * c, jnp.uint8, name="b")
    for buf, chunk in ((a, 3), (a, 4), (a, 9), (b, 1)):
        buf.commit(chunk * c, chunk * c + 1)
        write_bytes(buf, chunk * c, pattern(c, seed=chunk))
    ranges = [(a.id, 0, 12 * c - 5), (b.id, 1, 4 * c)]
    # a: runs [0,3), [5,9), [10,12); b: runs [0,1), [2,4)
    after = [chunk_range(a, 0, 12), chunk_range(b, 0, 4)]
    return arena, (a, b), ranges, after


FAULTS = (
    [("create", n) for n in (1, 2, 7, 12)]
    + [("map", n) for n in (1, 2, 7, 12)]
    + [("set_access", n) for n in (1, 2, 3, 5)]
)


@pytest.mark.parametrize("op,nth", FAULTS)
def test_failed_commit_leaves_everything_as_before(vm, faults, op, nth):
    arena, bufs, ranges, after = _multi_run_setup(vm)
    before = vm.snapshot(arena, bufs)
    s0 = arena.stats()
    injected0 = faults.injected(arena)
    faults.arm(arena, op, nth)
    with pytest.raises(InjectedFault, match=op):
        arena._handle.commit_ranges(ranges)
    s1 = arena.stats()
    assert faults.injected(arena) == injected0 + 1  # the fault did fire
    assert s1["failed_commits"] == s0["failed_commits"] + 1
    assert vm.snapshot(arena, bufs) == before
    # The hook is spent: the same commit now succeeds and data is intact.
    assert arena._handle.commit_ranges(ranges) == 12 * vm.chunk
    vm.assert_backed(arena, after)
    c = vm.chunk
    for buf, chunk in ((bufs[0], 3), (bufs[0], 4), (bufs[0], 9), (bufs[1], 1)):
        np.testing.assert_array_equal(
            read_bytes(buf, chunk * c, chunk * c + c), pattern(c, seed=chunk)
        )


@pytest.mark.parametrize("op", ["create", "map", "set_access"])
def test_failed_single_buffer_commit_rolls_back(vm, faults, op):
    c = vm.chunk
    arena = vm.arena(8 * c)
    buf = arena.allocate(6 * c, jnp.uint8)
    buf.commit(2 * c, 3 * c)
    before = vm.snapshot(arena, [buf])
    faults.arm(arena, op, 2)
    with pytest.raises(InjectedFault):
        buf.commit()
    assert vm.snapshot(arena, [buf]) == before
    assert buf.commit() == 5 * c
    vm.assert_backed(arena, [chunk_range(buf, 0, 6)])


def test_fault_armed_past_the_last_call_does_not_fire(vm, faults):
    arena, bufs, ranges, after = _multi_run_setup(vm)
    faults.arm(arena, "create", 13)  # this commit makes 12
    assert arena._handle.commit_ranges(ranges) == 12 * vm.chunk
    assert faults.injected(arena) == 0
    faults.disarm(arena)
    bufs[0].commit()  # would have been the 13th create
    assert faults.injected(arena) == 0


def test_the_rollback_check_sees_a_leaked_chunk(host_vm, faults):
    """The snapshot comparison above is sensitive to what a broken rollback leaves:
    a fault at map #5 strikes after chunks 0..3 were created and mapped. Backing exactly
    those chunks (what a rollback that forgot them would leave) must fail the check."""
    c = host_vm.chunk
    arena = host_vm.arena(8 * c)
    buf = arena.allocate(6 * c, jnp.uint8)
    before = host_vm.snapshot(arena, [buf])
    faults.arm(arena, "map", 5)
    with pytest.raises(InjectedFault):
        buf.commit()
    assert host_vm.snapshot(arena, [buf]) == before
    buf.commit(0, 4 * c)  # the state at the moment of the fault
    leaked = host_vm.snapshot(arena, [buf])
    assert leaked["oracle"] != before["oracle"]
    assert mo.ranges_of(leaked["oracle"][0], mo.BACKED) == [chunk_range(buf, 0, 4)]
    assert leaked["oracle"][1] == before["oracle"][1] + 4 * c  # memfd holds 4 chunks more


@pytest.mark.parametrize("op", ["create", "map", "set_access"])
def test_rollback_protection_is_what_keeps_the_state(host_vm, faults, op):
    """With the rollback's release and unmap calls broken (the testing layer's
    fault-injecting driver), the same failed commit leaves chunks behind and the checks
    of the rollback tests fail."""
    c = host_vm.chunk
    arena = host_vm.arena(8 * c)
    buf = arena.allocate(6 * c, jnp.uint8)
    before = host_vm.snapshot(arena, [buf])
    faults.break_release(arena)
    try:
        faults.arm(arena, op, 3 if op != "set_access" else 1)
        with pytest.raises(InjectedFault):
            buf.commit()
    finally:
        faults.disarm(arena)
    after = host_vm.snapshot(arena, [buf])
    # Not `pytest.raises(AssertionError)` around `==`: pytest then diffs the two snapshots'
    # contents, quadratic in their length (with poisoned fresh memory it ran for minutes).
    assert after != before, "the broken rollback left the state as it was"
    # Physical memory leaked into the memfd: this is what the rollback tests guard.
    assert after["oracle"][1] > before["oracle"][1]


# -- out of memory ------------------------------------------------------------------------------


def test_out_of_memory_raises_memory_error_and_changes_nothing(vm, faults):
    arena, bufs, ranges, _ = _multi_run_setup(vm)
    before = vm.snapshot(arena, bufs)
    faults.arm(arena, "create", 3, out_of_memory=True)
    with pytest.raises(MemoryError) as info:
        arena._handle.commit_ranges(ranges)
    e = info.value
    assert isinstance(e, jax_vmm.OutOfMemoryError)
    msg = str(e)
    assert e.requested_bytes > 0 and f"{e.requested_bytes} bytes" in msg
    assert f"{e.free_bytes} bytes" in msg and "free" in msg
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" in msg and "XLA_PYTHON_CLIENT_MEM_FRACTION" in msg
    assert "Nothing was committed" in msg
    assert vm.snapshot(arena, bufs) == before
    assert arena._handle.commit_ranges(ranges) == 12 * vm.chunk


def test_out_of_memory_through_buffer_commit(vm, faults):
    c = vm.chunk
    arena = vm.arena(8 * c)
    buf = arena.allocate(4 * c, jnp.uint8, name="kcache")
    faults.arm(arena, "create", 1, out_of_memory=True)
    with pytest.raises(jax_vmm.OutOfMemoryError):
        buf.commit()
    assert buf.backed_bytes == 0 and arena.stats()["failed_commits"] == 1
    vm.assert_backed(arena, [])


def test_out_of_memory_names_the_buffer_and_the_bytes_asked(vm, faults):
    c = vm.chunk
    arena = vm.arena(8 * c)
    buf = arena.allocate(4 * c, jnp.uint8, name="kcache")
    faults.arm(arena, "create", 2, out_of_memory=True)
    with pytest.raises(jax_vmm.OutOfMemoryError) as info:
        buf.commit()
    assert "'kcache'" in str(info.value)
    assert info.value.requested_bytes == 4 * c


@pytest.mark.parametrize("env", ["1", None])
def test_a_host_arena_reads_zeros_whatever_the_environment_says(monkeypatch, env):
    """The host driver has no deferred reservation: its unbacked pages read zeros always,
    and its stats say so."""
    if env is None:
        monkeypatch.delenv("JAX_VMM_DEFER_ZERO_READS", raising=False)
    else:
        monkeypatch.setenv("JAX_VMM_DEFER_ZERO_READS", env)
    with jax_vmm.Arena(8 << 20, device=jax.devices("cpu")[0]) as arena:
        assert arena.stats()["unbacked_reads_zero"]
        buf = arena.allocate((8 << 20,), jnp.uint8)
        assert not np.asarray(raw_bytes(buf)).any()


def test_a_commit_past_the_hosts_memory_is_refused_whole(host_vm):
    """On the host, a commit past the memory the machine has available raises
    OutOfMemoryError before anything is created: fallocate of a memfd does not fail
    there, the kernel's OOM killer ends the process instead (seen with a 1 TiB scratch
    reserve). The machine is pretended to have 8 chunks available (testing switch): 16
    are refused, nothing committed; 4 go through."""
    c = host_vm.chunk
    a = host_vm.arena(64 * c)
    buf = a.allocate((16 * c,), jnp.uint8, name="big")
    with jax_vmm.testing.host_memory_available(8 * c):
        with pytest.raises(jax_vmm.OutOfMemoryError, match="'big'.*out of memory committing") as e:
            buf.commit()
        assert e.value.requested_bytes == 16 * c
        host_vm.assert_backed(a, [])
        assert buf.commit(0, 4 * c) == 4 * c
    host_vm.assert_backed(a, [chunk_range(buf, 0, 4)])
    buf.commit()  # the machine's real memory holds 16 chunks


def test_allocate_with_dtype_none_is_jaxs_default_float(vm):
    """dtype=None means what it means to jnp.zeros (float32 with x64 off), so the buffer's
    array is a view (NumPy's float64 made a buffer that .array then refused)."""
    a = vm.arena(4 * vm.chunk)
    buf = a.allocate((4,), None)
    assert buf.dtype == np.dtype(jnp.zeros(1).dtype)
    buf.commit()
    assert buf.array.dtype == jnp.zeros(1).dtype
    with pytest.raises(TypeError, match="dtype complex128 cannot back an arena buffer"):
        a.put(np.ones(2, np.complex128))


def test_poisoned_fresh_memory_reads_nan_except_where_zero_filled():
    """jax_vmm.testing.fresh_memory_poisoned(): the host's committed memory holds 0xFF
    bytes (NaN) as a GPU's may hold anything, and a zero-filling arena still reads zeros
    (the host says its fresh memory is not zero then). Outside it, zeros again."""
    # On the host, whatever the default device: the switch poisons the host's memory.
    kw = dict(num_layers=1, num_kv_heads=2, head_dim=8, max_tokens=64, max_seqs=2,
              dtype=jnp.float32, device=jax.devices("cpu")[0])  # fmt: skip
    with jax_vmm.testing.fresh_memory_poisoned():
        raw, zeroed = jax_vmm.kv_arena(**kw), jax_vmm.kv_arena(**kw, zero_fill=True)
        raw.ensure(4, 0)
        zeroed.ensure(4, 0)
    assert np.isnan(np.asarray(raw.k[0])[0, :4]).all()
    assert not np.asarray(zeroed.k[0])[0, :4].any()
    after = jax_vmm.kv_arena(**kw)  # as before the block (a poisoned run: NaN)
    after.ensure(4, 0)
    poisoned_run = jax_vmm.testing._fresh_memory_poisoned
    assert np.isnan(np.asarray(after.k[0])[0, :4]).all() == poisoned_run
    assert poisoned_run or not np.asarray(after.k[0])[0, :4].any()
    for kv in (raw, zeroed, after):
        kv.close()
