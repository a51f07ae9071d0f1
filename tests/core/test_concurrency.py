"""Several threads committing and decommitting on one arena, on several arenas, and on a
KV arena's sequences. Afterwards the arena's bookkeeping must agree with the oracle,
deterministic parts must be exact, and data that no thread was allowed to touch must
be intact. (Commit/decommit release the GIL, so the threads really run in parallel.)"""

from __future__ import annotations

import threading
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
import maps_oracle as mo
from conftest import chunk_range, chunk_states, pattern, read_bytes, write_bytes

THREADS = 4


def _run(workers: list[Callable[[], None]]) -> None:
    """Start all workers at once; re-raise the first exception any of them hit."""
    errors: list[BaseException] = []
    start = threading.Barrier(len(workers))

    def wrap(fn):
        def run():
            try:
                start.wait()
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        return run

    threads = [threading.Thread(target=wrap(w)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    if errors:
        raise errors[0]


def _random_ops(buf: jax_vmm.Buffer, rng: np.random.Generator, n: int) -> None:
    for _ in range(n):
        lo, hi = sorted(int(x) for x in rng.integers(0, buf.nbytes + 1, size=2))
        if rng.random() < 0.55:
            buf.commit(lo, hi)
        else:
            buf.decommit(lo, hi)


def _assert_consistent(vm, arena: jax_vmm.Arena, buffers: list[jax_vmm.Buffer]) -> None:
    """The arena's page tables, its byte counts and the oracle tell the same story."""
    ranges = []
    for b in buffers:
        ranges += [chunk_range(b, i, i + 1) for i, s in enumerate(chunk_states(b)) if s]
    assert arena.backed_bytes == sum(b.backed_bytes for b in buffers)
    vm.assert_backed(arena, ranges)


def test_threads_on_one_arena(vm):
    c = vm.chunk
    arena = vm.arena(64 * c)
    own = [arena.allocate(8 * c, jnp.uint8, name=f"own{i}") for i in range(THREADS)]
    shared = arena.allocate(16 * c, jnp.uint8, name="shared")
    stop = threading.Event()

    def worker(i: int) -> Callable[[], None]:
        def run():
            rng = np.random.default_rng(i)
            for _ in range(40):
                _random_ops(own[i], rng, 1)
                _random_ops(shared, rng, 1)
            # A final state only this thread decides: chunks [i, i + 2) hold its data.
            own[i].decommit()
            own[i].commit(i * c, (i + 2) * c)
            write_bytes(own[i], i * c, pattern(2 * c, seed=i))
            _random_ops(shared, rng, 20)  # the others are still churning

        return run

    def reader():  # full-array reads racing with commits (host: mapping swaps are atomic)
        while not stop.is_set():
            for b in own:
                jnp.sum(b.array).block_until_ready()

    workers = [worker(i) for i in range(THREADS)]
    if vm.is_host:
        workers.append(reader)
        last = workers[THREADS - 1]

        def last_then_stop():
            try:
                last()
            finally:
                stop.set()

        workers[THREADS - 1] = last_then_stop
    try:
        _run(workers)
    finally:
        stop.set()
    for i, b in enumerate(own):
        assert chunk_states(b) == tuple(i <= k < i + 2 for k in range(8))
        np.testing.assert_array_equal(read_bytes(b, i * c, (i + 2) * c), pattern(2 * c, seed=i))
    _assert_consistent(vm, arena, own + [shared])
    s = arena.stats()
    assert s["chunks_created"] - s["chunks_released"] == s["backed_bytes"] // c


def test_threads_on_several_arenas(vm):
    c = vm.chunk
    common = vm.arena(32 * c)
    common_bufs = [common.allocate(4 * c, jnp.uint8, name=f"c{i}") for i in range(THREADS)]
    mine = [vm.arena(16 * c) for _ in range(THREADS)]
    my_bufs = [[a.allocate(3 * c, jnp.uint8) for _ in range(3)] for a in mine]
    leftovers: list[str] = []

    def worker(i: int) -> Callable[[], None]:
        def run():
            rng = np.random.default_rng(100 + i)
            for step in range(30):
                _random_ops(my_bufs[i][step % 3], rng, 1)
                _random_ops(common_bufs[i], rng, 1)
                if step % 10 == 0:
                    # Arenas created and closed while others work (registry, memfds).
                    with jax_vmm.Arena(8 * c, device=vm.device) as tmp:
                        tmp.allocate(2 * c, jnp.uint8).commit()
                    if vm.is_host and mo.ranges_of(
                        mo.layout(tmp.base, tmp.reserved_bytes), mo.BACKED
                    ):
                        leftovers.append(f"closed arena at 0x{tmp.base:x} still backed")
            my_bufs[i][0].commit(0, c)  # a known chunk in every private arena

        return run

    _run([worker(i) for i in range(THREADS)])
    assert not leftovers
    _assert_consistent(vm, common, common_bufs)
    for a, bufs in zip(mine, my_bufs):
        assert chunk_states(bufs[0])[0]
        _assert_consistent(vm, a, bufs)


@pytest.mark.parametrize("deferred", [False, True], ids=["inline", "deferred"])
def test_threads_on_kv_sequences(vm, faults, deferred):
    """Half the threads grow their sequence and write it; the other half keep growing
    and releasing theirs. Sequences are 1.5 chunks long, so neighbours share chunks:
    no release may take memory from a sequence that ensured it. deferred: releases go to
    the reclaimer thread (the host defers like the CUDA driver), which works behind them."""
    tpc = vm.chunk // (2 * 64 * 2)
    t = tpc + tpc // 2
    kv = vm.kv(
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
        max_tokens=t,
        max_seqs=THREADS,
        dtype=jnp.bfloat16,
    )
    if deferred:
        faults.defer_reclaim(kv)
    tb = kv.token_bytes

    def writer(q: int) -> Callable[[], None]:
        def run():
            for n in (1, t // 2, t):
                kv.ensure(n, seq=q)
            for i, b in enumerate(kv.buffers):
                write_bytes(b, q * kv.seq_bytes, pattern(t * tb, seed=10 * q + i))

        return run

    def churner(q: int) -> Callable[[], None]:
        def run():
            rng = np.random.default_rng(q)
            for _ in range(25):
                kv.ensure(int(rng.integers(0, t + 1)), seq=q)
                if rng.random() < 0.5:
                    kv.release(q)
            kv.release(q)

        return run

    _run([writer(q) if q % 2 == 0 else churner(q) for q in range(THREADS)])
    for q in range(0, THREADS, 2):
        assert kv.backed_tokens(q) == t
        for i, b in enumerate(kv.buffers):
            got = read_bytes(b, q * kv.seq_bytes, q * kv.seq_bytes + t * tb)
            np.testing.assert_array_equal(got, pattern(t * tb, seed=10 * q + i))
    _assert_consistent(vm, kv.arena, kv.buffers)
