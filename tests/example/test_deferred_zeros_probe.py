"""tools/gpu/cudnn_deferred_zeros_probe.py's case on the CPU: it reads the layer through
jax_vmm's attention without ever making a view (a view would turn deferred zeros on and
the GPU case would prove nothing), decode and several queries, aligned and unaligned rows."""

from __future__ import annotations

import pytest
from scripts import load_script

PROBE = load_script("tools/gpu/cudnn_deferred_zeros_probe.py")


@pytest.mark.parametrize("geometry", [(8, 128, 4096), (4, 256, 3000)])
@pytest.mark.parametrize("queries", [1, 16])
def test_a_probe_case_reads_without_a_view(geometry, queries, monkeypatch, capsys) -> None:
    monkeypatch.setenv("JAX_VMM_DEFER_ZERO_READS", "1")
    PROBE.one(*geometry, before=100, queries=queries)
    assert "tokens per chunk" in capsys.readouterr().out


def _done(rc: int, stdout: str = "", stderr: str = ""):
    import subprocess

    return subprocess.CompletedProcess([], rc, stdout, stderr)


def test_a_case_counts_only_when_cudnn_ran_and_nothing_faulted() -> None:
    ok = "lengths [1, 2, 0, 4], 128 tokens per chunk, 2 MiB backed, cuDNN executions 1\n"
    assert PROBE.case_failure(_done(0, ok)) is None
    assert "rc=" in PROBE.case_failure(_done(-6, ok, "illegal memory access"))
    no_cudnn = ok.replace("executions 1", "executions 0")
    assert "did not run" in PROBE.case_failure(_done(0, no_cudnn))
    assert "did not run" in PROBE.case_failure(_done(0, ""))


def test_the_control_needs_a_zero_read_and_an_illegal_address() -> None:
    eager = _done(0, "control read 0\n")
    fault = _done(1, "", "CUDARuntimeError: cudaErrorIllegalAddress: an illegal memory access")
    assert PROBE.control_failure(eager, fault) is None
    # Refused before any read (cupy's pointer check): proves nothing.
    refused = _done(1, "", "CUDARuntimeError: cudaErrorInvalidDevice: invalid device ordinal")
    assert "no illegal-address fault" in PROBE.control_failure(eager, refused)
    assert "no illegal-address fault" in PROBE.control_failure(eager, _done(0, "control read 0"))
    assert "expected 'control read 0'" in PROBE.control_failure(_done(0, "control read 7"), fault)
