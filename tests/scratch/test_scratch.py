"""Graph-safe scratch: grow-in-place keeps the address, retire keeps old blocks alive,
no growth under capture (clear error), resolution of captured streams, mode switches,
the free-on-growth emulation, and the scratch probe custom call (both in jax_vmm.testing).

Host workspaces (device -1) exercise the same C++ code as GPU ones, with the host
driver (mmap/memfd) for grow-in-place; the GPU variants run when a CUDA GPU is present.
Capture is simulated on the host through the ``capturing`` argument of
jax_vmm.testing.scratch_get.
"""

from __future__ import annotations

import ctypes
import itertools
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import child_env, cuda_ordinal
from jax_vmm import testing
from jax_vmm.base.loader import core as _core
from jax_vmm.ops import scratch

HOST = -1
KIB = 1024
CHUNK = 64 * KIB  # host driver default chunk

_streams = itertools.count(0x5000)


def _stream() -> int:
    """A stream key no other test uses: a fresh workspace."""
    return next(_streams)


def _get(stream: int, nbytes: int, capturing: bool = False, device: int = HOST) -> int:
    return testing.scratch_get(device, stream, nbytes, capturing)


def _ws(stream: int, device: str = "cpu") -> dict:
    found = [
        s
        for s in scratch.scratch_stats()
        if s["device"] == device and s["stream"] == stream and s["current"]
    ]
    assert len(found) == 1, found
    return found[0]


def _new_generation(mode: str) -> None:
    """Switch to `mode` through another mode, so that the table starts a fresh generation."""
    scratch.set_scratch_mode("retire" if mode != "retire" else "grow")
    scratch.set_scratch_mode(mode)


@pytest.fixture(autouse=True)
def _restore_scratch_settings():
    yield
    scratch.set_scratch_mode("default")
    scratch.set_reserve_bytes(0)


# -- strategies ------------------------------------------------------------------------


def test_grow_in_place_keeps_address_and_contents():
    _new_generation("grow")
    s = _stream()
    a1 = _get(s, 10_000)
    ctypes.memset(a1, 0xAB, 10_000)
    a2 = _get(s, 300_000)
    assert a2 == a1, "growing in place must not move the workspace"
    assert ctypes.string_at(a1, 10_000) == b"\xab" * 10_000
    ctypes.memset(a1 + 290_000, 0xCD, 10_000)  # the grown tail is writable
    w = _ws(s)
    assert w["mode"] == "grow"
    assert w["capacity"] == 5 * CHUNK  # 300_000 rounded up to 64 KiB chunks
    assert w["growth_events"] == 2
    assert w["retired_blocks"] == 0 and w["backed_bytes"] == w["capacity"]
    assert _get(s, 100) == a1 and _ws(s)["growth_events"] == 2  # no shrink, no growth


def test_retire_keeps_outgrown_blocks_alive():
    _new_generation("retire")
    s = _stream()
    a1 = _get(s, 10_000)
    ctypes.memset(a1, 0x5A, 10_000)
    a2 = _get(s, 300_000)
    assert a2 != a1
    # The outgrown block is still allocated: a graph that captured it may use it.
    assert ctypes.string_at(a1, 10_000) == b"\x5a" * 10_000
    ctypes.memset(a1, 0x11, 10_000)
    w = _ws(s)
    assert w["mode"] == "retire" and w["vmm"]  # exactly-sized VMM ranges on the host
    assert w["retired_blocks"] == 1 and w["retired_bytes"] == CHUNK  # 10_000 -> 1 chunk
    assert w["capacity"] == w["reserved_bytes"] == 5 * CHUNK
    assert w["backed_bytes"] == w["capacity"] + w["retired_bytes"]
    assert w["growth_events"] == 2 and w["freed_blocks"] == 0


@pytest.mark.parametrize("mode", ["grow", "retire"])
def test_debug_free_on_growth_frees_the_outgrown_block(mode):
    """The testing layer's emulation re-creates the seed's bug: the workspace moves and
    the old block's memory is given back (not retired). Its address range stays
    reserved, read-only zeros, so a stale writer faults (GPU tests rely on that)."""
    _new_generation(mode)
    with testing.free_scratch_on_growth():
        s = _stream()
        a1 = _get(s, 10_000)
        ctypes.memset(a1, 0xAB, 10_000)
        a2 = _get(s, 300_000)
    assert a2 != a1
    assert ctypes.string_at(a1, 10_000) == bytes(10_000), "the old block still holds data"
    w = _ws(s)
    assert w["freed_blocks"] == 1 and w["retired_blocks"] == 0
    assert w["backed_bytes"] == w["capacity"]


def test_outgrown_reservation_moves_to_a_larger_range():
    _new_generation("grow")
    scratch.set_reserve_bytes(2 * CHUNK)
    assert scratch.get_reserve_bytes() == 2 * CHUNK
    s = _stream()
    a1 = _get(s, CHUNK)
    assert _get(s, 2 * CHUNK) == a1  # still fits the reservation
    a2 = _get(s, 5 * CHUNK)
    assert a2 != a1
    w = _ws(s)
    assert w["retired_blocks"] == 1 and w["retired_bytes"] == 2 * CHUNK
    assert w["reserved_bytes"] == 5 * CHUNK and w["capacity"] == 5 * CHUNK
    assert _get(s, 5 * CHUNK) == a2


def test_mode_change_retires_current_workspaces():
    _new_generation("grow")
    s = _stream()
    a_grow = _get(s, 1000)
    scratch.set_scratch_mode("retire")
    assert scratch.get_scratch_mode() == "retire"
    old = [w for w in scratch.scratch_stats() if w["stream"] == s and not w["current"]]
    assert len(old) == 1 and old[0]["address"] == a_grow and old[0]["mode"] == "grow"
    a_retire = _get(s, 1000)
    assert a_retire != a_grow and _ws(s)["mode"] == "retire"
    assert _ws(s)["generation"] > old[0]["generation"]


# -- capture -------------------------------------------------------------------------


def test_capture_never_grows_and_says_what_to_do():
    _new_generation("grow")
    s = _stream()
    with pytest.raises(
        RuntimeError, match=r"capturing a CUDA graph.*jax_vmm\.ops\.scratch\.reserve"
    ):
        _get(s, 4096, capturing=True)
    w = _ws(s)
    assert w["capture_refusals"] == 1 and w["capacity"] == 0 and w["growth_events"] == 0
    a = _get(s, CHUNK)  # outside capture: grows
    assert _get(s, CHUNK, capturing=True) == a  # enough: served as is
    with pytest.raises(RuntimeError, match=f"needed.*holds {CHUNK} bytes"):
        _get(s, CHUNK + 1, capturing=True)
    w = _ws(s)
    assert w["capture_refusals"] == 2 and w["capacity"] == CHUNK and w["growth_events"] == 1


def test_capture_resolves_to_the_bound_then_the_default_workspace():
    """XLA records a graph on a private trace stream: Get() under capture falls back to
    the workspace this thread used outside capture, else the device default one."""
    _new_generation("grow")
    results: dict[str, int] = {}
    main_stream, trace_stream = _stream(), _stream()

    def recorder():  # kInitialize on the compute stream, then recording on the trace stream
        results["bound"] = _get(main_stream, 3 * CHUNK)
        results["captured"] = _get(trace_stream, 2 * CHUNK, capturing=True)

    t = threading.Thread(target=recorder)
    t.start()
    t.join()
    assert results["captured"] == results["bound"]

    scratch.reserve(4 * CHUNK, jax.devices("cpu")[0])  # the host default workspace
    default = _ws(0)["address"]

    def other_thread():  # no binding on this thread
        results["fallback"] = _get(_stream(), 4 * CHUNK, capturing=True)

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert results["fallback"] == default


# -- probe -------------------------------------------------------------------------------


def test_probe_copies_through_a_workspace(cpu_device):
    _new_generation("grow")
    # On a GPU machine jnp's default device is the GPU: put the input on the CPU.
    x = jax.device_put(jnp.arange(3000, dtype=jnp.float32), cpu_device)
    s0 = testing.scratch_probe_stats()
    f = jax.jit(lambda x: testing.scratch_probe(x, 200_000))
    y, addr = f(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    assert testing.scratch_probe_stats()["calls"] == s0["calls"] + 1
    ptr = testing.address_of(addr)
    hosts = {
        w["address"]: w for w in scratch.scratch_stats() if w["device"] == "cpu" and w["current"]
    }
    assert ptr in hosts and hosts[ptr]["capacity"] >= 200_000


def test_errors():
    with pytest.raises(ValueError, match="'default', 'grow' or 'retire'"):
        scratch.set_scratch_mode("fast")
    with pytest.raises(ValueError, match="> 0"):
        scratch.reserve(0)
    with pytest.raises(ValueError, match=r"at most 2\*\*47 \(the process's address space\)"):
        scratch.reserve(2**63)
    with pytest.raises(ValueError, match=r"at most 2\*\*47 \(the process's address space\)"):
        scratch.set_reserve_bytes(2**63)  # was accepted, to fail at a later growth
    with pytest.raises(ValueError, match="smaller than the input"):
        testing.scratch_probe(jnp.zeros(100), 10)
    if not _core.built_with_cuda_kernels:
        with pytest.raises(RuntimeError, match="no CUDA kernels"):
            _get(_stream(), 100, device=0)


_RESERVE_CHILD = """
from jax_vmm.ops import scratch
print(scratch.get_reserve_bytes())
scratch.set_reserve_bytes(3 << 20)
print(scratch.get_reserve_bytes())
scratch.set_reserve_bytes(0)
print(scratch.get_reserve_bytes())
"""


def _reserve_child(value: str) -> subprocess.CompletedProcess:
    env = child_env() | {scratch.RESERVE_ENV: value}
    return subprocess.run(
        [sys.executable, "-c", _RESERVE_CHILD], env=env, capture_output=True, text=True
    )


def test_the_reserve_variable_is_the_default_that_zero_restores():
    """JAX_VMM_SCRATCH_RESERVE_BYTES sets the default, and set_reserve_bytes(0) goes back
    to it (it went back to 1 GiB, ignoring the variable)."""
    r = _reserve_child(str(5 << 20))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(5 << 20), str(3 << 20), str(5 << 20)]


@pytest.mark.parametrize("value", ["-1", "1e9", " 1024", "1GiB", str(2**47 + 1)])
def test_a_malformed_reserve_variable_is_refused_at_import(value):
    """The core ignored such a value (or wrapped -1 to 2**64 - 1) without a word."""
    r = _reserve_child(value)
    assert r.returncode != 0
    assert "JAX_VMM_SCRATCH_RESERVE_BYTES=" in r.stderr
    assert "expected a number of bytes" in r.stderr


@pytest.mark.parametrize("mode", ["grow", "retire"])
@pytest.mark.parametrize("nbytes", [2**64 - 1, 2**64 - CHUNK // 2, 2**62 + 1])
def test_a_size_near_2_64_is_refused_not_wrapped(mode, nbytes):
    """The C++ Get() (what an FFI author calls, with a size_t) refuses a size near 2^64:
    rounded up to a chunk it wrapped to 0, and Get() returned the old workspace (or a
    fresh one of capacity 0) as if it were that large."""
    _new_generation(mode)
    stream = _stream()
    _get(stream, 4 * KIB)
    with pytest.raises(RuntimeError, match="more than any device holds"):
        _get(stream, nbytes)
    assert _ws(stream)["capacity"] < 2**62
    with pytest.raises(RuntimeError, match="more than any device holds"):
        _get(_stream(), nbytes)  # a fresh workspace


# -- GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["grow", "retire"])
def test_gpu_probe_and_growth(gpu_device, mode):
    _new_generation(mode)
    dev = f"cuda:{cuda_ordinal(gpu_device)}"
    s0 = testing.scratch_probe_stats()
    small = jax.device_put(jnp.arange(1000, dtype=jnp.float32), gpu_device)
    big = jax.device_put(jnp.arange(2_000_000, dtype=jnp.float32), gpu_device)  # 8 MB
    y, a_small = jax.jit(testing.scratch_probe)(small)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(small))
    y, a_big = jax.jit(testing.scratch_probe)(big)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(big))
    s1 = testing.scratch_probe_stats()
    assert s1["initialize_calls"] > s0["initialize_calls"], "kInitialize stage never ran"
    ws = [
        w
        for w in scratch.scratch_stats()
        if w["device"] == dev
        and w["current"]
        and w["address"] in (testing.address_of(a_small), testing.address_of(a_big))
    ]
    assert ws, scratch.scratch_stats()
    w = max(ws, key=lambda w: w["capacity"])
    assert w["mode"] == mode and w["capacity"] >= 8_000_000
    if mode == "grow":
        assert testing.address_of(a_small) == testing.address_of(a_big)
        assert w["retired_blocks"] == 0
    else:
        assert testing.address_of(a_small) != testing.address_of(a_big)
        assert w["retired_blocks"] >= 1


def test_a_growth_past_the_hosts_memory_is_refused():
    """A host workspace growth past the memory the machine has available fails with a
    message instead of the kernel's OOM killer ending the process (a 1 TiB reserve did).
    The machine is pretended to have 8 MiB available (testing switch)."""
    _new_generation("grow")
    stream = _stream()
    _get(stream, 1 << 20)
    before = _ws(stream)["backed_bytes"]
    with testing.host_memory_available(8 << 20):
        with pytest.raises(
            RuntimeError, match="out of memory committing .* bytes available and keeps 0"
        ):
            _get(stream, 64 << 20)
    assert _ws(stream)["backed_bytes"] == before
    _get(stream, 64 << 20)  # the real machine has the room
    assert _ws(stream)["backed_bytes"] >= 64 << 20
