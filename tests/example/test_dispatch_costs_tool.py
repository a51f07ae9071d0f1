"""bench/dispatch_costs.py on the CPU preset: its instrumented calls are the ones the
engine makes (same counts), and it leaves the engine and decode.py as they were."""

from __future__ import annotations

from scripts import load_script

from jax_vmm.serving import engine as E
from jax_vmm.serving.cli import decode as D

dispatch_costs = load_script("bench/dispatch_costs.py")


def test_breakdown_matches_the_engine_calls(cpu_device) -> None:
    run, make = E.Generator.run, D.make_cache
    r = dispatch_costs.measure(batch=2, preset="cpu", device="cpu")
    assert (E.Generator.run, D.make_cache) == (run, make)
    inside = {row["call"]: row for row in r["inside_calls"]}
    engine = r["engine_calls"]
    assert inside["kv.ensure_all (all of it)"]["calls"] == engine["ensure_all"]["calls"] > 0
    releases = (
        engine["release"]["calls"] + engine.get("release(keep_tokens)", {"calls": 0})["calls"]
    )
    assert inside["core arena.decommit_ranges"]["calls"] == releases
    # One table update per ensure_all (a copy only when an entry grew).
    assert inside["core kv_cache.raise_limits"]["calls"] == engine["ensure_all"]["calls"]
    assert any("main: dispatching" in name for name in r["cpu_seconds_by_thread"])
