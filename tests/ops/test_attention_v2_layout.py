"""A numpy model of the streaming kernel's shared-memory ring
(ffi/src/ops/attention/stream_ring.cuh, read by stream_kernel.cuh): where cp.async puts
each 16-byte chunk of a K/V tile (XOR swizzle), which bytes each lane reads for the QK and
PV fragments, and the movmatrix hand-over of the softmax weights from the QK accumulator
layout to the PV operand layout.

Checked for every (storage, head_dim) the kernel instantiates, over its ring tiles of 16
or 32 token rows (32 for rows of <= 128 bytes, read as two 16-token sub-tiles): the
swizzle is a bijection inside each row (every byte of the tile lands exactly once), every fragment
read returns the element the fragment layout asks for, and each warp-wide read needs no
more shared-memory wavefronts than its bytes require (no bank conflicts). The index
arithmetic is copied from the kernel by hand; the GPU tests check the kernel itself.
"""

from __future__ import annotations

import numpy as np
import pytest

CONFIGS = [(2, 64), (2, 128), (2, 256), (1, 64), (1, 128), (1, 256)]  # (bytes per element, D)


def tile_rows(rb: int) -> int:
    """Tokens per ring tile (stream_plan.h TileTokens): 32 for rows of <= 128 bytes."""
    return 32 if rb <= 128 else 16


def swizzle(row: int, rb: int) -> int:
    chunks = rb // 16
    return row & 7 if chunks >= 8 else (row >> 1) & 3


def physical_row(row: int, rb: int) -> int:
    return row if rb // 16 >= 8 else row ^ ((row >> 1) & 1)


def ring_offset(row: int, byte: int, rb: int) -> int:
    return physical_row(row, rb) * rb + (((byte >> 4) ^ swizzle(row, rb)) << 4) + (byte & 15)


def lanes():
    for lane in range(32):
        yield lane, lane >> 2, lane & 3


def wavefronts(accesses: list[tuple[int, int]]) -> int:
    """Shared-memory wavefronts of one warp instruction: accesses (byte address, width).
    A wavefront serves 128 bytes over 32 banks of 4 bytes; lanes reading the same word
    share it. The count is the largest number of distinct words asked of one bank, but
    at least the bytes over 128."""
    words_per_bank: dict[int, set[int]] = {}
    total = 0
    for addr, width in accesses:
        total += width
        for w in range(addr // 4, (addr + width) // 4):
            words_per_bank.setdefault(w % 32, set()).add(w)
    return max(max(len(s) for s in words_per_bank.values()), -(-total // 128))


@pytest.mark.parametrize("eb,D", CONFIGS, ids=lambda x: str(x))
def test_swizzle_is_a_bijection_and_the_copy_lands_every_byte(eb, D):
    rb = D * eb
    rows = tile_rows(rb)
    tile = np.full(rows * rb, -1)
    for q in range(rows * rb // 16):  # the kernel's chunk loop: chunk q -> (row, col)
        row, col = divmod(q, rb // 16)
        dst = ring_offset(row, col * 16, rb)
        assert tile[dst : dst + 16].max() == -1, "two chunks written to one place"
        tile[dst : dst + 16] = np.arange(16) + (row * rb + col * 16)
    assert (np.sort(tile) == np.arange(rows * rb)).all()
    # and every (row, byte) read through ring_offset finds that source byte
    for row in range(rows):
        for byte in range(rb):
            assert tile[ring_offset(row, byte, rb)] == row * rb + byte


def qk_reads(eb: int, D: int, offset):
    """Each warp-wide K fragment read of a ring tile: (what, [(byte address, width)]), for
    rows grp and grp + 8 of every 16-token sub-tile; offset(row, byte, rb) places a byte."""
    rb, width = D * eb, 8 * eb  # 8 elements per lane-load
    for j in range(D // 32):
        for rowsel in range(0, tile_rows(rb), 8):
            yield (
                ("qk", j, rowsel),
                [
                    (offset(grp + rowsel, (32 * j + 8 * tig) * eb, rb), width)
                    for _, grp, tig in lanes()
                ],
            )


def pv_reads(eb: int, D: int, offset):
    """Each warp-wide V fragment read: rows 2 tig (+ 1, + 8, + 9) of every sub-tile."""
    rb, width = D * eb, 8 * eb
    for sub in range(tile_rows(rb) // 16):
        for x in range(D // 64):
            for t4 in range(4):
                rows = [16 * sub + 2 * tig + (t4 & 1) + 8 * (t4 >> 1) for _, _, tig in lanes()]
                byte = [(64 * x + 8 * grp) * eb for _, grp, _ in lanes()]
                yield ("pv", sub, x, t4), [(offset(r, c, rb), width) for r, c in zip(rows, byte)]


@pytest.mark.parametrize("eb,D", CONFIGS, ids=lambda x: str(x))
def test_fragment_reads_are_conflict_free(eb, D):
    for what, acc in [*qk_reads(eb, D, ring_offset), *pv_reads(eb, D, ring_offset)]:
        assert wavefronts(acc) == 32 * 8 * eb // 128, (what, wavefronts(acc))


def test_wavefront_model_sees_a_conflict():
    """The unswizzled layout (rows 256 B apart, same banks) is an 8-way conflict: the
    model above would notice a swizzle that does not spread the rows."""
    rb = 256
    acc = [(grp * rb + 16 * tig, 16) for _, grp, tig in lanes()]
    assert wavefronts(acc) == 8


def test_movmatrix_turns_the_logit_layout_into_the_pv_operand():
    """QK's accumulator: lane (grp, tig) holds P[token grp][heads 2tig, 2tig+1] (and
    token grp + 8). movmatrix.trans of the packed pair gives lane (grp, tig) the pair at
    row grp, columns 2tig, 2tig+1 of the transpose, i.e. P[tokens 2tig, 2tig+1][head grp]:
    the m16n8k16 B fragment b0 (k = tokens 2tig.., n = head grp); the grp + 8 half gives b1."""
    rng = np.random.default_rng(0)
    P = rng.standard_normal((16, 8))  # tokens x heads
    held = {
        lane: ((P[g, 2 * t], P[g, 2 * t + 1]), (P[g + 8, 2 * t], P[g + 8, 2 * t + 1]))
        for lane, g, t in lanes()
    }
    for half in (0, 1):
        M = np.zeros((8, 8))  # the 8x8 matrix the warp holds, lane 4r + c: row r, cols 2c, 2c+1
        for lane, g, t in lanes():
            M[g, 2 * t : 2 * t + 2] = held[lane][half]
        MT = M.T
        for _, g, t in lanes():
            got = MT[g, 2 * t : 2 * t + 2]
            want = P[8 * half + 2 * t : 8 * half + 2 * t + 2, g]  # b0 / b1 of the PV mma
            assert np.array_equal(got, want)


def padded_offset(row: int, byte: int, rb: int) -> int:
    """The bulk-copy variant (impl="stream_tma"): plain rows, 16 bytes of padding each."""
    return row * (rb + 16) + byte


@pytest.mark.parametrize("eb,D", CONFIGS, ids=lambda x: str(x))
def test_padded_rows_are_conflict_free(eb, D):
    for what, acc in [*qk_reads(eb, D, padded_offset), *pv_reads(eb, D, padded_offset)]:
        assert wavefronts(acc) == 32 * 8 * eb // 128, (what, wavefronts(acc))
