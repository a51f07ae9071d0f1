"""A forked child must never change its parent's arena memory (docs/design.md, "Fork").

On the host driver a child inherits the arena's memfd and its MAP_SHARED mappings: the
physical pages are the parent's. Before the fork guard, a child's release, close, sleep
or garbage collection punched holes in that memfd and the parent read 0.0 where it had
written 8.0. Now every call of an inherited arena that would reach the driver raises
``jax_vmm.ForkedProcessError`` in the child, and a child that drops the arena (or exits)
gives nothing back.

Each test forks with ``os.fork()``; the child touches only jax_vmm objects, reports
through a pipe and leaves with ``os._exit``. The parent reads its memory straight from
the addresses (ctypes, no JAX view) and through the memfd's allocated blocks.
"""

from __future__ import annotations

import ctypes
import gc
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
import jax_vmm.testing
import maps_oracle as mo
from conftest import child_env, write_bytes
from jax_vmm.ops import scratch

H, D = 2, 64  # float32: 512 bytes per token per buffer
TOKENS = 300
REPO = Path(__file__).resolve().parents[2]


def _in_child(fn: Callable[[], object], timeout: float = 60.0) -> tuple[int, str]:
    """Runs fn in a forked child; returns (the child's exit code, what it reported):
    "ok:<repr of fn's result>" or "<exception type>:<message>"."""
    # No garbage left for the child's collections: freeing other tests' JAX objects in a
    # forked child can deadlock inside XLA (its threads did not survive the fork).
    gc.collect()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: jax_vmm objects only, then _exit (no atexit, no pytest)
        code = 0
        try:
            os.close(r)
            try:
                msg = f"ok:{fn()!r}"
            except BaseException as e:  # noqa: BLE001 -- reported to the parent
                msg = f"{type(e).__name__}:{e}"
            os.write(w, msg.encode())
            os.close(w)
        except BaseException:  # noqa: BLE001
            code = 3
        os._exit(code)
    os.close(w)
    chunks = []
    deadline = time.monotonic() + timeout
    while select.select([r], [], [], max(0.0, deadline - time.monotonic()))[0]:
        if not (data := os.read(r, 65536)):
            break
        chunks.append(data)
    else:  # the child hangs (a join of a thread that did not survive the fork, say)
        os.kill(pid, signal.SIGKILL)
        chunks.append(b"<timeout>")
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), b"".join(chunks).decode()


def _filled_kv(cpu_device) -> tuple[dict, list[tuple[int, int]], mo.MemfdProbe]:
    """A KV arena in a box (so that a child can drop the last reference) with TOKENS
    tokens of 8.0 in every buffer, the (address, bytes) of that data, and its memfd."""
    before = mo.jax_vmm_memfds()
    kv = jax_vmm.kv_arena(
        num_layers=2,
        num_kv_heads=H,
        head_dim=D,
        max_tokens=4096,
        dtype=jnp.float32,
        device=cpu_device,
        handle_bytes=None,
    )
    kv.ensure(TOKENS)
    n = TOKENS * H * D
    spans = []
    for b in kv.buffers:
        write_bytes(b, 0, np.full(n, 8.0, np.float32))
        spans.append((b.address, n * 4))
    return {"kv": kv}, spans, mo.MemfdProbe.between(before, mo.jax_vmm_memfds())


def _values(spans: list[tuple[int, int]]) -> np.ndarray:
    return np.concatenate([np.frombuffer(ctypes.string_at(a, n), np.float32) for a, n in spans])


def _assert_intact(
    box: dict, spans: list[tuple[int, int]], probe: mo.MemfdProbe, held: int
) -> None:
    values = _values(spans)
    assert (values == 8.0).all(), (
        f"the child changed the parent's memory: {np.count_nonzero(values != 8.0)} of "
        f"{values.size} floats are no longer 8.0 (e.g. {values[values != 8.0][:4]})"
    )
    assert probe.physical_bytes() == held, "the child freed blocks of the parent's memfd"
    # The parent's arena still works: grow, release, grow again.
    kv = box["kv"]
    kv.ensure(2 * TOKENS)
    assert (_values(spans) == 8.0).all()
    kv.release()
    kv.ensure(TOKENS)


def _assert_refused(report: str, what: str) -> None:
    kind, _, msg = report.partition(":")
    assert kind == "ForkedProcessError", f"{what} in the child: expected a refusal, got {report}"
    assert f"process {os.getpid()}" in msg, msg  # names the parent
    assert "fork" in msg and "create a new arena" in msg.lower(), msg


CHILD_OPS = {
    "release": lambda kv: kv.release(),
    "close": lambda kv: kv.close(),
    "sleep_discard": lambda kv: kv.sleep(keep="discard"),
    "sleep_keep": lambda kv: kv.sleep(keep="host"),
    "shrink": lambda kv: kv.shrink(0),
    "ensure": lambda kv: kv.ensure(3000),
    "offload": lambda kv: kv.offload(),
    "reclaim": lambda kv: kv.reclaim(),
}


@pytest.mark.parametrize("op", sorted(CHILD_OPS))
def test_a_child_cannot_change_the_parents_kv_memory(cpu_device, op):
    box, spans, probe = _filled_kv(cpu_device)
    held = probe.physical_bytes()
    code, report = _in_child(lambda: CHILD_OPS[op](box["kv"]))
    assert code == 0, report
    _assert_refused(report, op)
    _assert_intact(box, spans, probe, held)
    box["kv"].close()


def test_a_child_that_drops_the_arena_gives_nothing_back(cpu_device):
    box, spans, probe = _filled_kv(cpu_device)
    held = probe.physical_bytes()

    def drop() -> bool:
        gone = weakref.ref(box["kv"].arena)
        del box["kv"]
        gc.collect()
        return gone() is None  # the core arena was destroyed in the child

    code, report = _in_child(drop)
    assert (code, report) == (0, "ok:True")
    _assert_intact(box, spans, probe, held)
    box["kv"].close()


def test_plain_arena_calls_in_a_child_are_refused(cpu_device):
    arena = jax_vmm.Arena(1 << 22, device=cpu_device)
    buf = arena.allocate((1 << 16,), jnp.float32, name="weights")
    buf.commit()
    write_bytes(buf, 0, np.full(1 << 16, 8.0, np.float32))
    spans = [(buf.address, buf.nbytes)]
    calls = {
        "commit": lambda: buf.commit(0, buf.nbytes),
        "decommit": lambda: buf.decommit(),
        "free": lambda: buf.free(),
        "allocate": lambda: arena.allocate((16,), jnp.float32),
        "wake": lambda: arena.wake(),
        "close": lambda: arena.close(),
        "view": lambda: buf.view(),
    }
    for name, call in calls.items():
        code, report = _in_child(call)
        assert code == 0, report
        _assert_refused(report, name)
        # Queries answer from host bookkeeping, without the driver.
    code, report = _in_child(lambda: (arena.backed_bytes, arena.closed, buf.backed_bytes))
    assert report == f"ok:{(buf.nbytes, False, buf.nbytes)!r}"
    assert (_values(spans) == 8.0).all()
    arena.close()


def test_a_closed_arena_closes_again_quietly_in_a_child(cpu_device):
    arena = jax_vmm.Arena(1 << 20, device=cpu_device)
    arena.close()
    assert _in_child(arena.close) == (0, "ok:None")


def test_a_child_that_exits_normally_gives_nothing_back():
    # Interpreter shutdown in the child (module globals, garbage collection, the C++
    # statics) with the arena alive and open. A core arena without a JAX client: a
    # forked child cannot shut down JAX's CPU client (its thread pool deadlocks there).
    script = textwrap.dedent(
        """
        import ctypes, os
        from jax_vmm.base.loader import core
        arena = core.create_arena("host", 0, 1 << 22, 0, 0, True)
        buf = arena.allocate(1 << 20, "weights")
        arena.commit_ranges([(buf["id"], 0, 1 << 20)])
        ctypes.memset(buf["address"], 8, 1 << 20)
        pid = os.fork()
        if pid == 0:
            raise SystemExit(0)  # a normal exit, the arena still alive
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        data = ctypes.string_at(buf["address"], 1 << 20)
        print("intact" if data == b"\\x08" * (1 << 20) else f"lost {data.count(0)} bytes")
        arena.close()
        """
    )
    env = child_env(REPO)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "intact", out.stdout + out.stderr[-3000:]


def test_a_child_neither_uses_nor_releases_the_parents_cuda_objects():
    # The real CUDA driver code over the fake CUDA driver: in the child, the arena refuses,
    # a new CUDA arena cannot be made (the parent's context is unusable), and dropping the
    # inherited arena makes no driver call (the fake's objects stay as they were).

    t = jax_vmm.testing.extension()
    keys = ("live_reservations", "live_mappings", "live_allocations", "live_streams")
    box = {"arena": t.create_fake_cuda_arena(1 << 22, 0, 0, True)}
    buf = box["arena"].allocate(1 << 20, "weights")
    # A release starts the arena's reclaimer thread, which the child must neither join
    # (it did not survive the fork) nor destroy while joinable.
    box["arena"].commit_ranges([(buf["id"], 0, 1 << 20)])
    box["arena"].decommit_ranges([(buf["id"], 0, 1 << 20)], True)
    assert box["arena"].stats()["deferred_releases"] > 0  # the reclaimer got them
    box["arena"].commit_ranges([(buf["id"], 0, 1 << 20)])
    before = {k: t.fake_cuda_stats()[k] for k in keys}

    def child() -> tuple[list[str], bool]:
        outcomes = []
        for call in (
            lambda: box["arena"].commit_ranges([(buf["id"], 0, 1 << 20)]),
            lambda: box["arena"].decommit_ranges([(buf["id"], 0, 1 << 20)], False),
            lambda: box["arena"].close(),
            lambda: t.create_fake_cuda_arena(1 << 22, 0, 0, True),
        ):
            try:
                call()
                outcomes.append("ok")
            except Exception as e:  # noqa: BLE001 -- the type is the answer
                outcomes.append(type(e).__name__)
        box.clear()
        gc.collect()
        return outcomes, {k: t.fake_cuda_stats()[k] for k in keys} == before

    code, report = _in_child(child)
    assert (code, report) == (0, f"ok:{(['ForkedProcessError'] * 4, True)!r}")
    box["arena"].close()


@pytest.mark.gpu
def test_a_child_cannot_touch_a_gpu_arena(gpu_device):
    # The child never reaches the CUDA driver (the parent's context is unusable there):
    # every call is refused before it, and the parent's data stays.
    arena = jax_vmm.Arena(64 << 20, device=gpu_device)
    x = arena.put(np.full(1 << 20, 8.0, np.float32))
    buf = arena.buffers[-1]
    for name, call in {
        "decommit": lambda: buf.decommit(),
        "commit": lambda: buf.commit(),
        "sleep": lambda: arena.sleep(keep="discard"),
        "close": lambda: arena.close(),
    }.items():
        code, report = _in_child(call)
        assert code == 0, report
        _assert_refused(report, name)

    assert (np.asarray(x) == 8.0).all()
    x.delete()
    arena.close()


def test_scratch_and_statistics_in_a_child_use_the_childs_copy(cpu_device):
    """Graph-safe scratch and the statistics queries in a forked child answer (or refuse)
    at once and never reach the parent's memory: the host workspaces are private heap
    memory (the child's copy-on-write copy), and the queries read the child's copy of the
    counters. A call that would reach the parent's arena memory refuses (kv.check reads
    the drop counters through the arena)."""
    box, spans, probe = _filled_kv(cpu_device)
    kv = box["kv"]
    held = probe.physical_bytes()
    x = jnp.arange(4096, dtype=jnp.float32)
    y, _ = jax_vmm.testing.scratch_probe(x)  # the host workspace exists, in use
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    parent = [(s["address"], s["capacity"], s["generation"]) for s in scratch.scratch_stats()]
    mode = scratch.get_scratch_mode()
    queries = {
        "scratch_stats": lambda: len(scratch.scratch_stats()),
        "reserve": lambda: scratch.reserve(1 << 24, cpu_device),  # grows the child's copy
        "set_scratch_mode": lambda: scratch.set_scratch_mode("retire"),
        "set_reserve_bytes": lambda: scratch.set_reserve_bytes(1 << 20),
        "kv_stats": lambda: kv.stats()["backed_bytes"],
        "arena_stats": lambda: kv.arena.stats()["backed_bytes"],
        "kv_write_stats": lambda: jax_vmm.kv_write_stats()["dropped_writes"],
        "attention_stats": lambda: jax_vmm.attention_stats()["cpu_calls"],
    }
    for name, query in queries.items():
        code, report = _in_child(query)
        assert code == 0 and report.startswith("ok:"), f"{name} in a child: {code} {report}"
    code, report = _in_child(kv.check)
    assert code == 0
    _assert_refused(report, "kv.check")
    assert [(s["address"], s["capacity"], s["generation"]) for s in scratch.scratch_stats()] == (
        parent
    )
    assert scratch.get_scratch_mode() == mode
    y, _ = jax_vmm.testing.scratch_probe(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    _assert_intact(box, spans, probe, held)
    kv.close()
