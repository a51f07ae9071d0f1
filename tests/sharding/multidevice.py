"""Runs a scenario file on 4 host devices in a child process, one JSON line per scenario.

JAX fixes the number of host devices when it starts, and CI runs ``pytest tests`` once
without XLA_FLAGS: a scenario file (a script whose ``SCENARIOS`` maps names to functions)
runs as a child with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``, and
:func:`child_results` turns its output into one result per scenario for the parent's
parametrized test. One child per file: CI has 2 cores, and each start costs seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

DEVICES = 4
PREFIX = "SCENARIO "


def child_results(script: Path, timeout: int = 600) -> dict:
    """{scenario name: {"ok", "error"}} from running ``script`` on 4 host devices, plus
    ``"_proc"``: the finished process (its stderr explains a child that died)."""
    from conftest import child_env  # here: a child imports this module without conftest

    env = child_env(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}", JAX_PLATFORMS="cpu"
    )
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout
    )
    out: dict = {"_proc": proc}
    for line in proc.stdout.splitlines():
        if line.startswith(PREFIX):
            r = json.loads(line[len(PREFIX) :])
            out[r["name"]] = r
    return out


def check(results: dict, name: str) -> None:
    """The parent's assertion for one scenario."""
    proc = results["_proc"]
    assert name in results, (
        f"the child ended before scenario {name} (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    )
    assert results[name]["ok"], results[name]["error"]


def raises(exc: type[BaseException], fn: Callable[[], object], *words: str) -> BaseException:
    """For a scenario: ``fn()`` raises ``exc`` with every one of ``words`` in its message;
    returns the exception."""
    try:
        fn()
    except exc as e:
        for w in words:
            assert w in str(e), f"{w!r} not in {e}"
        return e
    raise AssertionError(f"{fn} did not raise {exc.__name__}")


def main(scenarios: dict[str, Callable[[], None]], names: list[str]) -> int:
    """The child: run the named scenarios (all by default), one JSON line each."""
    import jax

    assert len(jax.devices()) >= DEVICES, (
        f"run with XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES}"
    )
    for name in names or list(scenarios):
        try:
            scenarios[name]()
            result = {"name": name, "ok": True, "error": ""}
        except BaseException:  # noqa: BLE001 - reported to the parent test
            result = {"name": name, "ok": False, "error": traceback.format_exc()}
        print(PREFIX + json.dumps(result), flush=True)
    return 0
