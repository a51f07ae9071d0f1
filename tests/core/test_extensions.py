"""The two extension modules: jax_vmm._core (production) holds no test code and importing
jax_vmm loads none; jax_vmm._core_testing (the testing layer) shares _core's state; and
the committed type stubs (jax_vmm/_core.pyi, jax_vmm/_core_testing.pyi) match what
nanobind's stubgen makes of the built modules, so that they cannot drift (a build with
CUDA kernels, as CI's, binds more: it must hold every name of the stubs). Regenerate them
after changing a binding (from the repository root, with a CPU build in build/cpu):

    for m in _core _core_testing; do PYTHONPATH=build/cpu:. python3 -m nanobind.stubgen \\
        -q --exclude-values -m jax_vmm.$m -o jax_vmm/$m.pyi; done
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import jax_vmm
import jax_vmm.testing
from jax_vmm.base.loader import core as _core

MODULES = ("_core", "_core_testing")
SOURCE_PACKAGE = Path(__file__).resolve().parents[2] / "jax_vmm"


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=os.getcwd(), timeout=300
    )


def test_importing_jax_vmm_loads_no_test_code() -> None:
    r = _python(
        "import sys, jax_vmm\n"
        "print(sorted(m for m in sys.modules if m.startswith('jax_vmm') and 'testing' in m))"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_production_module_has_no_test_hooks() -> None:
    t = jax_vmm.testing.extension()
    assert t.__name__ == "jax_vmm._core_testing"
    assert not hasattr(_core, "testing")
    for hook in ("create_fault_injecting_arena", "set_host_map_limit", "scratch_get", "ZeroLayout"):
        assert hasattr(t, hook) and not hasattr(_core, hook), hook
    for platform in ("cpu", "CUDA"):
        production = _core.registrations(platform)
        assert not [name for name in production if "testing" in name or "probe" in name]
        assert not set(production) & set(t.registrations(platform))
    assert any(name.startswith("jax_vmm_testing_") for name in t.registrations("cpu"))


def test_testing_module_shares_the_core(vm) -> None:
    """An arena made by the testing module is a _core.Arena that _core's registry of live
    arenas finds: one copy of the core's state, not one per module."""
    with jax_vmm.testing.fault_injection():
        arena = vm.arena(1 << 20)
    assert isinstance(arena._handle, _core.Arena)
    buf = arena.allocate((1024,), "float32", name="x")
    assert _core.find_arena_buffer_by_uid(buf.uid) is not None
    # The testing module's driver decorator fails a commit made through _core, and its
    # exception type comes back through _core's binding.
    t = jax_vmm.testing.extension()
    t.arm_fault(arena._handle, "create", 1)
    with pytest.raises(jax_vmm.testing.InjectedFault):
        buf.commit()
    assert t.injected_faults(arena._handle) == 1 and buf.backed_bytes == 0
    buf.commit()
    assert buf.backed_bytes > 0


@pytest.mark.parametrize("name", MODULES)
def test_package_ships_the_stub(name: str) -> None:
    assert any((Path(p) / f"{name}.pyi").is_file() for p in jax_vmm.__path__), jax_vmm.__path__


@pytest.mark.parametrize("name", MODULES)
def test_stub_matches_the_built_module(name: str, tmp_path: Path) -> None:
    if importlib.util.find_spec("nanobind") is None:
        pytest.skip("nanobind (its stubgen) is not installed")
    committed = SOURCE_PACKAGE / f"{name}.pyi"
    if not committed.is_file():
        pytest.skip(f"no source tree next to the tests ({committed} missing)")
    out = tmp_path / f"{name}.pyi"
    r = subprocess.run(
        [sys.executable, "-m", "nanobind.stubgen", "-q", "--exclude-values"]
        + ["-m", f"jax_vmm.{name}", "-o", str(out)],
        capture_output=True,
        text=True,
        cwd=os.getcwd(),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    if _core.built_with_cuda_kernels:
        # The committed stubs are a CPU build's; a CUDA build (CI's: nvcc is there) binds
        # more names, so it must hold every name of the stub, with the same signature.
        missing = _signatures(committed.read_text()) - _signatures(out.read_text())
        assert not missing, f"{committed} names what the built jax_vmm.{name} lacks: {missing}"
        return
    assert out.read_text() == committed.read_text(), (
        f"{committed} is out of date with the built jax_vmm.{name}; regenerate it (see this "
        "file's docstring)"
    )


def _signatures(stub: str) -> set[str]:
    """The ``def`` and ``class`` lines of a stub, stripped."""
    return {
        line.strip() for line in stub.splitlines() if line.lstrip().startswith(("def ", "class "))
    }
