"""cuDNN over arena layers while the arena defers its zeros (docs/design.md "Zero reads"):
an unbacked byte is then unmapped, so a read past the chunks that back a sequence's
ensured tokens faults. Each case is a child of tools/gpu/cudnn_deferred_zeros_probe.py (a
fault ends only it); the control shows that such a read does fault, so a clean case means
cuDNN made none. The full probe (60 cases) is `run.sh probe:deferred_zeros`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cuda_vmm_device
from jax_vmm.ops import cudnn_attention as ca
from scripts import load_script

PROBE = load_script("tools/gpu/cudnn_deferred_zeros_probe.py")

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cudnn_gpu() -> None:
    dev, why = cuda_vmm_device()
    if dev is None:
        pytest.skip(f"needs a CUDA GPU: {why}")
    if not ca.cudnn_built():
        pytest.skip("jax_vmm was built without the cuDNN attention backend (JAX_VMM_CUDNN)")
    pytest.importorskip("cupy", reason="the control reads arena memory through cupy")


def test_an_unbacked_read_faults_only_while_zeros_are_deferred(cudnn_gpu) -> None:
    eager = PROBE.run_child(["--control"], "0")
    deferred = PROBE.run_child(["--control"], "1")
    failure = PROBE.control_failure(eager, deferred)
    assert failure is None, failure


# 128 tokens per chunk (the most boundaries per tile), and rows that are not chunk-aligned.
@pytest.mark.parametrize("geometry", [(64, 128, 4096), (4, 256, 3000)], ids=["H64", "H4D256"])
@pytest.mark.parametrize("before", [255, 1], ids=lambda b: f"{b}short")
@pytest.mark.parametrize("queries", [1, 16], ids=lambda s: f"S{s}")
def test_cudnn_reads_nothing_past_the_ensured_chunks(cudnn_gpu, geometry, before, queries):
    r = PROBE.run_child(["--one", *map(str, (*geometry, before, queries))], "1")
    failure = PROBE.case_failure(r)
    assert failure is None, f"{failure}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"


class IllegalAddress(AssertionError):
    """The child faulted on the device: the defect the xfail below names."""


@pytest.mark.xfail(
    raises=IllegalAddress,
    strict=True,
    reason="known defect (found on an H100, 2026-12-07): with zeros deferred, a multi-query "
    "prefill over the interleaved layout (64 tokens per chunk) reads past the chunks that "
    "back the ensured tokens and faults when nothing backs the next chunk (commit ahead "
    "off, as in a budget); docs/design.md 'Zero reads'",
)
def test_a_chunk_prefill_over_the_interleaved_layout_reads_nothing_unbacked(cudnn_gpu) -> None:
    """bench/shared_prefix.py with commit ahead off: each prompt (4160 tokens, a chunk
    boundary) is prefilled over the cache in a slot with room past it. With eager zeros the
    same run is the control: it must pass, so only the deferred case can be the defect."""
    bench = Path(__file__).resolve().parents[2] / "bench" / "shared_prefix.py"
    args = [sys.executable, str(bench), "--commit-ahead", "0", "--batch", "2", "--repeats", "1"]

    def run(defer: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, JAX_VMM_DEFER_ZERO_READS=defer)
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)

    eager = run("0")
    assert eager.returncode == 0, f"the control failed:\n{eager.stderr[-3000:]}"
    deferred = run("1")
    if deferred.returncode != 0:
        out = deferred.stdout + deferred.stderr
        if "ILLEGAL_ADDRESS" in out:
            raise IllegalAddress(out[-2000:])
        raise RuntimeError(f"failed otherwise (rc {deferred.returncode}):\n{out[-3000:]}")
