"""The command line: `jax-vmm` (console script) and `python -m jax_vmm`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import child_env
from jax_vmm.__main__ import main


@pytest.mark.parametrize(
    "argv0,prog",
    [("/venv/bin/jax-vmm", "jax-vmm"), ("/site-packages/jax_vmm/__main__.py", "python -m jax_vmm")],
)
def test_help_names_the_command_that_was_run(monkeypatch, capsys, argv0, prog):
    monkeypatch.setattr(sys, "argv", [argv0])
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {prog} "), out
    assert "``" not in out and "info" in out, "the help is plain text and lists the commands"


def test_a_bare_command_prints_help(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/jax-vmm"])
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: jax-vmm ") and "info" in out


def _python_dash_m(tmp_path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jax_vmm", *args],
        cwd=tmp_path,
        env=child_env() | env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_python_dash_m(tmp_path):
    proc = _python_dash_m(tmp_path, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m jax_vmm "), proc.stdout


def test_info_reports_a_jax_without_a_usable_backend(tmp_path):
    """`python -m jax_vmm info` is for a misconfigured machine: a JAX_PLATFORMS that names a
    backend this machine lacks is a line of its report, the rest still printed (it was a
    traceback and nothing else)."""
    proc = _python_dash_m(tmp_path, "info", JAX_PLATFORMS="tpu")
    assert proc.returncode == 0, proc.stderr
    assert "JAX devices: none (" in proc.stdout and "JAX_PLATFORMS=tpu" in proc.stdout
    assert "host driver (cpu): VMM yes" in proc.stdout, proc.stdout
    assert "cuDNN attention compiled in: " in proc.stdout  # docs/cudnn_attention.md says so
