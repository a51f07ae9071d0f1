"""Memory under running kernels, and sleep/wake, on a GPU (checked by the CUDA driver).

* A release while a jax_vmm kernel still reads the pages, and a commit next to them: the
  result is bit-identical and nothing faults; with the testing layer's
  ``skip_device_waits`` (no deferral) the same scenario faults or goes wrong. Both run in
  child processes (a device fault is sticky): tools/gpu/memory_hazard.py, which the
  sanitizer step runs under compute-sanitizer too.
* A commit while XLA reads the buffer through a raw view: commits wait for the device
  while views are alive; without the wait the reader faults.
* A release right after dispatching a step that reads the sequence: the step, still queued
  behind other work, reads all its tokens (the table change is ordered on XLA's compute
  stream); with the testing layer's ``unorder_table_writes`` it reads the lowered table.
* Sleep frees the device memory (cuMemGetInfo), the driver sees no mapping but the zero
  pieces, wake restores contents bit-exact; 100 cycles leak nothing; a fault in the middle
  of wake leaves the arena asleep and intact; a captured decode step (kv_write with dest +
  decode_attention) replays across sleep and wake with 0 handler calls and correct data.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
from conftest import cuda_ordinal, cuda_vmm_device, raw_bytes, unbacked_kind
from jax_vmm import ops
from jax_vmm.testing import InjectedFault

cu_oracle = pytest.importorskip("cuda_oracle", reason="needs cuda-python (cuda.bindings)")

pytestmark = pytest.mark.gpu

HAZARD = Path(__file__).resolve().parents[2] / "tools" / "gpu" / "memory_hazard.py"
MiB = 1 << 20


def _gpu() -> jax.Device:
    dev, why = cuda_vmm_device()
    if dev is None:
        pytest.skip(f"needs a CUDA GPU with VMM support: {why}")
    return dev


def _scenario(tmp_path, which: str, mode: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    dev = _gpu()
    out = tmp_path / f"{which}_{mode}.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(cuda_ordinal(dev)))
    proc = subprocess.run(
        [sys.executable, str(HAZARD), which, mode, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    return proc, json.loads(out.read_text()) if out.exists() else None


# -- kernels in flight ---------------------------------------------------------------------


def test_release_under_a_running_kernel_keeps_its_pages(tmp_path):
    proc, r = _scenario(tmp_path, "release", "safe")
    assert proc.returncode == 0 and r is not None, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert r["bit_identical"], r
    assert r["deferred_releases"] >= 1 and r["retired_after_release"] > 0, (
        f"the release was not deferred (nothing was in flight?): {r}"
    )
    assert r["held_after_reclaim"] > 0  # sequence 1's pages; sequence 0's went back


def test_release_without_the_deferral_is_caught(tmp_path):
    """The protection removed (skip_device_waits): the pages are unmapped under the
    kernels, so the run faults or its result differs. If this passed cleanly the test
    above could not see the bug it guards against."""
    proc, r = _scenario(tmp_path, "release", "unsafe")
    assert "RELEASING" in proc.stdout, f"did not reach the release:\n{proc.stderr[-4000:]}"
    assert proc.returncode != 0, f"unmapping under running kernels went unnoticed: {r}"
    if r is not None:
        assert not r["bit_identical"], r


def test_commit_under_a_raw_reader_waits_for_the_device(tmp_path):
    proc, r = _scenario(tmp_path, "commit", "safe")
    assert proc.returncode == 0 and r is not None, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert r["commit_drains"] == 40, r  # every commit waited: a raw view was alive


def test_commit_without_the_drain_faults(tmp_path):
    proc, r = _scenario(tmp_path, "commit", "unsafe")
    assert "COMMITTING" in proc.stdout, f"did not reach the commits:\n{proc.stderr[-4000:]}"
    assert proc.returncode != 0, f"swapping zero mappings under a reader went unnoticed: {r}"


def test_a_donated_view_leaves_arena_arrays_without_a_view_and_commits_still_wait():
    """Why the arena's waits key on "a view was handed out" rather than on live views: the
    output of a donated view aliases the arena (measured on jax 0.11.2), whether or not the
    view's lease is still counted. Commits must keep waiting for the device then."""
    dev = _gpu()
    with jax_vmm.Arena(64 * MiB, device=dev) as arena:
        buf = arena.allocate((1024,), jnp.float32)
        buf.commit()
        out = jax.jit(lambda x: x.at[3].set(7.0), donate_argnums=0)(buf.array)
        out.block_until_ready()
        assert out.unsafe_buffer_pointer() == buf.address
        s = arena.stats()
        print(f"live views counted after the donation: {s['live_views']}")
        assert s["views_exported"]
        other = arena.allocate((1024,), jnp.float32)
        other.commit()
        assert arena.stats()["commit_drains"] == s["commit_drains"] + 1
        del out


# -- a release right after a dispatch -------------------------------------------------------

_QUEUED_T, _QUEUED_H, _QUEUED_D = 2048, 8, 128


def _queued_kv(dev) -> jax_vmm.KVArena:
    """One bf16 layer, two sequences of _QUEUED_T tokens, nothing ensured."""
    return jax_vmm.kv_arena(
        num_layers=1, num_kv_heads=_QUEUED_H, head_dim=_QUEUED_D, max_tokens=_QUEUED_T,
        max_seqs=2, dtype=jnp.bfloat16, device=dev,
    )  # fmt: skip


@jax.jit
def _queued_attention(cache, q, lengths, w):
    x = w
    for _ in range(64):  # ~70 ms of matmuls on an H200: the attention waits in the queue
        x = jnp.tanh(x @ w)
    q = q + (x[0, 0] * 0).astype(q.dtype)  # ordered after the chain
    return jax_vmm.decode_attention(q, cache[0], lengths)


@pytest.mark.parametrize("tables", ["ordered", "unordered"])
def test_a_release_after_dispatch_leaves_the_queued_step_its_tokens(faults, tables):
    """kv.release documents that it may follow the dispatch of a step that still reads
    the sequence. The step here is queued behind ~70 ms of matmuls when the release runs;
    its output for the released sequence must equal the same step's without a release,
    and no read may be counted as clamped. With the table change landing at once
    (unordered: the protection removed) the queued step reads 0 tokens."""
    dev = _gpu()
    T, H, D = _QUEUED_T, _QUEUED_H, _QUEUED_D
    kv = _queued_kv(dev)
    try:
        rng = np.random.default_rng(0)
        for s in range(2):
            kv.ensure(T, seq=s)
        new = jax.device_put(jnp.asarray(rng.standard_normal((2 * T, H, D)), jnp.bfloat16), dev)
        seq = jnp.repeat(jnp.arange(2, dtype=jnp.int32), T)
        pos = jnp.tile(jnp.arange(T, dtype=jnp.int32), 2)
        cache = kv.cache()
        cache = cache.replace(0, jax_vmm.kv_write(cache[0], new, new, seq=seq, pos=pos))
        kv.check()
        q = jax.device_put(jnp.asarray(rng.standard_normal((2, 4 * H, D)), jnp.bfloat16), dev)
        lengths = jax.device_put(jnp.full((2,), T, jnp.int32), dev)
        w = jax.device_put(jnp.asarray(rng.standard_normal((8192, 8192)) / 90.5, jnp.bfloat16), dev)
        want = np.asarray(_queued_attention(cache, q, lengths, w), np.float32)
        assert np.any(want[0] != 0)
        kv.check()
        if tables == "unordered":
            faults.unorder_table_writes(kv)
        out = _queued_attention(cache, q, lengths, w)
        kv.release(0)
        got = np.asarray(out, np.float32)
        np.testing.assert_array_equal(got[1], want[1])
        if tables == "ordered":
            np.testing.assert_array_equal(got[0], want[0])
            kv.check()  # no clamped read
            # Dispatched after the release: the lowered table, so a read is clamped.
            _queued_attention(cache, q, lengths, w).block_until_ready()
            with pytest.raises(jax_vmm.OutOfBoundsRead):
                kv.check()
        else:
            assert not np.array_equal(got[0], want[0]), (
                "the release did not reach the queued step even without the ordering: "
                "this test cannot see the early clamp it guards against"
            )
    finally:
        kv.close()


@jax.jit
def _queued_write(cache, new, w):
    x = w
    for _ in range(64):
        x = jnp.tanh(x @ w)
    new = new + (x[0, 0] * 0).astype(new.dtype)
    seq, pos = jnp.array([0], jnp.int32), jnp.array([3], jnp.int32)
    return cache.replace(0, jax_vmm.kv_write(cache[0], new, new, seq=seq, pos=pos))


def test_a_write_queued_before_a_release_is_dropped():
    """Writes check the table as it is when they run (unlike reads): a write dispatched
    before the release of its sequence and still queued is dropped and counted, and lands
    nowhere (the released chunks are on their way back to the driver)."""
    dev = _gpu()
    T, H, D = _QUEUED_T, _QUEUED_H, _QUEUED_D
    kv = _queued_kv(dev)
    try:
        kv.ensure(T, seq=0)
        rng = np.random.default_rng(1)
        new = jax.device_put(jnp.full((1, H, D), 7, jnp.bfloat16), dev)
        w = jax.device_put(jnp.asarray(rng.standard_normal((8192, 8192)) / 90.5, jnp.bfloat16), dev)
        cache = _queued_write(kv.cache(), new, w)
        kv.release(0)
        assert not cache[0].token.is_ready(), "the write ran before the release: no test"
        with pytest.raises(jax_vmm.OutOfBoundsWrite):
            kv.check(cache)
        assert not np.any(np.asarray(kv.k[0])[0, 3].astype(np.float32) == 7)
    finally:
        kv.close()


# -- sleep and wake -------------------------------------------------------------------------


@pytest.fixture
def oracle() -> cu_oracle.CudaOracle:
    return cu_oracle.CudaOracle(cuda_ordinal(_gpu()))


def _kv(dev, layers=2, tokens=64 * 1024, seqs=2):
    kv = jax_vmm.kv_arena(
        num_layers=layers,
        num_kv_heads=8,
        head_dim=128,
        max_tokens=tokens,
        max_seqs=seqs,
        dtype=jnp.bfloat16,
        device=dev,
    )
    rng = np.random.default_rng(7)
    for q in range(seqs):
        kv.ensure(tokens * (q + 1) // seqs, seq=q)  # sequence 1 full, sequence 0 half
    for b in kv.buffers:
        for q in range(seqs):
            backed = kv.backed_tokens(q) * kv.token_bytes
            src = rng.integers(0, 256, size=backed, dtype=np.uint8)
            kv.arena._handle.copy_in(b.id, q * kv.seq_bytes, src.ctypes.data, backed)
    return kv


def _contents(kv) -> list[np.ndarray]:
    out = []
    for b in kv.buffers:
        for q in range(kv.max_seqs):
            n = kv.backed_tokens(q) * kv.token_bytes
            out.append(raw_bytes(b, q * kv.seq_bytes, q * kv.seq_bytes + n))
    return out


def _kinds(oracle, kv) -> list[str]:
    a = kv.arena
    return oracle.kinds(a.base, a.reserved_bytes, a.chunk_bytes)


def test_sleep_frees_device_memory_and_wake_restores_it(oracle):
    kv = _kv(_gpu())
    try:
        backed = kv.arena.backed_bytes
        want = _contents(kv)
        kinds = _kinds(oracle, kv)
        free0 = oracle.mem_free()
        kv.sleep()
        assert oracle.mem_free() - free0 >= backed - 2 * MiB, (
            "sleep returned before the memory was free"
        )
        assert set(_kinds(oracle, kv)) == {unbacked_kind(kv.arena)}, (
            "something is still mapped while asleep"
        )
        kv.wake()
        assert _kinds(oracle, kv) == kinds
        # Within one 2 MiB granule: JAX's own allocator may take one for the small arrays
        # a wake makes (the next test's hundred cycles show nothing accumulates).
        assert abs(free0 - oracle.mem_free()) <= 2 * MiB
        for got, w in zip(_contents(kv), want):
            np.testing.assert_array_equal(got, w)
    finally:
        kv.close()


def test_a_hundred_cycles_leak_no_device_memory(oracle):
    kv = _kv(_gpu(), layers=1, tokens=16 * 1024)
    try:
        want = _contents(kv)
        kv.sleep()
        kv.wake()  # the first cycle pins the host staging memory
        free0 = oracle.mem_free()
        for _ in range(99):
            kv.sleep()
            kv.wake()
        # One-sided: a leak lowers free memory; other processes freeing can only raise it.
        assert oracle.mem_free() > free0 - 2 * MiB, "sleep/wake cycles leaked device memory"
        for got, w in zip(_contents(kv), want):
            np.testing.assert_array_equal(got, w)
    finally:
        kv.close()


@pytest.mark.parametrize("op,nth", [("create", 2), ("map", 1), ("copy_to_device", 2)])
def test_a_fault_in_the_middle_of_wake_leaves_it_asleep_and_intact(oracle, faults, op, nth):
    kv = _kv(_gpu(), layers=1, tokens=16 * 1024)
    try:
        want = _contents(kv)
        kv.sleep()
        free = oracle.mem_free()
        faults.arm(kv, op, nth)
        with pytest.raises(InjectedFault):
            kv.wake()
        faults.disarm(kv)
        assert kv.asleep and set(_kinds(oracle, kv)) == {unbacked_kind(kv.arena)}
        assert oracle.mem_free() > free - 2 * MiB, "the failed wake kept device memory"
        kv.wake()
        for got, w in zip(_contents(kv), want):
            np.testing.assert_array_equal(got, w)
    finally:
        kv.close()


# -- a captured step across sleep and wake ------------------------------------------------

B, HQ, HKV, D = 4, 8, 8, 128


def _step(max_tokens: int, dest):
    """One decode step: kv_write of this position's token (static dest), then attention
    over the written tokens; a tail of small ops so that XLA forms a command buffer. k, v,
    pos, acc are donated and returned: stable addresses from the second call on."""

    def step(k, v, pos, acc, x):
        val = x * (pos.astype(jnp.float32) + 1.0)[:, None, None]
        nk, nv = val.astype(jnp.bfloat16), (-val).astype(jnp.bfloat16)
        slots = jnp.arange(B, dtype=jnp.int32) * max_tokens + pos
        k, v = ops.kv_write(k, v, nk, nv, slots, dest=dest)
        q = jnp.ones((B, HQ, D), jnp.bfloat16)
        out = jax_vmm.decode_attention(q, k, v, pos + 1).astype(jnp.float32)
        aux = out
        for _ in range(3):
            aux = jnp.tanh(aux) * 1.5 + jnp.mean(aux, axis=(1, 2), keepdims=True)
        return k, v, pos + 1, acc + jnp.sum(out, axis=(1, 2)) + 0.0 * jnp.sum(aux, axis=(1, 2))

    return step


def _handler_calls() -> tuple[int, int]:
    return (
        ops.kv_write_stats()["kv_write"]["calls"],
        jax_vmm.ops.attention.attention_stats()["cuda_execute_calls"],
    )


def test_a_captured_step_replays_across_sleep_and_wake_without_handler_calls():
    dev = _gpu()
    tokens = 4096
    kv = jax_vmm.kv_arena(
        num_layers=1,
        num_kv_heads=HKV,
        head_dim=D,
        max_tokens=tokens,
        max_seqs=B,
        dtype=jnp.bfloat16,
        device=dev,
        zero_fill=True,
    )
    try:
        for q in range(B):
            kv.ensure(tokens, seq=q)
        x_host = (np.arange(B * HKV * D, dtype=np.float32).reshape(B, HKV, D) % 13 + 1) / 8
        x = jax.device_put(jnp.asarray(x_host), dev)
        pos = jax.device_put(jnp.full((B,), 10, jnp.int32), dev)
        acc = jax.device_put(jnp.zeros((B,), jnp.float32), dev)
        k, v = kv.k[0], kv.v[0]
        exe = (
            jax.jit(_step(tokens, kv.dest(0)), donate_argnums=(0, 1, 2, 3))
            .lower(k, v, pos, acc, x)
            .compile()
        )

        def run(n):
            nonlocal k, v, pos, acc
            for _ in range(n):
                k, v, pos, acc = exe(k, v, pos, acc, x)
            jax.block_until_ready((pos, acc))

        run(4)  # warm-up, record, settle
        c0 = _handler_calls()
        run(6)  # positions 14..19
        assert _handler_calls() == c0, "the step was re-recorded before any sleep"
        kv.sleep()
        run(2)  # positions 20, 21: replays over an empty page table
        assert kv.dropped_writes() == 2 * 2 * B, "writes while asleep must be dropped and counted"
        kv.arena._handle.reset_drop_count(kv.k_buffers[0].id)
        kv.arena._handle.reset_drop_count(kv.v_buffers[0].id)
        kv.wake()
        run(6)  # positions 22..27
        assert _handler_calls() == c0, "sleep or wake made XLA re-record the graph"
        kv.check()
        view = np.asarray(kv.k[0]).reshape(B, tokens, HKV, D)
        for p in list(range(14, 20)) + list(range(22, 28)):
            want = (x_host * np.float32(p + 1)).astype(jnp.bfloat16)
            np.testing.assert_array_equal(
                view[:, p].view(np.uint16), want.view(np.uint16), err_msg=f"position {p}"
            )
        # Positions written while asleep were dropped: they hold what sleep saved (zeros).
        assert not view[:, 20:22].astype(np.float32).any()
    finally:
        kv.close()
