"""kv_write / kv_write_through: results, where the tokens land (arena and XLA copy),
padding, device-side drops of out-of-range and unbacked slots, loops, trace-time errors.

Every device-generic test runs on the CPU and, when present, on a CUDA GPU (the ``vm``
fixture). The contract (ops.py): with a static ``dest`` (``kv.dest(l)``, or found from
concrete arena views) the arena always holds the tokens, donated or not; the returned
arrays hold them too; the statistics say whether XLA handed over the arena itself.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
import jax_vmm.testing
from conftest import BackgroundCall, held_at_the_host_gate, read_bytes, write_bytes
from jax_vmm import ops
from jax_vmm.kv import base as _kv_base

H, D = 2, 8
_CHECK_WAIT = _kv_base.wait_for_writes  # kv.check()'s wait, before any test replaces it

# The array level is tested here, the trap of a jitted write without dest included (its
# results are right, the arena is not written): the ArenaNotWrittenWarning it raises is
# checked in tests/ops/test_kv_cache.py.
pytestmark = pytest.mark.filterwarnings("ignore::jax_vmm.ArenaNotWrittenWarning")


@pytest.fixture(autouse=True)
def _unchecked_writes_from_env():
    """test_checks_would_catch_unchecked_writes runs a test of this file in a child
    process with the protection removed."""
    if os.environ.get("JAX_VMM_TEST_UNCHECKED_WRITES") == "1":
        with jax_vmm.testing.unchecked_kv_writes():
            yield
    else:
        yield


def _is_gpu(vm) -> bool:
    return not vm.is_host


def _values(shape, dtype, seed: int) -> np.ndarray:
    """Finite, distinct values (compared bytewise)."""
    n = int(np.prod(shape))
    return ((np.arange(n) * 7 + seed * 131) % 251 + 1).astype(np.dtype(dtype)).reshape(shape)


def _cache(buf, dtype, h=H, d=D) -> np.ndarray:
    """The buffer's current content, read through a fresh view, as (num_slots, h, d)."""
    return read_bytes(buf).view(np.dtype(dtype)).reshape(-1, h, d)


def _fill(kv, dtype, seed: int = 1) -> list[np.ndarray]:
    """Writes distinct values into every backed token of every buffer; returns them."""
    out = []
    backed = kv.backed_tokens() if kv.max_seqs is None else None
    for i, b in enumerate(kv.buffers):
        tokens = backed if backed is not None else kv.num_slots
        data = _values((tokens, kv.num_kv_heads, kv.head_dim), dtype, seed * 10 + i)
        write_bytes(b, 0, data.view(np.uint8).reshape(-1))
        full = np.zeros((kv.num_slots, kv.num_kv_heads, kv.head_dim), np.dtype(dtype))
        full[:tokens] = data
        out.append(full)
    return out


def _apply(cache: np.ndarray, new: np.ndarray, slots, valid) -> np.ndarray:
    out = cache.copy()
    for t, s in enumerate(slots):
        if valid[t]:
            out[s] = new[t]
    return out


def _same(a: np.ndarray, b: np.ndarray, msg: str = "") -> None:
    np.testing.assert_array_equal(
        np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8), err_msg=msg
    )


def _put(vm, x):
    return jax.device_put(jnp.asarray(x), vm.device)


def _stats_delta(before: dict, after: dict) -> dict:
    return {
        h: {k: after[h][k] - before[h][k] for k in after[h]}
        for h in ("kv_write", "kv_write_through")
    } | {"dropped_writes": after["dropped_writes"] - before["dropped_writes"]}


# -- trace-time validation ------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_trace_time_errors(jit):
    k = jnp.zeros((16, H, D), jnp.float32)
    nk = jnp.ones((2, H, D), jnp.float32)
    slots = jnp.array([0, 1], jnp.int32)
    f = jax.jit(ops.kv_write) if jit else ops.kv_write
    cases = [
        ((k, k, nk.astype(jnp.float16), nk, slots), TypeError, "new_k has dtype float16"),
        ((k, k, nk, nk, slots.astype(jnp.float32)), TypeError, "slots must be int32"),
        ((k, k, nk, nk, slots[:1]), ValueError, r"slots must have shape \(2,\)"),
        ((k, k, jnp.ones((2, H, D + 1)), nk, slots), ValueError, "new_k must have shape"),
        ((k, k[:8], nk, nk, slots), ValueError, "same shape and dtype"),
        ((k[:, 0], k[:, 0], nk, nk, slots), ValueError, "rank >= 3"),
        ((k, k, nk, nk[:1], slots), ValueError, "new_v must have shape|same shape"),
    ]
    if not jit:  # under jit, JAX itself rejects the string argument
        cases.append((("k", k, nk, nk, slots), TypeError, "k must be an array"))
    for args, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            f(*args)
    with pytest.raises(TypeError, match="new_v has dtype"):
        ops.kv_write_through(k, k, nk, nk.astype(jnp.bfloat16), slots)


def test_zero_tokens_is_a_no_op():
    k = jnp.arange(16 * H * D, dtype=jnp.float32).reshape(16, H, D)
    empty = jnp.zeros((0, H, D), jnp.float32)
    ko, vo = ops.kv_write(k, k, empty, empty, jnp.zeros((0,), jnp.int32))
    assert ko is k and vo is k
    assert ops.kv_write_through(k, k, empty, empty, jnp.zeros((0,), jnp.int32)).shape == (2, 0)


# -- kv_write: results and where they land ---------------------------------------------


@pytest.mark.parametrize(
    "how,donate",
    [
        ("eager", False),  # an eager call cannot donate
        ("jit_dest", False),
        ("jit_dest", True),
        ("jit_no_dest", False),
        ("jit_no_dest", True),
    ],
    ids=["eager", "jit_dest-keep", "jit_dest-donate", "jit_no_dest-keep", "jit_no_dest-donate"],
)
def test_kv_write_returns_updated_cache(vm, donate, how):
    dtype = jnp.float32
    kv = vm.kv(
        num_layers=1, num_kv_heads=H, head_dim=D, max_tokens=64, dtype=dtype, initial_tokens=64
    )
    before_k, before_v = _fill(kv, dtype)
    slots = np.array([3, -1, 40, 7], np.int32)  # -1: padding
    nk, nv = _values((4, H, D), dtype, 5), _values((4, H, D), dtype, 6)
    valid = slots >= 0
    want_k, want_v = _apply(before_k, nk, slots, valid), _apply(before_v, nv, slots, valid)

    s0 = ops.kv_write_stats()
    if how == "eager":  # concrete arena views: the dest is found from the arrays
        f = ops.kv_write
    else:
        dest = kv.dest(0) if how == "jit_dest" else None
        f = jax.jit(lambda *a: ops.kv_write(*a, dest=dest), donate_argnums=(0, 1) if donate else ())
    ko, vo = f(kv.k[0], kv.v[0], _put(vm, nk), _put(vm, nv), _put(vm, slots))
    jax.block_until_ready((ko, vo))
    d = _stats_delta(s0, ops.kv_write_stats())

    _same(np.asarray(ko), want_k, "returned k")
    _same(np.asarray(vo), want_v, "returned v")
    assert d["kv_write"]["calls"] == 1 and d["kv_write_through"]["calls"] == 0
    arena_k, arena_v = _cache(kv.k_buffers[0], dtype), _cache(kv.v_buffers[0], dtype)
    in_place = _is_gpu(vm) and donate  # XLA hands over the arena itself
    if how != "jit_no_dest" or in_place:
        _same(arena_k, want_k, "arena k")
        _same(arena_v, want_v, "arena v")
        assert d["kv_write"]["non_arena"] == 0
        assert d["kv_write"]["alias_misses"] == (0 if in_place else 1)
    else:  # no dest and a copy handed over: nothing names the arena
        _same(arena_k, before_k, "arena k must be untouched without dest")
        _same(arena_v, before_v)
        assert d["kv_write"]["non_arena"] == 1
    if in_place:
        # A donated cache on a GPU is updated in place: no copy, the outputs are the arena.
        assert ko.unsafe_buffer_pointer() == kv.k_buffers[0].address
        assert vo.unsafe_buffer_pointer() == kv.v_buffers[0].address


@pytest.mark.parametrize("loop", ["scan", "fori"])
@pytest.mark.parametrize("donate", [False, True], ids=["keep", "donate"])
def test_kv_write_in_loops(vm, loop, donate):
    dtype = jnp.bfloat16
    kv = vm.kv(
        num_layers=1, num_kv_heads=H, head_dim=D, max_tokens=32, dtype=dtype, initial_tokens=32
    )
    before_k, before_v = _fill(kv, dtype)
    steps, per = 5, 2
    slots = np.array([[2 * i, 31 - i] for i in range(steps)], np.int32)
    nk = _values((steps, per, H, D), dtype, 7)
    nv = _values((steps, per, H, D), dtype, 8)
    dest = kv.dest(0)

    def run(k, v, nk, nv, slots):
        if loop == "scan":

            def body(c, xs):
                return ops.kv_write(c[0], c[1], *xs, dest=dest), None

            return jax.lax.scan(body, (k, v), (nk, nv, slots))[0]

        def body(i, c):
            return ops.kv_write(c[0], c[1], nk[i], nv[i], slots[i], dest=dest)

        return jax.lax.fori_loop(0, steps, body, (k, v))

    s0 = ops.kv_write_stats()
    f = jax.jit(run, donate_argnums=(0, 1) if donate else ())
    ko, vo = f(kv.k[0], kv.v[0], _put(vm, nk), _put(vm, nv), _put(vm, slots))
    jax.block_until_ready((ko, vo))
    misses = _stats_delta(s0, ops.kv_write_stats())["kv_write"]["alias_misses"]
    want_k, want_v = before_k.copy(), before_v.copy()
    for i in range(steps):
        want_k = _apply(want_k, nk[i], slots[i], [True] * per)
        want_v = _apply(want_v, nv[i], slots[i], [True] * per)
    _same(np.asarray(ko), want_k)
    _same(np.asarray(vo), want_v)
    _same(_cache(kv.k_buffers[0], dtype), want_k, "arena k")
    _same(_cache(kv.v_buffers[0], dtype), want_v, "arena v")
    if _is_gpu(vm) and donate:
        assert misses == 0, "a donated cache carried through the loop should stay in place"


def test_xla_hands_a_kept_cache_over_as_a_copy(cpu_device):
    """Why kv_write needs a static dest (docs/kv_write.md): XLA gives the aliased custom
    call a copy of a read-only argument, so the buffer it writes is not the arena."""
    k = jnp.zeros((16, H, D), jnp.float32)
    nk = jnp.ones((1, H, D), jnp.float32)
    hlo = jax.jit(ops.kv_write).lower(k, k, nk, nk, jnp.array([1], jnp.int32)).compile().as_text()
    calls = [line for line in hlo.splitlines() if 'custom_call_target="jax_vmm_kv_write"' in line]
    assert len(calls) == 1, hlo
    first = calls[0].split("custom-call(", 1)[1].split(",", 1)[0]
    assert "copy" in first, f"the cache operand is not XLA's copy any more: {calls[0]}"
    # kv_write_through (no aliasing) reads the argument itself: no copy at all.
    hlo = (
        jax.jit(ops.kv_write_through)
        .lower(k, k, nk, nk, jnp.array([1], jnp.int32))
        .compile()
        .as_text()
    )
    assert " copy(" not in hlo, hlo


def test_dest_errors_leave_the_arena_unchanged(vm):
    dtype = jnp.float32
    kv = vm.kv(
        num_layers=2, num_kv_heads=H, head_dim=D, max_tokens=16, dtype=dtype, initial_tokens=16
    )
    before = _fill(kv, dtype)
    nk = _put(vm, np.ones((1, H, D), np.float32))
    slots = _put(vm, np.array([1], np.int32))
    k, v = kv.k[0], kv.v[0]
    with pytest.raises(TypeError, match="dest must be a jax_vmm.KVDest"):
        ops.kv_write(k, v, nk, nk, slots, dest=(1, 2))
    small = vm.kv(num_layers=1, num_kv_heads=H, head_dim=D, max_tokens=8, dtype=dtype)
    with pytest.raises(ValueError, match="dest names buffers of 512 bytes"):
        ops.kv_write(k, v, nk, nk, slots, dest=small.dest(0))
    with pytest.raises(IndexError, match=r"layer 2 is out of range for 2 layers"):
        kv.dest(2)
    small.close()
    for buf, want in zip(kv.buffers, before):  # no bad call wrote anything
        _same(_cache(buf, dtype), want, buf.name)
    step = jax.jit(lambda k, v, a, s: ops.kv_write(k, v, a, a, s, dest=kv.dest(1)))
    plain = _put(vm, np.zeros((16, H, D), np.float32))
    jax.block_until_ready(step(plain, plain, nk, slots))  # compiled against layer 1
    ones = np.ones((1, H, D), np.float32)
    want = [
        before[0],
        _apply(before[1], ones, [1], [True]),
        before[2],
        _apply(before[3], ones, [1], [True]),
    ]  # k0, k1, v0, v1: only layer 1 written
    for buf, w in zip(kv.buffers, want):
        _same(_cache(buf, dtype), w, buf.name)
    kv.close()
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"dest_k is buffer 'k1' .*was closed"):
        jax.block_until_ready(step(plain, plain, nk, slots))
    with pytest.raises(jax_vmm.ArenaClosedError):
        kv.dest(0)


def test_kv_write_on_plain_arrays(vm):
    """Not arena memory: kv_write is an ordinary (functional) scatter with checks."""
    dtype = jnp.float32
    k = _put(vm, _values((16, H, D), dtype, 1))
    v = _put(vm, _values((16, H, D), dtype, 2))
    slots = np.array([0, 16, -3, 15], np.int32)  # 16: out of range
    nk, nv = _values((4, H, D), dtype, 3), _values((4, H, D), dtype, 4)
    s0 = ops.kv_write_stats()
    ko, vo = jax.jit(ops.kv_write)(k, v, _put(vm, nk), _put(vm, nv), _put(vm, slots))
    valid = [True, False, False, True]
    _same(np.asarray(ko), _apply(np.asarray(k), nk, slots, valid))
    _same(np.asarray(vo), _apply(np.asarray(v), nv, slots, valid))
    d = _stats_delta(s0, ops.kv_write_stats())
    assert d["kv_write"]["non_arena"] == 1 and d["kv_write"]["alias_misses"] == 0
    assert d["dropped_writes"] == 2  # slot 16, on the k and on the v side


# -- kv_write_through: the arena as the state -----------------------------------------------


def test_kv_write_through_per_sequence_layout(vm):
    dtype = jnp.bfloat16
    seqs, t = 3, 16
    kv = vm.kv(num_layers=2, num_kv_heads=H, head_dim=D, max_tokens=t, dtype=dtype, max_seqs=seqs)
    for q in range(seqs):
        kv.ensure(t, seq=q)
    before = _fill(kv, dtype)
    pos = np.array([0, 5, 15], np.int32)
    slots = (np.arange(seqs) * t + pos).astype(np.int32)
    nk, nv = _values((seqs, H, D), dtype, 11), _values((seqs, H, D), dtype, 12)

    @jax.jit
    def step(k1, v1, nk, nv, slots):  # layer 1 only
        return ops.kv_write_through(k1, v1, nk, nv, slots)

    status = step(kv.k[1], kv.v[1], _put(vm, nk), _put(vm, nv), _put(vm, slots))
    np.testing.assert_array_equal(np.asarray(status), np.full((2, seqs), ops.WRITTEN))
    # Layer 0 is untouched; layer 1 (buffers 1 and 3 of kv.buffers) holds the tokens.
    _same(_cache(kv.k_buffers[0], dtype), before[0])
    _same(_cache(kv.v_buffers[0], dtype), before[2])
    _same(_cache(kv.k_buffers[1], dtype), _apply(before[1], nk, slots, [True] * seqs))
    _same(_cache(kv.v_buffers[1], dtype), _apply(before[3], nv, slots, [True] * seqs))
    view = np.asarray(kv.k[1]).reshape(seqs, t, H, D)  # the (B, T, H, D) view agrees
    _same(view[1, 5], nk[1])
    kv.check()


@pytest.mark.parametrize("loop", ["scan", "fori"])
def test_kv_write_through_in_loops_without_donation(vm, loop):
    dtype = jnp.float32
    kv = vm.kv(
        num_layers=1, num_kv_heads=H, head_dim=D, max_tokens=32, dtype=dtype, initial_tokens=32
    )
    before_k, before_v = _fill(kv, dtype)
    steps = 6
    slots = np.array([[i, 20 + i] for i in range(steps)], np.int32)
    nk = _values((steps, 2, H, D), dtype, 21)
    nv = _values((steps, 2, H, D), dtype, 22)

    def run(k, v, nk, nv, slots):  # the cache is loop-invariant: XLA never copies it
        if loop == "scan":

            def body(n, xs):
                st = ops.kv_write_through(k, v, *xs)
                return n + jnp.sum(st == ops.WRITTEN), None

            return jax.lax.scan(body, jnp.int32(0), (nk, nv, slots))[0]

        def body(i, n):
            st = ops.kv_write_through(k, v, nk[i], nv[i], slots[i])
            return n + jnp.sum(st == ops.WRITTEN)

        return jax.lax.fori_loop(0, steps, body, jnp.int32(0))

    written = jax.jit(run)(kv.k[0], kv.v[0], _put(vm, nk), _put(vm, nv), _put(vm, slots))
    assert int(written) == 2 * 2 * steps
    want_k, want_v = before_k, before_v
    for i in range(steps):
        want_k = _apply(want_k, nk[i], slots[i], [True, True])
        want_v = _apply(want_v, nv[i], slots[i], [True, True])
    _same(_cache(kv.k_buffers[0], dtype), want_k, "arena k")
    _same(_cache(kv.v_buffers[0], dtype), want_v, "arena v")


def test_kv_write_through_refuses_copies(vm):
    k = _put(vm, np.zeros((16, H, D), np.float32))
    nk = _put(vm, np.ones((1, H, D), np.float32))
    with pytest.raises(jax.errors.JaxRuntimeError, match="not memory of a jax_vmm arena"):
        jax.block_until_ready(
            jax.jit(ops.kv_write_through)(k, k, nk, nk, _put(vm, np.array([1], np.int32)))
        )


# -- what XLA must keep, and when check() may read the counters ----------------------------


@pytest.mark.parametrize("op", ["through", "write", "fp8"])
def test_a_write_whose_result_is_unused_still_writes(vm, op):
    """The custom calls have a side effect (the arena): XLA must not remove them when
    the step ignores their result (kv_write_fp8 lacked it: nothing landed)."""
    dtype = jnp.float8_e4m3fn if op == "fp8" else jnp.float32
    kv = vm.kv(
        num_layers=1, num_kv_heads=H, head_dim=D, max_tokens=16, dtype=dtype, initial_tokens=16
    )
    dest = kv.dest(0)
    scale = jnp.ones((H,), jnp.float32)
    write = {
        "through": ops.kv_write_through,
        "write": ops.kv_write,
        "fp8": lambda *a, dest: ops.kv_write_fp8(*a, scale, scale, dest=dest),
    }[op]

    @jax.jit
    def step(k, v, new, slots):
        write(k, v, new, new, slots, dest=dest)  # result dropped
        return slots + 1

    new = _values((2, H, D), np.float32, 3)
    want = np.asarray(jnp.asarray(new).astype(dtype).astype(jnp.float32))
    slots = _put(vm, np.array([4, 9], np.int32))
    jax.block_until_ready(step(kv.k[0], kv.v[0], _put(vm, new), slots))
    got = np.asarray(jnp.asarray(_cache(kv.k_buffers[0], dtype)).astype(jnp.float32))
    _same(got[[4, 9]], want, "the write was removed")


def _slow_step_dropping(kv, n: int):
    """A step that writes n tokens to slots past the cache, all dropped and counted, only
    after work: on the CPU it first waits at the testing host gate, on a GPU large matrix
    products keep it running."""
    dest = kv.dest(0)
    gated = kv.arena.device.platform == "cpu"

    @jax.jit
    def step(k, v, x):
        y = jax_vmm.testing.through_host_gate(x) if gated else x
        for _ in range(4):
            y = jnp.sin(y @ y)
        late = (y[0, 0] > 2).astype(jnp.int32)  # 0, but only known after the work
        slots = kv.num_slots + late + jnp.arange(n, dtype=jnp.int32)
        new = jnp.ones((n, H, D), k.dtype)
        return ops.kv_write_through(k, v, new, new, slots, dest=dest)

    return step


def _check_waits_for_the_writes_in_flight(vm, wait: str) -> None:
    """kv.check() right after dispatching a step sees that step's drops: it waits for
    every kv_write dispatched from its thread (jax.effects_barrier), and for the arrays
    it is given (a step dispatched from another thread). On the CPU the step is held at
    the host gate until check() is inside its wait (or has returned), however fast the
    machine. Fails with pytest's "DID NOT RAISE" when check() misses the drop."""
    kv = vm.kv(num_layers=1, num_kv_heads=H, head_dim=D, max_tokens=16, dtype=jnp.float32)
    n = 4096
    step = _slow_step_dropping(kv, n)
    on_cpu = vm.device.platform == "cpu"
    x = _put(vm, np.full((64, 64) if on_cpu else (1500, 1500), 1e-3, np.float32))
    jax.block_until_ready(step(kv.k[0], kv.v[0], x))  # compile and run once
    with pytest.raises(jax_vmm.OutOfBoundsWrite):  # reset the count
        kv.check()

    def dispatch_then_check():
        if wait == "barrier":  # the same thread dispatches and checks
            step(kv.k[0], kv.v[0], x)
            return kv.check()
        box: list = []
        worker = threading.Thread(target=lambda: box.append(step(kv.k[0], kv.v[0], x)))
        worker.start()
        worker.join()  # dispatched from the worker; its result still computing
        return kv.check(*box)

    gate = jax_vmm.testing.host_gate_closed() if on_cpu else contextlib.nullcontext()
    with gate:
        checking = BackgroundCall(dispatch_then_check)
        if on_cpu:  # the step is let go once check() is inside its wait, or has returned
            held_at_the_host_gate()
            checking.wait_inside(_CHECK_WAIT, "check()'s wait")
    with pytest.raises(jax_vmm.OutOfBoundsWrite) as info:
        checking.join()
    assert info.value.count == 2 * n
    kv.check()


@pytest.mark.parametrize("wait", ["barrier", "arrays_from_another_thread"])
def test_check_waits_for_the_writes_in_flight(vm, wait):
    _check_waits_for_the_writes_in_flight(vm, wait)


@pytest.mark.parametrize("wait", ["barrier", "arrays_from_another_thread"])
def test_a_check_that_does_not_wait_misses_the_drop(host_vm, wait, monkeypatch):
    """The control: with kv.check()'s wait removed it reads the counters while the step
    is held and misses its drop, so the test above tests the wait."""
    monkeypatch.setattr(_kv_base, "wait_for_writes", lambda *a, **k: None)
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        _check_waits_for_the_writes_in_flight(host_vm, wait)


# -- device-side validation ---------------------------------------------------------------


@pytest.mark.parametrize("op", ["through", "write"])
def test_out_of_range_and_unensured_slots_are_dropped_and_counted(vm, op):
    """A slot past the ensured tokens is DROPPED_NOT_ENSURED whether or not its chunk is
    backed: the status must not depend on the chunk size (64 KiB on the host, 2 MiB on a
    GPU). It was DROPPED_UNBACKED where the chunk was not backed."""
    dtype = jnp.bfloat16
    tpc = vm.chunk // (H * D * 2)  # tokens per chunk
    kv = vm.kv(num_layers=2, num_kv_heads=H, head_dim=D, max_tokens=3 * tpc, dtype=dtype)
    kv.ensure(tpc - 4)  # chunk 0 backed, its last 4 tokens not ensured; chunks 1 and 2 not
    before = _fill(kv, dtype)
    slots = np.array([2, -1, kv.num_slots + 5, tpc + 3, tpc - 5, 2 * tpc, tpc - 2], np.int32)
    codes = [
        ops.WRITTEN,
        ops.PADDING,
        ops.DROPPED_OUT_OF_RANGE,
        ops.DROPPED_NOT_ENSURED,  # unbacked chunk
        ops.WRITTEN,
        ops.DROPPED_NOT_ENSURED,  # unbacked chunk
        ops.DROPPED_NOT_ENSURED,  # backed chunk
    ]
    valid = [c == ops.WRITTEN for c in codes]
    nk, nv = _values((7, H, D), dtype, 31), _values((7, H, D), dtype, 32)
    s0 = ops.kv_write_stats()
    if op == "through":
        status = jax.jit(ops.kv_write_through)(
            kv.k[0], kv.v[0], _put(vm, nk), _put(vm, nv), _put(vm, slots)
        )
        np.testing.assert_array_equal(np.asarray(status), np.array([codes, codes]))
    else:  # donated (in place on a GPU; on the CPU the dest names the arena)
        dest = kv.dest(0)
        ko, vo = jax.jit(lambda *a: ops.kv_write(*a, dest=dest), donate_argnums=(0, 1))(
            kv.k[0], kv.v[0], _put(vm, nk), _put(vm, nv), _put(vm, slots)
        )
        jax.block_until_ready((ko, vo))
        _same(np.asarray(ko), _apply(before[0], nk, slots, valid))
    d = _stats_delta(s0, ops.kv_write_stats())
    # Only the valid tokens changed, anywhere in the arena (other layer included).
    _same(_cache(kv.k_buffers[0], dtype), _apply(before[0], nk, slots, valid), "k0")
    _same(_cache(kv.v_buffers[0], dtype), _apply(before[2], nv, slots, valid), "v0")
    _same(_cache(kv.k_buffers[1], dtype), before[1], "k1")
    _same(_cache(kv.v_buffers[1], dtype), before[3], "v1")
    assert kv.backed_tokens() == tpc, "a dropped write must not commit memory"
    assert d["dropped_writes"] == 8  # 4 dropped tokens, k and v side
    assert kv.dropped_writes() == 8
    with pytest.raises(jax_vmm.OutOfBoundsWrite) as info:
        kv.check()
    assert info.value.count == 8
    kv.check()  # the count was reset
    # Committing the page makes the same slot writable.
    kv.ensure(2 * tpc)
    status = jax.jit(ops.kv_write_through)(
        kv.k[0], kv.v[0], _put(vm, nk[3:4]), _put(vm, nv[3:4]), _put(vm, slots[3:4])
    )
    np.testing.assert_array_equal(np.asarray(status), [[ops.WRITTEN], [ops.WRITTEN]])
    _same(_cache(kv.k_buffers[0], dtype)[tpc + 3], nk[3])


def test_checks_would_catch_unchecked_writes():
    """The drop test above, on the CPU, with the device-side checks switched off: the
    out-of-range slot then lands in the next buffer (caught by the 'k1 untouched'
    check) and the unbacked one faults. Either way the test must not pass. (The
    write-through variant: kv_write would also scribble past XLA's heap copy of the
    cache, corrupting the child's heap in ways that may hang instead of failing.)"""
    if os.environ.get("JAX_VMM_TEST_UNCHECKED_WRITES") == "1":
        pytest.skip("already the child process")
    env = dict(os.environ, JAX_VMM_TEST_UNCHECKED_WRITES="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            __file__,
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "dropped_and_counted and cpu and through",
        ],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"with unchecked writes the test still passed:\n{out[-3000:]}"
    assert "1 passed" not in out
    assert (
        "1 failed" in out
        or "Segmentation fault" in out
        or "Fatal Python error" in out
        or proc.returncode < 0
    ), out[-3000:]


# -- geometries and copy widths ---------------------------------------------------------


@pytest.mark.parametrize(
    "h,d,dtype",
    [
        (1, 3, jnp.float16),  # 6-byte tokens: 2-byte copies
        (3, 5, jnp.float32),  # 60-byte tokens: 4-byte copies
        (1, 1, jnp.int8),  # 1-byte tokens
        (2, 64, jnp.bfloat16),  # 256 bytes: 16-byte copies
        (8, 128, jnp.bfloat16),  # 2 KiB tokens: every thread of a block copies
    ],
)
def test_geometries(vm, h, d, dtype):
    kv = vm.kv(
        num_layers=1, num_kv_heads=h, head_dim=d, max_tokens=40, dtype=dtype, initial_tokens=40
    )
    before = _fill(kv, dtype)
    slots = np.array([39, 0, 17, -5, 1], np.int32)
    nk, nv = _values((5, h, d), dtype, 41), _values((5, h, d), dtype, 42)
    valid = slots >= 0
    status = jax.jit(ops.kv_write_through)(
        kv.k[0], kv.v[0], _put(vm, nk), _put(vm, nv), _put(vm, slots)
    )
    assert (np.asarray(status) == ops.WRITTEN).sum() == 2 * valid.sum()
    _same(_cache(kv.k_buffers[0], dtype, h, d), _apply(before[0], nk, slots, valid))
    _same(_cache(kv.v_buffers[0], dtype, h, d), _apply(before[1], nv, slots, valid))
    # kv_write on the same geometry returns the same content (whatever path it took).
    ko, _ = jax.jit(ops.kv_write)(kv.k[0], kv.v[0], _put(vm, nk), _put(vm, nv), _put(vm, slots))
    _same(np.asarray(ko), _apply(before[0], nk, slots, valid))


def test_stats_count_host_invocations(cpu_device):
    k = jnp.zeros((8, H, D), jnp.float32)
    nk = jnp.ones((1, H, D), jnp.float32)
    f = jax.jit(ops.kv_write)
    f(k, k, nk, nk, jnp.array([1], jnp.int32))  # compile
    s0 = ops.kv_write_stats()
    for _ in range(3):
        jax.block_until_ready(f(k, k, nk, nk, jnp.array([1], jnp.int32)))
    d = _stats_delta(s0, ops.kv_write_stats())
    assert d["kv_write"]["calls"] == 3 and d["kv_write_through"]["calls"] == 0
    assert d["kv_write"]["captured_calls"] == 0  # no graphs on the CPU
    assert d["kv_write"]["non_arena"] == 3 and d["kv_write"]["alias_misses"] == 0
    ops.reset_kv_write_stats()
    s = ops.kv_write_stats()
    assert s["kv_write"]["calls"] == 0 and s["dropped_writes"] == 0


@pytest.mark.parametrize("fp8", [False, True])
def test_vmap_of_a_write_into_plain_arrays_is_one_write_per_element(fp8):
    """Array-level kv_write (and kv_write_fp8) on plain arrays is a pure function, so vmap
    means a write per batch element: over a batch of caches, and over new tokens into one
    cache (each element gets its own copy). It raised JAX's raw "vmap_method" error."""
    N = 10
    dtype = jnp.float8_e4m3fn if fp8 else jnp.float32
    scale = jnp.ones(H, jnp.float32)

    def write(k, v, nk, slots):
        if fp8:
            return jax_vmm.ops.kv_write_fp8(k, v, nk, nk, slots, scale, scale)
        return jax_vmm.kv_write(k, v, nk, nk, slots)

    caches = jnp.zeros((3, N, H, D), dtype)
    new = jnp.arange(3 * H * D, dtype=jnp.float32).reshape(3, 1, H, D) / 8 + 1
    slots = jnp.array([[2], [5], [-1]], jnp.int32)
    got = jax.vmap(lambda k, n, s: write(k, k, n, s)[0])(caches, new, slots)
    want = jnp.stack([write(caches[i], caches[i], new[i], slots[i])[0] for i in range(3)])
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    one = jax.vmap(lambda n, s: write(caches[0], caches[0], n, s)[0])(new, slots)
    np.testing.assert_array_equal(np.asarray(one, np.float32), np.asarray(want, np.float32))
    assert np.count_nonzero(np.asarray(got, np.float32)) == 2 * H * D  # the -1 slot dropped
