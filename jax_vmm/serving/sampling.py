"""Next-token choice from one step's logits: greedy, or seeded sampling with temperature,
top-k and top-p (in that order, as transformers applies them).

* temperature 0: greedy (argmax; the lowest id wins an exact tie, as `np.argmax`).
* top_k k > 0: only the k most likely tokens (exactly k: ties at the boundary are broken
  by the lower id, so top_k=1 is greedy).
* top_p p < 1: only the smallest set of most likely tokens whose probability adds up to
  at least p (after temperature and top-k), renormalised.

Every request draws from its own generator, seeded by (seed, request id), so what a
request samples does not depend on which other requests share the batch or the order in
which the engine serves them.
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from ..base.args import is_int


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0

    def __post_init__(self) -> None:
        if not (_is_real(self.temperature) and self.temperature >= 0):
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not (is_int(self.top_k) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (_is_real(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not (is_int(self.seed) and 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.greedy and (self.top_k or self.top_p < 1):
            raise ValueError(
                "top_k and top_p shape the sampling distribution: they need "
                "a temperature > 0 (temperature 0 is greedy decoding)"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_real(x: object) -> bool:
    if not isinstance(x, numbers.Real) or isinstance(x, (bool, np.bool_)):
        return False
    try:
        return bool(np.isfinite(float(x)))
    except OverflowError:  # an int past float64's range
        return False


def next_token_probabilities(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """The distribution a sampling step draws from: (vocab,) float64, zero outside the
    top-k / top-p set, summing to 1. Not for greedy configs."""
    order, p = _candidates(logits, cfg)
    out = np.zeros(np.shape(logits)[-1], np.float64)
    out[order] = p
    return out


def choose_token(logits: np.ndarray, cfg: SamplingConfig, rng: np.random.Generator) -> int:
    if cfg.greedy:
        return int(np.argmax(logits))
    order, p = _candidates(logits, cfg)
    # Inverse CDF with one uniform draw: one number per step from the request's stream.
    i = int(np.searchsorted(np.cumsum(p), rng.random(), side="right"))
    return int(order[min(i, len(order) - 1)])  # min: a cumsum that ends just below 1


def _candidates(logits: np.ndarray, cfg: SamplingConfig) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, their probabilities) of the kept set, most likely first."""
    if cfg.greedy:
        raise ValueError("a greedy config has no sampling distribution")
    x = np.asarray(logits, np.float64).reshape(-1)
    order = np.argsort(-x, kind="stable")  # ties: the lower id first
    if cfg.top_k:
        order = order[: cfg.top_k]
    # Shifted before the division: a tiny temperature sends the rest to -inf (p 0), the
    # most likely to 0 (p 1), never inf - inf.
    with np.errstate(over="ignore"):
        p = np.exp((x[order] - x[order[0]]) / cfg.temperature)
    p /= p.sum()
    if cfg.top_p < 1:
        # The smallest prefix with mass >= top_p (the token that crosses it is kept).
        n = int(np.searchsorted(np.cumsum(p), cfg.top_p, side="left")) + 1
        order, p = order[:n], p[:n] / p[:n].sum()
    return order, p


class RequestSampler:
    """choose(request_id, logits) -> token, one seeded stream per request. Not
    thread-safe."""

    def __init__(self, cfg: SamplingConfig) -> None:
        self.cfg = cfg
        self._rngs: dict[int, np.random.Generator] = {}

    def __call__(self, request_id: int, logits: np.ndarray) -> int:
        rng = self._rngs.get(request_id)
        if rng is None:
            rng = self._rngs[request_id] = np.random.default_rng([self.cfg.seed, request_id])
        return choose_token(logits, self.cfg, rng)
