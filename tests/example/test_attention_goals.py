"""bench/_attention_goals.py, the goal lines of bench/cudnn_attention.py (issue 28): each
goal's ratio range is taken over the rows that measure it only (decode rows for decode and
fp8, S > 1 rows for several queries), rows without the ratio (a failed point) are left
out, and a point exactly at the goal counts as met."""

from __future__ import annotations

from scripts import load_script

BENCH = load_script("bench/_attention_goals.py")


def test_goal_lines_take_each_ratio_from_its_own_rows():
    rows = [
        dict(S=1, layer_ratio=0.98, fp8_ratio=0.56, best_ratio=None),
        dict(S=1, layer_ratio=1.0, fp8_ratio=0.55, best_ratio=None),
        dict(S=1, layer_ratio=1.02, fp8_ratio=None, best_ratio=None),
        dict(S=1, error="out of memory"),
        dict(S=512, layer_ratio=5.0, fp8_ratio=None, best_ratio=0.9),
        dict(S=2048, layer_ratio=5.0, fp8_ratio=None, best_ratio=1.2),
    ]
    assert BENCH.goal_lines(rows) == [
        "goal decode, layer / JAX cuDNN <= 1.0: 0.980-1.020, 2 of 3 points met",
        "goal fp8 decode / bf16 JAX cuDNN <= 0.55: 0.550-0.560, 1 of 2 points met",
        "goal multi-query, layer / best of JAX <= 1.1: 0.900-1.200, 1 of 2 points met",
    ]


def test_goal_lines_leave_out_a_goal_no_row_measured():
    assert BENCH.goal_lines([dict(S=1, layer_ratio=0.9)]) == [
        "goal decode, layer / JAX cuDNN <= 1.0: 0.900-0.900, 1 of 1 points met"
    ]
