"""Shared fixtures: the device matrix, an arena harness with oracles, data helpers.

Every device-generic test takes the ``device`` fixture: the CPU always, plus the first
CUDA GPU with VMM support when there is one (those params carry ``@pytest.mark.gpu``).
``gpu_device`` is for GPU-only tests and skips cleanly without a CUDA GPU.

The ``vm`` fixture builds arenas/KV arenas on ``device``, closes them after the test, and
checks backing against an independent oracle (with the ``faults`` fixture, the arenas it
builds can be made to fail driver calls): on the host, ``/proc/self/maps`` plus the
memfd's allocated blocks (tests/oracles/maps_oracle.py); on a GPU, the CUDA driver's own answer
per chunk through cuda-python (tests/oracles/cuda_oracle.py, when importable).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
import jax_vmm.testing

# tests/oracles is on the path by pyproject's pytest `pythonpath`; a child process gets
# it from child_env().
import maps_oracle as mo
from jax_vmm.base.loader import core as _core

TESTS = Path(__file__).resolve().parent


def child_env(*folders: Path, **extra: str) -> dict[str, str]:
    """``os.environ`` plus ``extra`` for a child Python process that imports what this one
    does: ``folders``, tests/ (conftest), tests/oracles, then this process's ``sys.path``
    (jax_vmm, a development build), as its PYTHONPATH."""
    path = [str(f) for f in folders] + [str(TESTS), str(TESTS / "oracles")]
    path += [p for p in sys.path if p and p not in path]
    return dict(os.environ, **extra, PYTHONPATH=os.pathsep.join(path))


def run_cpu_script(script: str, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """``python -c script args...`` in a child on JAX's CPU platform (``child_env``), its
    output captured: for probes that may kill their process."""
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        env=child_env(JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@functools.cache
def cuda_vmm_device() -> tuple[jax.Device | None, str]:
    """(the first JAX CUDA device whose driver supports VMM, or None; why not)."""
    try:
        gpus = [d for d in jax.devices() if d.platform in ("gpu", "cuda")]
    except RuntimeError as exc:
        return None, f"no JAX GPU backend ({exc})"
    if not gpus:
        return None, "no JAX GPU device (jax.devices() has none)"
    infos, error = _core.query_cuda_devices()
    if not infos:
        return None, f"the CUDA driver is not usable: {error}"
    dev = gpus[0]
    ordinal = getattr(dev, "local_hardware_id", None)
    ordinal = dev.id if ordinal is None else ordinal
    info = next((i for i in infos if i["ordinal"] == ordinal), None)
    if info is None or not info["vmm_supported"]:
        return None, f"CUDA device {ordinal} has no VMM support"
    return dev, ""


def _device_params() -> list[Any]:
    params = [pytest.param("cpu", id="cpu")]
    if cuda_vmm_device()[0] is not None:
        params.append(pytest.param("gpu", id="gpu", marks=pytest.mark.gpu))
    return params


@pytest.fixture(params=_device_params())
def device(request) -> jax.Device:
    if request.param == "cpu":
        return jax.devices("cpu")[0]
    return cuda_vmm_device()[0]


@pytest.fixture
def cpu_device() -> jax.Device:
    return jax.devices("cpu")[0]


@pytest.fixture
def gpu_device() -> jax.Device:
    dev, why = cuda_vmm_device()
    if dev is None:
        pytest.skip(f"needs a CUDA GPU with VMM support: {why}")
    return dev


# -- data helpers ----------------------------------------------------------------------


def _cuda_memcpy_htod(ordinal: int, dst: int, src: np.ndarray) -> None:
    try:
        import cupy  # the GPU machine has it; a plain runtime memcpy, no JAX involved
    except ImportError:
        pytest.skip("writing test data into GPU arena memory needs cupy")
    with cupy.cuda.Device(ordinal):
        cupy.cuda.runtime.memcpy(
            dst, src.ctypes.data, src.nbytes, cupy.cuda.runtime.memcpyHostToDevice
        )
        # A pageable-memory copy may return before its DMA lands; JAX reads on its own
        # streams next, so wait for the device.
        cupy.cuda.runtime.deviceSynchronize()


def write_bytes(buf: jax_vmm.Buffer, offset: int, data: np.ndarray) -> None:
    """Write raw bytes into a buffer's memory outside JAX (memcpy to its address).
    The range must be committed: a write to an unbacked host page would fault."""
    data = np.ascontiguousarray(data)
    n = data.nbytes
    assert 0 <= offset and offset + n <= buf.nbytes, "write outside the buffer"
    assert buf.backed_prefix(offset, offset + n) == n, "test bug: writing unbacked memory"
    target = buf.arena._target
    if target.driver == "host":
        ctypes.memmove(buf.address + offset, data.ctypes.data, n)
    else:
        _cuda_memcpy_htod(target.ordinal, buf.address + offset, data)


def read_bytes(buf: jax_vmm.Buffer, start: int = 0, stop: int | None = None) -> np.ndarray:
    """A host copy of bytes [start, stop) of the buffer, read through a fresh JAX view."""
    stop = buf.nbytes if stop is None else stop
    view = buf.view((buf.nbytes,), jnp.uint8)
    return np.array(view[start:stop])


def raw_bytes(buf: jax_vmm.Buffer, start: int = 0, stop: int | None = None) -> np.ndarray:
    """A host copy of bytes [start, stop) read straight from memory, without a JAX view
    (a view would count as a raw reader of the arena and change how it releases). While
    the arena defers its zeros, an unmapped chunk (the CUDA driver's answer) is returned as
    zeros without being read: it holds no bytes, and a view turns zeros on before any
    reader of the arena could see it."""
    stop = buf.nbytes if stop is None else stop
    n = stop - start
    target = buf.arena._target
    if target.driver == "host":
        return np.frombuffer(ctypes.string_at(buf.address + start, n), np.uint8).copy()
    try:
        import cupy
    except ImportError:
        pytest.skip("reading GPU arena memory without a view needs cupy")
    # Lock-free questions only: a test may read while a commit holds the arena's lock.
    spans = [(buf.address + start, buf.address + stop)]
    if not buf.arena._handle.unbacked_reads_zero:
        driver = _cuda_driver_oracle(target.ordinal)
        if driver is None:
            pytest.skip("reading a GPU arena that defers its zeros needs cuda-python")
        spans = _mapped_spans(driver, buf.address + start, n, buf.arena.chunk_bytes)
    out = np.zeros(n, np.uint8)
    with cupy.cuda.Device(target.ordinal):
        for lo, hi in spans:
            at = lo - buf.address - start
            cupy.cuda.runtime.memcpy(
                out[at:].ctypes.data, lo, hi - lo, cupy.cuda.runtime.memcpyDeviceToHost
            )
    return out


def _mapped_spans(driver: Any, address: int, n: int, chunk: int) -> list[tuple[int, int]]:
    """The [lo, hi) runs of [address, address + n) that the driver has mapped."""
    pieces = []
    at, stop = address, address + n
    while at < stop:
        end = min(stop, (at // chunk + 1) * chunk)
        if driver.access(at) is not None:
            pieces.append((at, end))
        at = end
    return mo.merge(pieces)


@contextlib.contextmanager
def eager_zeros(eager: bool = True) -> Iterator[None]:
    """Arenas made inside map their read-only zero pieces at creation
    (JAX_VMM_DEFER_ZERO_READS=0); eager=False: they defer them until the first view."""
    with mock.patch.dict(os.environ, {"JAX_VMM_DEFER_ZERO_READS": "0" if eager else "1"}):
        yield


def unbacked_kind(arena: jax_vmm.Arena) -> str:
    """What the CUDA driver oracle calls an unbacked chunk of ``arena`` now: 'zero' (a
    read-only zero piece) or 'hole' (zeros deferred and no view yet: nothing mapped).
    Lock-free (the core's property, not stats(), which waits for a commit in progress)."""
    return "zero" if arena._handle.unbacked_reads_zero else "hole"


def pattern(n: int, seed: int) -> np.ndarray:
    """n distinctive non-zero bytes."""
    return (np.arange(n, dtype=np.uint64) * 2654435761 + seed * 97 + 1).astype(np.uint8) | 1


def chunk_states(buf: jax_vmm.Buffer) -> tuple[bool, ...]:
    """Backed-ness of each chunk of the buffer as the arena reports it."""
    c = buf.arena.chunk_bytes
    out = []
    for lo in range(0, buf.nbytes, c):
        hi = min(lo + c, buf.nbytes)
        out.append(buf.backed_prefix(lo, hi) == hi - lo)
    return tuple(out)


def two_seq_kv(vm: Any, dtype: Any = jnp.float32, chunks_per_seq: int = 4, **kw: Any):
    """A KV arena of 2 layers x 2 sequences of `chunks_per_seq` chunks each, 2 KV heads of
    64 (`vm.kv`, any keyword overridden by `kw`), and its tokens per chunk."""
    tpc = vm.chunk // (2 * 64 * np.dtype(dtype).itemsize)
    args = dict(
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
        max_tokens=chunks_per_seq * tpc,
        max_seqs=2,
        dtype=dtype,
    )
    return vm.kv(**(args | kw)), tpc


def seq_chunk_states(kv: jax_vmm.KVArena, q: int) -> tuple[bool, ...]:
    """Backed-ness of each chunk of sequence q of a KV arena, the same in every buffer."""
    per_seq = kv.seq_bytes // kv.arena.chunk_bytes
    states = {chunk_states(b)[q * per_seq : (q + 1) * per_seq] for b in kv.buffers}
    assert len(states) == 1, f"buffers disagree: {states}"
    return states.pop()


@dataclasses.dataclass
class HeldCommit:
    """A background commit held by :func:`hold_commit_ahead`: ``inside`` is set once its
    first buffer's core call returned; setting ``go`` lets it go on."""

    inside: threading.Event
    go: threading.Event


def hold_commit_ahead(
    kv: jax_vmm.KVArena,
    start: Callable[[], Any],
    hold_s: float,
    after: threading.Event | None = None,
) -> HeldCommit:
    """Calls ``start``, which makes the KV arena's worker begin a background commit, with a
    stand-in core whose ``commit_ahead`` holds after its first buffer's core call until
    ``go`` is set (at most ``hold_s``); returns once that call returned. With ``after``,
    the call first waits for that event (at most 30 s) and this returns once the call is
    entered, before its core call. The real core is back in place on return (the worker
    keeps the method it is inside)."""
    core = kv.arena._handle
    entered, held = threading.Event(), HeldCommit(threading.Event(), threading.Event())

    class Holding:
        def __getattr__(self, name: str) -> Any:
            return getattr(core, name)

        def commit_ahead(self, ranges: Any) -> int:
            entered.set()
            if after is not None:
                after.wait(timeout=30)
            done = core.commit_ahead(ranges)
            held.inside.set()
            held.go.wait(timeout=hold_s)
            return done

    kv.arena._handle = Holding()
    try:
        start()
        reached = entered if after is not None else held.inside
        assert reached.wait(30), "the background commit never reached the core"
    finally:
        kv.arena._handle = core
    return held


def write_one_token(kv: jax_vmm.KVArena, slot: int, value: float) -> None:
    """kv_write of one token (every element `value`) to flat slot `slot` of layer 0."""
    new = jax.device_put(
        jnp.full((1, kv.num_kv_heads, kv.head_dim), value, kv.dtype), kv.arena.device
    )
    jax.jit(jax_vmm.kv_write)(kv.cache()[0], new, new, jnp.array([slot], jnp.int32))


def k_tokens(kv: jax_vmm.KVArena, seq: int) -> np.ndarray:
    """Layer 0's K tokens of sequence `seq` as the arena's memory holds them (raw_bytes)."""
    raw = raw_bytes(kv.k_buffers[0]).view(kv.dtype)
    return raw.reshape(kv.max_seqs, -1, kv.num_kv_heads, kv.head_dim)[seq]


def assert_unwritable_until_ensure(kv: jax_vmm.KVArena, seq: int, tokens: int, pos: int) -> None:
    """A write to position `pos` of sequence `seq` (layer 0) is dropped until
    ``kv.ensure(tokens, seq)``: counted by ``check()``, its bytes unchanged; after the
    ensure the same write lands."""
    slot = seq * kv.max_tokens + pos
    before = k_tokens(kv, seq)[pos].copy()
    write_one_token(kv, slot, 9.0)
    with pytest.raises(jax_vmm.OutOfBoundsWrite) as info:
        kv.check()
    assert info.value.count == 2  # K and V
    np.testing.assert_array_equal(k_tokens(kv, seq)[pos], before, "the dropped write landed")
    kv.ensure(tokens, seq)
    write_one_token(kv, slot, 9.0)
    kv.check()
    assert np.all(k_tokens(kv, seq)[pos] == 9.0)


def assert_write_lands_without_the_table(kv: jax_vmm.KVArena, seq: int, pos: int) -> None:
    """The switch for assert_unwritable_until_ensure: with the table of ensured tokens
    ignored, the same write to a backed position lands (and nothing is counted)."""
    import jax_vmm.testing

    with jax_vmm.testing.limits_ignored():
        write_one_token(kv, seq * kv.max_tokens + pos, 9.0)
    kv.check()
    assert np.all(k_tokens(kv, seq)[pos] == 9.0)


STAT_KEYS_STABLE = (
    "reserved_bytes",
    "placed_bytes",
    "backed_bytes",
    "peak_backed_bytes",
    "num_buffers",
    "commit_calls",
    "decommit_calls",
    "chunks_created",
    "chunks_released",
    "set_access_calls",
    "closed",
)


def stable_stats(arena: jax_vmm.Arena) -> dict:
    """stats() without timings, free memory and the failure counters."""
    s = arena.stats()
    return {k: s[k] for k in STAT_KEYS_STABLE}


# -- the harness ---------------------------------------------------------------------


class CudaBackingOracle:
    """The GPU counterpart of maps_oracle.HostOracle, over tests/oracles/cuda_oracle.py: per
    chunk of the reservation, 'rw' (committed), else 'zero' (the read-only zero chunk) or,
    while the arena defers its zeros, 'hole'."""

    def __init__(self, arena: jax_vmm.Arena, driver_oracle: Any):
        self.arena = arena
        self.base = arena.base
        self.size = arena.reserved_bytes
        self.chunk = arena.chunk_bytes
        self.driver = driver_oracle

    def kinds(self) -> tuple[str, ...]:
        return tuple(self.driver.kinds(self.base, self.size, self.chunk))

    def snapshot(self) -> tuple:
        return (self.kinds(),)

    def assert_backed_exactly(self, ranges: Iterable[tuple[int, int]]) -> None:
        ranges = mo.merge(ranges)
        unbacked = unbacked_kind(self.arena)
        want = tuple(
            "rw" if any(lo <= off < hi for lo, hi in ranges) else unbacked
            for off in range(0, self.size, self.chunk)
        )
        got = self.kinds()
        assert got == want, f"driver says {got}, expected {want}"

    def assert_released(self) -> None:
        self.assert_backed_exactly([])


@functools.cache
def _cuda_driver_oracle(ordinal: int) -> Any:
    try:
        import cuda_oracle

        return cuda_oracle.CudaOracle(ordinal)
    except Exception:  # noqa: BLE001 - no cuda-python: data and bookkeeping checks only
        return None


class Harness:
    """Creates arenas on one device, remembers each host arena's memfd, closes all."""

    def __init__(self, device: jax.Device):
        self.device = device
        self.is_host = device.platform == "cpu"
        driver = "host" if self.is_host else "cuda"
        ordinal = 0 if self.is_host else cuda_ordinal(device)
        #: the default chunk size on this device: test sizes are multiples of it
        self.chunk = _core.resolve_chunk_bytes(driver, ordinal, 0)
        self._owned: list[Any] = []
        self._oracles: dict[int, mo.HostOracle] = {}

    def _track(self, make, arena_of):
        before = mo.jax_vmm_memfds() if self.is_host else None
        obj = make()
        arena = arena_of(obj)
        if self.is_host:
            probe = mo.MemfdProbe.between(before, mo.jax_vmm_memfds())
            self._oracles[id(arena)] = mo.HostOracle(arena.base, arena.reserved_bytes, probe)
        elif (driver := _cuda_driver_oracle(cuda_ordinal(self.device))) is not None:
            if arena.reserved_bytes // arena.chunk_bytes <= 256:  # a few driver calls per chunk
                self._oracles[id(arena)] = CudaBackingOracle(arena, driver)
        self._owned.append(obj)
        return obj

    def arena(self, reserve_bytes: int, chunk_bytes: int | None = None, **kw: Any) -> jax_vmm.Arena:
        return self._track(
            lambda: jax_vmm.Arena(reserve_bytes, device=self.device, chunk_bytes=chunk_bytes, **kw),
            lambda a: a,
        )

    def kv(self, **kw: Any) -> jax_vmm.KVArena:
        """A KV arena on this device. Commits ahead of need are off unless asked for
        (commit_ahead_tokens): the tests check exact backing, which a background commit
        would change behind them (tests/core/test_commit_ahead.py covers it)."""
        kw.setdefault("device", self.device)
        kw.setdefault("commit_ahead_tokens", 0)
        return self._track(lambda: jax_vmm.kv_arena(**kw), lambda kv: kv.arena)

    def oracle(self, arena: jax_vmm.Arena) -> mo.HostOracle | CudaBackingOracle | None:
        """The independent oracle of an arena made here (None: too large, or no
        cuda-python on a GPU machine)."""
        return self._oracles.get(id(arena))

    def snapshot(self, arena: jax_vmm.Arena, buffers: Iterable[jax_vmm.Buffer]) -> dict:
        """Everything a failed commit must leave exactly as it was (after the releases
        still in the background have finished: they would change it meanwhile)."""
        arena.reclaim()
        bufs = list(buffers)
        snap = {
            "stats": stable_stats(arena),
            "backed": [b.backed_bytes for b in bufs],
            "chunks": [chunk_states(b) for b in bufs],
            "data": [read_bytes(b).tobytes() for b in bufs],
        }
        o = self.oracle(arena)
        if o is not None:
            snap["oracle"] = o.snapshot()
        return snap

    def assert_backed(
        self,
        arena: jax_vmm.Arena,
        ranges: Iterable[tuple[int, int]],
        held: Iterable[tuple[int, int]] | None = None,
    ) -> None:
        """Exactly ``ranges`` (bytes relative to the arena base) are committed: by the
        arena's stats and page tables, and by the oracle (the kernel on the host, the CUDA
        driver on a GPU). ``held``: the ranges that physically hold memory, when that is
        more than ``ranges`` (released chunks parked inside a larger allocation)."""
        arena.reclaim()  # releases still in the background (GPU) finish first
        ranges = mo.merge(ranges)
        held = ranges if held is None else mo.merge(held)
        total = sum(hi - lo for lo, hi in ranges)
        assert arena.backed_bytes == total, (arena.backed_bytes, total)
        c = arena.chunk_bytes
        for b in arena.buffers:
            if arena._handle.closed:
                break
            try:
                states = chunk_states(b)
            except ValueError:  # freed buffer
                continue
            want = tuple(
                any(lo <= b.offset + i * c and b.offset + (i + 1) * c <= hi for lo, hi in ranges)
                for i in range(len(states))
            )
            assert states == want, f"{b.name}: page table {states}, expected {want}"
        assert arena.stats()["held_bytes"] == sum(hi - lo for lo, hi in held)
        o = self.oracle(arena)
        if o is not None:
            o.assert_backed_exactly(held)

    def close_all(self) -> None:
        for obj in reversed(self._owned):
            obj.close()
        self._owned.clear()
        self._oracles.clear()


def cuda_ordinal(device: jax.Device) -> int:
    ordinal = getattr(device, "local_hardware_id", None)
    return device.id if ordinal is None else int(ordinal)


def chunk_range(buf: jax_vmm.Buffer, first: int, end: int) -> tuple[int, int]:
    """Arena-relative byte range of chunks [first, end) of a buffer."""
    c = buf.arena.chunk_bytes
    return (buf.offset + first * c, buf.offset + end * c)


@pytest.fixture
def vm(device) -> Harness:
    h = Harness(device)
    yield h
    h.close_all()


@pytest.fixture
def faults() -> jax_vmm.testing.FaultInjection:
    """Arenas the test creates (``vm.arena``, ``vm.kv``, ``jax_vmm.Arena``) get a
    fault-injecting driver; arm it with ``faults.arm(arena, op, nth)``."""
    with jax_vmm.testing.fault_injection() as f:
        yield f


@pytest.fixture
def host_vm(cpu_device) -> Harness:
    """A harness on the CPU only: for tests about the host driver's OS-level behaviour."""
    h = Harness(cpu_device)
    yield h
    h.close_all()


# -- calls on other threads, and steps held at the testing host gate ------------------------


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


class BackgroundCall:
    """Runs fn in a thread; .done tells whether it returned, .result / .error what."""

    def __init__(self, fn: Callable[[], object]):
        self.result = self.error = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn):
        try:
            self.result = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised by join()
            self.error = exc

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def inside(self, fn: Callable[..., object]) -> bool:
        """Whether the call is running ``fn`` now (a frame of its code on the thread's
        stack)."""
        frame = sys._current_frames().get(self._thread.ident)
        while frame is not None and frame.f_code is not fn.__code__:
            frame = frame.f_back
        return frame is not None

    def wait_inside(self, fn: Callable[..., object], what: str) -> None:
        """Returns once the call is inside ``fn`` (its wait), or has returned: a step held
        at the testing host gate can then be let go, and ``done`` tells which."""
        wait_until(lambda: self.inside(fn) or self.done, what)

    def join(self, timeout: float = 60.0):
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the call hung"
        if self.error is not None:
            raise self.error
        return self.result


def held_at_the_host_gate() -> None:
    """Returns once a step waits at the testing host gate (``jax_vmm.testing``)."""
    wait_until(lambda: jax_vmm.testing.host_gate_held() > 0, "a step at the host gate")
