"""The C++ loops behind KVArena.ensure_all (ffi/src/python/ensure_plan_bindings.cc)
against the NumPy expressions they stand for, on random tables."""

from __future__ import annotations

import numpy as np
import pytest

import jax_vmm
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


def _kv(vm):
    return vm.kv(num_layers=1, num_kv_heads=2, head_dim=64, max_tokens=256, max_seqs=3)


@pytest.mark.parametrize(
    "tokens",
    [
        [5, 0, 3],
        (5, 0, 3),
        np.array([5, 0, 3], np.int32),
        np.array([5, 0, 3], np.uint64),
        np.array([5, 9, 0, 7, 3, 1])[::2],  # not contiguous
    ],
    ids=["list", "tuple", "int32", "uint64", "strided"],
)
def test_every_int_form_ensures_the_same(vm, tokens):
    """Each form ensures what one kv.ensure(n, seq) per sequence ensures (what a chunk
    backs beyond that depends on the device's chunk size, so compare, don't assume)."""
    kv, ref = _kv(vm), _kv(vm)
    kv.ensure_all(tokens)
    for q, n in enumerate([5, 0, 3]):
        if n:
            ref.ensure(n, q)
    assert kv._core_cache.limits() == ref._core_cache.limits() == [5, 0, 3]
    assert [kv.backed_tokens(q) for q in range(3)] == [ref.backed_tokens(q) for q in range(3)]
    assert kv.backed_tokens(0) >= 5 and kv.backed_tokens(2) >= 3


@pytest.mark.parametrize("tokens", [[True, 1, 1], (1, np.True_, 0)], ids=["bool", "np.bool_"])
def test_a_bool_among_the_counts_is_refused(vm, tokens):
    """np.asarray([True, 1, 1]) is an int array; kv.ensure(True) is refused, so is this."""
    kv = _kv(vm)
    with pytest.raises(TypeError, match="num_tokens must be 3 ints"):
        kv.ensure_all(tokens)
    assert kv._core_cache.limits() == [0, 0, 0]


def test_a_huge_unsigned_count_is_out_of_range_not_wrapped(vm):
    kv = _kv(vm)
    with pytest.raises(ValueError, match=r"must be in \[0, 256\].*max 18446744073709551615"):
        kv.ensure_all(np.array([2**64 - 1, 0, 0], np.uint64))
    assert kv._core_cache.limits() == [0, 0, 0]


@pytest.mark.parametrize("tokens", [[0, 0, 0], [5, 0, 3]])
def test_ensure_all_on_a_closed_arena_says_so(vm, tokens):
    kv = _kv(vm)
    kv.ensure_all([5, 0, 3])
    kv.close()
    with pytest.raises(jax_vmm.ArenaClosedError, match="KVArena.ensure_all: the arena is closed"):
        kv.ensure_all(tokens)
