"""bench/shared_prefix.py's memory rows hold together: what it measures is the layout's
chunk floor plus what commit ahead backs, and each row changes with what it names."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import child_env
from scripts import REPO

# cpu preset, interleaved: a token of every layer is 1 KiB, a host chunk 64 tokens, so a
# 256-token prefix and 64-token rests end on chunk boundaries.
BASE = ["--device", "cpu", "--preset", "cpu", "--prefix", "256", "--batch", "2", "--repeats", "1"]


def _run(tmp_path, *args: str) -> dict:
    out = tmp_path / "sp.json"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "shared_prefix.py"),
            *BASE,
            *args,
            "--json",
            str(out),
        ],
        env=child_env(JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "args, ahead_chunks",
    [
        ([], 2),  # each request ends on a chunk boundary with room left: one chunk ahead
        (["--commit-ahead", "0"], 0),
        (["--new-tokens", "0"], 0),  # slots full at their prompts: nothing to back ahead
    ],
    ids=["default", "commit_ahead_off", "no_room"],
)
def test_memory_is_the_floor_plus_what_commit_ahead_backs(tmp_path, args, ahead_chunks):
    got = _run(tmp_path, "--suffix", "64", *args)
    chunk = got["chunk_bytes"]
    assert got["backed_ahead_bytes"] == ahead_chunks * chunk
    floor = round(got["floor_ratio_chunk_over_layers"] * got["ideal_bytes"])
    assert got["physical_bytes"] == floor + got["backed_ahead_bytes"]
    assert got["memory_ratio"] == pytest.approx(got["physical_bytes"] / got["ideal_bytes"])
