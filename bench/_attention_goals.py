"""Issue 28's speed goals over bench/cudnn_attention.py's rows: each ratio's range and
how many points meet it. No sibling imports, so tests can load it by path."""

from __future__ import annotations

GOALS = (  # (name, row key, decode rows or S > 1 rows, the most the ratio may be)
    ("decode, layer / JAX cuDNN", "layer_ratio", True, 1.0),
    ("fp8 decode / bf16 JAX cuDNN", "fp8_ratio", True, 0.55),
    ("multi-query, layer / best of JAX", "best_ratio", False, 1.1),
)


def goal_lines(rows: list[dict]) -> list[str]:
    """One line per goal of issue 28: the range of the ratio over the rows that measured
    it, and how many points are at or under the goal."""
    lines = []
    for name, key, decode, goal in GOALS:
        got = [r[key] for r in rows if (r["S"] == 1) == decode and r.get(key) is not None]
        if got:
            met = sum(x <= goal for x in got)
            lines.append(
                f"goal {name} <= {goal}: {min(got):.3f}-{max(got):.3f}, "
                f"{met} of {len(got)} points met"
            )
    return lines
