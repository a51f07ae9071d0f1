"""The C++ loops behind KVArena.ensure_all (ffi/src/python/ensure_plan_bindings.cc)
against the NumPy expressions they stand for, on random tables."""

from __future__ import annotations

import numpy as np
import pytest

from jax_vmm import _core


def _tables(rng, n):
    covered = rng.integers(0, 64, n) * 16
    tokens = np.where(rng.random(n) < 0.2, 0, rng.integers(0, 1100, n))
    valid_gen = rng.integers(2, 5, n)
    blocked = np.where(rng.random(n) < 0.3, covered, -1)
    return [np.ascontiguousarray(a, np.int64) for a in (tokens, covered, valid_gen, blocked)]


@pytest.mark.parametrize("n", [0, 1, 7, 64, 1000])
def test_the_loops_match_numpy(n):
    rng = np.random.default_rng(n)
    for _ in range(20):
        tokens, covered, valid_gen, blocked = _tables(rng, n)
        gen, ahead, max_tokens = 3, int(rng.integers(0, 64)), 1000
        fast = (tokens <= covered) & (valid_gen == gen)
        assert (
            _core.ensure_need(tokens, covered, valid_gen, gen)
            == np.flatnonzero((tokens > 0) & ~fast).tolist()
        )
        due = (tokens > 0) & (covered - tokens <= ahead) & (covered < max_tokens)
        due &= blocked != covered
        got = _core.ahead_due(tokens, covered, blocked, ahead, max_tokens)
        assert got == np.flatnonzero(due).tolist()
        lo, hi = _core.token_range(tokens)
        assert (lo, hi) == ((tokens.min(), tokens.max()) if n else (0, 0))


def test_tables_of_other_lengths_are_refused():
    a, b = np.zeros(3, np.int64), np.zeros(4, np.int64)
    with pytest.raises(ValueError, match="tables of 4 and 3 entries"):
        _core.ensure_need(a, b, a, 0)
    with pytest.raises(TypeError):  # int32: not the tables' dtype
        _core.ensure_need(a.astype(np.int32), a, a, 0)
