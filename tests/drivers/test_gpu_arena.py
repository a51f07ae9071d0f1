"""The CUDA driver backend on a real GPU, checked by the driver itself (tests/oracles/cuda_oracle.py
asks CUDA through cuda-python what is mapped where), never by jax_vmm's own counters alone.

All tests are GPU-only (``gpu_device`` skips without a CUDA GPU with VMM). They hold
whether or not JAX preallocates (only the out-of-memory test depends on how much is free,
and it asks the driver). Sizes are multiples of the chunk size so every expectation is
exact.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
from conftest import cuda_ordinal, eager_zeros, read_bytes, stable_stats, unbacked_kind, write_bytes
from jax_vmm.testing import InjectedFault

cu_oracle = pytest.importorskip("cuda_oracle", reason="needs cuda-python (cuda.bindings)")

pytestmark = pytest.mark.gpu

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture
def oracle(gpu_device) -> cu_oracle.CudaOracle:
    return cu_oracle.CudaOracle(cuda_ordinal(gpu_device))


def zero_handle(oracle: cu_oracle.CudaOracle, arena: jax_vmm.Arena) -> frozenset[int] | None:
    """The handles of the device's shared zero allocations (one per piece size), read by
    the driver oracle over a fresh 255-chunk reservation, which the zero layout tiles into
    one piece of each size (128, 64, ..., 2 and 1 chunks: up to the default 256 MiB ceiling
    with 2 MiB chunks; a lower ceiling repeats its largest piece). Call it while ``arena``
    lives: the zero allocations are shared only while some reservation holds them. None when the
    driver does not hand back stable handle values (then only access flags identify the
    zero memory)."""
    with eager_zeros(), jax_vmm.Arena(255 * 2 * MiB, device=arena.device) as probe:
        c = probe.chunk_bytes
        states = oracle.chunk_states(probe.base, probe.reserved_bytes, c)
        again = oracle.allocation_handle(probe.base)
    if again != states[0].handle:
        return None
    return frozenset(s.handle for s in states)


def kinds(oracle, arena, buf, nbytes=None) -> list[str]:
    n = buf.nbytes if nbytes is None else nbytes
    c = arena.chunk_bytes
    return oracle.kinds(buf.address, (n + c - 1) // c * c, c, zero_handle(oracle, arena))


# -- backing ------------------------------------------------------------------------------


def test_reservation_is_zero_chunk_read_only_everywhere(gpu_device, oracle):
    with eager_zeros(), jax_vmm.Arena(64 * MiB, device=gpu_device) as arena:
        assert arena.driver == "cuda"
        c = arena.chunk_bytes
        states = oracle.chunk_states(arena.base, arena.reserved_bytes, c)
        assert [s.access for s in states] == [cu_oracle.READ] * (arena.reserved_bytes // c)
        handles = {s.handle for s in states}
        zeros = zero_handle(oracle, arena)
        if zeros is not None:
            assert handles <= zeros, "every unbacked chunk maps a shared zero allocation"


@pytest.mark.parametrize("eager", [False, True], ids=["default", "eager_zeros"])
def test_commit_decommit_seen_by_driver(gpu_device, oracle, eager):
    with eager_zeros(eager):
        arena = jax_vmm.Arena(64 * MiB, device=gpu_device)
    with arena:
        c = arena.chunk_bytes
        z = unbacked_kind(arena)
        assert z == ("zero" if eager else "hole")
        buf = arena.allocate((10 * c,), jnp.uint8)
        assert kinds(oracle, arena, buf) == [z] * 10
        free0 = oracle.mem_free()
        # bytes [1.5c, 4.5c) round out to chunks 1..4
        assert buf.commit(3 * c // 2, 9 * c // 2) == 4 * c
        assert kinds(oracle, arena, buf) == [z] + ["rw"] * 4 + [z] * 5
        handles = [oracle.allocation_handle(buf.address + i * c) for i in range(1, 5)]
        assert len(set(handles)) == 4, "one physical allocation per chunk"
        assert free0 - oracle.mem_free() >= 4 * c, "the driver did not hand out the memory"
        # decommit rounds inwards: [2c, 4.5c) frees chunks 2 and 3 only (wait: until the
        # memory is back with the driver; no view is alive, so it would otherwise go in the
        # background)
        assert buf.decommit(2 * c, 9 * c // 2, wait=True) == 2 * c
        assert kinds(oracle, arena, buf) == [z, "rw", z, z, "rw"] + [z] * 5
        arena.close()
        assert kinds(oracle, arena, buf) == [z] * 10
        assert oracle.mem_free() >= free0 - c // 2, "close() left physical memory behind"


def test_reservation_gone_after_destruction(gpu_device, oracle):
    with eager_zeros():  # a deferred reservation maps nothing: the oracle could not tell
        arena = jax_vmm.Arena(64 * MiB, device=gpu_device)
    base = arena.base
    assert oracle.access(base) == cu_oracle.READ
    arena.close()
    del arena
    gc.collect()
    assert oracle.access(base) is None, "the reservation outlived its arena"


def test_large_chunks(gpu_device, oracle):
    with jax_vmm.Arena(1 * GiB, device=gpu_device, chunk_bytes=64 * MiB) as arena:
        assert arena.chunk_bytes == 64 * MiB and arena.base % (64 * MiB) == 0
        buf = arena.allocate((100 * MiB,), jnp.uint8)
        before = arena.stats()["set_access_calls"]
        assert buf.commit() == 128 * MiB
        assert arena.stats()["set_access_calls"] == before + 1, "one set-access per run"
        assert kinds(oracle, arena, buf) == ["rw", "rw"]


def test_deferred_zeros_map_nothing_until_the_first_view(gpu_device, oracle):
    with eager_zeros(False):
        arena = jax_vmm.Arena(64 * MiB, device=gpu_device)
    with arena:
        c = arena.chunk_bytes
        states = oracle.chunk_states(arena.base, arena.reserved_bytes, c)
        assert all(s.access is None for s in states), "no zero piece before a view"
        assert not arena.stats()["unbacked_reads_zero"]
        buf = arena.allocate((8 * c // 4,), jnp.float32)
        assert buf.commit(c, 3 * c) == 2 * c
        access = [s.access for s in oracle.chunk_states(buf.address, 8 * c, c)]
        assert access == [None, cu_oracle.READWRITE, cu_oracle.READWRITE] + [None] * 5
        write_bytes(buf, c, np.ones(2 * c // 4, np.float32))
        # The first view: every unbacked byte reads zeros from now on, the data stays.
        assert float(jax.jit(jnp.sum)(buf.array)) == 2 * c // 4
        assert arena.stats()["unbacked_reads_zero"]
        assert kinds(oracle, arena, buf) == ["zero", "rw", "rw"] + ["zero"] * 5
        buf.decommit(wait=True)
        assert kinds(oracle, arena, buf) == ["zero"] * 8
        assert float(jax.jit(jnp.sum)(buf.array)) == 0.0


# -- reads through JAX --------------------------------------------------------------------


def test_unbacked_reads_zero_through_jax(gpu_device, oracle):
    with jax_vmm.Arena(4 * GiB, device=gpu_device) as arena:
        c = arena.chunk_bytes
        buf = arena.allocate((GiB // 4,), jnp.float32)  # 1 GiB, all but one chunk unbacked
        buf.commit(0, c)
        write_bytes(buf, 0, np.ones(c // 4, np.float32))
        total = float(jax.jit(jnp.sum)(buf.array))
        assert total == c // 4
        # a second, wider view over the same memory (bf16) is also readable everywhere
        wide = buf.view((GiB // 2,), jnp.bfloat16)
        assert bool(jax.jit(lambda x: jnp.isfinite(x).all())(wide))
        buf.decommit()
        assert float(jax.jit(jnp.sum)(buf.array)) == 0.0
        assert kinds(oracle, arena, buf, c)[0] == "zero"


def test_recommitted_chunks_read_zero_not_old_bytes(gpu_device):
    """Physical memory released by one commit comes back to the next ones: the driver
    zero-fills every newly committed run, so it never shows the old bytes."""
    with jax_vmm.Arena(256 * MiB, device=gpu_device) as arena:
        c = arena.chunk_bytes
        bufs = [arena.allocate((8 * c,), jnp.uint8) for _ in range(2)]
        dirty = np.full(8 * c, 0xA5, np.uint8)
        for _ in range(3):
            for b in bufs:
                b.commit()
                assert not read_bytes(b).any(), "a committed chunk showed old bytes"
                write_bytes(b, 0, dirty)
            for b in bufs:
                b.decommit()


def test_views_keep_their_address_across_commits(gpu_device):
    with jax_vmm.Arena(64 * MiB, device=gpu_device) as arena:
        c = arena.chunk_bytes
        buf = arena.allocate((4 * c,), jnp.uint8)
        old = buf.array
        assert old.unsafe_buffer_pointer() == buf.address
        buf.commit(0, c)
        buf.commit(2 * c, 4 * c)
        buf.decommit(2 * c, 3 * c)
        new = buf.array
        assert new.unsafe_buffer_pointer() == old.unsafe_buffer_pointer() == buf.address
        data = (np.arange(c) % 251 + 1).astype(np.uint8)
        write_bytes(buf, 3 * c, data)  # written after `old` was made: it sees it anyway
        np.testing.assert_array_equal(np.asarray(old[3 * c :]), data)
        assert not np.asarray(old[c : 3 * c]).any()


def test_donation_keeps_the_arena_address(gpu_device):
    with jax_vmm.Arena(64 * MiB, device=gpu_device) as arena:
        buf = arena.allocate((1024,), jnp.float32)
        buf.commit()
        step = jax.jit(lambda x: x.at[3].set(7.0), donate_argnums=0)
        out = step(buf.array)
        out.block_until_ready()
        assert out.unsafe_buffer_pointer() == buf.address, "donation moved the buffer"
        assert read_bytes(buf, 12, 16).view(np.float32)[0] == 7.0


# -- failures roll back -------------------------------------------------------------------


@pytest.mark.parametrize(
    "op,nth",
    [("create", 1), ("create", 3), ("map", 1), ("map", 4), ("set_access", 1), ("set_access", 2)],
)
def test_injected_fault_rolls_back(gpu_device, oracle, faults, op, nth):
    # Large chunks: a leaked chunk would show as 64 MiB missing from the driver's free count.
    with jax_vmm.Arena(1 * GiB, device=gpu_device, chunk_bytes=64 * MiB) as arena:
        c = arena.chunk_bytes
        buf = arena.allocate((8 * c,), jnp.uint8)
        buf.commit(0, c)
        buf.commit(3 * c, 4 * c)
        before_kinds = kinds(oracle, arena, buf)
        before_handles = [oracle.allocation_handle(buf.address + i * c) for i in (0, 3)]
        before_stats = stable_stats(arena)
        failed = arena.stats()["failed_commits"]
        free0 = oracle.mem_free()
        faults.arm(arena, op, nth)
        # chunks 1-2 and 4-7: two runs, so two set-access calls
        with pytest.raises(InjectedFault):
            buf.commit(0, 8 * c)
        faults.disarm(arena)
        assert kinds(oracle, arena, buf) == before_kinds
        assert [oracle.allocation_handle(buf.address + i * c) for i in (0, 3)] == before_handles
        assert stable_stats(arena) == before_stats
        assert arena.stats()["failed_commits"] == failed + 1
        # One-sided: a leak lowers free memory; other tests' buffers being
        # garbage-collected meanwhile can only raise it.
        assert oracle.mem_free() > free0 - c // 2, "a failed commit kept physical memory"
        assert buf.commit(0, 8 * c) == 6 * c  # and the arena still works


def test_rollback_checks_catch_a_broken_rollback(gpu_device, oracle, faults):
    """With the rollback's release and unmap calls broken (the testing layer's
    fault-injecting driver), the same kind of failed commit keeps physical memory, and the
    driver oracle sees it: the checks above would fail. (The chunks leak for the rest of
    this process: 64 MiB each.)"""
    with jax_vmm.Arena(1 * GiB, device=gpu_device, chunk_bytes=64 * MiB) as arena:
        c = arena.chunk_bytes
        buf = arena.allocate((4 * c,), jnp.uint8)
        free0 = oracle.mem_free()
        faults.break_release(arena)
        try:
            faults.arm(arena, "map", 3)
            with pytest.raises(InjectedFault):
                buf.commit()
        finally:
            faults.disarm(arena)
        assert free0 - oracle.mem_free() >= 2 * c, "leaked chunks should hold driver memory"


def test_out_of_memory_is_memory_error_and_rolls_back(gpu_device, oracle):
    total = oracle.mem_total()
    chunk = 1 * GiB  # few, large chunks: quick to exhaust and to roll back
    reserve = (total // chunk + 8) * chunk
    with jax_vmm.Arena(reserve, device=gpu_device, chunk_bytes=chunk) as arena:
        buf = arena.allocate((reserve - 2 * chunk,), jnp.uint8)
        free0 = oracle.mem_free()
        before = stable_stats(arena)
        with pytest.raises(MemoryError) as info:
            buf.commit()
        err = info.value
        assert isinstance(err, jax_vmm.OutOfMemoryError)
        msg = str(err)
        assert str(err.requested_bytes) in msg and str(err.free_bytes) in msg
        assert err.requested_bytes > 0
        assert "XLA_PYTHON_CLIENT_PREALLOCATE" in msg and "XLA_PYTHON_CLIENT_MEM_FRACTION" in msg
        assert stable_stats(arena) == before
        assert "rw" not in kinds(oracle, arena, buf)
        assert abs(oracle.mem_free() - free0) < chunk // 2, "the failed commit kept memory"


def test_injected_out_of_memory(gpu_device, oracle, faults):
    with jax_vmm.Arena(64 * MiB, device=gpu_device) as arena:
        c = arena.chunk_bytes
        buf = arena.allocate((4 * c,), jnp.uint8)
        faults.arm(arena, "create", 2, out_of_memory=True)
        with pytest.raises(MemoryError, match="XLA_PYTHON_CLIENT_PREALLOCATE"):
            buf.commit()
        assert kinds(oracle, arena, buf) == [unbacked_kind(arena)] * 4


# -- concurrency --------------------------------------------------------------------------


def _churn(oracle, arena, buf, seed, rounds, errors):
    try:
        c = arena.chunk_bytes
        n = buf.nbytes // c
        rng = np.random.default_rng(seed)
        for _ in range(rounds):
            lo = int(rng.integers(0, n))
            hi = int(rng.integers(lo + 1, n + 1))
            buf.commit(lo * c, hi * c)
            got = oracle.kinds(buf.address + lo * c, (hi - lo) * c, c)
            assert got == ["rw"] * (hi - lo), got
            buf.decommit(0, buf.nbytes, wait=True)
            got = oracle.kinds(buf.address, buf.nbytes, c)
            assert got == [unbacked_kind(arena)] * n, got
    except BaseException as e:  # noqa: BLE001 - reported by the main thread
        errors.append(e)


@pytest.mark.parametrize("num_arenas,bufs_per_arena", [(1, 6), (3, 2)])
def test_threads_commit_and_decommit(gpu_device, oracle, num_arenas, bufs_per_arena):
    arenas = [jax_vmm.Arena(256 * MiB, device=gpu_device) for _ in range(num_arenas)]
    try:
        c = arenas[0].chunk_bytes
        free0 = oracle.mem_free()
        work = [(a, a.allocate((8 * c,), jnp.uint8)) for a in arenas for _ in range(bufs_per_arena)]
        errors: list[BaseException] = []
        threads = [
            threading.Thread(target=_churn, args=(oracle, a, b, i, 20, errors))
            for i, (a, b) in enumerate(work)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        for _a, b in work:
            assert b.backed_bytes == 0
            assert "rw" not in oracle.kinds(b.address, b.nbytes, c)
        for a in arenas:
            s = a.stats()
            assert s["backed_bytes"] == 0 and s["chunks_created"] == s["chunks_released"]
        # One-sided: a leak lowers free memory; other tests' buffers being
        # garbage-collected meanwhile can only raise it.
        assert oracle.mem_free() > free0 - c // 2
    finally:
        for a in arenas:
            a.close()


# -- a commit while the GPU reads the same (unbacked) memory ------------------------------

_READ_WHILE_COMMIT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, jax_vmm
    GiB = 1 << 30
    arena = jax_vmm.Arena(2 * GiB, device=jax.devices()[0])
    buf = arena.allocate((GiB // 4,), jnp.float32)
    c = arena.chunk_bytes

    @jax.jit
    def reread(x):  # ~a second of reads over the whole buffer (i keeps XLA from hoisting)
        body = lambda i, acc: acc + jnp.sum(x * (i + 1).astype(jnp.float32))
        return jax.lax.fori_loop(0, 3000, body, 0.0)

    view = buf.array
    reread(view).block_until_ready()  # compile
    for _ in range(3):
        out = reread(view)            # runs on the GPU while ...
        buf.commit(0, 64 * c)         # ... the host swaps the zero mapping for real memory
        buf.decommit()
        # fresh chunks carry no zero guarantee: only survival and completion are checked
        print(float(out))
    print("ok")
""")


def test_commit_while_device_reads_unbacked_memory(gpu_device):
    """A commit replaces the zero mapping under memory a running kernel may read. The
    arena must not let that kernel see a hole (the GPU would fault and kill the
    process), so this runs in a subprocess and checks it survived."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(cuda_ordinal(gpu_device)))
    proc = subprocess.run(
        [sys.executable, "-c", _READ_WHILE_COMMIT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )


# -- driver facts jax_vmm relies on -------------------------------------------------------


def test_driver_facts(gpu_device):
    facts = cu_oracle.probe_driver_facts(cuda_ordinal(gpu_device))
    print(facts)
    assert facts["read_only_access_ok"], "the zero chunk needs read-only device mappings"
    assert facts["access_flags_seen"] == cu_oracle.READ
    assert not facts["unmap_partial_mapping_ok"], "cuMemUnmap unmapped part of a mapping"
    # Mapping part of an allocation is refused on the H200 (CUDA_ERROR_NOT_SUPPORTED): the
    # zero layout maps only whole allocations, whatever this fact says.
    assert facts["read_only_over_pieces_ok"], "one read-only cuMemSetAccess over zero pieces"
