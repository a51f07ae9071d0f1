"""jax_vmm.serving.sampling: greedy, temperature, top-k and top-p, seeded per request."""

from __future__ import annotations

import numpy as np
import pytest

from jax_vmm.serving.sampling import (
    RequestSampler,
    SamplingConfig,
    choose_token,
    next_token_probabilities,
)


def _logits(seed: int, vocab: int = 50) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 3, vocab).astype(np.float32)


def test_greedy_and_top_k_1_are_argmax() -> None:
    rng = np.random.default_rng(0)
    for seed in range(20):
        logits = _logits(seed)
        best = int(np.argmax(logits))
        assert choose_token(logits, SamplingConfig(), rng) == best
        for t in (0.1, 1.0, 5.0):
            assert choose_token(logits, SamplingConfig(temperature=t, top_k=1), rng) == best
    tie = np.array([1.0, 3.0, 3.0, 0.0], np.float32)  # exact tie: the lower id, as argmax
    assert choose_token(tie, SamplingConfig(temperature=1.0, top_k=1), rng) == 1


def test_top_k_keeps_the_k_most_likely_renormalised() -> None:
    logits = _logits(1)
    p = next_token_probabilities(logits, SamplingConfig(temperature=1.0, top_k=5))
    top5 = np.argsort(-logits)[:5]
    assert set(np.flatnonzero(p)) == set(top5)
    full = np.exp(logits[top5].astype(np.float64) - logits.max())
    np.testing.assert_allclose(p[top5], full / full.sum(), rtol=1e-12)


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = np.array([0.05, 0.5, 0.15, 0.3])
    logits = np.log(probs)
    # Sorted: 0.5 (id 1), 0.3 (id 3), 0.15 (id 2), 0.05 (id 0); cumulative 0.5, 0.8, 0.95.
    kept = {0.3: {1}, 0.49: {1}, 0.51: {1, 3}, 0.79: {1, 3}, 0.81: {1, 3, 2}, 0.96: {0, 1, 2, 3}}
    for top_p, want in kept.items():
        p = next_token_probabilities(logits, SamplingConfig(temperature=1.0, top_p=top_p))
        assert set(np.flatnonzero(p)) == want, top_p
        np.testing.assert_allclose(p.sum(), 1.0)
        np.testing.assert_allclose(p[list(want)], probs[list(want)] / probs[list(want)].sum())


def test_temperature_then_top_k_then_top_p() -> None:
    """The order transformers applies them: temperature reshapes the distribution that
    top-p measures."""
    logits = np.log(np.array([0.6, 0.25, 0.1, 0.05]))
    # T=0.5 squares the odds: 0.83, 0.14, ...; T=1: 0.6, 0.25, 0.1 (cumulative 0.95).
    cold = next_token_probabilities(logits, SamplingConfig(temperature=0.5, top_p=0.86))
    warm = next_token_probabilities(logits, SamplingConfig(temperature=1.0, top_p=0.86))
    assert set(np.flatnonzero(cold)) == {0, 1} and set(np.flatnonzero(warm)) == {0, 1, 2}
    both = next_token_probabilities(logits, SamplingConfig(temperature=1.0, top_k=2, top_p=0.7))
    # top-k first (0.6, 0.25 -> 0.706, 0.294), then top-p 0.7 keeps only token 0.
    assert set(np.flatnonzero(both)) == {0}


def test_draws_follow_the_distribution() -> None:
    """20000 seeded draws: every kept token's frequency within 4 standard errors of its
    probability, and no token outside the kept set ever drawn."""
    logits = _logits(2, vocab=12)
    cfg = SamplingConfig(temperature=0.8, top_k=6, top_p=0.9)
    p = next_token_probabilities(logits, cfg)
    rng = np.random.default_rng(123)
    n = 20000
    counts = np.bincount([choose_token(logits, cfg, rng) for _ in range(n)], minlength=12)
    assert np.all(counts[p == 0] == 0)
    se = np.sqrt(p * (1 - p) / n)
    assert np.all(np.abs(counts / n - p) <= 4 * se + 1e-12), (counts / n, p)


def test_request_streams_are_seeded_and_independent() -> None:
    cfg = SamplingConfig(temperature=1.0, seed=7)
    logits = [_logits(s) for s in range(30)]

    def draws(sampler: RequestSampler, rid: int) -> list[int]:
        return [sampler(rid, lg) for lg in logits]

    a = RequestSampler(cfg)
    first = draws(a, 0)
    assert first == draws(RequestSampler(cfg), 0)  # same seed, same request: same draws
    b = RequestSampler(cfg)
    draws(b, 1)  # another request drawing first does not shift request 0's stream
    assert draws(b, 0) == first
    assert draws(RequestSampler(SamplingConfig(temperature=1.0, seed=8)), 0) != first
    assert draws(RequestSampler(cfg), 1) != first


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
        (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
        (dict(temperature=1.0, top_k=-2), "top_k must be an integer >= 0"),
        (dict(temperature=1.0, top_k=2.5), "top_k must be an integer >= 0"),
        (dict(temperature=1.0, top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(temperature=1.0, top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=3), "need a temperature > 0"),
        (dict(top_p=0.5), "need a temperature > 0"),
    ],
)
def test_bad_sampling_settings_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


@pytest.mark.parametrize("temperature", [1e-5, 1e-300, 1e-320])
def test_a_tiny_temperature_is_the_argmax(temperature: float) -> None:
    """A temperature near 0 puts all the mass on the most likely token. (Dividing the
    logits first made inf - inf: NaN probabilities, and token 0 was drawn.)"""
    logits = np.array([0.1, 0.9, 0.3, -2.0])
    cfg = SamplingConfig(temperature=temperature)
    np.testing.assert_array_equal(next_token_probabilities(logits, cfg), [0, 1, 0, 0])
    rng = np.random.default_rng(0)
    assert {choose_token(logits, cfg, rng) for _ in range(20)} == {1}
