"""Zero-copy views and their leases (#11.2, #11.4).

A view (``buf.array``, ``kv.k[l]``) is a DLPack import whose deleter drops a C++ view
lease: it keeps the arena's reservation alive and counts as a live view of its buffer.
The deleter runs on whatever thread XLA releases the buffer on and never touches Python.

* Exit with work in flight: a script that ends (or raises) while a computation over an
  arena view still runs exits cleanly. With the GIL-taking deleter of a plain nanobind
  ndarray (``jax_vmm.testing.legacy_views()``) the same script aborts.
* ``Buffer.free()`` with live views: the freed range is not placed again until the last
  view is gone, so an old view never reads a newer buffer (it reads zeros). With leaseless
  legacy views the check fails.
"""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
import jax_vmm.testing
from conftest import child_env, write_bytes

REPO = Path(__file__).resolve().parents[2]

# Eight sequences of 32768 x 8 x 128 float32 (1 GiB per buffer, unbacked: it reads zeros
# and costs no memory), read by a queue of passes, each its own asynchronous dispatch (a
# loop inside one computation could make the dispatch wait on the host for its trip
# count). On a GPU, 2000 queued passes (half a millisecond each on an H200) outlast their
# dispatch; the script checks that the work it leaves behind is still running (and queues
# ten times more passes until it is). On the CPU the passes wait at the testing host gate,
# which the script opens only at exit, so they run while the interpreter shuts down. Their
# number scales with the cores, so that they last about as long on any machine: with 4 on
# a 16-core machine they ended too early and the legacy control below exited clean.
_EXIT_SCRIPT = r"""
import atexit, contextlib, faulthandler, os, sys
faulthandler.dump_traceback_later(45, exit=True)  # a hang fails with every thread's stack
import jax, jax.numpy as jnp
import jax_vmm, jax_vmm.testing
platform, end, views = sys.argv[1:4]
device = jax.devices(platform)[0]
kv = jax_vmm.kv_arena(num_layers=1, num_kv_heads=8, head_dim=128, max_tokens=32768,
                      max_seqs=8, dtype=jnp.float32, device=device)
legacy = jax_vmm.testing.legacy_views() if views == "legacy" else contextlib.nullcontext()
with legacy:
    k = kv.k[0]
if platform == "cpu":
    gate = jax_vmm.testing.host_gate_closed()
    gate.__enter__()
    atexit.register(gate.__exit__, None, None, None)  # runs before JAX's own exit handlers
    held = jax_vmm.testing.through_host_gate
    one_pass = jax.jit(lambda k, s: s + jnp.sin(k + 0 * held(s)).sum())
else:
    one_pass = jax.jit(lambda k, s: s + jnp.sin(k).sum())
passes = 2 * os.cpu_count() if platform == "cpu" else 2000  # CPU: ~constant time
while True:
    out = jnp.zeros((), jnp.float32, device=device)
    for _ in range(passes):
        out = one_pass(k, out)
    if not out.is_ready():
        break
    print(f"finished before the check: {passes} passes", flush=True)
    passes *= 10
print(f"dispatched, in flight: {passes} passes", flush=True)
if end == "raise":
    raise RuntimeError("the script fails before block_until_ready")
"""


def _run_exit_script(platform: str, end: str, views: str) -> subprocess.CompletedProcess:
    # The CPU's run on JAX's CPU platform alone, as on a machine without a GPU: with the
    # GPU as JAX's default backend the control below did not abort (the H100 machine).
    env = child_env(JAX_PLATFORMS="cpu") if platform == "cpu" else child_env()
    return subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, platform, end, views],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,  # the script dumps every thread's stack at 45 s
    )


def _assert_clean_exit(proc: subprocess.CompletedProcess, end: str) -> None:
    out = proc.stdout + proc.stderr
    assert "dispatched, in flight" in proc.stdout, out[-3000:]
    assert "terminate called" not in out, out[-3000:]
    if end == "raise":
        assert proc.returncode == 1, out[-3000:]  # the traceback, and nothing else
        assert "the script fails before block_until_ready" in proc.stderr
    else:
        assert proc.returncode == 0, out[-3000:]


@pytest.mark.parametrize("end", ["return", "raise"])
def test_exit_with_work_in_flight_is_clean(device, end):
    _assert_clean_exit(_run_exit_script(device.platform, end, "lease"), end)


def test_the_exit_check_catches_a_deleter_that_takes_the_gil(cpu_device):
    """The same script with views whose deleter takes the GIL (a plain nanobind ndarray,
    as before the leases) aborts at exit: the check above sees the failure."""
    proc = _run_exit_script("cpu", "raise", "legacy")
    assert "dispatched, in flight" in proc.stdout, proc.stderr[-3000:]
    with pytest.raises(AssertionError, match="terminate called|assert -6 == 1|assert 134 == 1"):
        _assert_clean_exit(proc, "raise")


# -- free() with live views -----------------------------------------------------------------


def _stale_view_of_a_freed_buffer(arena: jax_vmm.Arena) -> None:
    c = arena.chunk_bytes
    old = arena.allocate((c // 4,), jnp.float32, name="old")
    old.commit()
    write_bytes(old, 0, np.full(c // 4, 1, np.float32))
    view = old.array
    old.free()
    new = arena.allocate((c // 4,), jnp.float32, name="new")
    new.commit()
    write_bytes(new, 0, np.full(c // 4, 7, np.float32))
    assert new.address != old.address, "a freed range was placed again under a live view"
    assert not np.asarray(view).any(), "the view of a freed buffer must read zeros"


def test_a_freed_range_is_not_reused_while_a_view_lives(vm):
    arena = vm.arena(4 * vm.chunk)
    _stale_view_of_a_freed_buffer(arena)
    assert arena.live_views() == 0
    # The last view died with the helper's frame: the range is free again.
    again = arena.allocate((vm.chunk // 4,), jnp.float32)
    assert again.address == arena.base, "the freed range came back after its last view"


def test_the_freed_range_check_catches_views_without_leases(host_vm):
    arena = host_vm.arena(4 * host_vm.chunk)
    with jax_vmm.testing.legacy_views(), pytest.raises(AssertionError, match="placed again"):
        _stale_view_of_a_freed_buffer(arena)


def test_live_views_are_counted_per_buffer(vm):
    arena = vm.arena(4 * vm.chunk)
    a = arena.allocate(vm.chunk, jnp.uint8)
    b = arena.allocate(vm.chunk, jnp.uint8)
    assert (a.live_views(), b.live_views(), arena.live_views()) == (0, 0, 0)
    views = [a.array, a.view((8,), jnp.uint8), b.array]
    assert (a.live_views(), b.live_views(), arena.live_views()) == (2, 1, 3)
    jax.block_until_ready(jax.jit(lambda x: x + 1)(views[0]))
    del views[0]
    gc.collect()
    assert (a.live_views(), b.live_views()) == (1, 1)
    views.clear()
    gc.collect()
    assert arena.live_views() == 0
    arena.close()
    assert arena.live_views() == 0  # still answers after close


def test_a_freed_buffer_refuses_further_use(vm):
    arena = vm.arena(4 * vm.chunk)
    buf = arena.allocate(vm.chunk, jnp.uint8, name="gone")
    view = buf.array
    buf.free()
    for call in (
        buf.commit,
        buf.decommit,
        lambda: buf.array,
        lambda: buf.view((8,)),
        lambda: buf.backed_prefix(0, 8),
        buf.free,
    ):
        with pytest.raises(ValueError, match=r"buffer 'gone' was freed"):
            call()
    assert buf not in arena.buffers
    assert not np.asarray(view).any()
