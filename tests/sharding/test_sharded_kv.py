"""Sharded KV arenas on 4 host devices (issue #16): ``kv_arena(..., sharding=...)``.

Every scenario of tests/sharding/sharded_scenarios.py runs in one child process with 4
host devices (tests/sharding/multidevice.py says why) and becomes one test here. They
check: sharded against single-device results for kv_write and attention (the bytes in
every device's arena by a raw memcpy, attention outputs), zero-copy global views, no
collective in the compiled step (and that the detector sees one), per-device memory by
/proc/self/maps, all-or-nothing growth with a fault injected on one device (and that the
test fails with the rollback removed), counts over the shards, and the refusals.
"""

from __future__ import annotations

from pathlib import Path

# This folder's modules, imported by name: pytest puts a test's folder on sys.path.
import multidevice
import pytest
import sharded_scenarios  # for its names: the scenarios run in the child

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def results() -> dict:
    return multidevice.child_results(HERE / "sharded_scenarios.py")


@pytest.mark.parametrize("name", list(sharded_scenarios.SCENARIOS))
def test_sharded_scenario(results, name):
    multidevice.check(results, name)
