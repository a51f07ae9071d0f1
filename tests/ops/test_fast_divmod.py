"""The tiled kv_write kernel finds the token of each 16-byte vector with FastDivmod
(ffi/src/common/fast_divmod.h), a multiply-high and a shift. Run here on the host with
the device's arithmetic, against numpy's integer division: every divisor the kernel can
see (vectors per token, vectors per fp8 head) up to 4096 with every small dividend, and
sampled large ones up to the 2^31 bound."""

from __future__ import annotations

import numpy as np
import pytest

import jax_vmm.testing

LIMIT = 1 << 31


def _check(divisor: int, dividends: np.ndarray) -> None:
    got = jax_vmm.testing.fast_div(divisor, dividends)
    want = dividends // np.uint32(divisor)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (
        f"divisor {divisor}: {bad.size} wrong quotients, first n={dividends[bad[0]]} "
        f"got {got[bad[0]]} want {want[bad[0]]}"
    )


def test_every_small_divisor_and_dividend():
    small = np.arange(70_000, dtype=np.uint32)  # past 32 tokens x 2048 vectors
    top = np.arange(LIMIT - 4096, LIMIT, dtype=np.uint32)
    for d in range(1, 4097):
        _check(d, small)
        _check(d, top)


def test_sampled_divisors_and_dividends_up_to_the_bound():
    rng = np.random.default_rng(0)
    n = rng.integers(0, LIMIT, 20_000, dtype=np.uint32)
    powers = [1 << k for k in range(31)]
    divisors = sorted(
        {p + e for p in powers for e in (-1, 0, 1) if 1 <= p + e < LIMIT}
        | {int(x) for x in rng.integers(1, LIMIT, 300)}
    )
    for d in divisors:
        _check(d, n)
        edges = np.array([0, d - 1, d, 2 * d - 1, LIMIT - 1], np.int64)
        _check(d, edges[(edges >= 0) & (edges < LIMIT)].astype(np.uint32))


@pytest.mark.parametrize("divisor,dividend", [(0, 1), (LIMIT, 1), (3, LIMIT)])
def test_out_of_range_arguments_are_refused(divisor, dividend):
    with pytest.raises(ValueError, match=r"fast_div: .* 2\^31"):
        jax_vmm.testing.fast_div(divisor, np.array([dividend], np.uint32))
