"""A numpy model of the tensor-core kernel's fragment bookkeeping (ffi/src/ops/attention/
attention_tensor_core.cuh, SplitKernelTensorCore), checked on the CPU.

The kernel feeds mma.sync.m16n8k16 straight from row-major K/V rows by permuting the
reduction dimension (QK) and pairing tokens with byte permutes (PV). This model follows
the PTX ISA fragment layouts and the kernel's per-lane index arithmetic line by line --
which lane loads which 16 bytes, how words become A/B registers, where the C elements
land -- and checks that the result is exactly K Q^T and P V, that every output dim is
written once, and that rows at or past the chunk length are never used (they hold NaN).
It is a model kept in sync by hand, not the CUDA code: the GPU tests in
test_attention.py check the kernel itself.
"""

from __future__ import annotations

import numpy as np
import pytest

Reg = tuple[float, float]  # a 32-bit register holding two 16-bit elements (low, high)


def lanes():
    for lane in range(32):
        yield lane, lane >> 2, lane & 3  # lane, groupID, threadID_in_group


def load16(row: np.ndarray, start: int) -> list[Reg]:
    """A 16-byte load of 8 elements as 4 registers."""
    v = row[start : start + 8]
    return [(v[2 * j], v[2 * j + 1]) for j in range(4)]


ZERO: list[Reg] = [(0.0, 0.0)] * 4


def byte_perm(x: Reg, y: Reg, sel: int) -> Reg:
    """__byte_perm with the two selectors the kernel uses."""
    assert sel in (0x5410, 0x7632)
    return (x[0], y[0]) if sel == 0x5410 else (x[1], y[1])


def mma(
    c: list[list[float]], a: dict[int, tuple[Reg, Reg, Reg, Reg]], b: dict[int, tuple[Reg, Reg]]
) -> None:
    """D = A B + C for m16n8k16 with the PTX fragment layouts (per-lane registers)."""
    A = np.full((16, 16), np.nan)
    B = np.full((16, 8), np.nan)
    for lane, g, t in lanes():
        a0, a1, a2, a3 = a[lane]
        b0, b1 = b[lane]
        A[g, 2 * t : 2 * t + 2], A[g + 8, 2 * t : 2 * t + 2] = a0, a1
        A[g, 2 * t + 8 : 2 * t + 10], A[g + 8, 2 * t + 8 : 2 * t + 10] = a2, a3
        B[2 * t : 2 * t + 2, g], B[2 * t + 8 : 2 * t + 10, g] = b0, b1
    assert not np.isnan(A).any() and not np.isnan(B).any(), "a fragment element was never set"
    R = A @ B
    for lane, g, t in lanes():
        c[lane][0] += R[g, 2 * t]
        c[lane][1] += R[g, 2 * t + 1]
        c[lane][2] += R[g + 8, 2 * t]
        c[lane][3] += R[g + 8, 2 * t + 1]


def model_tile(D: int, GB: int, n: int, rng: np.random.Generator) -> None:
    NQT = 1 if GB <= 8 else 2
    kKB, kVC, kMT = D // 32, D // 64, D // 16
    K = rng.standard_normal((16, D))
    V = rng.standard_normal((16, D))
    Q = rng.standard_normal((GB, D))
    K[n:] = np.nan  # past the length: must never be loaded
    V[n:] = np.nan

    # Q fragments: lane (g, t) holds dims [32 j + 8 t, +8) of head 8 nt + g.
    qf = {
        (lane, nt, j): load16(Q[nt * 8 + g], 32 * j + 8 * t) if nt * 8 + g < GB else ZERO
        for lane, g, t in lanes()
        for nt in range(NQT)
        for j in range(kKB)
    }
    # Phase 1: A rows g and g + 8 are tokens; same permutation of the dims as Q.
    sc = [[[0.0] * 4 for _ in range(32)] for _ in range(NQT)]
    ka = {
        (lane, j): load16(K[g], 32 * j + 8 * t) if g < n else ZERO
        for lane, g, t in lanes()
        for j in range(kKB)
    }
    kb = {
        (lane, j): load16(K[g + 8], 32 * j + 8 * t) if g + 8 < n else ZERO
        for lane, g, t in lanes()
        for j in range(kKB)
    }
    for j in range(kKB):
        for nt in range(NQT):
            for half in range(2):
                a = {
                    lane: (
                        ka[lane, j][2 * half],
                        kb[lane, j][2 * half],
                        ka[lane, j][2 * half + 1],
                        kb[lane, j][2 * half + 1],
                    )
                    for lane in range(32)
                }
                b = {
                    lane: (qf[lane, nt, j][2 * half], qf[lane, nt, j][2 * half + 1])
                    for lane in range(32)
                }
                mma(sc[nt], a, b)
    logits = np.full((GB, 16), np.nan)
    for lane, g, t in lanes():
        for nt in range(NQT):
            for e in range(2):
                head = nt * 8 + 2 * t + e
                if head < GB:
                    if g < n:
                        logits[head, g] = sc[nt][lane][e]
                    if g + 8 < n:
                        logits[head, g + 8] = sc[nt][lane][2 + e]
    np.testing.assert_allclose(logits[:, :n], Q @ K[:n].T, rtol=1e-12, atol=1e-12)
    assert np.isnan(logits[:, n:]).all(), "a logit past the length was written"

    # Phase 3: O^T = V^T P^T; P is zero past n (phase 2 zero-fills the tile tail).
    P = rng.random((GB, 16))
    P[:, n:] = 0.0
    pb = {
        (lane, nt): (
            (P[nt * 8 + g, 2 * t], P[nt * 8 + g, 2 * t + 1]),
            (P[nt * 8 + g, 2 * t + 8], P[nt * 8 + g, 2 * t + 9]),
        )
        if nt * 8 + g < GB
        else ((0.0, 0.0), (0.0, 0.0))
        for lane, g, t in lanes()
        for nt in range(NQT)
    }
    vr = {}
    for lane, g, t in lanes():
        for t4 in range(4):
            row = 2 * t + (t4 & 1) + (t4 >> 1) * 8
            for x in range(kVC):
                vr[lane, t4, x] = load16(V[row], 64 * x + 8 * g) if row < n else ZERO
    acc = [[[0.0] * 4 for _ in range(32)] for _ in range(NQT * kMT)]
    for x in range(kVC):
        for i2 in range(4):
            a = {}
            for lane in range(32):
                w0, w1, w2, w3 = (vr[lane, t4, x] for t4 in range(4))
                a[lane] = (
                    byte_perm(w0[i2], w1[i2], 0x5410),
                    byte_perm(w0[i2], w1[i2], 0x7632),
                    byte_perm(w2[i2], w3[i2], 0x5410),
                    byte_perm(w2[i2], w3[i2], 0x7632),
                )
            for nt in range(NQT):
                mma(acc[nt * kMT + 4 * x + i2], a, {lane: pb[lane, nt] for lane in range(32)})
    O = np.full((GB, D), np.nan)
    for lane, g, t in lanes():
        for nt in range(NQT):
            for e in range(2):
                head = nt * 8 + 2 * t + e
                if head < GB:
                    for mt in range(kMT):
                        d = 64 * (mt // 4) + 8 * g + 2 * (mt % 4)
                        assert np.isnan(O[head, d]) and np.isnan(O[head, d + 1]), (
                            "dim written twice"
                        )
                        O[head, d] = acc[nt * kMT + mt][lane][e]
                        O[head, d + 1] = acc[nt * kMT + mt][lane][2 + e]
    assert not np.isnan(O).any(), "an output dim was never written"
    np.testing.assert_allclose(O, P[:, :n] @ V[:n], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("D", [64, 128, 256])
def test_fragment_model(D):
    for GB in (1, 2, 3, 4, 6, 8, 9, 12, 16):
        for n in (1, 5, 8, 9, 15, 16):
            model_tile(D, GB, n, np.random.default_rng(D * 1000 + GB * 20 + n))


def test_fragment_model_detects_a_wrong_permutation():
    """The model can fail: pairing the tokens with the wrong selector breaks P V."""
    global byte_perm
    original = byte_perm
    byte_perm = lambda x, y, sel: (x[0], y[1]) if sel == 0x5410 else (x[1], y[0])  # noqa: E731
    try:
        with pytest.raises(AssertionError):
            model_tile(64, 4, 16, np.random.default_rng(0))
    finally:
        byte_perm = original
