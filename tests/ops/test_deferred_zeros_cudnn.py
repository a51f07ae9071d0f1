"""cuDNN over arena layers while the arena defers its zeros (docs/design.md "Zero reads"):
an unbacked byte is then unmapped, so a read past the chunks that back a sequence's
ensured tokens faults. Each case is a child of tools/gpu/cudnn_deferred_zeros_probe.py (a
fault ends only it); the control shows that such a read does fault, so a clean case means
cuDNN made none. The full probe (72 cases) is `run.sh probe:deferred_zeros`."""

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


# (kv heads, head dim, max_tokens, layers): 128 tokens per chunk (a tile's), rows that are
# not chunk-aligned, and the interleaved layout's 64 tokens per chunk (half a tile).
GEOMETRIES = {"H64": (64, 128, 4096, 1), "H4D256": (4, 256, 3000, 1), "L8": (8, 128, 4096, 8)}


def probe_case(geometry: str, before: int, queries: int, untiled: bool = False):
    heads, dim, max_tokens, layers = GEOMETRIES[geometry]
    case = map(str, (heads, dim, max_tokens, before, queries, layers))
    return PROBE.run_child(["--one", *(["--untiled"] if untiled else []), *case], "1")


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("before", [1, 0], ids=lambda b: f"{b}short")
@pytest.mark.parametrize("queries", [1, 16], ids=lambda s: f"S{s}")
def test_cudnn_reads_nothing_past_the_ensured_chunks(cudnn_gpu, geometry, before, queries):
    r = probe_case(geometry, before, queries)
    failure = PROBE.case_failure(r)
    assert failure is None, f"{failure}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"


def test_without_the_read_tile_the_interleaved_case_faults(cudnn_gpu) -> None:
    """The test above would catch the defect: with ensure backing only the asked tokens'
    chunks (testing.untiled_reads), cuDNN's last tile of a 64-token-chunk row crosses into
    an unmapped chunk. (Decode, S = 1, read no further than 64 tokens on an H100.)"""
    r = probe_case("L8", 0, 16, untiled=True)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "illegal" in out.lower(), (
        f"expected an illegal-address fault (rc {r.returncode}):\n{out[-3000:]}"
    )


def test_a_chunk_prefill_over_the_interleaved_layout_reads_nothing_unbacked(cudnn_gpu) -> None:
    """bench/shared_prefix.py with commit ahead off, the run that first faulted: each prompt
    (4160 tokens, a chunk boundary) is prefilled over the cache in a slot with room past
    it, with zeros deferred. Eager zeros first, as the control: it must pass too."""
    bench = Path(__file__).resolve().parents[2] / "bench" / "shared_prefix.py"
    args = [sys.executable, str(bench), "--commit-ahead", "0", "--batch", "2", "--repeats", "1"]

    def run(defer: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, JAX_VMM_DEFER_ZERO_READS=defer)
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)

    eager = run("0")
    assert eager.returncode == 0, f"the control failed:\n{eager.stderr[-3000:]}"
    deferred = run("1")
    out = deferred.stdout + deferred.stderr
    assert deferred.returncode == 0, (
        f"deferred zeros failed (rc {deferred.returncode}):\n{out[-3000:]}"
    )
