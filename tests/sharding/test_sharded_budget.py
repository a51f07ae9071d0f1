"""Memory budgets across host devices: every scenario of tests/sharding/budget_scenarios.py
runs in one child process with 4 host devices (tests/sharding/multidevice.py says why) and
becomes one test here."""

from __future__ import annotations

from pathlib import Path

# This folder's modules, imported by name: pytest puts a test's folder on sys.path.
import budget_scenarios  # for its names: the scenarios run in the child
import multidevice
import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def results() -> dict:
    return multidevice.child_results(HERE / "budget_scenarios.py")


@pytest.mark.parametrize("name", list(budget_scenarios.SCENARIOS))
def test_budget_scenario(results, name):
    multidevice.check(results, name)
