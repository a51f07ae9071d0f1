"""The real CUDA driver code (ffi/src/drivers/cuda/) on the CPU, over a strict host
emulation of the CUDA VMM driver API (ffi/src/testing/fake_cuda.h, exposed as
``jax_vmm._core_testing.fake_cuda_*``).

What the fake emulates: reservations (cuMemAddressReserve/Free), physical allocations
(cuMemCreate/Release, memfd-backed, fresh contents garbage), mappings (cuMemMap/Unmap),
access (cuMemSetAccess/GetAccess, as page protections), copies and memsets checked against
the access flags, metadata and pinned host allocations, contexts and streams (tracked, no
real asynchrony). Strict rules, each the real driver's: cuMemMap maps whole allocations
only (offset 0, size == allocation size, else CUDA_ERROR_NOT_SUPPORTED), inside one
reservation, over no existing mapping; cuMemUnmap unmaps whole mappings only; a
reservation with mappings cannot be freed; cuMemSetAccess needs every byte mapped; a
write to a read-only or unmapped page is CUDA_ERROR_ILLEGAL_ADDRESS and changes nothing;
releasing what is not held is refused.

What it cannot show: kernels and graph replay, real timing and asynchrony (no
use-after-unmap race can happen), the sticky context error of a real illegal access, and
real driver quirks it does not model (costs, fragmentation, granularity other than 64 KiB).
The GPU tests (test_gpu_arena.py) check the same driver on the real thing.

Every test leaves the fake as it found it: the ``fake`` fixture checks, after closing and
dropping every arena it made, that no reservation, mapping, allocation, stream, context
reference or metadata block is left.
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import jax_vmm.testing
from jax_vmm.base.loader import core as _core

t = jax_vmm.testing.extension()
R = t.fake_cuda_results()
OK = R["CUDA_SUCCESS"]
INVALID_VALUE = R["CUDA_ERROR_INVALID_VALUE"]
NOT_SUPPORTED = R["CUDA_ERROR_NOT_SUPPORTED"]
ILLEGAL_ADDRESS = R["CUDA_ERROR_ILLEGAL_ADDRESS"]
OUT_OF_MEMORY = R["CUDA_ERROR_OUT_OF_MEMORY"]
G = t.fake_cuda_granularity()  # 64 KiB
MiB = 1 << 20
RO, RW = 1, 3  # CU_MEM_ACCESS_FLAGS_PROT_READ / _READWRITE
# The largest zero piece on the fake device (4 GiB): 1/512 of it.
MAX_PIECE = t.zero_piece_bytes(t.fake_cuda_total_bytes(), G)
LIVE_KEYS = (
    "live_reservations",
    "live_mappings",
    "live_allocations",
    "live_handles",
    "live_metadata_allocs",
    "live_host_allocs",
    "live_streams",
    "primary_context_refs",
)


def live(stats: dict) -> dict:
    return {k: stats[k] for k in LIVE_KEYS}


class Fake:
    """Arenas of the real CudaDriver over the fake, and readers of the fake's state."""

    def __init__(self) -> None:
        self.arenas: list = []
        self._refusals = t.fake_cuda_stats()["partial_map_refusals"]

    def close_all(self) -> None:
        while self.arenas:
            self.arenas.pop().close()

    def partial_map_refusals(self) -> int:
        """cuMemMap calls refused as partial (offset or size) since the test began."""
        return t.fake_cuda_stats()["partial_map_refusals"] - self._refusals

    def arena(
        self,
        reserve_bytes: int,
        chunk_bytes: int = G,
        handle_bytes: int = 0,
        zero_fill: bool = True,
        defer_zero_reads: bool | None = False,
    ):
        a = t.create_fake_cuda_arena(
            reserve_bytes, chunk_bytes, handle_bytes, zero_fill, defer_zero_reads
        )
        self.arenas.append(a)
        return a

    @staticmethod
    def zero_handles() -> set[int]:
        """The zero allocations: the only ones alive while no chunk is backed."""
        return {h for h, *_ in t.fake_cuda_allocations()}

    @staticmethod
    def flags(a) -> np.ndarray:
        """Per chunk: the access flags, or -1 where nothing is mapped."""
        out = []
        for i in range(a.reserved_bytes // a.chunk_bytes):
            r, f = t.fake_cuda_access(a.base + i * a.chunk_bytes)
            out.append(f if r == OK else -1)
        return np.array(out)

    @staticmethod
    def contents(a) -> np.ndarray:
        r, data = t.fake_cuda_read(a.base, a.reserved_bytes)
        assert r == OK, f"reading the whole reservation: CUresult {r} (an unreadable page)"
        return np.frombuffer(data, np.uint8).copy()

    @staticmethod
    def real_mappings(a, zero: set[int]) -> list[tuple[int, int, int]]:
        end = a.base + a.reserved_bytes
        return [m for m in t.fake_cuda_mappings() if a.base <= m[0] < end and m[2] not in zero]


@pytest.fixture
def fake():
    # Not asserted idle here: after a failure, pytest's traceback keeps that test's
    # (closed) arenas alive, and the tests after it should still report on their own.
    before = live(t.fake_cuda_stats())
    f = Fake()
    try:
        yield f
    finally:
        t.fake_cuda_disarm()
        f.close_all()
        gc.collect()
        after = live(t.fake_cuda_stats())
        assert after == before, f"leaked driver objects: {after}"


def write(a, offset: int, data: np.ndarray) -> None:
    """Through the driver: Arena.copy_in (cuMemcpyAsync from pageable host memory)."""
    data = np.ascontiguousarray(data, np.uint8)
    a.copy_in(0, offset, data.ctypes.data, data.nbytes)


# ---- the fake itself is strict -------------------------------------------------------


def test_fake_refuses_what_the_real_driver_refuses(fake):
    r, va = t.fake_cuda_reserve(4 * MiB, 2 * MiB)
    assert r == OK and va % (2 * MiB) == 0, "the alignment argument is honoured"
    r, h = t.fake_cuda_create(2 * MiB)
    assert r == OK
    # Part of an allocation (the bug that made every H200 reservation fail), or an offset.
    assert t.fake_cuda_map(va, G, 0, h) == NOT_SUPPORTED
    assert t.fake_cuda_map(va, MiB, MiB, h) == NOT_SUPPORTED
    assert t.fake_cuda_map(va, 2 * MiB, G, h) == NOT_SUPPORTED
    assert fake.partial_map_refusals() == 3
    # Outside a reservation, straddling its end, unaligned.
    assert t.fake_cuda_map(va + 3 * MiB, 2 * MiB, 0, h) == INVALID_VALUE
    assert t.fake_cuda_map(va + 4096, 2 * MiB, 0, h) == INVALID_VALUE
    assert t.fake_cuda_stats()["live_mappings"] == 0
    assert t.fake_cuda_map(va, 2 * MiB, 0, h) == OK
    # New mappings have no access; overlapping maps are refused.
    assert t.fake_cuda_access(va) == (OK, 0)
    assert t.fake_cuda_map(va + MiB, 2 * MiB, 0, h) == INVALID_VALUE
    assert t.fake_cuda_map(va, 2 * MiB, 0, h) == INVALID_VALUE
    # Access over unmapped bytes is refused; a read or write without access faults.
    assert t.fake_cuda_set_access(va, 4 * MiB, RO) == INVALID_VALUE
    assert t.fake_cuda_read(va, 1)[0] == ILLEGAL_ADDRESS
    assert t.fake_cuda_access(va + 2 * MiB)[0] == INVALID_VALUE
    # Partial unmaps, unmaps past the mapping, and freeing a reservation with mappings.
    assert t.fake_cuda_unmap(va, MiB) == INVALID_VALUE
    assert t.fake_cuda_unmap(va + G, 2 * MiB - G) == INVALID_VALUE
    assert t.fake_cuda_unmap(va, 4 * MiB) == INVALID_VALUE
    assert t.fake_cuda_address_free(va, 4 * MiB) == INVALID_VALUE
    assert t.fake_cuda_address_free(va, 2 * MiB) == INVALID_VALUE  # not the reservation
    # Sizes off the granularity.
    assert t.fake_cuda_create(G + 4096)[0] == INVALID_VALUE
    assert t.fake_cuda_reserve(G + 4096)[0] == INVALID_VALUE
    # Release while mapped: the memory stays until the unmap; a second release is refused.
    assert t.fake_cuda_set_access(va, 2 * MiB, RW) == OK
    assert t.fake_cuda_write(va, b"kept") == OK
    assert t.fake_cuda_release(h) == OK
    assert t.fake_cuda_release(h) == INVALID_VALUE
    assert t.fake_cuda_read(va, 4) == (OK, b"kept")
    assert t.fake_cuda_stats()["live_allocations"] == 1
    assert t.fake_cuda_stats()["live_handles"] == 0
    assert t.fake_cuda_unmap(va, 2 * MiB) == OK
    assert t.fake_cuda_stats()["live_allocations"] == 0
    # A released (stale) handle cannot be mapped; the placeholder is back (no access).
    assert t.fake_cuda_map(va, 2 * MiB, 0, h) == INVALID_VALUE
    assert t.fake_cuda_read(va, 1)[0] == ILLEGAL_ADDRESS
    assert t.fake_cuda_address_free(va, 4 * MiB) == OK
    assert t.fake_cuda_address_free(va, 4 * MiB) == INVALID_VALUE


def test_fake_unmaps_several_whole_mappings_at_once_but_not_with_a_hole(fake):
    r, va = t.fake_cuda_reserve(4 * G)
    hs = [t.fake_cuda_create(G)[1] for _ in range(3)]
    for i, h in enumerate(hs):
        assert t.fake_cuda_map(va + i * G, G, 0, h) == OK
    assert t.fake_cuda_unmap(va, 4 * G) == INVALID_VALUE  # past the last mapping
    assert t.fake_cuda_unmap(va, 3 * G) == OK
    assert t.fake_cuda_stats()["live_mappings"] == 0
    assert t.fake_cuda_map(va, G, 0, hs[0]) == OK
    assert t.fake_cuda_map(va + 2 * G, G, 0, hs[2]) == OK
    assert t.fake_cuda_unmap(va, 3 * G) == INVALID_VALUE  # a hole in between
    assert t.fake_cuda_unmap(va, G) == OK and t.fake_cuda_unmap(va + 2 * G, G) == OK
    for h in hs:
        assert t.fake_cuda_release(h) == OK
    assert t.fake_cuda_address_free(va, 4 * G) == OK


def test_fake_write_to_read_only_memory_is_an_illegal_address_and_changes_nothing(fake):
    r, va = t.fake_cuda_reserve(2 * G)
    r, h = t.fake_cuda_create(2 * G)
    assert t.fake_cuda_map(va, 2 * G, 0, h) == OK
    assert t.fake_cuda_set_access(va, 2 * G, RW) == OK
    assert t.fake_cuda_memset(va, 7, 2 * G) == OK
    assert t.fake_cuda_set_access(va + G, G, RO) == OK
    faults = t.fake_cuda_stats()["illegal_addresses"]
    # A memset reaching one byte into the read-only page: refused whole.
    assert t.fake_cuda_memset(va, 9, G + 1) == ILLEGAL_ADDRESS
    assert t.fake_cuda_write(va + G, b"x") == ILLEGAL_ADDRESS
    assert t.fake_cuda_stats()["illegal_addresses"] == faults + 2
    assert t.fake_cuda_read(va, 2 * G) == (OK, b"\x07" * (2 * G))
    # Fresh physical memory is garbage, not zeros (cuMemCreate promises nothing).
    r, h2 = t.fake_cuda_create(G)
    assert t.fake_cuda_unmap(va, 2 * G) == OK
    assert t.fake_cuda_map(va, G, 0, h2) == OK
    assert t.fake_cuda_set_access(va, G, RO) == OK
    r, data = t.fake_cuda_read(va, G)
    assert r == OK and set(data) == {0xCD}
    assert t.fake_cuda_unmap(va, G) == OK
    assert t.fake_cuda_release(h) == OK and t.fake_cuda_release(h2) == OK
    assert t.fake_cuda_address_free(va, 2 * G) == OK


# ---- the CUDA driver on the fake: reserve, commit, release ----------------------------


def check_zero_pieces(a, zero: set[int]) -> None:
    """Every zero mapping is a whole zero allocation, a power of two aligned to its size."""
    sizes = {h: n for h, n, *_ in t.fake_cuda_allocations()}
    for va, n, h in t.fake_cuda_mappings():
        if h in zero:
            assert sizes[h] == n and n & (n - 1) == 0 and (va - a.base) % n == 0, (va, n)


def test_reserve_maps_read_only_zeros_in_whole_zero_allocations(fake):
    t.fake_cuda_map_log(clear=True)
    a = fake.arena(32 * MiB + 3 * G)
    zero = fake.zero_handles()
    sizes = sorted(n for _, n, *_ in t.fake_cuda_allocations())
    assert sizes == [G << k for k in range(len(sizes))] and sizes[-1] == MAX_PIECE == 8 * MiB
    assert (fake.flags(a) == RO).all()
    assert not fake.contents(a).any()
    pieces = sorted(n for _, n, h in t.fake_cuda_mappings() if h in zero)
    assert pieces == [G, 2 * G] + [8 * MiB] * 4, "largest aligned pieces first"
    check_zero_pieces(a, zero)
    log = t.fake_cuda_map_log()
    assert log and all(off == 0 and n == alloc and r == OK for _, n, off, _, alloc, r in log)
    assert fake.partial_map_refusals() == 0


@pytest.mark.parametrize(
    ("start", "stop", "handle_chunks"),
    [
        (3 * MiB + G, 3 * MiB + 2 * G, 1),  # one chunk inside a big zero piece
        (8 * MiB - 2 * G, 8 * MiB + 3 * G, 1),  # a run across two pieces
        (8 * MiB - 2 * G, 24 * MiB + 5 * G, 4),  # across three, allocations of 4 chunks
        (16 * MiB, 24 * MiB, 4),  # one whole aligned piece
        (0, 32 * MiB + 3 * G, 16),  # everything
    ],
)
def test_commit_backs_exactly_its_chunks_and_release_restores_zeros(
    fake, start, stop, handle_chunks
):
    a = fake.arena(32 * MiB + 3 * G, handle_bytes=handle_chunks * G)
    zero = fake.zero_handles()
    a.allocate(a.reserved_bytes, "all")
    n = a.reserved_bytes // G
    inside = np.zeros(n, bool)
    inside[start // G : stop // G] = True
    t.fake_cuda_map_log(clear=True)
    assert a.commit(0, start, stop) == stop - start
    assert (fake.flags(a) == np.where(inside, RW, RO)).all()
    assert not fake.contents(a).any(), "fresh chunks (garbage in the fake) were zero-filled"
    data = np.random.default_rng(start).integers(1, 256, stop - start, dtype=np.uint8)
    write(a, start, data)
    got = fake.contents(a)
    assert (got[start:stop] == data).all() and not got[:start].any() and not got[stop:].any()
    check_zero_pieces(a, zero)
    real = fake.real_mappings(a, zero)
    assert sum(m[1] for m in real) == stop - start
    assert all(m[1] <= handle_chunks * G for m in real)
    log = t.fake_cuda_map_log()
    assert all(off == 0 and nb == alloc and r == OK for _, nb, off, _, alloc, r in log)
    # Release: read-only zeros again once the memory went back (wait=True: reclaimed).
    assert a.decommit(0, start, stop, True) == stop - start
    assert (fake.flags(a) == RO).all()
    assert not fake.contents(a).any()
    assert fake.real_mappings(a, zero) == []
    assert fake.zero_handles() == zero, "every chunk allocation was released"
    check_zero_pieces(a, zero)
    assert fake.partial_map_refusals() == 0


class Model:
    """What every chunk must look like: backed chunks RW with their data; chunks of an
    allocation still in use (parked) RW with their old data; every other chunk RO zeros."""

    def __init__(self, fake: Fake, a) -> None:
        self.fake, self.a = fake, a
        self.zero = fake.zero_handles()
        self.chunk = a.chunk_bytes
        self.n = a.reserved_bytes // self.chunk
        self.backed = np.zeros(self.n, bool)
        self.data = np.zeros(a.reserved_bytes, np.uint8)

    def chunks(self, first: int, count: int) -> slice:
        return slice(first * self.chunk, (first + count) * self.chunk)

    def commit(self, first: int, count: int) -> None:
        new = int((~self.backed[first : first + count]).sum())
        got = self.a.commit(0, first * self.chunk, (first + count) * self.chunk)
        assert got == new * self.chunk
        for c in range(first, first + count):
            if not self.backed[c]:
                self.data[self.chunks(c, 1)] = 0  # zero_fill: fresh and revived chunks
        self.backed[first : first + count] = True

    def decommit(self, first: int, count: int, wait: bool = True) -> None:
        was = int(self.backed[first : first + count].sum())
        got = self.a.decommit(0, first * self.chunk, (first + count) * self.chunk, wait)
        assert got == was * self.chunk
        self.backed[first : first + count] = False

    def write(self, first: int, count: int, rng) -> None:
        data = rng.integers(0, 256, count * self.chunk, dtype=np.uint8)
        write(self.a, first * self.chunk, data)
        self.data[self.chunks(first, count)] = data

    def check(self) -> None:
        mapped = np.zeros(self.n, bool)
        for va, nbytes, _ in self.fake.real_mappings(self.a, self.zero):
            c0 = (va - self.a.base) // self.chunk
            held = slice(c0, c0 + nbytes // self.chunk)
            assert self.backed[held].any(), "an allocation with no backed chunk is still mapped"
            mapped[held] = True
        assert (mapped | ~self.backed).all(), "a backed chunk is not mapped to real memory"
        expect_flags = np.where(mapped, RW, RO)
        flags = self.fake.flags(self.a)
        assert (flags == expect_flags).all(), np.nonzero(flags != expect_flags)[0][:8]
        for c in np.nonzero(~mapped)[0]:
            self.data[self.chunks(c, 1)] = 0  # zero-mapped
        got = self.fake.contents(self.a)
        bad = np.nonzero((got != self.data).reshape(self.n, -1).any(axis=1))[0]
        assert bad.size == 0, f"chunks {bad[:8]} differ from the model"
        assert self.a.stats()["backed_bytes"] == int(self.backed.sum()) * self.chunk

    def random_op(self, rng, wait: bool = True) -> None:
        count = min(int(rng.choice([1, 2, 3, 5, 16, 32, 64])), self.n)
        first = int(rng.integers(0, self.n - count + 1))
        op = rng.random()
        if op < 0.45:
            self.commit(first, count)
        elif op < 0.85:
            self.decommit(first, count, wait)
        else:
            backed = np.nonzero(self.backed)[0]
            if backed.size:
                self.write(int(rng.choice(backed)), 1, rng)


@pytest.mark.parametrize(("seed", "handle_chunks"), [(1, 1), (2, 4)])
def test_random_commit_and_release_sequences_match_a_model(fake, seed, handle_chunks):
    a = fake.arena(5 * MiB + 3 * G, handle_bytes=handle_chunks * G)
    a.allocate(a.reserved_bytes, "all")
    m = Model(fake, a)
    rng = np.random.default_rng(seed)
    t.fake_cuda_map_log(clear=True)
    for _ in range(250):
        m.random_op(rng)
        m.check()
        check_zero_pieces(a, m.zero)
    log = t.fake_cuda_map_log()
    assert all(off == 0 and nb == alloc and r == OK for _, nb, off, _, alloc, r in log)
    assert fake.partial_map_refusals() == 0


def test_concurrent_arenas_and_the_reclaimer_keep_every_chunk_exact(fake):
    """Two arenas driven from two threads (the GIL is released in every call), releases
    left to each arena's reclaimer thread: the fake's entry points, the shared zero
    allocations and the driver's zero layouts are all used concurrently."""
    arenas = [fake.arena(2 * MiB + 5 * G, handle_bytes=h * G) for h in (1, 3)]
    models = []
    for a in arenas:
        a.allocate(a.reserved_bytes, "all")
        models.append(Model(fake, a))
    errors: list[BaseException] = []

    def drive(m: Model, seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(150):
                m.random_op(rng, wait=False)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=drive, args=(m, 10 + i)) for i, m in enumerate(models)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for m in models:
        m.a.reclaim()
        m.check()
    assert fake.partial_map_refusals() == 0


def test_zero_fill_hides_old_data_and_no_zero_fill_shows_the_garbage(fake):
    filled = fake.arena(16 * G, handle_bytes=4 * G)
    filled.allocate(filled.reserved_bytes, "all")
    filled.commit(0, 0, 4 * G)
    write(filled, 0, np.full(4 * G, 0x5A, np.uint8))
    filled.decommit(0, G, 2 * G, True)  # parked: its allocation still holds chunks 0, 2, 3
    assert fake.flags(filled)[1] == RW and fake.contents(filled)[G] == 0x5A
    filled.commit(0, G, 2 * G)  # revived without a driver allocation
    assert filled.stats()["chunks_revived"] == 1
    got = fake.contents(filled)
    assert not got[G : 2 * G].any() and (got[:G] == 0x5A).all()
    raw = fake.arena(16 * G, zero_fill=False)
    raw.allocate(raw.reserved_bytes, "all")
    raw.commit(0, 0, 2 * G)
    got = fake.contents(raw)
    assert (got[: 2 * G] == 0xCD).all(), "no fill: the fake's fresh garbage shows"
    assert not got[2 * G :].any()


def test_sleep_and_wake_are_bit_exact(fake):
    a = fake.arena(MiB + 5 * G, handle_bytes=2 * G)
    a.allocate(a.reserved_bytes, "all")
    rng = np.random.default_rng(7)
    for first, count in [(0, 3), (5, 1), (9, 6)]:
        a.commit(0, first * G, (first + count) * G)
    data = np.zeros(a.reserved_bytes, np.uint8)
    data[: 3 * G] = rng.integers(0, 256, 3 * G, dtype=np.uint8)
    data[9 * G : 15 * G] = rng.integers(0, 256, 6 * G, dtype=np.uint8)
    write(a, 0, data[: 3 * G])
    write(a, 9 * G, data[9 * G : 15 * G])
    flags = fake.flags(a)
    a.sleep(True)
    assert (fake.flags(a) == RO).all() and not fake.contents(a).any()
    assert a.stats()["backed_bytes"] == 0
    a.wake()
    assert (fake.flags(a) == flags).all()
    assert (fake.contents(a) == data).all()
    a.sleep(False)
    a.wake()
    assert (fake.flags(a) == flags).all()
    assert not fake.contents(a).any(), "discarded contents wake zero-filled"


def test_an_emulated_device_waits_on_none_of_xlas_compute_streams(fake):
    # The fake is device 0, as a real GPU is: on a GPU machine the streams a real arena
    # registered for device 0 belong to libcuda, and the fake's wait on them failed
    # (CUDA_ERROR_INVALID_HANDLE) while the table was keyed by ordinal alone. A made-up
    # stream stands in for XLA's; every device wait (sleep, wake, a table write) of the
    # fake must leave it alone (tests/drivers/test_device_waits.py shows that the fake does
    # wait on a stream registered for its own table).
    theirs = t.forget_compute_streams(0)
    t.register_compute_streams(0, [*theirs, 0x5EED0000])
    try:
        a = fake.arena(8 * G)
        a.allocate(a.reserved_bytes, "all")
        a.commit(0, 0, 4 * G)
        data = np.arange(4 * G, dtype=np.uint8)
        write(a, 0, data)
        a.sleep(True)
        a.wake()
        assert (fake.contents(a)[: 4 * G] == data).all()
        assert a.decommit(0, 0, 4 * G, True) == 4 * G
        a.reclaim()
    finally:
        t.forget_compute_streams(0)
        t.register_compute_streams(0, theirs)


def test_offload_and_restore_are_bit_exact(fake):
    a = fake.arena(32 * G)
    a.allocate(a.reserved_bytes, "all")
    a.commit(0, 0, 20 * G)
    data = np.random.default_rng(3).integers(0, 256, 20 * G, dtype=np.uint8)
    write(a, 0, data)
    ticket = a.offload([(0, 4 * G, 12 * G)])
    state, err = a.wait_transfer(ticket)
    assert state == 1, err  # offloaded
    # The memory goes back in a reclaimer round, which may still be unmapping: a reader
    # there now would be one the arena does not allow (no view, outside the page table).
    a.reclaim()
    flags = fake.flags(a)
    assert (flags[4:12] == RO).all() and (flags[:4] == RW).all() and (flags[12:20] == RW).all()
    got = fake.contents(a)
    assert not got[4 * G : 12 * G].any() and (got[12 * G : 20 * G] == data[12 * G :]).all()
    a.restore(ticket, True)
    assert (fake.flags(a)[:20] == RW).all()
    assert (fake.contents(a)[: 20 * G] == data).all()


# ---- rollback: a commit that fails midway leaves everything as it was -----------------


def snapshot(fake: Fake, a) -> tuple:
    s = a.stats()
    f = t.fake_cuda_stats()
    return (
        fake.flags(a).tolist(),
        fake.contents(a).tobytes(),
        s["backed_bytes"],
        s["held_bytes"],
        s["handles_created"] - s["handles_released"],
        f["live_allocations"],
        f["live_handles"],
        f["live_metadata_allocs"],
        f["live_streams"],
    )


@pytest.mark.parametrize(
    ("entry", "result"),
    [
        ("cuMemMap", OUT_OF_MEMORY),
        ("cuMemCreate", OUT_OF_MEMORY),
        ("cuMemMap", INVALID_VALUE),
        ("cuMemSetAccess", INVALID_VALUE),
        ("cuMemUnmap", INVALID_VALUE),
    ],
)
@pytest.mark.parametrize(
    ("start", "stop"),
    [
        (2 * MiB - 5 * G, 2 * MiB + 6 * G),  # across two zero pieces, around backed chunks
        (MiB - 3 * G, MiB + 5 * G),  # inside pieces: zero remainders on both sides
    ],
)
def test_failed_commit_midway_leaves_every_chunk_as_it_was(fake, entry, result, start, stop):
    failures = 0
    for nth in range(1, 100):
        # A fresh arena each round, so that every call of the same sequence gets to fail:
        # 3 MiB (zero pieces of 2 MiB and 1 MiB) with a few backed chunks holding data.
        a = fake.arena(3 * MiB, handle_bytes=4 * G)
        zero = fake.zero_handles()
        a.allocate(a.reserved_bytes, "all")
        a.commit(0, 2 * MiB - 3 * G, 2 * MiB - G)
        a.commit(0, 2 * MiB + G, 2 * MiB + 2 * G)
        write(a, 2 * MiB - 3 * G, np.full(2 * G, 0x11, np.uint8))
        write(a, 2 * MiB + G, np.full(G, 0x22, np.uint8))
        before = snapshot(fake, a)
        real_before = fake.real_mappings(a, zero)
        calls = t.fake_cuda_stats()["calls"].get(entry, 0)
        t.fake_cuda_fail_nth(entry, nth, result)
        try:
            a.commit(0, start, stop)
            failed = False
        except (_core.OutOfMemoryError, _core.DriverError):
            failed = True
        finally:
            t.fake_cuda_disarm()
        fired = t.fake_cuda_stats()["calls"].get(entry, 0) - calls >= nth
        if failed:
            failures += 1
            assert snapshot(fake, a) == before, f"{entry} failing at call {nth}: state changed"
            assert fake.real_mappings(a, zero) == real_before
        else:
            # Committed: either the fault came after the last call, or the driver
            # recovered from the refusal (one cuMemUnmap over several mappings, retried
            # one by one).
            assert (fake.flags(a)[start // G : stop // G] == RW).all()
        check_zero_pieces(a, zero)
        fake.close_all()
        del a
        gc.collect()
        if not fired:
            break  # the commit made fewer calls than nth: every failure point was tried
    else:
        pytest.fail("the commit never ran out of failure points")
    if entry != "cuMemUnmap":
        assert failures >= 2, f"only {failures} failure points of {entry} were reached"
    assert fake.partial_map_refusals() == 0


def test_failed_reserve_leaves_nothing_behind(fake):
    fake.arena(G)  # the zero allocations exist from here on
    with_zero = live(t.fake_cuda_stats())
    for nth in (1, 2, 3):
        t.fake_cuda_fail_nth("cuMemMap", nth, OUT_OF_MEMORY)
        with pytest.raises((_core.OutOfMemoryError, _core.DriverError)):
            t.create_fake_cuda_arena(17 * MiB + G, G, 0, True)
        t.fake_cuda_disarm()
        gc.collect()
        assert live(t.fake_cuda_stats()) == with_zero


# ---- deferred zero reads: no zero mapping until the first raw view --------------------

HOLE = -1  # Fake.flags: nothing mapped


def calls(name: str) -> int:
    return t.fake_cuda_stats()["calls"].get(name, 0)


def read(a, start: int, stop: int) -> np.ndarray:
    r, data = t.fake_cuda_read(a.base + start, stop - start)
    assert r == OK, f"reading [{start}, {stop}): CUresult {r}"
    return np.frombuffer(data, np.uint8).copy()


def view(a) -> None:
    """Hands out (and drops) a raw view of buffer 0: from then on any byte may be read."""
    del_me = a.view(0, [a.reserved_bytes], 1, 8, 2, 0)  # uint8, kDLCUDA, device 0
    del del_me


@pytest.mark.parametrize(
    "env, option, deferred",
    [
        ("1", None, True),
        ("0", None, False),
        (None, None, True),
        ("1", False, False),
        ("0", True, True),
    ],
)
def test_an_explicit_choice_wins_over_the_environment(fake, monkeypatch, env, option, deferred):
    if env is None:
        monkeypatch.delenv("JAX_VMM_DEFER_ZERO_READS", raising=False)
    else:
        monkeypatch.setenv("JAX_VMM_DEFER_ZERO_READS", env)  # read when the arena is made
    a = fake.arena(32 * MiB + 3 * G, defer_zero_reads=option)
    assert (fake.flags(a) == HOLE).all() == deferred  # deferred: no zero mapping yet
    assert (t.fake_cuda_allocations() == []) == deferred
    assert a.stats()["unbacked_reads_zero"] == (not deferred)
    a.allocate(a.reserved_bytes, "all")
    view(a)  # the first view turns zeros on either way
    assert a.stats()["unbacked_reads_zero"] and not (fake.flags(a) == HOLE).any()


@pytest.mark.parametrize("value", ["yes", "true", "2", " 1"])
def test_an_unknown_environment_value_is_refused(fake, monkeypatch, value):
    monkeypatch.setenv("JAX_VMM_DEFER_ZERO_READS", value)
    before = t.fake_cuda_allocations()
    with pytest.raises(ValueError, match=r"JAX_VMM_DEFER_ZERO_READS=.*expected 1 .* or 0"):
        fake.arena(32 * MiB + 3 * G, defer_zero_reads=None)
    assert t.fake_cuda_allocations() == before  # nothing made
    monkeypatch.setenv("JAX_VMM_DEFER_ZERO_READS", "1")
    fake.arena(32 * MiB + 3 * G, defer_zero_reads=None)  # a valid value works after


def test_deferred_arena_maps_nothing_and_makes_no_zero_memory(fake):
    a = fake.arena(32 * MiB + 3 * G, defer_zero_reads=True)
    assert t.fake_cuda_allocations() == [], "no zero allocation while nothing may read zeros"
    assert (fake.flags(a) == HOLE).all()


@pytest.mark.parametrize("handle_chunks", [1, 4])
def test_deferred_commit_is_create_map_set_access_only(fake, handle_chunks):
    a = fake.arena(32 * MiB + 3 * G, handle_bytes=handle_chunks * G, defer_zero_reads=True)
    a.allocate(a.reserved_bytes, "all")
    start, stop = 3 * MiB + G, 3 * MiB + 9 * G
    unmaps, access = calls("cuMemUnmap"), calls("cuMemSetAccess")
    creates, maps = calls("cuMemCreate"), calls("cuMemMap")
    assert a.commit(0, start, stop) == stop - start
    n = 8 // handle_chunks
    assert calls("cuMemUnmap") == unmaps, "no zero piece to clear"
    assert calls("cuMemSetAccess") == access + 1, "one set-access for the run"
    assert (calls("cuMemCreate") - creates, calls("cuMemMap") - maps) == (n, n)
    inside = np.zeros(a.reserved_bytes // G, bool)
    inside[start // G : stop // G] = True
    assert (fake.flags(a) == np.where(inside, RW, HOLE)).all()
    assert not read(a, start, stop).any(), "zero-filled"
    data = np.random.default_rng(1).integers(1, 256, stop - start, dtype=np.uint8)
    write(a, start, data)
    assert (read(a, start, stop) == data).all()
    assert a.decommit(0, start, stop, True) == stop - start
    assert (fake.flags(a) == HOLE).all(), "released: unmapped, no zero restored"
    assert t.fake_cuda_allocations() == [], "every allocation released"


def test_first_view_gives_every_unbacked_byte_zeros_and_keeps_the_data(fake):
    fake.arena(G)  # the zero allocations exist from here on (shared with the arena below)
    zero = fake.zero_handles()
    a = fake.arena(32 * MiB + 3 * G, handle_bytes=4 * G, defer_zero_reads=True)
    a.allocate(a.reserved_bytes, "all")
    a.commit(0, 0, 4 * G)
    a.commit(0, 8 * MiB - 2 * G, 8 * MiB + 3 * G)
    data = np.random.default_rng(2).integers(1, 256, 4 * G, dtype=np.uint8)
    write(a, 0, data)
    a.decommit(0, G, 2 * G)  # parked: its allocation keeps chunks 0, 2, 3
    a.decommit(0, 8 * MiB - 2 * G, 8 * MiB + 3 * G)  # retired, not yet reclaimed
    view(a)
    flags = fake.flags(a)
    assert (flags[:4] == RW).all() and (flags[4:] == RO).all()
    got = fake.contents(a)  # every byte readable now
    assert (got[:G] == data[:G]).all() and (got[2 * G : 4 * G] == data[2 * G :]).all()
    assert not got[4 * G :].any()
    check_zero_pieces(a, zero)
    # From now on a release restores zeros, as in an arena that never deferred.
    a.decommit(0, 0, 4 * G, True)
    assert (fake.flags(a) == RO).all() and not fake.contents(a).any()
    view(a)  # the second view changes nothing
    assert (fake.flags(a) == RO).all()


def test_failed_zero_reads_change_nothing_and_a_later_view_succeeds(fake):
    fake.arena(G)  # the zero allocations exist from here on
    a = fake.arena(32 * MiB + 3 * G, defer_zero_reads=True)
    a.allocate(a.reserved_bytes, "all")
    a.commit(0, 5 * G, 7 * G)
    flags, mappings = fake.flags(a), t.fake_cuda_mappings()
    for nth in (1, 2, 3):
        t.fake_cuda_fail_nth("cuMemMap", nth, OUT_OF_MEMORY)
        with pytest.raises(_core.OutOfMemoryError):
            view(a)
        t.fake_cuda_disarm()
        assert (fake.flags(a) == flags).all() and t.fake_cuda_mappings() == mappings
        assert not a.stats()["views_exported"]
    t.fake_cuda_fail_nth("cuMemSetAccess", 1, R["CUDA_ERROR_INVALID_VALUE"])
    with pytest.raises(_core.DriverError):
        view(a)
    t.fake_cuda_disarm()
    assert t.fake_cuda_mappings() == mappings
    view(a)
    assert (fake.flags(a)[5:7] == RW).all() and (np.delete(fake.flags(a), [5, 6]) == RO).all()


def test_failed_deferred_commit_unmaps_and_releases_everything(fake):
    a = fake.arena(32 * MiB + 3 * G, handle_bytes=2 * G, defer_zero_reads=True)
    a.allocate(a.reserved_bytes, "all")
    a.commit(0, 0, 2 * G)
    flags, allocs = fake.flags(a), t.fake_cuda_allocations()
    t.fake_cuda_fail_nth("cuMemMap", 3, OUT_OF_MEMORY)
    with pytest.raises(_core.OutOfMemoryError):
        a.commit(0, 4 * G, 12 * G)
    t.fake_cuda_disarm()
    assert (fake.flags(a) == flags).all() and t.fake_cuda_allocations() == allocs
    assert a.stats()["failed_commits"] == 1
    assert a.commit(0, 4 * G, 12 * G) == 8 * G
    view(a)  # the zeros tile around what a failed commit left: nothing
    assert (fake.contents(a)[12 * G :] == 0).all()


def test_deferred_sleep_and_wake_are_bit_exact(fake):
    a = fake.arena(MiB + 5 * G, handle_bytes=2 * G, defer_zero_reads=True)
    a.allocate(a.reserved_bytes, "all")
    a.commit(0, 0, 3 * G)
    a.commit(0, 9 * G, 15 * G)
    rng = np.random.default_rng(7)
    head = rng.integers(0, 256, 3 * G, dtype=np.uint8)
    tail = rng.integers(0, 256, 6 * G, dtype=np.uint8)
    write(a, 0, head)
    write(a, 9 * G, tail)
    flags = fake.flags(a)
    a.sleep(True)
    assert (fake.flags(a) == HOLE).all()
    a.wake()
    assert (fake.flags(a) == flags).all()
    assert (read(a, 0, 3 * G) == head).all() and (read(a, 9 * G, 15 * G) == tail).all()


# ---- no leaks ---------------------------------------------------------------------------


def test_close_leaves_only_the_zero_allocations_and_the_last_driver_leaves_nothing(fake):
    a = fake.arena(12 * MiB, handle_bytes=2 * G)
    zero = fake.zero_handles()
    b = fake.arena(3 * MiB)
    for x in (a, b):
        x.allocate(x.reserved_bytes, "all")
        x.commit(0, G, x.reserved_bytes - 3 * G)
    del x
    a.decommit(0, 2 * G, 5 * G)  # released, not waited for: the reclaimer's work
    a.sleep(True)
    a.wake()
    a.close()
    assert fake.real_mappings(a, zero) == []
    assert (fake.flags(a) == RO).all() and not fake.contents(a).any(), "closed: zeros"
    b.close()
    assert fake.zero_handles() == zero
    assert all(h in zero for _, _, h in t.fake_cuda_mappings())
    fake.arenas.clear()
    del a, b
    gc.collect()
    s = t.fake_cuda_stats()
    assert all(s[k] == 0 for k in LIVE_KEYS), live(s)
    assert s["used_bytes"] == 0


def test_a_fake_driver_never_shares_the_zero_allocations_of_another_table(fake):
    """The zero allocations are per (entry-point table, ordinal): a second arena reuses the
    fake's own set, made once."""
    a = fake.arena(G)
    zero = fake.zero_handles()
    creates = t.fake_cuda_stats()["calls"]["cuMemCreate"]
    fake.arena(2 * G)
    assert fake.zero_handles() == zero
    assert t.fake_cuda_stats()["calls"]["cuMemCreate"] == creates
    del a


def test_zero_piece_ceiling_from_the_environment(fake, monkeypatch):
    # Read when a device's zero allocations are made (none is alive between tests).
    monkeypatch.setenv("JAX_VMM_ZERO_PIECE_MAX_BYTES", str(2 * G))
    a = fake.arena(32 * MiB + 3 * G)
    zero = fake.zero_handles()
    assert sorted(n for _, n, *_ in t.fake_cuda_allocations()) == [G, 2 * G]
    pieces = [n for _, n, h in t.fake_cuda_mappings() if h in zero]
    assert max(pieces) == 2 * G and sum(pieces) == 32 * MiB + 3 * G
    check_zero_pieces(a, zero)
    fake.close_all()
    del a
    gc.collect()
    monkeypatch.setenv("JAX_VMM_ZERO_PIECE_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match="JAX_VMM_ZERO_PIECE_MAX_BYTES=lots is not a positive"):
        fake.arena(4 * G)
    assert live(t.fake_cuda_stats())["live_reservations"] == 0


# ---- shared memory (Arena.share_spans, kv.share_prefix) ------------------------------


def _one_written_allocation(fake, seed: int):
    """An arena whose first 4 chunks are one allocation holding random bytes: (arena, the
    zero allocations, the bytes)."""
    a = fake.arena(32 * G, handle_bytes=4 * G, zero_fill=False)
    zero = fake.zero_handles()
    a.allocate(a.reserved_bytes, "all")
    a.commit(0, 0, 4 * G)  # one allocation of 4 chunks
    data = np.random.default_rng(seed).integers(1, 256, 4 * G, dtype=np.uint8)
    write(a, 0, data)
    return a, zero, data


def test_a_whole_allocation_is_mapped_at_a_second_address_and_freed_with_the_last(fake):
    a, zero, data = _one_written_allocation(fake, seed=3)
    (src,) = fake.real_mappings(a, zero)
    t.fake_cuda_map_log(clear=True)
    assert a.share_spans([(0, 0, 0, 16 * G, 4 * G)]) == (4 * G, [])
    # The driver's own answer: the same handle, mapped whole, at both addresses.
    real = fake.real_mappings(a, zero)
    assert sorted(m[0] - a.base for m in real) == [0, 16 * G]
    assert {m[2] for m in real} == {src[2]}
    assert fake.partial_map_refusals() == 0
    assert (fake.contents(a)[16 * G : 20 * G] == data).all()
    write(a, 16 * G, data[::-1].copy())  # one memory: the write shows at both addresses
    assert (fake.contents(a)[: 4 * G] == data[::-1]).all()
    s = a.stats()
    assert (s["held_bytes"], s["alias_bytes"], s["shared_bytes"]) == (4 * G, 4 * G, 4 * G)
    # Released first (deferred: retired, not yet unmapped), the source keeps the memory
    # for the second address; a commit there at once waits for the reclaimer and gets
    # new memory, never the shared allocation back.
    revived = s["chunks_revived"]
    a.decommit(0, 0, 4 * G, False)
    a.commit(0, 0, 4 * G)
    assert a.stats()["chunks_revived"] == revived
    assert (fake.contents(a)[16 * G : 20 * G] == data[::-1]).all()
    handles = [m[2] for m in fake.real_mappings(a, zero)]
    assert len(handles) == 2 and src[2] in handles and len(set(handles)) == 2
    a.decommit(0, 0, 4 * G, True)
    a.decommit(0, 16 * G, 20 * G, True)
    assert fake.real_mappings(a, zero) == []
    assert fake.zero_handles() == zero, "the shared allocation was released at the last unmap"


def test_the_source_holds_its_allocation_alone_once_the_alias_is_reclaimed(fake):
    """After the second address is released and reclaimed (a share undone, or a sharer
    released first), the source is ordinary memory again: a chunk it releases is taken
    back by the next commit (no new allocation), and it sleeps and wakes with its bytes.
    Marked shared for good, it refused both ("released by part", "several addresses")."""
    a, zero, data = _one_written_allocation(fake, seed=5)
    assert a.share_spans([(0, 0, 0, 16 * G, 4 * G)]) == (4 * G, [])
    a.decommit(0, 16 * G, 20 * G, True)  # the alias, unmapped and gone
    s = a.stats()
    assert (s["held_bytes"], s["alias_bytes"], s["shared_bytes"]) == (4 * G, 0, 0)
    (src,) = fake.real_mappings(a, zero)
    a.decommit(0, 3 * G, 4 * G, False)
    a.commit(0, 3 * G, 4 * G)
    assert a.stats()["chunks_revived"] == s["chunks_revived"] + 1
    assert fake.real_mappings(a, zero) == [src]
    a.sleep(True)
    a.wake()
    assert (fake.contents(a)[: 3 * G] == data[: 3 * G]).all()


def test_part_of_an_allocation_is_left_to_the_caller_on_cuda(fake):
    a = fake.arena(32 * G, handle_bytes=4 * G, zero_fill=False)
    zero = fake.zero_handles()
    a.allocate(a.reserved_bytes, "all")
    a.commit(0, 0, 3 * G)  # one allocation of 3 chunks; share its first 2
    before = fake.real_mappings(a, zero)
    assert a.share_spans([(0, 0, 0, 16 * G, 2 * G)]) == (0, [(0, 16 * G, 18 * G)])
    assert fake.real_mappings(a, zero) == before and fake.partial_map_refusals() == 0
    assert a.stats()["chunks_shared"] == 0
    # The caller commits and copies them.
    a.commit(0, 16 * G, 18 * G)
    data = np.random.default_rng(4).integers(1, 256, 2 * G, dtype=np.uint8)
    write(a, 0, data)
    a.copy_spans([(0, 0, 0, 16 * G, 2 * G)])
    assert (fake.contents(a)[16 * G : 18 * G] == data).all()
    # A copy into shared memory, a share into memory that is held, overlaps: refused.
    a.share_spans([(0, 4 * G, 0, 8 * G, 0)])  # empty: nothing to do
    with pytest.raises(ValueError, match="holds memory"):
        a.share_spans([(0, 0, 0, 16 * G, 3 * G)])
    with pytest.raises(ValueError, match="not all backed"):
        a.share_spans([(0, 8 * G, 0, 24 * G, G)])
    with pytest.raises(ValueError, match="overlap"):
        a.share_spans([(0, 0, 0, G, 3 * G)])
    with pytest.raises(ValueError, match="whole chunks"):
        a.share_spans([(0, 0, 0, 24 * G, G // 2)])
