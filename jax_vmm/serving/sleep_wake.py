"""Sleep and wake the whole engine (KV cache and weights) while it serves
(`examples/decode.py --sleep-every K`; library side: docs/sleep.md).

`EngineSleeper` puts the weights into an arena of their own (`Arena.put`), and its
`pause()` (the engine's pause hook, called between decode blocks with sequences in
flight) sleeps both arenas, checks that no device memory is held while asleep, and
wakes them at the same addresses: the compiled programs run on unchanged. Whether
generation is unchanged is for the caller to compare (`same_tokens`). Not thread-safe.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

import jax_vmm

from .engine import RunReport


@dataclasses.dataclass
class SleepStats:
    cycles: int = 0
    sleep_seconds: list[float] = dataclasses.field(default_factory=list)
    wake_seconds: list[float] = dataclasses.field(default_factory=list)
    asleep_backed_bytes: int = 0  # the most either arena held while asleep (want 0)

    def summary(self) -> dict[str, Any]:
        med = lambda xs: float(np.median(xs)) if xs else 0.0  # noqa: E731
        return {
            "cycles": self.cycles,
            "sleep_ms_median": 1e3 * med(self.sleep_seconds),
            "wake_ms_median": 1e3 * med(self.wake_seconds),
            "asleep_backed_bytes": self.asleep_backed_bytes,
        }


class EngineSleeper:
    """The weights in an arena, and a pause() that sleeps and wakes them with `kv`."""

    def __init__(
        self,
        kv: jax_vmm.KVArena,
        params: Any,
        device: jax.Device,
        budget: jax_vmm.MemoryBudget | None = None,
        name: str = "weights",
    ) -> None:
        """name: what the budget's stats and errors call the weights' arena."""
        leaves = jax.tree_util.tree_leaves(params)
        total = sum(int(x.nbytes) for x in leaves)
        # Every buffer is rounded up to whole chunks (the driver's granularity): room for
        # that rounding per leaf; address space is free.
        self.weights = jax_vmm.Arena(
            2 * total + len(leaves) * (64 << 20), device=device, budget=budget, name=name
        )
        self.params = jax.tree_util.tree_map(self.weights.put, params)
        self.kv = kv
        self.stats = SleepStats()

    def pause(self) -> None:
        self.sleep()
        self.wake()

    def sleep(self) -> None:
        """Both arenas give all their memory back (contents kept on the host)."""
        t0 = time.perf_counter()
        self.kv.sleep()
        self.weights.sleep()
        self.stats.sleep_seconds.append(time.perf_counter() - t0)
        held = max(int(self.kv.arena.backed_bytes), int(self.weights.backed_bytes))
        self.stats.asleep_backed_bytes = max(self.stats.asleep_backed_bytes, held)

    def wake(self) -> None:
        t0 = time.perf_counter()
        self.weights.wake()
        self.kv.wake()
        self.stats.wake_seconds.append(time.perf_counter() - t0)
        self.stats.cycles += 1

    def close(self) -> None:
        self.weights.close()


def same_tokens(a: RunReport, b: RunReport) -> list[int]:
    """Ids of the requests whose tokens differ between two runs (empty: the same)."""
    return [x.id for x, y in zip(a.results, b.results, strict=True) if x.tokens != y.tokens]


def divergences(a: RunReport, b: RunReport, ids: list[int]) -> list[dict[str, int]]:
    """For each request of ``ids``: the index of its first token that differs between the
    two runs, and how many tokens it has in each (a flip at token 0 points at the
    prefill, a late one at rounding that grew over the decode)."""
    by_id = {x.id: (x, y) for x, y in zip(a.results, b.results, strict=True)}
    out = []
    for i in ids:
        x, y = by_id[i]
        first = next(
            (k for k, (s, t) in enumerate(zip(x.tokens, y.tokens)) if s != t),
            min(len(x.tokens), len(y.tokens)),
        )
        out.append(dict(request=i, first=first, tokens=len(x.tokens), other=len(y.tokens)))
    return out
