"""cuDNN over arena layers while the arena defers its zeros (docs/design.md "Zero reads"):
an unbacked byte is then unmapped, so a read past the chunks that back a sequence's
ensured tokens faults. Each case is a child of tools/gpu/cudnn_deferred_zeros_probe.py (a
fault ends only it); the control shows that such a read does fault, so a clean case means
cuDNN made none. The full probe (60 cases) is `run.sh probe:deferred_zeros`."""

from __future__ import annotations

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
