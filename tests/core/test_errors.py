"""One test per row of docs/errors.md: every bad input and what it raises.

The document is the specification: each row here is only the call; the exception class
and the message come from the row's text in docs/errors.md (its *raises* and *message*
columns, see ``message_pattern``), so the document cannot go stale unnoticed.
``test_the_table_and_the_rows_agree`` checks that every documented row is run.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import pathlib
import pickle
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
import maps_oracle as mo
from jax_vmm import ops
from jax_vmm.base.loader import core as _core

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
        args = dict(num_layers=2, num_kv_heads=1, head_dim=8, max_tokens=16, dtype=jnp.float32)
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

    # -- kv_write operands: one float32 token of one head of 8 into slot 1 --
    def put(self, x: Any) -> jax.Array:
        return jax.device_put(jnp.asarray(x), self.device)

    @functools.cached_property
    def one(self) -> jax.Array:
        return self.put(np.ones((1, 1, 8), np.float32))

    @functools.cached_property
    def slot(self) -> jax.Array:
        return self.put(np.array([1], np.int32))

    def write(self, dest: Any, heads: int = 1) -> Any:
        """kv_write of one token into a plain (16, heads, 8) float32 cache with ``dest``."""
        cache = self.put(np.zeros((16, heads, 8), np.float32))
        new = self.put(np.ones((1, heads, 8), np.float32))
        return ops.kv_write(cache, cache, new, new, self.slot, dest=dest)


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


@dataclasses.dataclass
class Row:
    id: str
    call: Callable[[Ctx], Any]
    requires: Callable[[], str | None] | None = None
    xfail: str | None = None  # a known bug: its doc row says **BUG**, states the wanted behaviour


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


def _host_map_limit(ctx: Ctx) -> None:
    if not ctx.vm.is_host:
        pytest.skip("the mapping limit is the host driver's")
    arena = ctx.vm.arena(8 * ctx.c)
    buf = arena.allocate(2 * ctx.c, jnp.uint8, name="buf")
    with jax_vmm.testing.host_map_limit(len(mo.read_maps()) + 4096):  # no room past the margin
        buf.commit()


def _injected(ctx: Ctx) -> None:
    arena, faults = _fault_injecting_arena(ctx)
    buf = arena.allocate(2 * ctx.c, jnp.uint8, name="buf")
    faults.arm(arena, "map", 2)
    buf.commit()


def _dropped_then_check(ctx: Ctx) -> None:
    kv = ctx.kv1
    out_of_range = ctx.put(np.array([kv.num_slots], np.int32))
    ops.kv_write_through(kv.k[0], kv.v[0], ctx.one, ctx.one, out_of_range, dest=kv.dest(0))
    kv.check()


def _closed_dest(ctx: Ctx) -> None:
    kv = ctx.kv()
    dest = kv.dest(0)
    kv.close()
    jax.block_until_ready(ctx.write(dest))


def _destroyed_dest(ctx: Ctx) -> None:
    def make():
        return jax_vmm.kv_arena(
            num_layers=2,
            num_kv_heads=1,
            head_dim=8,
            max_tokens=16,
            dtype=jnp.float32,
            device=ctx.device,
        )

    kv = make()
    dest = kv.dest(0)
    kv.close()
    del kv
    gc.collect()
    ctx.keep = make()  # a newer arena, usually at the same address
    jax.block_until_ready(ctx.write(dest))


def _cache_step(ctx: Ctx, kv: jax_vmm.KVArena):
    """A jitted kv_write of one token into layer 0 of `kv`'s cache."""
    return jax.jit(lambda c: jax_vmm.kv_write(c[0], ctx.one, ctx.one, ctx.slot).token)


def _clamped_read_then_check(ctx: Ctx) -> None:
    kv = ctx.kv(max_seqs=2, head_dim=64, initial_tokens=2)
    q = ctx.put(np.ones((2, 1, 64), np.float32))
    out = jax_vmm.decode_attention(q, kv.cache()[0], ctx.put(np.array([5, 1], np.int32)))
    kv.check(out)


def _closed_cache(ctx: Ctx) -> None:
    kv = ctx.kv(initial_tokens=4)
    cache = kv.cache()
    kv.close()
    jax.block_until_ready(_cache_step(ctx, kv)(cache))


def _destroyed_cache(ctx: Ctx) -> None:
    kv = ctx.kv_args(dtype=jnp.float32, initial_tokens=4)
    cache = kv.cache()
    step = _cache_step(ctx, kv)
    kv.close()
    del kv
    gc.collect()
    jax.block_until_ready(step(cache))


def _written_then_ordered_views(ctx: Ctx) -> None:
    kv = ctx.kv1

    def step(cache, k, v):
        layer = jax_vmm.kv_write(cache[0], ctx.one, ctx.one, ctx.slot)
        return jax_vmm.ordered_views(layer, k, v)

    jax.jit(step)(kv.cache(), kv.k[0], kv.v[0])


def _grad_through_a_write(ctx: Ctx) -> None:
    def loss(x):
        layer = jax_vmm.kv_write(ctx.kv1.cache()[0], x, x, ctx.slot)
        return jax_vmm.decode_attention(
            ctx.put(np.ones((1, 1, 8), np.float32)), layer, ctx.put(np.ones(1, np.int32))
        ).sum()

    jax.grad(loss)(ctx.one)


def _grad_through_attention(ctx: Ctx) -> None:
    lengths = ctx.put(np.ones(3, np.int32))
    jax.grad(lambda q: jax_vmm.decode_attention(q, ctx.kv3.cache()[0], lengths).sum())(
        ctx.put(np.ones((3, 1, 8), np.float32))
    )


def _allocate_behind_a_freed_buffers_view(ctx: Ctx) -> None:
    arena = ctx.vm.arena(4 * ctx.c)
    buf = arena.allocate(3 * ctx.c, jnp.uint8)
    view = buf.array
    buf.free()
    try:
        arena.allocate(4 * ctx.c, jnp.uint8)
    finally:
        del view


def _read_in_the_vmap_that_wrote(ctx: Ctx) -> None:
    kv = ctx.kv3
    q, lengths = ctx.put(np.ones((3, 1, 8), np.float32)), ctx.put(np.ones(3, np.int32))

    def write_then_read(cache, new):
        layer = jax_vmm.kv_write(
            cache[0], new, new, seq=jnp.zeros(1, jnp.int32), pos=jnp.zeros(1, jnp.int32)
        )
        return jax_vmm.decode_attention(q, layer, lengths)

    jax.vmap(write_then_read, (None, 0))(kv.cache(), ctx.put(np.ones((2, 1, 1, 8), np.float32)))


def _float32_query_over_an_fp8_cache(ctx: Ctx) -> None:
    k8 = ctx.put(np.zeros((2, 10, 2, 64), np.float32)).astype(jnp.float8_e4m3fn)
    one = ctx.put(np.ones(2, np.float32))
    q = ctx.put(np.ones((2, 3, 4, 64), np.float32))
    jax_vmm.attention(
        q, k8, k8, ctx.put(np.array([3, 4], np.int32)), k_scale=one, v_scale=one, window=2
    )


def _several_query_rows_to_decode_attention(ctx: Ctx) -> None:
    lengths = ctx.put(np.ones(3, np.int32))
    jax_vmm.decode_attention(
        ctx.put(np.ones((3, 2, 1, 8), np.float32)), ctx.kv3.cache()[0], lengths
    )


def _attention_past_the_cuda_grid(ctx: Ctx) -> None:
    k = ctx.put(np.zeros((1, 16, 1, 8), np.float32))
    q = ctx.put(np.zeros((1, 2048, 32, 8), np.float32))
    jax.block_until_ready(jax_vmm.attention(q, k, k, ctx.put(np.ones(1, np.int32))))


def _ordered_views_of_another_layer(ctx: Ctx) -> None:
    kv = ctx.kv1
    step = jax.jit(lambda c, k, v: jax_vmm.ordered_views(c[0], k, v)[0].sum())
    jax.block_until_ready(step(kv.cache(), kv.k[1], kv.v[0]))


def _array_write_without_dest(ctx: Ctx) -> None:
    import warnings

    kv = ctx.kv1
    with warnings.catch_warnings():
        warnings.simplefilter("error", jax_vmm.ArenaNotWrittenWarning)
        jax.jit(ops.kv_write)(kv.k[0], kv.v[0], ctx.one, ctx.one, ctx.slot)


def _array_layer_of_traced_views(ctx: Ctx) -> None:
    import warnings

    kv = ctx.kv1

    def step(k, v):
        layer = jax_vmm.KVLayer.from_arrays(k, v)
        return jax_vmm.kv_write(layer, ctx.one, ctx.one, ctx.slot).k

    with warnings.catch_warnings():
        warnings.simplefilter("error", jax_vmm.ArenaNotWrittenWarning)
        jax.jit(step)(kv.k[0], kv.v[0])


def _fp8_array_layer_zero_scale(ctx: Ctx) -> None:
    cache = ctx.put(np.zeros((16, 1, 8), np.uint8)).view(jnp.float8_e4m3fn)
    ones, zeros = ctx.put(np.ones(1, np.float32)), ctx.put(np.zeros(1, np.float32))
    jax_vmm.KVLayer.from_arrays(cache, cache, k_scale=zeros, v_scale=ones)


def _fp8_scales_mapped(ctx: Ctx) -> None:
    kv = ctx.kv(dtype=jnp.float8_e4m3fn, initial_tokens=4)
    doubled = jax.tree.map(lambda x: x * 2 if x.dtype == jnp.float32 else x, kv.cache())
    jax_vmm.kv_write(doubled[0], ctx.one, ctx.one, ctx.slot)


def _cache_mapped_astype(ctx: Ctx) -> None:
    cache = jax.tree.map(lambda x: x.astype(jnp.bfloat16), ctx.kv(initial_tokens=4).cache())
    jax_vmm.kv_write(cache[0], ctx.one, ctx.one, ctx.slot)


def _cache_on_another_device(ctx: Ctx) -> None:
    kv = ctx.kv(initial_tokens=4)
    fake = _core.create_kv_cache(  # the same buffers, registered for another device ordinal
        kv.arena._handle,
        [b.id for b in kv.k_buffers],
        [b.id for b in kv.v_buffers],
        1,
        False,
        16,
        1,
        8,
        "float32",
        4,
        7,
    )
    ctx.keep = fake
    from jax_vmm.cache import KVCache, KVLayer

    lid = dataclasses.replace(kv.cache()[0].id, cache_uid=fake.uid)
    cache = KVCache([KVLayer._arena(lid, ctx.put(np.int32(0)))])
    jax.block_until_ready(_cache_step(ctx, kv)(cache))


ROWS = [
    # -- Arena(reserve_bytes, device, chunk_bytes) --
    Row("A1", lambda x: x.new_arena(0)),
    Row("A2", lambda x: x.new_arena(-1)),
    Row("A3", lambda x: x.new_arena(1.5)),
    Row("A4", lambda x: x.new_arena(2**64 + 5)),
    Row("A5", lambda x: x.new_arena(1 << 62)),
    Row("A5b", lambda x: x.new_arena(chunk_bytes=1 << 62)),
    Row("A6", lambda x: x.new_arena(chunk_bytes=1000)),
    Row("A7", lambda x: x.new_arena(chunk_bytes=0)),
    Row("A7", lambda x: x.new_arena(chunk_bytes=1 << 64)),
    Row("A8", lambda x: x.new_arena(chunk_bytes=-4096)),
    Row("A9", lambda x: x.new_arena(chunk_bytes=4096.0)),
    Row("A10", lambda x: x.new_arena(device="cpu")),
    Row("A11", lambda x: x.new_arena(device=object())),
    Row("A12", lambda x: x.new_arena(device=fake_device("tpu"))),
    Row("A13", lambda x: x.new_arena(device=fake_device("gpu", "rocm 6.2"))),
    Row(
        "A14",
        lambda x: x.new_arena(device=fake_device("gpu", "cuda 12.8")),
        requires=_no_cuda_driver,
    ),
    Row(
        "A15",
        lambda x: x.new_arena(device=fake_device("gpu", "cuda", ordinal=999)),
        requires=_has_gpu,
    ),
    Row("A16", _non_vmm_arena, requires=_has_non_vmm_gpu),
    Row("A17", lambda x: x.new_arena(True)),
    Row("A18", lambda x: x.new_arena(chunk_bytes=True)),
    Row("A19a", lambda x: pickle.dumps(x.arena)),
    Row("A19b", lambda x: copy.deepcopy(x.arena)),
    # -- Arena.allocate(shape, dtype, name) --
    Row("B1", lambda x: x.arena.allocate(())),
    Row("B2", lambda x: x.arena.allocate((4, 0))),
    Row("B3", lambda x: x.arena.allocate(-3)),
    Row("B4", lambda x: x.arena.allocate((2.5,))),
    Row("B5", lambda x: x.arena.allocate(None)),
    Row("B6", lambda x: x.arena.allocate(4, jnp.complex64)),
    Row("B7", lambda x: x.arena.allocate(4, jnp.float8_e5m2)),
    Row("B8", lambda x: x.arena.allocate(4, "float33")),
    Row("B9", lambda x: x.arena.allocate(4, name=3)),
    Row("B10", lambda x: (x.buf, x.arena.allocate(7 * x.c, jnp.uint8, name="big"))),
    Row("B11", lambda x: x.arena.allocate((2**40, 2**40))),
    Row("B12", _too_many_buffers),
    Row("B13", lambda x: x.closed_buf.arena.allocate(4)),
    Row("B14", lambda x: x.arena.allocate((True, 2))),
    Row("B15", lambda x: pickle.dumps(x.buf)),
    Row("B16", _allocate_behind_a_freed_buffers_view),
    Row("B17", lambda x: x.vm.arena(4 * x.c).put(np.ones(5 * x.c // 4, np.float32))),
    # -- Buffer.commit / decommit / backed_prefix / view / free --
    Row("C1", lambda x: x.buf.commit(10, 5)),
    Row("C2", lambda x: x.buf.commit(0, x.buf.nbytes + 1)),
    Row("C3", lambda x: x.buf.commit(-1)),
    Row("C4", lambda x: x.buf.commit(0.5)),
    Row("C5", lambda x: x.buf.decommit(None)),
    Row("C6", lambda x: x.buf.decommit(0, x.buf.nbytes + 1)),
    Row("C7", lambda x: x.buf.backed_prefix(5, 1)),
    Row("C8", lambda x: x.buf.view((x.buf.nbytes + 1,), jnp.uint8)),
    Row("C9", lambda x: x.buf.view((4,), jnp.complex64)),
    Row("C10a", lambda x: x.closed_buf.commit()),
    Row("C10b", lambda x: x.closed_buf.decommit()),
    Row("C10c", lambda x: x.closed_buf.array),
    Row("C10d", lambda x: x.closed_buf.free()),
    Row("C11a", lambda x: x.freed_buf.commit()),
    Row("C11b", lambda x: x.freed_buf.array),
    Row("C12", lambda x: x.freed_buf.free()),
    Row("C13", lambda x: x.buf.commit(True)),
    # -- test hooks and driver failures --
    Row("D1", _unknown_op),
    Row("D2", _oom),
    Row("D3", _injected),
    Row("D5", _host_map_limit),
    # -- kv_arena(...) and KVArena --
    Row("E1", lambda x: x.kv_args(num_layers=0)),
    Row("E2", lambda x: x.kv_args(head_dim=-2)),
    Row("E3", lambda x: x.kv_args(max_tokens=8.0)),
    Row("E4a", lambda x: x.kv_args(max_seqs=0)),
    Row("E4b", lambda x: x.kv_args(max_seqs=-1)),
    Row("E5", lambda x: x.kv_args(initial_tokens=17)),
    Row("E6", lambda x: x.kv_args(dtype=jnp.complex64)),
    Row("E7", lambda x: x.kv_args(device="gpu")),
    Row("E8", lambda x: x.kv1.ensure(17)),
    Row("E9a", lambda x: x.kv1.ensure(-1)),
    Row("E9b", lambda x: x.kv1.ensure(2.0)),
    Row("E9c", lambda x: x.kv1.ensure(True)),
    Row("E10", lambda x: x.kv1.ensure(4, seq=0)),
    Row("E11", lambda x: x.kv3.ensure(4)),
    Row("E12a", lambda x: x.kv3.release(3)),
    Row("E12b", lambda x: x.kv3.ensure(3, seq=True)),
    Row("E13", lambda x: x.kv1.shrink(17)),
    Row("E14a", lambda x: x.kv1.k[2]),
    Row("E14b", lambda x: x.kv1.k[True]),
    Row("E14c", lambda x: jax.jit(lambda l: x.kv1.k[l])(0)),
    Row("E15a", lambda x: x.kv_closed.ensure(8)),
    Row("E15b", lambda x: x.kv_closed.shrink(0)),
    Row("E15c", lambda x: x.kv_closed.release()),
    Row("E15d", lambda x: x.kv_closed.ensure_all([0])),
    Row("E15e", lambda x: x.kv_closed.restore()),
    Row("E16", _dropped_then_check),
    Row("E17a", lambda x: x.kv1.dest(2)),
    Row("E17b", lambda x: x.kv_closed.dest(0)),
    Row("E17c", lambda x: x.kv1.dest(True)),
    Row("E17d", lambda x: jax.jit(lambda l: x.kv1.dest(l))(0)),
    Row("E18a", lambda x: x.write((1, 2))),
    Row("E18b", lambda x: x.write(x.kv(num_kv_heads=2, max_tokens=8).dest(0), heads=2)),
    Row("E19", _closed_dest),
    Row(
        "E20",
        lambda x: ops.kv_write(x.kv1.k[1], x.kv1.v[1], x.one, x.one, x.slot, dest=x.kv1.dest(0)),
    ),
    Row("E21", _destroyed_dest),
    Row(
        "E22",
        lambda x: x.kv_args(
            num_layers=64, num_kv_heads=64, head_dim=128, max_tokens=1 << 20, max_seqs=1024
        ),
    ),
    Row("E22b", lambda x: x.kv_args(max_tokens=1 << 21, max_seqs=1024)),
    Row("E23", lambda x: pickle.dumps(x.kv1)),
    Row("E24a", lambda x: x.kv_args(max_seqs=True)),
    Row("E24b", lambda x: x.kv_args(num_layers=True)),
    Row("E24c", lambda x: x.kv_args(initial_tokens=True)),
    Row(
        "E25",
        lambda x: jax.block_until_ready(
            jax.jit(ops.kv_write_through)(
                x.put(np.zeros((16, 1, 8), np.float32)),
                x.put(np.zeros((16, 1, 8), np.float32)),
                x.one,
                x.one,
                x.slot,
            )
        ),
    ),
    Row("E26", lambda x: x.kv3.wait_prefetch(0, timeout="1")),
    # -- the cache API --
    Row("F1", _clamped_read_then_check),
    Row("F2", _closed_cache),
    Row("F3", _destroyed_cache),
    Row("F4", lambda x: jax.jit(lambda c: c[0].k)(x.kv1.cache())),
    Row(
        "F5", lambda x: jax_vmm.kv_write(x.kv1.cache()[0], x.one, x.one, x.slot, dest=x.kv1.dest(0))
    ),
    Row("F6", lambda x: x.kv1.cache().replace(0, x.kv1.cache()[1])),
    Row("F7", lambda x: jax_vmm.KVLayer.from_arrays(x.kv1.k[0], x.kv1.v[0])),
    Row("F8", _written_then_ordered_views),
    Row("F9", _ordered_views_of_another_layer),
    Row("F10", _array_write_without_dest),
    Row("F11", _cache_on_another_device),
    Row("F12", lambda x: x.kv_args(dtype=jnp.float32, k_scales=np.ones((2, 1), np.float32))),
    Row("F13", _array_layer_of_traced_views),
    Row("F14", _fp8_array_layer_zero_scale),
    Row("F15", _fp8_scales_mapped),
    Row("F16", lambda x: jax_vmm.kv_write(x.kv1.cache(), x.one, x.one, x.slot)),
    Row("F17", _cache_mapped_astype),
    Row("F18", _grad_through_a_write),
    Row("F19", _grad_through_attention),
    Row("F20", _read_in_the_vmap_that_wrote),
    Row("F21", _float32_query_over_an_fp8_cache),
    Row("F22", _several_query_rows_to_decode_attention),
    Row("F23", _attention_past_the_cuda_grid),
]


# -- the document ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DocRow:
    id: str
    bad_input: str
    raises: str
    message: str


def doc_rows() -> dict[str, DocRow]:
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"[A-Z]\d+[a-z]?", cells[0]):
            assert cells[0] not in rows, f"duplicate row id {cells[0]} in docs/errors.md"
            rows[cells[0]] = DocRow(*cells)
    return rows


def documented_types(row: DocRow) -> set[str]:
    """The exception class names the *raises* column names (`OutOfMemoryError` (a
    `MemoryError`) names two)."""
    return {name.split(".")[-1] for name in re.findall(r"`([\w.]+)`", row.raises)}


def _asleep_commit(ctx: Ctx) -> None:
    arena = ctx.vm.arena(4 * ctx.c)
    buf = arena.allocate(ctx.c, jnp.uint8)
    arena.sleep()
    buf.commit()


def _asleep_release(ctx: Ctx) -> None:
    kv = ctx.kv(max_seqs=3, initial_tokens=4)
    kv.sleep()
    kv.release(1)


def _zero_fill_keep_tokens(ctx: Ctx) -> None:
    kv = ctx.kv(max_seqs=2, initial_tokens=4, zero_fill=True)
    kv.release(0, keep_tokens=2)


def _offloaded_read_then_check(ctx: Ctx) -> None:
    kv = ctx.kv(max_seqs=2, head_dim=64, initial_tokens=2)
    kv.offload(1)
    q = ctx.put(np.ones((2, 1, 64), np.float32))
    out = jax_vmm.decode_attention(q, kv.cache()[0], ctx.put(np.array([2, 2], np.int32)))
    kv.check(out)


def _offloaded_write_then_check(ctx: Ctx) -> None:
    kv = ctx.kv(max_seqs=2, initial_tokens=4)  # both sequences in one chunk
    kv.offload(0)
    jax.block_until_ready(_cache_step(ctx, kv)(kv.cache()))  # slot 1: sequence 0
    kv.check()


def _offloaded_ensure(ctx: Ctx) -> None:
    kv = ctx.kv(max_seqs=3)
    kv.ensure(4, seq=0)
    kv.offload(0)
    kv.ensure(5, seq=0)


# -- sharded KV arenas (one device here: tests/sharding covers several) --
def _one_device_sharding(ctx: Ctx, spec: Any) -> Any:
    from jax.sharding import Mesh, NamedSharding

    return NamedSharding(Mesh(np.array([ctx.device]), ("tp",)), spec)


def _sharded_layer(ctx: Ctx) -> jax_vmm.KVLayer:
    from jax.sharding import PartitionSpec as P

    kv = ctx.kv_args(
        device=None, max_seqs=2, sharding=_one_device_sharding(ctx, P(None, None, "tp"))
    )
    ctx.vm._owned.append(kv)  # closed with the test's arenas
    return kv.cache()[0]


def _sharded(ctx: Ctx, **kw: Any) -> Any:
    from jax.sharding import PartitionSpec as P

    kv = ctx.kv_args(
        device=None, max_seqs=2, sharding=_one_device_sharding(ctx, P(None, None, "tp")), **kw
    )
    ctx.vm._owned.append(kv)  # closed with the test's arenas
    return kv


def _sharded_ordered_views(ctx: Ctx) -> None:
    layer = _sharded_layer(ctx)
    jax_vmm.ordered_views(layer, None, None)


def _sharded_attention_bad_q(ctx: Ctx) -> None:
    layer = _sharded_layer(ctx)
    q = jnp.zeros((3, 1, 8), jnp.float32)
    jax_vmm.decode_attention(q, layer, jnp.ones((2,), jnp.int32))


def _spec(*entries: Any) -> Any:
    from jax.sharding import PartitionSpec as P

    return P(*entries)


ROWS += [
    Row(
        "S1",
        lambda x: x.kv_args(device=None, sharding=jax.sharding.SingleDeviceSharding(x.device)),
    ),
    Row("S2", lambda x: x.kv_args(sharding=_one_device_sharding(x, _spec(None, None, "tp")))),
    Row("S3", lambda x: x.kv_args(device=None, sharding=_one_device_sharding(x, _spec("tp")))),
    Row(
        "S4",
        lambda x: x.kv_args(
            device=None, sharding=_one_device_sharding(x, _spec(None, None, None, "tp"))
        ),
    ),
    Row("S5", _sharded_ordered_views),
    Row("S6", _sharded_attention_bad_q),
    Row("S7", lambda x: _sharded(x).sleep()),
    Row(
        "S8",
        lambda x: _sharded(x, dtype=jnp.float8_e4m3fn, k_scales=np.ones((3, 1), np.float32)),
    ),
]


# -- memory options, sleep, offload --
ROWS += [
    Row("M1", lambda x: x.new_arena(handle_bytes=3 * x.c // 2)),
    Row("M2", lambda x: x.new_arena(handle_bytes=0)),
    Row("M2", lambda x: x.new_arena(handle_bytes=1 << 64)),
    Row("M3", lambda x: x.new_arena(zero_fill=1)),
    Row("M4", lambda x: x.arena.sleep(keep="disk")),
    Row("M5", lambda x: x.arena.wake()),
    Row("M6", _asleep_commit),
    Row("M7", _offloaded_ensure),
    Row("M8", lambda x: x.kv3.restore(1)),
    Row("M9", lambda x: x.kv3.ensure_all([1, 2])),
    Row("M10", lambda x: x.kv3.ensure_all([1.5, 0, 0])),
    Row("M11", lambda x: x.arena.put(np.float32(1))),
    Row("M12", lambda x: x.arena.put(np.array([2**40], np.int64)), requires=lambda: _x64_off()),
    Row("M12b", lambda x: x.arena.put(np.array([1.0, 1e300])), requires=lambda: _x64_off()),
    Row("M13", _asleep_release),
    Row("M14", _offloaded_read_then_check),
    Row("M15", _offloaded_write_then_check),
    Row("M16", _zero_fill_keep_tokens),
]


# -- shared prefixes --
def _shared_kv(ctx: Ctx, n: int = 4) -> jax_vmm.KVArena:
    kv = ctx.kv(max_seqs=4, max_tokens=8 * ctx.c // 32)  # two chunks per sequence
    kv.ensure(n, 0)
    return kv


def _share_into_holder(ctx: Ctx) -> None:
    kv = _shared_kv(ctx)
    kv.ensure(2, 2)
    kv.share_prefix(0, 2, 4)


def _share_too_many(ctx: Ctx) -> None:
    _shared_kv(ctx).share_prefix(0, 1, 5)


def _share_misaligned(ctx: Ctx) -> None:
    kv = ctx.kv(max_seqs=3, max_tokens=3 * ctx.c // 64)  # 1.5 chunks per sequence
    kv.ensure(4, 0)
    kv.share_prefix(0, 1, 4)


def _shrink_below_shared(ctx: Ctx) -> None:
    kv = _shared_kv(ctx, 8)
    kv.share_prefix(0, 1, 8)
    kv.shrink(4)


def _write_into_shared_then_check(ctx: Ctx) -> None:
    kv = _shared_kv(ctx)
    kv.share_prefix(0, 1, 4)
    x = ctx.put(np.ones((1, 1, 8), np.float32))
    layer = jax_vmm.kv_write(kv.cache()[0], x, x, seq=jnp.array([1]), pos=jnp.array([2]))
    jax.block_until_ready(layer)
    kv.check()


ROWS += [
    Row("P1", _share_into_holder),
    Row("P2", _share_too_many),
    Row("P3", _share_misaligned),
    Row("P4", _shrink_below_shared),
    Row("P5", _write_into_shared_then_check),
]


def _x64_off() -> str | None:
    return "x64 is on: int64 is kept" if jax.config.jax_enable_x64 else None


def _rope_without_type(ctx: Ctx) -> None:
    from jax_vmm.serving.hf import config

    config.parse_rope({"rope_scaling": {"factor": 4.0}}, where="config.json", max_position=64)


def _gemma2_with_gelu(ctx: Ctx) -> None:
    from jax_vmm.serving.hf import config

    raw = dict(
        architectures=["Gemma2ForCausalLM"],
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        hidden_activation="gelu",
    )
    config.parse_config(raw)


def _follows_unknown(ctx: Ctx) -> None:
    from jax_vmm.serving import engine

    engine.context_lengths([engine.Request(5, np.ones(2, np.int32), 1, follows=99)])


def _chunks_of_an_unknown_attention(ctx: Ctx) -> None:
    from jax_vmm.serving import attention

    attention.chunk_attention("flash")


def _prefill_chunk_zero(ctx: Ctx) -> None:
    from jax_vmm.serving import engine

    engine.check_prefill_chunk(0)


def _shared_prefix_without_attend_chunk(ctx: Ctx) -> None:
    from jax_vmm.serving import engine, model
    from jax_vmm.serving.cache import make_cache

    cfg = model.ModelConfig(vocab=16, d_model=16, num_layers=1, num_q_heads=2, num_kv_heads=1,
                            head_dim=8, ffn_dim=16)  # fmt: skip
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        # 128 tokens x 32 bytes: each sequence one 4 KiB chunk, as sharing needs
        cache = make_cache("jax_vmm", cfg, max_seqs=2, max_tokens=128, device=cpu, chunk_bytes=4096)
        try:
            gen = engine.Generator(
                model.init_params(cfg), cfg, cache, jax_vmm.decode_attention, block=1
            )
            prompt = np.arange(6, dtype=np.int32)
            gen.run([engine.Request(0, prompt, 2)], shared_prefix=4)
        finally:
            cache.close()


ROWS += [
    Row("H1", _rope_without_type),
    Row("H2", _gemma2_with_gelu),
    Row("H3", _prefill_chunk_zero),
    Row("H4", _follows_unknown),
    Row("H5", _chunks_of_an_unknown_attention),
    Row("H6", _shared_prefix_without_attend_chunk),
]


# -- memory budgets --
def _budget(ctx: Ctx, chunks: int, device: Any = None) -> jax_vmm.MemoryBudget:
    return jax_vmm.MemoryBudget(chunks * ctx.c, device=device or ctx.device)


def _devices() -> set:
    return set(jax.devices()) | set(jax.devices("cpu"))


def _past_the_budget(ctx: Ctx) -> None:
    arena = ctx.new_arena(budget=_budget(ctx, 2))
    ctx.vm._owned.append(arena)
    arena.allocate(3 * ctx.c, jnp.uint8, name="buf").commit()


ROWS += [
    Row("G1", lambda x: jax_vmm.MemoryBudget(0, device=x.device)),
    Row("G2", lambda x: jax_vmm.MemoryBudget(1.5e6, device=x.device)),
    Row("G3", lambda x: x.new_arena(budget=8 * x.c)),
    Row(
        "G4",
        lambda x: x.new_arena(budget=_budget(x, 4, next(d for d in _devices() if d != x.device))),
        requires=lambda: None if len(_devices()) > 1 else "one device: see budget_scenarios.py",
    ),
    Row("G5", lambda x: x.new_arena(budget=jax_vmm.MemoryBudget(x.c - 1, device=x.device))),
    Row("G6", lambda x: _sharded(x, budget=[_budget(x, 4)] * 2)),
    Row("G7", _past_the_budget),
]


def message_pattern(row_id: str, rows: dict[str, DocRow]) -> str:
    """The *message* column as a regex: `…` is any text, a standalone N one word,
    ` / ` separates alternatives, `as X` is row X's message."""
    text = rows[row_id].message
    if m := re.fullmatch(r"as ([A-Z]\d+[a-z]?)", text):
        return message_pattern(m.group(1), rows)
    alternatives = []
    for alt in text.split(" / "):
        parts = re.split(r"(…|\bN\b)", alt)
        alternatives.append(
            "".join(r".*?" if p == "…" else r"\S+?" if p == "N" else re.escape(p) for p in parts)
        )
    return "|".join(f"(?:{a})" for a in alternatives)


def _param(row: Row) -> Any:
    marks = []
    if row.xfail:
        marks.append(pytest.mark.xfail(strict=True, reason=row.xfail))
    return pytest.param(row, id=row.id, marks=marks)


@pytest.mark.parametrize("row", [_param(r) for r in ROWS])
def test_error_row(vm, row: Row):
    """The call raises a class the row names, with the row's message."""
    if row.requires is not None and (why := row.requires()):
        pytest.skip(why)
    rows = doc_rows()
    doc = rows[row.id]
    with pytest.raises(Exception) as info:  # noqa: PT011 - the class is checked below
        row.call(Ctx(vm))
    names = {cls.__name__ for cls in type(info.value).__mro__}
    assert names & documented_types(doc), (
        f"{row.id}: raised {type(info.value).__name__}, docs/errors.md says {doc.raises}: "
        f"{info.value}"
    )
    pattern = message_pattern(row.id, rows)
    assert re.search(pattern, str(info.value), flags=re.S), (
        f"{row.id}: the message does not match docs/errors.md\n  raised: {info.value}\n"
        f"  documented: {doc.message}"
    )


def test_bad_input_leaves_the_arena_usable(vm):
    ctx = Ctx(vm)
    for row in ROWS:
        if row.id.startswith("C") and not row.id.startswith(("C10", "C11", "C12")):
            with pytest.raises((ValueError, TypeError)):
                row.call(ctx)
    assert ctx.buf.commit() == 2 * ctx.c
    vm.assert_backed(ctx.arena, [(ctx.buf.offset, ctx.buf.offset + 2 * ctx.c)])


def test_the_table_and_the_rows_agree():
    rows = doc_rows()
    untestable = {i for i, r in rows.items() if "untestable here" in r.bad_input}
    assert set(rows) - untestable == {r.id for r in ROWS}
    for row in ROWS:
        doc = rows[row.id]
        assert documented_types(doc), f"{row.id}: the raises column names no exception"
        assert ("**BUG**" in doc.message) == bool(row.xfail), (
            f"{row.id}: a row is marked **BUG** exactly when its test is an expected failure"
        )


def test_the_text_check_sees_a_wrong_message_or_class():
    """The doc-driven check is not vacuous: a stale message or class fails it."""
    rows = doc_rows()
    pattern = message_pattern("E2", rows)
    assert re.search(pattern, "head_dim must be > 0, got -2")
    assert not re.search(pattern, "head_dim must be >= 0, got -2")
    assert re.search(
        message_pattern("C6", rows),
        "Buffer 'buf': byte range [0, 9) is outside [0, 8); expected 0 <= start <= stop <= nbytes",
    )
    assert documented_types(rows["D2"]) == {"OutOfMemoryError", "MemoryError"}
    assert "ValueError" not in documented_types(rows["A17"])
