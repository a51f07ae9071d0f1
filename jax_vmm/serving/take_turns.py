"""Two engines taking turns inside one memory budget (`examples/decode.py --sleep-every K
--budget BYTES`; library side: docs/sharing.md, "One memory budget").

A policy engine serves its requests; every K decode blocks it sleeps (KV cache and
weights), a reference engine (another model, e.g. the reference of an RL step) wakes and
serves its own (short) requests, sleeps again, and the policy wakes and goes on. All four arenas
draw from one `MemoryBudget` smaller than the sum of the two engines' peaks: only one
engine fits at a time. Whether each engine's generation is unchanged is checked against
its first run. Not thread-safe.
"""

from __future__ import annotations

from typing import Any

import jax_vmm

from .engine import Generator, Request, RunReport
from .sleep_wake import EngineSleeper, same_tokens


class TakeTurns:
    """The pause hook of the policy's run: sleep it, run the reference, wake it again."""

    def __init__(
        self,
        policy: EngineSleeper,
        reference: EngineSleeper,
        reference_gen: Generator,
        reference_requests: list[Request],
    ) -> None:
        self.policy, self.reference = policy, reference
        self.gen, self.requests = reference_gen, reference_requests
        self.first: RunReport | None = None
        self.changed: list[int] = []  # reference requests whose tokens differed from its first run
        self.turns = 0

    def pause(self) -> None:
        # The policy wakes whatever the reference run does: a policy left asleep could not
        # give its run's slots back (the engine's run raises with this pause's error).
        self.policy.sleep()
        try:
            self.reference.wake()
            try:
                report = self.gen.run(self.requests)
            finally:
                self.reference.sleep()
        finally:
            self.policy.wake()
        if self.first is None:
            self.first = report
        else:
            self.changed = sorted(set(self.changed) | set(same_tokens(self.first, report)))
        self.turns += 1


def budget_summary(budget: jax_vmm.MemoryBudget, labels: dict[int, str]) -> dict[str, Any]:
    """The budget's cap and peak, each arena's peak by its label, and the sum of the
    engines' peaks (each engine holds its weights and its KV peak at once)."""
    s = budget.stats()
    peaks = {labels.get(a["uid"], str(a["uid"])): a["peak_bytes"] for a in s["arenas"]}
    total = sum(peaks.values())
    return {
        "budget_bytes": s["cap_bytes"],
        "peak_bytes": s["peak_bytes"],
        "arena_peak_bytes": peaks,
        "sum_of_engine_peaks_bytes": total,
        "budget_below_sum_of_peaks": s["cap_bytes"] < total,
    }
