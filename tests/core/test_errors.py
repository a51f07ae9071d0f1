"""One test per row of docs/errors.md: every bad input and what it raises.

Each row names the call, the exception type and a regex over the message that checks the
message says what was wrong, what was expected and (where there is a choice) what to do.
``test_the_table_and_the_rows_agree`` keeps the document and this file in step.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import re
from collections.abc import Callable
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
import jax_vmm.testing
from jax_vmm._loader import core as _core

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "errors.md"


class Ctx:
    """Objects a row needs, made on first use on the test's device."""

    def __init__(self, vm):
        self.vm = vm
        self.c = vm.chunk
        self.device = vm.device

    @functools.cached_property
    def arena(self) -> jax_vmm.Arena:
        return self.vm.arena(8 * self.c)

    @functools.cached_property
    def buf(self) -> jax_vmm.Buffer:
        return self.arena.allocate(2 * self.c, jnp.uint8, name="buf")

    @functools.cached_property
    def closed_buf(self) -> jax_vmm.Buffer:
        a = self.vm.arena(4 * self.c)
        b = a.allocate(self.c, jnp.uint8, name="gone")
        b.commit()
        a.close()
        return b

    @functools.cached_property
    def freed_buf(self) -> jax_vmm.Buffer:
        b = self.arena.allocate(self.c, jnp.uint8, name="freed")
        b.free()
        return b

    def kv(self, **kw: Any) -> jax_vmm.KVArena:
        args = dict(num_layers=2, num_kv_heads=1, head_dim=8, max_tokens=16)
        args.update(kw)
        return self.vm.kv(**args)

    @functools.cached_property
    def kv1(self) -> jax_vmm.KVArena:
        return self.kv()

    @functools.cached_property
    def kv3(self) -> jax_vmm.KVArena:
        return self.kv(max_seqs=3)

    @functools.cached_property
    def kv_closed(self) -> jax_vmm.KVArena:
        kv = self.kv(initial_tokens=4)
        kv.close()
        return kv

    def new_arena(self, reserve: Any = None, **kw: Any) -> jax_vmm.Arena:
        kw.setdefault("device", self.device)
        return jax_vmm.Arena(8 * self.c if reserve is None else reserve, **kw)

    def kv_args(self, **kw: Any) -> jax_vmm.KVArena:
        args = dict(num_layers=2, num_kv_heads=1, head_dim=8, max_tokens=16, device=self.device)
        args.update(kw)
        return jax_vmm.kv_arena(**args)


def fake_device(platform: str, version: str = "", ordinal: int = 0) -> Any:
    """A stand-in for a jax.Device of another platform (isinstance() passes)."""
    d = mock.Mock(spec=jax.Device)
    d.platform = platform
    d.client = mock.Mock(platform_version=version)
    d.local_hardware_id = ordinal
    d.id = ordinal
    d.__str__ = lambda self: f"{platform}:{ordinal}"
    return d


def _no_cuda_driver() -> str | None:
    devices, error = _core.query_cuda_devices()
    return None if not devices and "load" in error else "a CUDA driver is loadable here"


def _has_gpu() -> str | None:
    from conftest import cuda_vmm_device

    return None if cuda_vmm_device()[0] is not None else "needs a CUDA GPU"


def _has_non_vmm_gpu() -> str | None:
    devices, _ = _core.query_cuda_devices()
    if any(not d["vmm_supported"] for d in devices):
        return None
    return "no CUDA device without VMM support on this machine"


def _non_vmm_arena(ctx: Ctx) -> Any:
    devices, _ = _core.query_cuda_devices()
    ordinal = next(d["ordinal"] for d in devices if not d["vmm_supported"])
    return _core.create_arena("cuda", ordinal, 1 << 21)


def _too_many_buffers(ctx: Ctx) -> None:
    arena = (
        ctx.vm.arena(4097 * 4096, chunk_bytes=4096)
        if ctx.vm.is_host
        else ctx.vm.arena(4097 * ctx.c)
    )
    for _ in range(4097):
        arena.allocate(1, jnp.uint8)


def _fault_injecting_arena(ctx: Ctx) -> tuple[jax_vmm.Arena, jax_vmm.testing.FaultInjection]:
    with jax_vmm.testing.fault_injection() as faults:
        return ctx.vm.arena(8 * ctx.c), faults


def _unknown_op(ctx: Ctx) -> None:
    arena, faults = _fault_injecting_arena(ctx)
    faults.arm(arena, "mmap", 1)


def _oom(ctx: Ctx) -> None:
    arena, faults = _fault_injecting_arena(ctx)
    buf = arena.allocate(2 * ctx.c, jnp.uint8, name="buf")
    faults.arm(arena, "create", 1, out_of_memory=True)
    buf.commit()


def _injected(ctx: Ctx) -> None:
    arena, faults = _fault_injecting_arena(ctx)
    buf = arena.allocate(2 * ctx.c, jnp.uint8, name="buf")
    faults.arm(arena, "map", 2)
    buf.commit()


@dataclasses.dataclass
class Row:
    id: str
    call: Callable[[Ctx], Any]
    raises: type | tuple[type, ...]
    match: str
    requires: Callable[[], str | None] | None = None
    xfail: str | None = None  # a known bug: the row states the wanted behaviour
    fails_with: type | None = None  # what the bug raises today


ROWS = [
    # -- Arena(reserve_bytes, device, chunk_bytes) --
    Row("A1", lambda x: x.new_arena(0), ValueError, r"reserve_bytes must be > 0"),
    Row("A2", lambda x: x.new_arena(-1), ValueError, r"reserve_bytes must be >= 0, got -1"),
    Row(
        "A3", lambda x: x.new_arena(1.5), TypeError, r"reserve_bytes must be an integer, got float"
    ),
    Row(
        "A4",
        lambda x: x.new_arena(2**64 + 5),
        ValueError,
        r"reserve_bytes.*2\^64|reserve_bytes.*too large",
        fails_with=TypeError,
    ),
    Row(
        "A5",
        lambda x: x.new_arena(1 << 62),
        (ValueError, jax_vmm.DriverError),
        r"reserve",
        fails_with=MemoryError,
    ),
    Row(
        "A6",
        lambda x: x.new_arena(chunk_bytes=1000),
        ValueError,
        r"chunk_bytes=1000 .*multiple of .*(page size 4096|granularity)",
    ),
    Row(
        "A7", lambda x: x.new_arena(chunk_bytes=0), ValueError, r"chunk_bytes must be > 0 \(or None"
    ),
    Row("A8", lambda x: x.new_arena(chunk_bytes=-4096), ValueError, r"chunk_bytes must be >= 0"),
    Row(
        "A9",
        lambda x: x.new_arena(chunk_bytes=4096.0),
        TypeError,
        r"chunk_bytes must be an integer",
    ),
    Row(
        "A10",
        lambda x: x.new_arena(device="cpu"),
        TypeError,
        r"device must be a jax.Device .* got str",
    ),
    Row("A11", lambda x: x.new_arena(device=object()), TypeError, r"device must be a jax.Device"),
    Row(
        "A12",
        lambda x: x.new_arena(device=fake_device("tpu")),
        ValueError,
        r"does not support devices of platform 'tpu'.*use a CUDA GPU or the CPU",
    ),
    Row(
        "A13",
        lambda x: x.new_arena(device=fake_device("gpu", "rocm 6.2")),
        ValueError,
        r"ROCm GPU; jax_vmm supports CUDA GPUs and the CPU",
    ),
    Row(
        "A14",
        lambda x: x.new_arena(device=fake_device("gpu", "cuda 12.8")),
        jax_vmm.DriverError,
        r"cannot load the CUDA driver library .*libcuda.*install an NVIDIA driver, or use the host",
        requires=_no_cuda_driver,
    ),
    Row(
        "A15",
        lambda x: x.new_arena(device=fake_device("gpu", "cuda", ordinal=999)),
        ValueError,
        r"CUDA device ordinal 999 does not exist; this process sees \d+ CUDA device",
        requires=_has_gpu,
    ),
    Row(
        "A16",
        _non_vmm_arena,
        jax_vmm.DriverError,
        r"does not support CUDA virtual memory management",
        requires=_has_non_vmm_gpu,
    ),
    # -- Arena.allocate(shape, dtype, name) --
    Row("B1", lambda x: x.arena.allocate(()), ValueError, r"at least one dimension.*got \(\)"),
    Row("B2", lambda x: x.arena.allocate((4, 0)), ValueError, r"all sizes > 0, got \(4, 0\)"),
    Row("B3", lambda x: x.arena.allocate(-3), ValueError, r"all sizes > 0, got \(-3,\)"),
    Row("B4", lambda x: x.arena.allocate((2.5,)), TypeError, r"shape must be a tuple of ints"),
    Row(
        "B5",
        lambda x: x.arena.allocate(None),
        TypeError,
        r"shape must be a tuple of ints, got None",
    ),
    Row(
        "B6",
        lambda x: x.arena.allocate(4, jnp.complex64),
        TypeError,
        r"dtype complex64 cannot back an arena buffer; use a float",
    ),
    Row(
        "B7",
        lambda x: x.arena.allocate(4, jnp.float8_e4m3fn),
        TypeError,
        r"float8_e4m3fn cannot back an arena buffer",
    ),
    Row("B8", lambda x: x.arena.allocate(4, "float33"), TypeError, r"'float33' is not a JAX dtype"),
    Row(
        "B9",
        lambda x: x.arena.allocate(4, name=3),
        TypeError,
        r"name must be a str or None, got int",
    ),
    Row(
        "B10",
        lambda x: (x.buf, x.arena.allocate(7 * x.c, jnp.uint8, name="big")),
        jax_vmm.ReservationFullError,
        r"allocate\('big'\): needs \d+ bytes .*largest free range .* larger reserve_bytes",
    ),
    Row(
        "B11",
        lambda x: x.arena.allocate((2**40, 2**40)),
        (ValueError, jax_vmm.ReservationFullError),
        r"bytes",
        fails_with=TypeError,
    ),
    Row("B12", _too_many_buffers, jax_vmm.ReservationFullError, r"already holds 4096 buffers"),
    Row(
        "B13",
        lambda x: x.closed_buf.arena.allocate(4),
        jax_vmm.ArenaClosedError,
        r"Arena.allocate: the arena is closed; create a new arena",
    ),
    # -- Buffer.commit / decommit / backed_prefix / view / free --
    Row(
        "C1",
        lambda x: x.buf.commit(10, 5),
        ValueError,
        r"'buf': byte range \[10, 5\) is outside \[0, \d+\); expected 0 <= start <= stop <= nbytes",
    ),
    Row("C2", lambda x: x.buf.commit(0, x.buf.nbytes + 1), ValueError, r"is outside \[0, \d+\)"),
    Row("C3", lambda x: x.buf.commit(-1), ValueError, r"start must be >= 0, got -1"),
    Row("C4", lambda x: x.buf.commit(0.5), TypeError, r"start must be an integer, got float"),
    Row("C5", lambda x: x.buf.decommit(None), TypeError, r"start must be an integer, got NoneType"),
    Row("C6", lambda x: x.buf.decommit(0, x.buf.nbytes + 1), ValueError, r"is outside"),
    Row("C7", lambda x: x.buf.backed_prefix(5, 1), ValueError, r"is outside"),
    Row(
        "C8",
        lambda x: x.buf.view((x.buf.nbytes + 1,), jnp.uint8),
        ValueError,
        r"shape needs \d+ bytes but buffer 'buf' has \d+",
    ),
    Row("C9", lambda x: x.buf.view((4,), jnp.complex64), TypeError, r"cannot back an arena buffer"),
    Row(
        "C10a",
        lambda x: x.closed_buf.commit(),
        jax_vmm.ArenaClosedError,
        r"commit: the arena is closed",
    ),
    Row(
        "C10b",
        lambda x: x.closed_buf.decommit(),
        jax_vmm.ArenaClosedError,
        r"decommit: the arena is closed",
    ),
    Row(
        "C10c",
        lambda x: x.closed_buf.array,
        jax_vmm.ArenaClosedError,
        r"Buffer.array: the arena is closed",
    ),
    Row(
        "C10d",
        lambda x: x.closed_buf.free(),
        jax_vmm.ArenaClosedError,
        r"Buffer.free: the arena is closed",
    ),
    Row(
        "C11a",
        lambda x: x.freed_buf.commit(),
        ValueError,
        r"no buffer with id \d+ .*was it freed\?",
    ),
    Row("C11b", lambda x: x.freed_buf.array, ValueError, r"no buffer with id \d+ .*was it freed\?"),
    Row("C12", lambda x: x.freed_buf.free(), ValueError, r"no buffer with id \d+ .*was it freed\?"),
    # -- test hooks and driver failures --
    Row(
        "D1",
        _unknown_op,
        ValueError,
        r"unknown driver op 'mmap'; expected one of create, map, set_access, zero_fill, host_alloc",
    ),
    Row(
        "D2",
        _oom,
        (MemoryError, jax_vmm.OutOfMemoryError),
        r"out of physical memory .*\d+ bytes free.*Nothing was committed"
        r".*XLA_PYTHON_CLIENT_PREALLOCATE"
        r".*XLA_PYTHON_CLIENT_MEM_FRACTION",
    ),
    Row("D3", _injected, jax_vmm.testing.InjectedFault, r"injected fault in driver map"),
    # -- kv_arena(...) --
    Row("E1", lambda x: x.kv_args(num_layers=0), ValueError, r"num_layers must be > 0, got 0"),
    Row("E2", lambda x: x.kv_args(head_dim=-2), ValueError, r"head_dim must be >= 0, got -2"),
    Row(
        "E3",
        lambda x: x.kv_args(max_tokens=8.0),
        TypeError,
        r"max_tokens must be an integer, got float",
    ),
    Row("E4", lambda x: x.kv_args(max_seqs=0), ValueError, r"max_seqs must be > 0 or None"),
    Row(
        "E5",
        lambda x: x.kv_args(initial_tokens=17),
        ValueError,
        r"initial_tokens=17 exceeds max_tokens=16",
    ),
    Row("E6", lambda x: x.kv_args(dtype=jnp.complex64), TypeError, r"cannot back an arena buffer"),
    Row("E7", lambda x: x.kv_args(device="gpu"), TypeError, r"device must be a jax.Device"),
    Row(
        "E8",
        lambda x: x.kv1.ensure(17),
        ValueError,
        r"KVArena.ensure: num_tokens=17 exceeds max_tokens=16",
    ),
    Row("E9a", lambda x: x.kv1.ensure(-1), ValueError, r"num_tokens must be >= 0, got -1"),
    Row("E9b", lambda x: x.kv1.ensure(2.0), TypeError, r"num_tokens must be an integer, got float"),
    Row(
        "E10",
        lambda x: x.kv1.ensure(4, seq=0),
        ValueError,
        r"no per-sequence layout \(max_seqs=None\); pass seq=None",
    ),
    Row("E11", lambda x: x.kv3.ensure(4), ValueError, r"has max_seqs=3; pass seq=<0..2>"),
    Row(
        "E12",
        lambda x: x.kv3.release(3),
        ValueError,
        r"KVArena.release: seq=3 is out of range; expected 0 <= seq < 3",
    ),
    Row("E13", lambda x: x.kv1.shrink(17), ValueError, r"KVArena.shrink: num_tokens=17 exceeds"),
    Row("E14", lambda x: x.kv1.k[2], IndexError, r"layer 2 out of range for 2 layers"),
    Row(
        "E15a",
        lambda x: x.kv_closed.ensure(8),
        jax_vmm.ArenaClosedError,
        r"KVArena.ensure: the arena is closed",
    ),
    Row(
        "E15b",
        lambda x: x.kv_closed.shrink(0),
        jax_vmm.ArenaClosedError,
        r"KVArena.shrink: the arena is closed",
    ),
    Row(
        "E15c",
        lambda x: x.kv_closed.release(),
        jax_vmm.ArenaClosedError,
        r"KVArena.release: the arena is closed",
    ),
]


def _asleep_commit(ctx: Ctx) -> None:
    arena = ctx.vm.arena(4 * ctx.c)
    buf = arena.allocate(ctx.c, jnp.uint8)
    arena.sleep()
    buf.commit()


def _offloaded_ensure(ctx: Ctx) -> None:
    kv = ctx.kv(max_seqs=3)
    kv.ensure(4, seq=0)
    kv.offload(0)
    kv.ensure(5, seq=0)


MEMORY_ROWS = [
    Row(
        "M1",
        lambda x: x.new_arena(handle_bytes=3 * x.c // 2),
        ValueError,
        r"handle_bytes=\d+ must be a multiple of chunk_bytes",
    ),
    Row(
        "M2",
        lambda x: x.new_arena(handle_bytes=0),
        ValueError,
        r"handle_bytes must be > 0 \(or None",
    ),
    Row("M3", lambda x: x.new_arena(zero_fill=1), TypeError, r"zero_fill must be True or False"),
    Row(
        "M4",
        lambda x: x.arena.sleep(keep="disk"),
        ValueError,
        r"Arena.sleep: keep must be 'host' or 'discard', got 'disk'",
    ),
    Row("M5", lambda x: x.arena.wake(), ValueError, r"Arena.wake: the arena is not asleep"),
    Row(
        "M6",
        _asleep_commit,
        jax_vmm.ArenaAsleepError,
        r"Arena.commit: the arena is asleep .*call wake\(\) first",
    ),
    Row("M7", _offloaded_ensure, ValueError, r"sequence 0 is offloaded .*kv.restore\(0\)"),
    Row(
        "M8",
        lambda x: x.kv3.restore(1),
        ValueError,
        r"KVArena.restore: sequence 1 is not offloaded",
    ),
    Row(
        "M9",
        lambda x: x.kv3.ensure_all([1, 2]),
        ValueError,
        r"num_tokens has shape \(2,\); expected \(3,\)",
    ),
    Row(
        "M10",
        lambda x: x.kv3.ensure_all([1.5, 0, 0]),
        TypeError,
        r"num_tokens must be 3 ints \(one per sequence\)",
    ),
    Row(
        "M11",
        lambda x: x.arena.put(np.float32(1)),
        ValueError,
        r"Arena.put: needs an array with at least one dimension",
    ),
]
ROWS += MEMORY_ROWS


def _param(row: Row) -> Any:
    marks = []
    if row.xfail:
        marks.append(pytest.mark.xfail(strict=True, reason=row.xfail, raises=row.fails_with))
    return pytest.param(row, id=row.id, marks=marks)


@pytest.mark.parametrize("row", [_param(r) for r in ROWS])
def test_error_row(vm, row: Row):
    if row.requires is not None and (why := row.requires()):
        pytest.skip(why)
    ctx = Ctx(vm)
    with pytest.raises(row.raises, match=row.match):
        row.call(ctx)


def test_bad_input_leaves_the_arena_usable(vm):
    ctx = Ctx(vm)
    for row in ROWS:
        if row.id.startswith("C") and not row.id.startswith(("C10", "C11", "C12")):
            with pytest.raises(row.raises):
                row.call(ctx)
    assert ctx.buf.commit() == 2 * ctx.c
    vm.assert_backed(ctx.arena, [(ctx.buf.offset, ctx.buf.offset + 2 * ctx.c)])


def test_the_table_and_the_rows_agree():
    text = DOC.read_text()
    doc_ids = re.findall(r"^\|\s*([A-Z]\d+[a-z]?)\s*\|", text, flags=re.M)
    tested_elsewhere = set(
        re.findall(
            r"^\|\s*([A-Z]\d+[a-z]?)\s*\|.*(?:tested in tests/|untestable here)",
            text,
            flags=re.M | re.I,
        )
    )
    assert len(doc_ids) == len(set(doc_ids)), "duplicate row ids in docs/errors.md"
    assert set(doc_ids) - tested_elsewhere == {r.id for r in ROWS}
