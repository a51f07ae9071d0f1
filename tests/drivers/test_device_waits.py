"""Device waits of the CUDA driver wait for XLA's compute stream, not the whole context.

An arena waits for the device before memory goes back (the reclaimer thread, a release
with views out, offload, sleep). A cuCtxSynchronize there also waits on the stream that
XLA captures a command buffer on, from another thread: the driver refuses it
(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) and the capture is invalidated, so the step being
recorded fails with cudaErrorStreamCaptureInvalidated. The driver waits instead for the
compute streams that jax_vmm's Python layer registers when it creates an arena on a GPU
(ffi/src/drivers/cuda/compute_streams.h).

* On the fake CUDA driver (CPU): with a stream registered a device wait is a
  cuStreamSynchronize of it (and of the driver's copy stream) and no cuCtxSynchronize;
  with none registered, a cuCtxSynchronize.
* On a GPU: a GPU arena registers JAX's stream; a device wait while another thread
  captures leaves the capture valid; with the streams forgotten
  (``jax_vmm.testing.context_wide_device_waits``) the same wait invalidates it.
* A JAX client destroys its streams when it goes (at the latest at exit): they are
  forgotten first, so that an arena collected later never waits on a dead stream.
"""

from __future__ import annotations

import contextlib
import gc
import threading

import jax.numpy as jnp
import pytest

import jax_vmm
import jax_vmm.testing
from conftest import cuda_ordinal
from jax_vmm.base.loader import core as _core

t = jax_vmm.testing.extension()
G = t.fake_cuda_granularity()


@pytest.fixture
def no_registered_streams():
    """Device 0's registered streams put aside for the test, libcuda's and the fake
    driver's (its device is 0 of its own entry-point table)."""
    saved = {e: t.forget_compute_streams(0, emulated=e) for e in (False, True)}
    try:
        yield
    finally:
        for e, streams in saved.items():
            t.forget_compute_streams(0, emulated=e)
            t.register_compute_streams(0, streams, emulated=e)


def _calls(name: str) -> int:
    return t.fake_cuda_stats()["calls"].get(name, 0)


def _wait_once(arena) -> tuple[int, int]:
    """(cuCtxSynchronize, cuStreamSynchronize) calls of one commit + decommit(wait=True)."""
    ctx0, stream0 = _calls("cuCtxSynchronize"), _calls("cuStreamSynchronize")
    assert arena.commit(0, 0, 2 * G) == 2 * G
    assert arena.decommit(0, 0, 2 * G, True) == 2 * G
    return _calls("cuCtxSynchronize") - ctx0, _calls("cuStreamSynchronize") - stream0


def test_a_device_wait_syncs_the_registered_stream_not_the_context(no_registered_streams):
    r, stream = t.fake_cuda_stream_create()
    assert r == 0
    arena = t.create_fake_cuda_arena(8 * G, G, 0, True)
    try:
        arena.allocate(arena.reserved_bytes, "all")
        ctx_waits, _ = _wait_once(arena)
        assert ctx_waits > 0, "with no stream registered the context is waited for"
        t.register_compute_streams(0, [stream], emulated=True)
        assert t.compute_streams(0, emulated=True) == [stream]
        ctx_waits, stream_waits = _wait_once(arena)
        assert ctx_waits == 0, "a registered stream is waited for instead of the context"
        assert stream_waits >= 2, "the registered stream and the driver's copy stream"
    finally:
        arena.close()  # the fixture forgets the stream
        assert t.fake_cuda_stream_destroy(stream) == 0


def test_registering_a_stream_twice_keeps_one(no_registered_streams):
    t.register_compute_streams(0, [0x1234, 0x1234, 0x5678])
    assert t.compute_streams(0) == [0x1234, 0x5678]
    assert t.forget_compute_streams(0) == [0x1234, 0x5678]
    assert t.compute_streams(0) == []


# -- on a GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
def test_a_gpu_arena_registers_the_compute_stream(gpu_device):
    with jax_vmm.Arena(16 << 20, device=gpu_device):
        assert t.compute_streams(cuda_ordinal(gpu_device)), "no compute stream registered"


def _capture_across_a_device_wait(gpu_device, context_wide: bool) -> dict:
    """Another thread captures a memset into a CUDA graph (thread-local mode, as XLA
    does) for two seconds; meanwhile this thread releases a chunk with wait=True (the
    arena's device wait). Returns "capture_valid" (cuStreamEndCapture succeeded), its
    result "end", and any wait error."""
    cu = pytest.importorskip("cuda.bindings.driver", reason="needs cuda-python")
    cu_oracle = pytest.importorskip("cuda_oracle", reason="needs cuda-python (cuda.bindings)")
    _ok = cu_oracle._ok
    oracle = cu_oracle.CudaOracle(cuda_ordinal(gpu_device))
    arena = jax_vmm.Arena(16 << 20, device=gpu_device)
    buf = arena.allocate(arena.chunk_bytes, jnp.uint8)
    buf.commit()
    began = threading.Event()
    out: dict = {}

    def capture() -> None:
        with oracle.context():
            stream = _ok("cuStreamCreate", cu.cuStreamCreate(1))  # CU_STREAM_NON_BLOCKING
            mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
            _ok("cuStreamBeginCapture", cu.cuStreamBeginCapture(stream, mode))
            _ok("cuMemsetD8Async", cu.cuMemsetD8Async(buf.address, 1, 256, stream))
            began.set()
            threading.Event().wait(2.0)
            err, graph = cu.cuStreamEndCapture(stream)
            out["end"] = err
            out["capture_valid"] = err == cu.CUresult.CUDA_SUCCESS
            if out["capture_valid"]:
                _ok("cuGraphDestroy", cu.cuGraphDestroy(graph))
            _ok("cuStreamDestroy", cu.cuStreamDestroy(stream))

    thread = threading.Thread(target=capture)
    thread.start()
    try:
        assert began.wait(30), "the capture did not begin"
        switch = (
            jax_vmm.testing.context_wide_device_waits(gpu_device)
            if context_wide
            else contextlib.nullcontext()
        )
        with switch:
            try:
                buf.decommit(wait=True)
            except Exception as e:  # noqa: BLE001 -- reported to the caller
                out["wait_error"] = e
    finally:
        thread.join(60)
        arena.close()
    return out


@pytest.mark.gpu
def test_a_device_wait_leaves_a_capture_on_another_thread_valid(gpu_device):
    out = _capture_across_a_device_wait(gpu_device, context_wide=False)
    assert "wait_error" not in out, out.get("wait_error")
    assert out["capture_valid"], f"the capture was broken: {out['end']}"


@pytest.mark.gpu
def test_a_context_wide_wait_would_break_the_capture(gpu_device):
    """The check above catches the failure: with the compute streams forgotten the same
    release waits for the whole context, and the capture comes back invalidated (or the
    wait itself fails)."""
    out = _capture_across_a_device_wait(gpu_device, context_wide=True)
    assert "wait_error" in out or not out["capture_valid"], out


# -- streams of a JAX client that goes --------------------------------------------------


class _Client:
    """Stands in for a JAX client: something a weak reference can follow."""


def test_a_clients_streams_are_forgotten_when_it_goes(no_registered_streams):
    from jax_vmm.base import compute_streams as _compute_streams

    t.register_compute_streams(0, [0x1234])
    client = _Client()
    _compute_streams.forget_when_gone(client, (id(client), 0), 0)
    assert t.compute_streams(0) == [0x1234], "forgotten while the client lives"
    del client
    gc.collect()
    assert t.compute_streams(0) == [], "the stream outlived its client"


def test_forget_compute_streams_counts_what_it_forgot(no_registered_streams):
    t.register_compute_streams(0, [0x1234, 0x5678])
    assert _core.forget_compute_streams(0) == 2
    assert _core.forget_compute_streams(0) == 0 and t.compute_streams(0) == []


_EXIT_SCRIPT = r"""
import atexit, sys
seen = {}
atexit.register(lambda: print("STREAMS_AT_EXIT", seen["streams"]()))  # runs last
import jax, jax.numpy as jnp, numpy as np, jax_vmm, jax_vmm.testing
from jax_vmm.base.devices import resolve_device
dev = jax.devices("gpu")[0]
ordinal = resolve_device(dev).ordinal
seen["streams"] = lambda: jax_vmm.testing.extension().compute_streams(ordinal)
def arena():
    kv = jax_vmm.kv_arena(num_layers=1, num_kv_heads=2, head_dim=64, max_tokens=4096,
                          max_seqs=2, dtype=jnp.bfloat16, device=dev)
    kv.ensure(100, 0)
    new = jax.device_put(jnp.ones((1, 2, 64), jnp.bfloat16), dev)
    layer = jax.jit(jax_vmm.kv_write)(kv.cache()[0], new, new, jnp.array([5], jnp.int32))
    kv.check(layer)
    return kv
closed = arena(); closed.close()
live = arena(); live.cycle = live  # never closed, in a cycle: collected in no set order
print("STREAMS_BEFORE_EXIT", seen["streams"]())
if "--keep-streams" in sys.argv:
    jax_vmm.testing.keep_compute_streams_past_their_clients()
"""


def _exit_run(tmp_path, *args: str) -> tuple[int, str]:
    import subprocess
    import sys

    script = tmp_path / "exit_with_arenas.py"
    script.write_text(_EXIT_SCRIPT)
    p = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=120
    )
    return p.returncode, p.stdout + p.stderr


@pytest.mark.gpu
def test_exit_with_arenas_alive_forgets_the_streams_first(gpu_device, tmp_path):
    """At exit JAX destroys its client, and with it the compute stream, possibly before
    the last arena (closed or not) is collected; that arena's device wait must not use
    the dead stream (it crashed bench/attention.py and bench/kv_write.py at exit)."""
    rc, out = _exit_run(tmp_path)
    assert "STREAMS_BEFORE_EXIT []" not in out, f"no stream was registered:\n{out}"
    assert rc == 0, f"exit failed (rc {rc}):\n{out}"
    assert "STREAMS_AT_EXIT []" in out, f"a stream stayed registered past exit:\n{out}"


@pytest.mark.gpu
def test_without_the_finalizers_the_dead_stream_stays_registered(gpu_device, tmp_path):
    """The switch: with the finalizers detached the stream stays in the table through
    exit, where the last arena's device wait would use it; the check above sees that."""
    _, out = _exit_run(tmp_path, "--keep-streams")
    assert "STREAMS_AT_EXIT [" in out and "STREAMS_AT_EXIT []" not in out, out
