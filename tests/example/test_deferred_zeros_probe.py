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
