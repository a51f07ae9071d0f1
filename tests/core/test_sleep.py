"""Sleep and wake (docs/sleep.md): all physical memory goes back and comes back at the
same addresses, contents bit-exact; arena.put() lets weights sleep too.

Memory is checked by the oracle (host: /proc/self/maps and the memfd's allocated blocks;
GPU: the CUDA driver through cuda-python), never by the arena's counters alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
import maps_oracle as mo
from conftest import chunk_range, chunk_states, pattern, raw_bytes, write_bytes
from jax_vmm.testing import InjectedFault

H, D = 2, 64  # bfloat16: 256 bytes per token per buffer


def _tpc(vm) -> int:
    return vm.chunk // (H * D * 2)


def _filled_arena(vm, **kw):
    """An arena with backed, partly backed and never backed buffers, and a parked chunk
    (a release inside a larger allocation), all filled with distinct bytes."""
    c = vm.chunk
    arena = vm.arena(32 * c, handle_bytes=4 * c, **kw)
    a = arena.allocate((8 * c,), jnp.uint8, name="a")
    b = arena.allocate((3 * c + 100,), jnp.uint8, name="b")
    arena.allocate((4 * c,), jnp.uint8, name="never")
    a.commit(0, 6 * c)  # two allocations: [0, 4c) and [4c, 6c)
    b.commit()
    write_bytes(a, 0, pattern(6 * c, seed=1))
    write_bytes(b, 0, pattern(b.nbytes, seed=2))
    a.decommit(c, 2 * c, wait=True)  # chunk 1 parked inside the first allocation
    backed = [chunk_range(a, 0, 1), chunk_range(a, 2, 6), chunk_range(b, 0, 4)]
    return arena, a, b, backed


def _contents(a, b, c):
    return raw_bytes(a, 0, c), raw_bytes(a, 2 * c, 6 * c), raw_bytes(b)


def test_sleep_gives_all_memory_back_and_wake_restores_it_bit_exact(vm):
    c = vm.chunk
    arena, a, b, backed = _filled_arena(vm)
    before = _contents(a, b, c)
    states = (chunk_states(a), chunk_states(b))
    addresses = (a.address, b.address, arena.base)
    arena.sleep()
    assert arena.asleep
    s = arena.stats()
    assert (s["backed_bytes"], s["held_bytes"]) == (0, 0)
    assert s["sleep_image_bytes"] == 9 * c  # what was backed; the parked chunk is dropped
    assert chunk_states(a) == (False,) * 8 and chunk_states(b) == (False,) * 4
    o = vm.oracle(arena)
    if o is not None:
        o.assert_released()  # nothing mapped, no physical memory: the oracle says so
    arena.wake()
    assert not arena.asleep
    assert (a.address, b.address, arena.base) == addresses
    assert (chunk_states(a), chunk_states(b)) == states
    vm.assert_backed(arena, backed)
    for got, want in zip(_contents(a, b, c), before):
        np.testing.assert_array_equal(got, want)
    assert arena.stats()["sleep_image_bytes"] == 0


def test_views_read_zeros_while_asleep_and_the_data_after_wake(vm):
    c = vm.chunk
    arena, a, b, _ = _filled_arena(vm)
    view = a.array  # a live view across the whole cycle

    def read():  # through the device each time (a GPU array caches its first host copy)
        return np.asarray(jnp.copy(view))

    want = read()
    arena.sleep()
    assert not read().any()  # the same view, nothing backed: zeros, no fault
    arena.wake()
    got = read()
    np.testing.assert_array_equal(got[:c], want[:c])
    np.testing.assert_array_equal(got[2 * c : 6 * c], want[2 * c : 6 * c])


@pytest.mark.parametrize("zero_fill", [True, False])
def test_discarding_sleep_backs_the_same_chunks_without_contents(vm, zero_fill):
    c = vm.chunk
    arena, a, b, backed = _filled_arena(vm, zero_fill=zero_fill)
    arena.sleep(keep="discard")
    assert arena.stats()["sleep_image_bytes"] == 0 and arena.stats()["held_bytes"] == 0
    arena.wake()
    vm.assert_backed(arena, backed)
    if zero_fill:
        assert not any(x.any() for x in _contents(a, b, c))


def test_asleep_arena_refuses_commits_and_releases(vm):
    arena, a, b, _ = _filled_arena(vm)
    arena.sleep()
    calls = [
        lambda: a.commit(),
        lambda: a.decommit(),
        lambda: b.free(),
        arena.sleep,
        lambda: arena.put(np.zeros(8, np.float32)),
    ]
    for call in calls:
        with pytest.raises(jax_vmm.ArenaAsleepError, match="asleep.*wake"):
            call()
    kv = vm.kv(num_layers=1, num_kv_heads=H, head_dim=D, max_tokens=2 * _tpc(vm))
    kv.ensure(5)
    kv.sleep()
    for call in (lambda: kv.ensure(7), lambda: kv.ensure(3 * _tpc(vm) // 2), kv.release):
        with pytest.raises(jax_vmm.ArenaAsleepError):
            call()
    kv.wake()
    assert kv.ensure(7) == 0 and kv.backed_tokens() == _tpc(vm)
    arena.wake()
    with pytest.raises(ValueError, match="not asleep"):
        arena.wake()
    with pytest.raises(ValueError, match="keep must be 'host' or 'discard'"):
        arena.sleep(keep="disk")
    arena.sleep()
    arena.close()  # closing an asleep arena drops the host copy
    assert arena.stats()["sleep_image_bytes"] == 0
    with pytest.raises(jax_vmm.ArenaClosedError):
        arena.wake()


def test_a_step_compiled_before_sleep_runs_while_asleep_and_after_wake(vm):
    """The same executable: before sleep it writes and reads the cache; while asleep its
    writes are dropped and counted and its reads see zeros; after wake it writes and
    reads correctly again, and the tokens written before sleep are back."""
    tpc = _tpc(vm)
    B = 2
    kv = vm.kv(
        num_layers=1, num_kv_heads=H, head_dim=D, max_tokens=tpc, max_seqs=B, dtype=jnp.float32
    )
    for q in range(B):
        kv.ensure(tpc, seq=q)
    dest = kv.dest(0)

    def step(k, v, pos, x):
        slots = jnp.arange(B, dtype=jnp.int32) * tpc + pos
        new = (x * (pos.astype(jnp.float32) + 1)[:, None, None]).astype(jnp.float32)
        st = jax_vmm.kv_write_through(k, v, new, -new, slots, dest=dest)
        lengths = pos + 1 + 0 * st[0]  # ordered after the write
        q = jnp.ones((B, H, D), jnp.float32)
        return jax_vmm.decode_attention(q, k, v, lengths), st

    k, v = kv.k[0], kv.v[0]
    x = jnp.asarray(np.random.default_rng(0).normal(size=(B, H, D)).astype(np.float32))
    pos = jnp.asarray([3, 5], jnp.int32)
    exe = jax.jit(step).lower(k, v, pos, x).compile()
    out, st = exe(k, v, pos, x)
    assert (np.asarray(st) == jax_vmm.ops.WRITTEN).all()
    before = [np.asarray(kv.k[0][q, p]) for q, p in ((0, 3), (1, 5))]
    kv.check()

    kv.sleep()
    out_asleep, st_asleep = exe(k, v, pos + 1, x)
    # Not ensured while asleep (the table reads 0), checked before the backing.
    assert (np.asarray(st_asleep) == jax_vmm.ops.DROPPED_NOT_ENSURED).all()
    assert not np.asarray(out_asleep).any()  # attention over zeros
    assert kv.dropped_writes() == 2 * B  # K and V of each token, counted
    with pytest.raises(jax_vmm.OutOfBoundsWrite):
        kv.check()

    kv.wake()
    after = [np.asarray(kv.k[0][q, p]) for q, p in ((0, 3), (1, 5))]
    for got, want in zip(after, before):
        np.testing.assert_array_equal(got, want)
    out2, st2 = exe(k, v, pos + 1, x)
    assert (np.asarray(st2) == jax_vmm.ops.WRITTEN).all()
    for q, p in ((0, 4), (1, 6)):
        np.testing.assert_allclose(np.asarray(kv.k[0][q, p]), np.asarray(x[q]) * (p + 1))
    kv.check()


def _arena_files(probe: mo.MemfdProbe) -> tuple:
    """Whether the arena's memfd is still open, the jax_vmm memfds open beyond it, and
    every mapping of its memfd anywhere in the process."""
    others = {fd for fd, ino in mo.jax_vmm_memfds().items() if ino != probe.inode}
    maps = sorted((m.start, m.end, m.perms) for m in mo.mappings_of_inode(probe.inode))
    return probe.is_open(), others, maps


def _anonymous_bytes() -> int:
    """Bytes of private anonymous read-write mappings (where host staging memory lives)."""
    return sum(
        m.end - m.start
        for m in mo.read_maps()
        if m.inode == 0 and not m.path and m.perms.startswith("rw")
    )


def test_a_hundred_cycles_leak_nothing(host_vm):
    """Host driver: 100 sleep/wake cycles; no file descriptor or memfd mapping is left
    behind, the memfd holds exactly the backed bytes awake and none asleep, the host
    staging memory does not grow, contents bit-exact."""
    vm = host_vm
    c = vm.chunk
    arena, a, b, backed = _filled_arena(vm)
    want = _contents(a, b, c)
    o = vm.oracle(arena)
    block = 2 << 20  # the staging block of this small image (arena_transfer.cc)
    for cycle in range(100):
        arena.sleep()
        if cycle in (0, 99):
            o.assert_released()
        arena.wake()
        if cycle == 2:
            files, anon = _arena_files(o.probe), _anonymous_bytes()
    is_open, others, maps = _arena_files(o.probe)
    assert is_open and maps == files[2]
    assert others <= files[1], "sleep/wake opened a file descriptor and kept it"
    # A staging block kept per cycle would add 97 blocks; other threads' allocations add
    # far less than that.
    assert _anonymous_bytes() - anon < 97 * block
    vm.assert_backed(arena, backed)
    for got, w in zip(_contents(a, b, c), want):
        np.testing.assert_array_equal(got, w)
    arena.free_host_cache()
    assert arena.stats()["host_cached_bytes"] == 0


@pytest.mark.parametrize(
    "op,nth",
    [
        ("create", 1),
        ("create", 2),
        ("map", 2),
        ("set_access", 2),
        ("copy_to_device", 1),
        ("copy_to_device", 3),
    ],
)
def test_a_failed_wake_stays_asleep_and_intact(vm, faults, op, nth):
    c = vm.chunk
    arena, a, b, backed = _filled_arena(vm)
    want = _contents(a, b, c)
    arena.sleep()
    image = arena.stats()["sleep_image_bytes"]
    faults.arm(arena, op, nth)
    with pytest.raises(InjectedFault):
        arena.wake()
    faults.disarm(arena)
    assert arena.asleep and arena.stats()["sleep_image_bytes"] == image
    assert arena.stats()["held_bytes"] == 0
    o = vm.oracle(arena)
    if o is not None:
        o.assert_released()
    arena.wake()  # the second wake succeeds
    vm.assert_backed(arena, backed)
    for got, w in zip(_contents(a, b, c), want):
        np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("op,nth", [("host_alloc", 1), ("copy_to_host", 1), ("copy_to_host", 2)])
def test_a_failed_sleep_leaves_the_arena_awake_and_intact(vm, faults, op, nth):
    c = vm.chunk
    arena, a, b, backed = _filled_arena(vm)
    want = _contents(a, b, c)
    faults.arm(arena, op, nth)
    with pytest.raises(InjectedFault):
        arena.sleep()
    faults.disarm(arena)
    assert not arena.asleep
    vm.assert_backed(arena, backed, held=backed + [chunk_range(a, 1, 2)])
    for got, w in zip(_contents(a, b, c), want):
        np.testing.assert_array_equal(got, w)


def test_the_leak_check_sees_a_sleep_that_keeps_its_memory(host_vm, faults):
    """With the driver's release broken (testing layer), sleep keeps physical memory and
    the oracle check above fails: it would catch the leak vLLM #36651 reports."""
    vm = host_vm
    arena, a, b, backed = _filled_arena(vm)
    faults.break_release(arena)
    arena.sleep()
    with pytest.raises(AssertionError):
        vm.oracle(arena).assert_released()
    faults.disarm(arena)


def test_sleep_finishes_deferred_releases(vm, faults):
    c = vm.chunk
    arena = vm.arena(16 * c)
    faults.defer_reclaim(arena)
    buf = arena.allocate((4 * c,), jnp.uint8)
    buf.commit()
    with faults.hold_device(arena):
        buf.decommit(0, 2 * c)
        assert arena.stats()["retired_bytes"] == 2 * c
    arena.sleep()
    assert arena.stats()["held_bytes"] == 0
    arena.wake()
    vm.assert_backed(arena, [chunk_range(buf, 2, 4)])


# -- put ----------------------------------------------------------------------------------


def test_put_copies_into_the_arena_and_sleeps_with_it(vm):
    arena = vm.arena(64 * vm.chunk)
    w_np = np.arange(3 * 1000, dtype=np.float32).reshape(3, 1000) / 7
    w_jax = jax.device_put(
        jnp.asarray(np.random.default_rng(1).normal(size=(17, 33)), jnp.bfloat16), vm.device
    )
    v1 = arena.put(w_np, name="w1")
    v2 = arena.put(w_jax)
    assert v1.shape == (3, 1000) and v1.dtype == jnp.float32 and v2.dtype == jnp.bfloat16
    b1, b2 = arena.buffers[-2:]
    assert b1.name == "w1" and v1.unsafe_buffer_pointer() == b1.address  # zero-copy
    np.testing.assert_array_equal(np.asarray(v1), w_np)
    np.testing.assert_array_equal(np.asarray(v2).view(np.uint16), np.asarray(w_jax).view(np.uint16))
    f = jax.jit(lambda a, b: a.sum() + b.astype(jnp.float32).sum()).lower(v1, v2).compile()
    want = float(f(v1, v2))
    arena.sleep()
    assert arena.stats()["held_bytes"] == 0
    arena.wake()
    assert float(f(v1, v2)) == want  # the program compiled before sleep, the same views


def test_put_stores_the_dtype_jax_reads(vm):
    """With x64 off JAX reads int64/float64 as int32/float32: the buffer must hold that,
    so the result is a view of it (zero-copy, sleeps with the arena), not a converted
    copy beside an unread 64-bit buffer."""
    if jax.config.jax_enable_x64:
        pytest.skip("x64 is on: 64-bit dtypes are kept")
    arena = vm.arena(8 * vm.chunk)
    for x, want in (
        (np.arange(6, dtype=np.int64) - 3, np.int32),
        (np.linspace(0, 1, 6), np.float32),
        (np.arange(6, dtype=np.uint64), np.uint32),
    ):
        view = arena.put(x)
        buf = arena.buffers[-1]
        assert view.dtype == want and buf.dtype == want and buf.nbytes == 6 * 4
        assert view.unsafe_buffer_pointer() == buf.address  # a view of the buffer
        np.testing.assert_array_equal(np.asarray(view), x.astype(want))
    held = arena.stats()["held_bytes"]
    with pytest.raises(ValueError, match="does not fit int32, the dtype JAX uses"):
        arena.put(np.array([2**40], np.int64))
    assert arena.stats()["held_bytes"] == held  # nothing left behind


def test_byte_order_and_64_bit_views_are_never_misread(vm):
    """A big-endian array is put in native order (its raw bytes were read as native:
    1.5 became 6.9e-41); a non-native dtype cannot back a buffer; with x64 off a 64-bit
    view is refused (JAX would hand back a converted copy, not the arena's memory)."""
    arena = vm.arena(8 * vm.chunk)
    for x in (np.array([1.5, 2.5], ">f4"), np.array([1, 2], ">i4")):
        view = arena.put(x)
        np.testing.assert_array_equal(np.asarray(view), x)
        assert view.unsafe_buffer_pointer() == arena.buffers[-1].address
    held = arena.stats()["held_bytes"]
    with pytest.raises(TypeError, match="not in this machine's byte order"):
        arena.allocate((2,), ">f4")
    assert arena.stats()["held_bytes"] == held
    if not jax.config.jax_enable_x64:
        buf = arena.allocate((4,), np.float64)
        buf.commit()
        with pytest.raises(TypeError, match="a float64 view needs jax_enable_x64"):
            buf.array  # noqa: B018
        assert buf.view((8,), np.float32).unsafe_buffer_pointer() == buf.address


def test_put_rejects_what_it_cannot_hold(vm):
    arena = vm.arena(8 * vm.chunk)
    with pytest.raises(ValueError, match="at least one dimension"):
        arena.put(np.float32(3))
    with pytest.raises(ValueError, match="at least one dimension and one element"):
        arena.put(np.zeros((0, 4), np.float32))
    with pytest.raises(TypeError, match="cannot back an arena buffer"):
        arena.put(np.zeros(4, np.complex64))
    with pytest.raises(jax_vmm.ReservationFullError):
        arena.put(np.zeros(9 * vm.chunk, np.uint8))
    assert arena.stats()["held_bytes"] == 0  # nothing left behind by the failures
    arena.close()
    with pytest.raises(jax_vmm.ArenaClosedError):
        arena.put(np.zeros(4, np.float32))


def test_a_put_that_meets_a_sleep_from_another_thread_leaves_nothing_after_wake(
    vm, faults, monkeypatch
):
    """Another thread sleeps the arena between put's commit and its copy: the copy fails,
    and so did the clean-up's free (asleep), which left the buffer placed and backed after
    wake. The buffer is freed by the next wake now. Its memory goes back to the driver
    through the reclaimer, as every release on a GPU does (the host driver made to defer
    the same way): nothing is held after arena.reclaim()."""
    arena = vm.arena(8 * vm.chunk)
    faults.defer_reclaim(arena)
    commit = jax_vmm.Buffer.commit

    def commit_then_another_thread_sleeps(self, *args):
        out = commit(self, *args)
        self._arena.sleep()
        return out

    monkeypatch.setattr(jax_vmm.Buffer, "commit", commit_then_another_thread_sleeps)
    with pytest.raises(jax_vmm.ArenaAsleepError):
        arena.put(np.ones(vm.chunk // 4, np.float32))
    monkeypatch.undo()
    arena.wake()
    assert arena.buffers == [] and arena.backed_bytes == 0
    arena.reclaim()
    assert arena.stats()["held_bytes"] == 0
    kept = arena.put(np.arange(8, dtype=np.float32))  # the arena serves on
    np.testing.assert_array_equal(np.asarray(kept), np.arange(8, dtype=np.float32))
    arena.close()
