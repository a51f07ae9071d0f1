"""The CUDA driver's zero-mapping bookkeeping (ffi/src/drivers/cuda/zero_layout.h), on the
CPU: every unbacked chunk of a reservation must stay covered by exactly one read-only
zero piece through any sequence of commits and releases, and every piece must be one the
driver can map: cuMemMap maps only whole allocations, so a piece is a power of two times
the granularity, at most the largest zero allocation, aligned to its size. The GPU tests
check the same layout against the CUDA driver itself."""

from __future__ import annotations

import numpy as np
import pytest

from jax_vmm.base.loader import core as _core

ZeroLayout = _core.testing.ZeroLayout
MiB = 1 << 20
CHUNK = 2 * MiB
BASE = 1 << 40


def _check(z, free: np.ndarray, max_piece: int) -> None:
    pieces = z.pieces()
    ends = [va + n for va, n in pieces]
    assert all(e <= nxt for e, (nxt, _) in zip(ends, pieces[1:])), "pieces overlap"
    for va, n in pieces:
        assert CHUNK <= n <= max_piece and n & (n - 1) == 0, (
            f"piece of {n} bytes: no such zero allocation"
        )
        assert (va - BASE) % n == 0, f"piece [{va:#x}, +{n}) is not aligned to its size"
    for i, is_free in enumerate(free):
        got = z.covered(BASE + i * CHUNK, CHUNK)
        assert got == (CHUNK if is_free else 0), f"chunk {i}: covered {got}, free={is_free}"


@pytest.mark.parametrize("max_piece", [CHUNK, 8 * MiB, 32 * MiB])
def test_random_commits_and_releases_keep_the_layout_exact(max_piece):
    n = 96  # 192 MiB: 6 pieces of 32 MiB, one partial
    z = ZeroLayout(BASE, n * CHUNK, max_piece, CHUNK)
    z.add(z.tile(BASE, n * CHUNK))
    free = np.ones(n, bool)
    _check(z, free, max_piece)
    rng = np.random.default_rng(0)
    for _ in range(400):
        lo = int(rng.integers(0, n))
        hi = int(rng.integers(lo + 1, min(n, lo + 20) + 1))
        va, size = BASE + lo * CHUNK, (hi - lo) * CHUNK
        if free[lo:hi].all():  # a commit of a run of unbacked chunks
            unmap, remap, hull_va, hull_bytes = z.plan_clear(va, size)
            assert hull_va <= va and va + size <= hull_va + hull_bytes
            assert sum(b for _, b in unmap) == hull_bytes
            assert sum(b for _, b in remap) == hull_bytes - size  # the rest comes back
            assert len(remap) <= 2 * (max_piece // CHUNK).bit_length()
            z.remove(unmap)
            z.add(remap)
            free[lo:hi] = False
        elif not free[lo:hi].any():  # a release of a run of backed chunks
            z.add(z.tile(va, size))
            free[lo:hi] = True
        _check(z, free, max_piece)


def test_a_large_aligned_commit_clears_whole_pieces():
    z = ZeroLayout(BASE, 1 << 30, 32 * MiB, CHUNK)
    z.add(z.tile(BASE, 1 << 30))
    assert len(z.pieces()) == 32
    unmap, remap, _, _ = z.plan_clear(BASE + 32 * MiB, 64 * MiB)
    assert unmap == [(BASE + 32 * MiB, 32 * MiB), (BASE + 64 * MiB, 32 * MiB)] and remap == []
    unmap, remap, _, _ = z.plan_clear(BASE + 2 * MiB, 2 * MiB)  # a decode-sized commit
    assert unmap == [(BASE, 32 * MiB)]
    assert remap == [(BASE + o * MiB, n * MiB) for o, n in [(0, 2), (4, 4), (8, 8), (16, 16)]]


def test_an_unaligned_tail_is_tiled_into_aligned_pieces():
    z = ZeroLayout(BASE, 7 * CHUNK, 32 * MiB, CHUNK)  # 14 MiB: no piece of 14 MiB exists
    assert z.tile(BASE, 7 * CHUNK) == [
        (BASE, 8 * MiB),
        (BASE + 8 * MiB, 4 * MiB),
        (BASE + 12 * MiB, 2 * MiB),
    ]
    with pytest.raises(ValueError, match="not a power-of-two piece"):
        z.add([(BASE, 6 * MiB)])  # cuMemMap would refuse it: the guard the driver relies on
    with pytest.raises(ValueError, match="not a power-of-two piece"):
        z.add([(BASE + 4 * MiB, 8 * MiB)])  # the right size, misaligned
    with pytest.raises(ValueError, match="powers of two"):
        ZeroLayout(BASE, 7 * CHUNK, 24 * MiB, CHUNK)


def test_bad_bookkeeping_is_refused():
    z = ZeroLayout(BASE, 16 * CHUNK, 8 * MiB, CHUNK)
    z.add(z.tile(BASE, 16 * CHUNK))
    z.remove(z.plan_clear(BASE, CHUNK)[0])  # piece [0, 8 MiB) gone, remainder not added
    with pytest.raises(ValueError, match="not zero-mapped"):
        z.plan_clear(BASE + CHUNK, CHUNK)
    with pytest.raises(ValueError, match="overlaps"):
        z.add([(BASE + 8 * MiB, CHUNK)])


def test_zero_piece_size():
    assert _core.testing.zero_piece_bytes(141 << 30, CHUNK) == 256 * MiB  # an H200
    assert _core.testing.zero_piece_bytes(16 << 30, CHUNK) == 32 * MiB  # 1/512 of the device
    assert _core.testing.zero_piece_bytes(512 * MiB, CHUNK) == CHUNK
    assert _core.testing.zero_piece_bytes(141 << 30, CHUNK, 32 * MiB) == 32 * MiB
    assert _core.testing.zero_piece_bytes(141 << 30, CHUNK, 48 * MiB) == 32 * MiB  # a power of 2


def test_zero_piece_ceiling_from_env(monkeypatch):
    read = _core.testing.zero_piece_ceiling_from_env
    monkeypatch.delenv("JAX_VMM_ZERO_PIECE_MAX_BYTES", raising=False)
    assert read() == 256 * MiB
    monkeypatch.setenv("JAX_VMM_ZERO_PIECE_MAX_BYTES", str(32 * MiB))
    assert read() == 32 * MiB
    for bad in ("0", "-1", "32MiB", "1.5"):
        monkeypatch.setenv("JAX_VMM_ZERO_PIECE_MAX_BYTES", bad)
        with pytest.raises(ValueError, match="JAX_VMM_ZERO_PIECE_MAX_BYTES=.*positive number"):
            read()
