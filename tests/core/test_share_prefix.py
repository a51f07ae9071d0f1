"""``kv.share_prefix(src, dst, n)``: dst starts with src's first n tokens, the chunks wholly
inside them mapped at both sequences' addresses (docs/sharing.md, "Shared prefixes").

Oracles that do not trust the arena: on the host ``/proc/self/maps`` (the same memfd range
mapped at both addresses) and the memfd's allocated blocks (physical memory held once, and
given back only at the last release); the arena's bytes read by address (``raw_bytes``).
The write protection is shown necessary with ``jax_vmm.testing.shared_writes_allowed()``.
"""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
import jax_vmm.testing
from conftest import BackgroundCall, hold_commit_ahead, raw_bytes, wait_until
from jax_vmm.base.fp8 import FP8_DTYPE
from jax_vmm.ops.attention import decode_attention_tuned
from jax_vmm.ops.general_attention import attention_tuned
from oracles import maps_oracle as mo

H, D = 2, 64  # float32: 512 bytes per token per buffer
LAYERS = 2


def _tokens_per_chunk(vm):
    return vm.chunk // (H * D * 4)


def _kv(vm, seqs=3, chunks_per_seq=4, **kw):
    """One allocation per chunk unless handle_bytes says otherwise (None: kv_arena's)."""
    tpc = _tokens_per_chunk(vm)
    kw.setdefault("handle_bytes", vm.chunk)
    if kw["handle_bytes"] is None:
        del kw["handle_bytes"]
    args = dict(
        num_layers=LAYERS,
        num_kv_heads=H,
        head_dim=D,
        max_tokens=chunks_per_seq * tpc,
        max_seqs=seqs,
        dtype=jnp.float32,
    )
    return vm.kv(**(args | kw)), tpc


def _tokens(kv, n, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((LAYERS, 2, n, H, D)).astype(np.float32)


def _write(kv, seq, start, data):
    """data[l, side] (n, H, D) written at positions [start, start + n) of sequence seq."""
    n = data.shape[2]
    cache = kv.cache()
    seqs = jnp.full((n,), seq, jnp.int32)
    pos = jnp.arange(start, start + n, dtype=jnp.int32)
    for layer in range(LAYERS):
        k, v = (jax.device_put(data[layer, s], kv.arena.device) for s in (0, 1))
        cache = cache.replace(layer, jax_vmm.kv_write(cache[layer], k, v, seq=seqs, pos=pos))
    jax.block_until_ready(cache)


def _seq_tokens(kv, seq):
    """[layer, side] tokens of sequence seq as the arena's memory holds them."""
    # raw_bytes reads whole buffers behind the arena's back: deferred releases finish
    # first (on a GPU the reclaimer swaps zero pieces in under released chunks meanwhile).
    kv.reclaim()
    out = []
    for layer in range(LAYERS):
        row = []
        for buf in (kv.k_buffers[layer], kv.v_buffers[layer]):
            raw = raw_bytes(buf).view(np.float32).reshape(kv.max_seqs, kv.max_tokens, H, D)
            row.append(raw[seq])
        out.append(row)
    return np.array(out)


def _memfd_places(start, stop, step):
    """(inode, file offset) of every `step` bytes of the addresses [start, stop)."""
    maps = [m for m in mo.read_maps() if m.is_memfd]
    out = []
    for addr in range(start, stop, step):
        m = next((m for m in maps if m.start <= addr < m.end), None)
        out.append(None if m is None else (m.inode, m.offset + addr - m.start))
    return out


def _shared(vm, n_chunks_frac=2.5, **kw):
    """An arena with sequence 0 holding n tokens (2.5 chunks) of known data, shared into
    sequence 1. Returns (kv, tpc, n, data)."""
    kv, tpc = _kv(vm, **kw)
    n = int(n_chunks_frac * tpc)
    data = _tokens(kv, n, seed=1)
    kv.ensure(n, 0)
    _write(kv, 0, 0, data)
    kv.check()
    got = kv.share_prefix(0, 1, n)
    return kv, tpc, n, data, got


# -- the mapping ---------------------------------------------------------------------------


def test_whole_chunks_are_one_memfd_range_at_both_addresses(host_vm):
    kv, tpc, n, data, got = _shared(host_vm)
    c = kv.arena.chunk_bytes
    buffers = 2 * LAYERS
    assert got == {"mapped_bytes": 2 * c * buffers, "copied_bytes": (n - 2 * tpc) * 512 * buffers}
    for buf in kv.buffers:
        src = _memfd_places(buf.address, buf.address + 3 * c, c)
        dst = _memfd_places(buf.address + kv.seq_bytes, buf.address + kv.seq_bytes + 3 * c, c)
        assert None not in src and None not in dst
        assert dst[:2] == src[:2], f"{buf.name}: the whole chunks are not the same memory"
        assert dst[2] != src[2], f"{buf.name}: the partial chunk must be dst's own memory"
    # Physical memory: src's 3 chunks plus dst's own partial one, per buffer (not 6).
    o = host_vm.oracle(kv.arena)
    assert o.probe.physical_bytes() == 4 * c * buffers
    s = kv.stats()
    assert s["held_bytes"] == 4 * c * buffers
    assert s["backed_bytes"] == 6 * c * buffers  # addresses: both sequences' chunks
    assert s["alias_bytes"] == s["shared_bytes"] == 2 * c * buffers
    assert s["sharing_seqs"] == [0, 1]
    assert s["shared_prefixes"] == [dict(src=0, dst=1, tokens=n, **got)]
    np.testing.assert_array_equal(_seq_tokens(kv, 1)[:, :, :n], data)


def test_one_allocation_of_several_chunks_is_copied_on_every_driver(vm):
    """kv_arena's default handle_bytes: src's 3 chunks are one allocation, which also backs
    a chunk past the prefix. CUDA maps an allocation only whole, so the prefix is copied;
    the host driver, which could map a memfd range by part, does the same (what is shared,
    and so what may sleep, move and be released by part, is the same on every driver)."""
    kv, tpc, n, data, got = _shared(vm, handle_bytes=None)
    assert kv.arena.handle_bytes > 3 * kv.arena.chunk_bytes
    buffers = 2 * LAYERS
    assert got == {"mapped_bytes": 0, "copied_bytes": n * 512 * buffers}
    np.testing.assert_array_equal(_seq_tokens(kv, 1)[:, :, :n], data)
    s = kv.stats()
    assert s["shared_bytes"] == s["alias_bytes"] == 0


def test_a_prefix_within_one_chunk_is_copied(vm):
    kv, tpc = _kv(vm)
    n = tpc // 2
    data = _tokens(kv, n, seed=2)
    kv.ensure(n, 0)
    _write(kv, 0, 0, data)
    assert kv.share_prefix(0, 2, n) == {"mapped_bytes": 0, "copied_bytes": n * 512 * 2 * LAYERS}
    np.testing.assert_array_equal(_seq_tokens(kv, 2)[:, :, :n], data)
    assert kv.stats()["shared_bytes"] == 0


# -- writes ----------------------------------------------------------------------------------


def _write_one(kv, seq, pos, value):
    x = np.full((LAYERS, 2, 1, H, D), value, np.float32)
    _write(kv, seq, pos, x)


@pytest.mark.parametrize("writer", [0, 1])
def test_writes_into_the_shared_prefix_are_dropped_and_counted(vm, writer):
    kv, tpc, n, data, _ = _shared(vm)
    for pos in (0, tpc + 3, n - 1):  # a shared chunk, the last shared token
        if writer == 0 and pos >= 2 * tpc:
            continue  # src's own tokens past its shared chunks stay writable
        _write_one(kv, writer, pos, 7.0)
        with pytest.raises(jax_vmm.OutOfBoundsWrite) as info:
            kv.check()
        assert info.value.count == 2 * LAYERS
    for seq in (0, 1):
        np.testing.assert_array_equal(_seq_tokens(kv, seq)[:, :, :n], data)


def test_kv_write_through_reports_the_shared_status(vm):
    kv, tpc, n, data, _ = _shared(vm)
    x = jnp.ones((2, H, D), jnp.float32)
    slots = jnp.array([kv.max_tokens + 1, kv.max_tokens + n], jnp.int32)  # seq 1: 1, n
    kv.ensure(n + 1, 1)
    status = jax_vmm.kv_write_through(kv.k[0], kv.v[0], x, x, slots, dest=kv.dest(0))
    np.testing.assert_array_equal(
        np.asarray(status), [[jax_vmm.ops.DROPPED_SHARED, jax_vmm.ops.WRITTEN]] * 2
    )
    with pytest.raises(jax_vmm.OutOfBoundsWrite):
        kv.check()
    np.testing.assert_array_equal(_seq_tokens(kv, 0)[:, :, :n], data)


def test_writes_past_the_prefix_land_in_dst_only(vm):
    kv, tpc, n, data, _ = _shared(vm)
    kv.ensure(n + 2, 0)
    kv.ensure(n + 2, 1)
    _write_one(kv, 1, n, 5.0)
    _write_one(kv, 0, n + 1, 6.0)
    kv.check()
    dst, src = _seq_tokens(kv, 1), _seq_tokens(kv, 0)
    assert np.all(dst[:, :, n] == 5.0) and not np.any(src[:, :, n] == 5.0)
    assert np.all(src[:, :, n + 1] == 6.0) and not np.any(dst[:, :, n + 1] == 6.0)
    np.testing.assert_array_equal(dst[:, :, :n], data)


def test_without_the_floor_a_write_into_dst_lands_in_src(vm):
    """The switch for the tests above: without the published floor the same write is not
    dropped and changes src's tokens."""
    kv, tpc = _kv(vm)
    n = int(2.5 * tpc)
    data = _tokens(kv, n, seed=1)
    kv.ensure(n, 0)
    _write(kv, 0, 0, data)
    with jax_vmm.testing.shared_writes_allowed():
        kv.share_prefix(0, 1, n)
    _write_one(kv, 1, 0, 7.0)
    kv.check()
    assert np.all(_seq_tokens(kv, 0)[:, :, 0] == 7.0)


# -- release orders ----------------------------------------------------------------------


@pytest.mark.parametrize("first", [0, 1])
def test_a_release_keeps_the_memory_for_the_other_sharer(host_vm, first):
    kv, tpc, n, data, _ = _shared(host_vm)
    c, buffers = kv.arena.chunk_bytes, 2 * LAYERS
    o = host_vm.oracle(kv.arena)
    other = 1 - first
    kv.release(first, wait=True)
    np.testing.assert_array_equal(_seq_tokens(kv, other)[:, :, :n], data)
    # Still held: the shared chunks and the other's own partial chunk (3 per buffer).
    assert o.probe.physical_bytes() == 3 * c * buffers == kv.stats()["held_bytes"]
    assert kv.stats()["shared_bytes"] == 0
    # The released slot starts again in new memory: its writes never reach the other.
    kv.ensure(n, first)
    _write(kv, first, 0, _tokens(kv, n, seed=9))
    kv.check()
    np.testing.assert_array_equal(_seq_tokens(kv, other)[:, :, :n], data)
    kv.release(first, wait=True)
    kv.release(other, wait=True)
    assert o.probe.physical_bytes() == 0 == kv.stats()["held_bytes"]
    o.assert_released()


def test_the_memory_goes_back_only_at_the_last_of_three_sharers(host_vm):
    kv, tpc, n, data, _ = _shared(host_vm)
    kv.share_prefix(0, 2, n)
    o = host_vm.oracle(kv.arena)
    c, buffers = kv.arena.chunk_bytes, 2 * LAYERS
    assert o.probe.physical_bytes() == 5 * c * buffers  # 3 + two own partial chunks
    assert kv.stats()["alias_bytes"] == 4 * c * buffers
    kv.release(0, wait=True)
    kv.release(2, wait=True)
    np.testing.assert_array_equal(_seq_tokens(kv, 1)[:, :, :n], data)
    assert o.probe.physical_bytes() == 3 * c * buffers
    kv.release(1, wait=True)
    o.assert_released()


# -- attention over a shared prefix --------------------------------------------------------


def test_attention_over_a_shared_prefix_equals_a_private_copy(vm):
    kv, tpc, n, data, _ = _shared(vm)
    kv.ensure(n, 2)
    _write(kv, 2, 0, data)  # the private copy
    extra = _tokens(kv, 3, seed=4)
    for seq in (1, 2):
        kv.ensure(n + 3, seq)
        _write(kv, seq, n, extra)
    kv.check()
    lengths = jnp.array([0, n + 3, n + 3], jnp.int32)
    q = jax.device_put(
        np.random.default_rng(5).standard_normal((3, H, D)).astype(np.float32), kv.arena.device
    )
    q = q.at[1].set(q[2])
    cache = kv.cache()
    for layer in range(LAYERS):
        out = np.asarray(jax_vmm.decode_attention(q, cache[layer], lengths))
        np.testing.assert_array_equal(out[1], out[2])
        q4 = jnp.broadcast_to(q[:, None], (3, 2, H, D))
        out4 = np.asarray(jax_vmm.attention(q4, cache[layer], lengths))
        np.testing.assert_array_equal(out4[1], out4[2])
    kv.check(out, out4)


@pytest.mark.parametrize(
    "dtype, impl",
    [(jnp.bfloat16, "auto"), (jnp.bfloat16, "tensor_core"), (jnp.bfloat16, "stream"),
     (FP8_DTYPE, "auto")],
    ids=["bf16-auto", "bf16-tensor_core", "bf16-stream", "fp8-auto"],
)  # fmt: skip
def test_every_kernel_reads_a_shared_prefix_as_a_private_copy(vm, dtype, impl):
    """Decode (the kernel ``impl`` names; "auto": what the routing picks, cuDNN on a GPU
    built with it) and two query rows with a window (split-K; an fp8 layer through its
    copy) give the same result for a sequence that shares a prefix of 2.5 chunks and one
    that holds a private copy of it."""
    Hq = 2 * H
    tpc = vm.chunk // (H * D * np.dtype(dtype).itemsize)
    kv = vm.kv(
        num_layers=1, num_kv_heads=H, head_dim=D, max_tokens=4 * tpc, max_seqs=3, dtype=dtype,
        handle_bytes=vm.chunk,
    )  # fmt: skip
    n = int(2.5 * tpc)
    rng = np.random.default_rng(7)
    data = jnp.asarray(rng.standard_normal((2, n + 3, H, D)), jnp.bfloat16)

    def write(seq, start, stop):
        put = lambda x: jax.device_put(x, kv.arena.device)  # noqa: E731
        pos = jnp.arange(start, stop, dtype=jnp.int32)
        layer = jax_vmm.kv_write(
            kv.cache()[0], put(data[0, start:stop]), put(data[1, start:stop]),
            seq=jnp.full(pos.shape, seq, jnp.int32), pos=pos,
        )  # fmt: skip
        jax.block_until_ready(layer)

    kv.ensure(n, 0)
    write(0, 0, n)
    kv.share_prefix(0, 1, n)
    kv.ensure(n, 2)
    write(2, 0, n)  # the private copy
    for seq in (1, 2):
        kv.ensure(n + 3, seq)
        write(seq, n, n + 3)
    kv.check()
    q = jnp.asarray(rng.standard_normal((3, Hq, D)), jnp.bfloat16)
    q = jax.device_put(q.at[1].set(q[2]), kv.arena.device)
    lengths = jnp.array([0, n + 3, n + 3], jnp.int32)
    layer = kv.cache()[0]
    if impl == "auto":
        out = jax_vmm.decode_attention(q, layer, lengths)
    else:
        out = decode_attention_tuned(q, layer, lengths, impl=impl)
    rows = attention_tuned(
        jnp.stack([q, q], axis=1), layer, lengths, window=5,
        impl=impl if impl != "stream" else "auto",
    )  # fmt: skip
    kv.check(out, rows)
    out, rows = (np.asarray(x.astype(jnp.float32)) for x in (out, rows))
    assert np.abs(out[1]).max() > 0
    # Within rounding, not bit for bit: the streaming kernel shares all sequences' tiles
    # out over its CTAs, so two sequences with the same tokens may be summed in another
    # order. A wrong mapping differs by the values themselves.
    np.testing.assert_allclose(out[1], out[2], rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(rows[1], rows[2], rtol=1e-2, atol=1e-2)


# -- refusals (nothing changes) ------------------------------------------------------------


def _state(kv):
    """What a refused call must leave as it was. Its raw read of the buffers must not race
    a release still being reclaimed: on a GPU arena that defers its zeros, an unmapped
    alias leaves no mapping to read."""
    kv.reclaim()  # releases deferred for the device (GPU) end first: held_bytes is exact
    s = kv.stats()
    return (
        s["backed_bytes"],
        s["held_bytes"],
        kv._core_cache.limits(),
        kv._core_cache.floors(),
        s["shared_prefixes"],
        [raw_bytes(b).tobytes() for b in kv.buffers],
    )


def test_a_share_right_after_a_release_waits_for_the_background_commit(vm):
    """release(dst) then share_prefix(src, dst) while a commit ahead of dst's previous
    sequence is on its way: overtaken by the release, it commits its first buffer's chunk
    anyway (void) and is held there (up to 1 s). The share waits for it to give that
    back instead of refusing dst as "holds memory" (without the wait this test sees that
    refusal)."""
    tpc = _tokens_per_chunk(vm)
    kv, _ = _kv(vm, commit_ahead_tokens=tpc // 4)
    n = 2 * tpc + 1
    data = _tokens(kv, n, seed=3)
    kv.ensure(n, 0)
    _write(kv, 0, 0, data)
    kv.ensure(tpc // 2, 1)
    assert kv._ahead.wait_idle()
    released = threading.Event()
    # Near the end of chunk 0: chunk 1 is committed ahead.
    held = hold_commit_ahead(kv, lambda: kv.ensure(tpc - tpc // 8, 1), 1.0, after=released)
    try:
        kv.release(1)
        released.set()
        assert held.inside.wait(30)
        got = kv.share_prefix(0, 1, n)
    finally:
        released.set()
        held.go.set()
        assert kv._ahead.wait_idle()
    assert got["mapped_bytes"] == 2 * 2 * LAYERS * vm.chunk  # chunks 0 and 1 of K and V
    np.testing.assert_array_equal(_seq_tokens(kv, 1)[:, :, :n], data)
    kv.check()


def test_refusals_change_nothing(vm):
    kv, tpc = _kv(vm, seqs=4)
    n = int(2.5 * tpc)
    kv.ensure(n, 0)
    _write(kv, 0, 0, _tokens(kv, n, seed=1))
    kv.ensure(3, 2)
    before = _state(kv)
    cases = [
        ((0, 2, n), "holds memory"),  # dst holds tokens
        ((0, 1, n + 1), "tokens ensured"),  # more than src ensured
        ((0, 0, n), "both 0"),
        ((0, 1, 0), "num_tokens must be > 0"),
        ((0, 4, n), "out of range"),
        ((-1, 1, n), "seq"),
        ((0, 1, kv.max_tokens + 1), "exceeds max_tokens"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            kv.share_prefix(*args)
        assert _state(kv) == before, args
    with pytest.raises(TypeError):
        kv.share_prefix(0, 1)  # the forgotten argument


def test_a_share_the_budget_refuses_leaves_the_source_as_it_was(vm):
    """A share that mapped src's whole chunks at dst, then found no room in the budget for
    dst's own partial chunk, changes nothing: src offloads, sleeps and wakes with its
    tokens, and shares again. (The core kept src marked shared after such a refusal, and
    refused its offload and sleep: "memory mapped at several addresses".)"""
    tpc = _tokens_per_chunk(vm)
    held = 4 * 2 * LAYERS * vm.chunk  # src's 4 chunks in every buffer: the whole budget
    budget = jax_vmm.MemoryBudget(held, vm.device)
    kv, _ = _kv(vm, budget=budget)
    n = 3 * tpc + tpc // 4
    data = _tokens(kv, n, seed=3)
    kv.ensure(n, 0)
    _write(kv, 0, 0, data)
    before = _state(kv)
    with pytest.raises(jax_vmm.OutOfMemoryError, match="budget"):
        kv.share_prefix(0, 1, 2 * tpc + tpc // 2)  # maps 2 chunks, then needs a third
    kv.offload(0)  # at once: it reclaims the undone share's addresses first
    kv.restore(0).wait()
    assert _state(kv) == before
    assert budget.stats()["used_bytes"] == held
    kv.sleep()
    kv.wake()
    np.testing.assert_array_equal(_seq_tokens(kv, 0)[:, :, :n], data)
    assert kv.share_prefix(0, 1, 3 * tpc)["mapped_bytes"] == 3 * 2 * LAYERS * vm.chunk
    np.testing.assert_array_equal(_seq_tokens(kv, 1)[:, :, : 3 * tpc], data[:, :, : 3 * tpc])
    kv.release(1, wait=True)
    kv.release(0, wait=True)
    assert budget.stats()["used_bytes"] == 0


def _offload_then_free_the_device(kv, faults, device_held: contextlib.ExitStack, seq: int):
    """kv.offload(seq) while ``device_held`` (holding ``faults.hold_device(kv)``) keeps the
    arena's device busy; it is closed once the offload waits for the device, so addresses
    released before stay unreclaimed until the offload reclaims them itself."""
    syncs = faults.device_syncs(kv)
    offloading = BackgroundCall(lambda: kv.offload(seq))
    try:
        waiting = lambda: faults.device_syncs(kv) > syncs or offloading.done  # noqa: E731
        wait_until(waiting, "the offload's device wait")
    finally:
        device_held.close()
    offloading.join()


def test_a_source_is_not_refused_for_addresses_still_to_be_reclaimed(host_vm, faults):
    """A released sharer's addresses are unmapped by the reclaimer after a device wait;
    until then the core counts the source's chunks as mapped twice and refuses to move
    them. The source's floor drops at the release, and its offload, sleep and shrink
    reclaim those addresses first instead of refusing ("mapped at several addresses").
    The host defers its releases here as CUDA does (faults.defer_reclaim), with the device
    held busy until the offload waits for it: the reclaim is still to come when offload is
    called, whatever the timing."""
    tpc = _tokens_per_chunk(host_vm)
    kv, _ = _kv(host_vm)
    faults.defer_reclaim(kv)
    n = 3 * tpc + tpc // 4
    data = _tokens(kv, n, seed=3)
    kv.ensure(n, 0)
    _write(kv, 0, 0, data)
    kv.share_prefix(0, 1, 2 * tpc)
    with contextlib.ExitStack() as device_held:
        device_held.enter_context(faults.hold_device(kv))
        s0 = kv.arena.stats()
        kv.release(1)
        s1 = kv.arena.stats()
        assert s1["deferred_releases"] > s0["deferred_releases"]  # left to the reclaimer,
        assert s1["reclaim_syncs"] == s0["reclaim_syncs"]  # which waits for the device
        assert kv.stats()["sharing_seqs"] == []
        # Still unreclaimed as offload begins (else this would pass without its reclaim).
        assert kv.arena.stats()["reclaim_syncs"] == s0["reclaim_syncs"]
        _offload_then_free_the_device(kv, faults, device_held, 0)
    kv.restore(0).wait()
    kv.sleep()
    kv.wake()
    kv.shrink(tpc)
    np.testing.assert_array_equal(_seq_tokens(kv, 0)[:, :, :tpc], data[:, :, :tpc])


def test_a_refused_share_leaves_no_addresses_that_block_the_source(host_vm, faults, monkeypatch):
    """A share the budget refuses after mapping src's whole chunks at dst gives those
    addresses back without waiting for the device (the reclaimer unmaps them). src's
    offload right after the refusal reclaims them first instead of being refused ("mapped
    at several addresses"). The device is held from the moment the share is undone (a
    wrapper of the undo, here in the test), so the reclaim is still to come when offload
    is called, whatever the timing: the host defers its releases as CUDA does."""
    tpc = _tokens_per_chunk(host_vm)
    held = 4 * 2 * LAYERS * host_vm.chunk  # src's 4 chunks in every buffer: the whole budget
    budget = jax_vmm.MemoryBudget(held, host_vm.device)
    kv, _ = _kv(host_vm, budget=budget)
    faults.defer_reclaim(kv)
    n = 3 * tpc + tpc // 4
    data = _tokens(kv, n, seed=6)
    kv.ensure(n, 0)
    _write(kv, 0, 0, data)
    undos = []
    undo = type(kv)._undo_share
    device_held = contextlib.ExitStack()

    def undo_with_the_device_busy(self, dst):
        undos.append(dst)
        device_held.enter_context(faults.hold_device(kv))
        undo(self, dst)

    monkeypatch.setattr(type(kv), "_undo_share", undo_with_the_device_busy)
    s0 = kv.arena.stats()
    with device_held:
        with pytest.raises(jax_vmm.OutOfMemoryError, match="budget"):
            kv.share_prefix(0, 1, 2 * tpc + tpc // 2)  # maps 2 chunks, then needs a third
        assert undos == [1]  # the share was undone after mapping
        s1 = kv.arena.stats()
        assert s1["deferred_releases"] > s0["deferred_releases"]  # left to the reclaimer
        # Still unreclaimed as offload begins (else this would pass without its reclaim).
        assert s1["reclaim_syncs"] == s0["reclaim_syncs"]
        _offload_then_free_the_device(kv, faults, device_held, 0)
    kv.restore(0).wait()
    assert budget.stats()["used_bytes"] == held
    np.testing.assert_array_equal(_seq_tokens(kv, 0)[:, :, :n], data)


def test_a_source_whose_sharers_were_released_is_its_own_again(vm):
    """Once every sequence that maps src's chunks is released, src is refused nothing a
    sequence that never shared is allowed: writes into its first tokens (at once, before
    any call that reclaims the sharers' addresses), offload and restore, sleep and wake.
    A sharer of a sharer keeps src's floor: it maps src's chunks through the sequence it
    shared from, even after that one is released."""
    kv, tpc = _kv(vm)
    n = 2 * tpc + tpc // 2
    data = _tokens(kv, n, seed=4)
    kv.ensure(n, 0)
    _write(kv, 0, 0, data)
    kv.share_prefix(0, 1, n)
    kv.ensure(n + tpc, 1)
    kv.share_prefix(1, 2, n + tpc)
    kv.release(1)
    with pytest.raises(ValueError, match="shares its first"):
        kv.offload(0)  # sequence 2 still maps 0's first two chunks
    assert kv.stats()["sharing_seqs"] == [0, 2]
    kv.release(2)
    assert kv.stats()["sharing_seqs"] == []
    _write_then_move(kv, 0, data, seed=5)  # its first tokens are writable again, at once
    assert kv.stats()["sharing_seqs"] == []
    np.testing.assert_array_equal(_seq_tokens(kv, 0)[:, :, :n], data)


def _write_then_move(kv, seq, data, seed):
    """Writes 4 new tokens at the start of seq (raising if they were dropped as writes
    into a shared prefix), records them in data, then offloads and restores seq and
    sleeps and wakes the arena: what a sequence that shares nothing may do."""
    again = _tokens(kv, 4, seed=seed)
    _write(kv, seq, 0, again)
    kv.check()
    data[:, :, :4] = again
    kv.offload(seq)
    kv.restore(seq).wait()
    kv.sleep()
    kv.wake()


def test_a_destination_whose_source_was_released_is_its_own_again(vm):
    """Once its source is released and no other address maps its chunks, a share's
    destination is refused nothing a sequence that never shared is allowed: a write into
    its prefix lands, offload and restore, sleep and wake, release with keep_tokens. (It
    stayed read-only, refused them all and named a sharer that was gone.)"""
    kv, tpc, n, data, got = _shared(vm)
    assert got["mapped_bytes"] > 0
    kv.release(0)
    kv.reclaim()  # on a GPU the release of 0's addresses waits for the device until here
    assert kv.stats()["sharing_seqs"] == [] and kv.stats()["shared_prefixes"] == []
    _write_then_move(kv, 1, data, seed=31)
    np.testing.assert_array_equal(_seq_tokens(kv, 1)[:, :, :n], data)
    kv.release(1, keep_tokens=4)
    np.testing.assert_array_equal(_seq_tokens(kv, 1)[:, :, :4], data[:, :, :4])


def _copy_only_share(vm, seed: int, ensure: str):
    """Sequence 0 with half a chunk of written tokens (committed by ``kv.<ensure>``),
    shared into sequence 1: all copied, nothing mapped. Returns kv, n, the tokens."""
    kv, tpc = _kv(vm)
    n = tpc // 2
    getattr(kv, ensure)(n, 0)
    data = _tokens(kv, n, seed=seed)
    _write(kv, 0, 0, data)
    assert kv.share_prefix(0, 1, n)["mapped_bytes"] == 0
    return kv, n, data


def test_a_copied_prefix_is_writable_once_its_source_is_released(vm):
    """A share that copied everything (a prefix within one chunk) maps nothing: once its
    source is released the destination's prefix is writable and it may move (it stayed
    read-only, and refused to, for as long as it lived). stats() of the closed arena
    with a share in place still works, and lists no share (the memory went with it)."""
    kv, n, data = _copy_only_share(vm, seed=33, ensure="ensure")
    _write_one(kv, 1, 0, 7.0)
    with pytest.raises(jax_vmm.OutOfBoundsWrite):
        kv.check()  # read-only while the source lives
    kv.release(0)
    assert kv.stats()["sharing_seqs"] == []
    _write_one(kv, 1, 0, 7.0)
    kv.check()
    kv.offload(1)
    kv.restore(1).wait()
    got = _seq_tokens(kv, 1)
    assert np.all(got[:, :, 0] == 7.0)
    np.testing.assert_array_equal(got[:, :, 1:n], data[:, :, 1:])
    kv.ensure(n, 0)
    kv.share_prefix(1, 2, n)
    assert kv.stats()["sharing_seqs"] == [2]  # a copy raises no floor on its source
    kv.close()
    assert (kv.stats()["sharing_seqs"], kv.stats()["shared_prefixes"]) == ([], [])


class _NothingSharedSaysTheCore:
    """The arena's core, but for shared_bytes, which says no chunk is mapped elsewhere."""

    def __init__(self, core):
        self._core = core

    def shared_bytes(self, ranges):
        return 0

    def __getattr__(self, name):
        return getattr(self._core, name)


def test_destinations_of_a_released_source_stay_read_only_while_two_map_it(vm, monkeypatch):
    """Two destinations of one source, the source released: they still map the same
    memory, so both keep their prefixes read-only and refuse to move. Without the core's
    word that the other maps the chunks, a write into one lands in the other's tokens."""
    kv, tpc, n, data, _ = _shared(vm)
    kv.share_prefix(0, 2, n)
    kv.release(0)
    assert kv.stats()["sharing_seqs"] == [1, 2]
    with pytest.raises(ValueError, match="shares its first"):
        kv.offload(1)
    _write_one(kv, 1, 0, 7.0)
    with pytest.raises(jax_vmm.OutOfBoundsWrite):
        kv.check()
    np.testing.assert_array_equal(_seq_tokens(kv, 2)[:, :, :n], data)
    monkeypatch.setattr(kv.arena, "_handle", _NothingSharedSaysTheCore(kv.arena._handle))
    assert kv.stats()["sharing_seqs"] == []  # both taken for lone: the floors drop
    _write_one(kv, 1, 0, 7.0)
    kv.check()
    assert np.all(_seq_tokens(kv, 2)[:, :, 0] == 7.0)


def test_sequences_at_different_chunk_offsets_are_refused(vm):
    tpc = _tokens_per_chunk(vm)
    kv, _ = _kv(vm, chunks_per_seq=1, max_tokens=tpc + tpc // 2)  # 1.5 chunks per sequence
    kv.ensure(tpc, 0)
    with pytest.raises(ValueError, match="different offsets within a chunk"):
        kv.share_prefix(0, 1, tpc)
    assert kv.stats()["backed_tokens"][1] == 0


def test_what_would_move_or_write_shared_memory_is_refused(vm):
    kv, tpc, n, data, _ = _shared(vm)
    before = _state(kv)
    with pytest.raises(ValueError, match="shrink to at least"):
        kv.shrink(tpc)
    with pytest.raises(ValueError, match="without keep_tokens"):
        kv.release(1, keep_tokens=4)
    with pytest.raises(ValueError, match="cannot move to the host"):
        kv.offload(0)
    with pytest.raises(ValueError, match="release them first"):
        kv.sleep()
    with pytest.raises(ValueError, match="several addresses"):
        kv.arena.sleep()
    assert _state(kv) == before
    assert not kv.asleep
    kv.shrink(n)  # at the floor: allowed
    np.testing.assert_array_equal(_seq_tokens(kv, 1)[:, :, :n], data)


def test_a_single_sequence_arena_and_an_offloaded_dst_are_refused(vm):
    kv1 = vm.kv(num_layers=1, num_kv_heads=H, head_dim=D, max_tokens=64, dtype=jnp.float32)
    with pytest.raises(ValueError, match="max_seqs=None"):
        kv1.share_prefix(0, 1, 4)
    kv, tpc = _kv(vm)
    kv.ensure(tpc, 0)
    kv.ensure(4, 1)
    kv.offload(1)
    with pytest.raises(ValueError, match="offload"):
        kv.share_prefix(0, 1, tpc)


def test_ensure_shareable_lets_a_default_arena_share_its_whole_chunks(vm):
    # kv_arena's default handle_bytes (1 GiB): a plain ensure puts the prompt's whole
    # chunks and its partial last chunk in one allocation, which CUDA cannot map by part.
    kv, tpc = _kv(vm, handle_bytes=None)
    n = int(2.5 * tpc)
    created = kv.stats()["handles_created"]
    kv.ensure_shareable(n, 0)
    assert kv.stats()["handles_created"] - created == 2 * 2 * LAYERS  # whole | partial
    data = _tokens(kv, n, seed=6)
    _write(kv, 0, 0, data)
    got = kv.share_prefix(0, 1, n)
    assert got["mapped_bytes"] == 2 * kv.arena.chunk_bytes * 2 * LAYERS
    np.testing.assert_array_equal(_seq_tokens(kv, 1)[:, :, :n], data)
    assert kv.ensure_shareable(n, 0) == 0  # backed already: a plain ensure


@pytest.mark.gpu
def test_the_gpu_gives_no_memory_for_the_mapped_chunks(gpu_device):
    """cuMemGetInfo (the arena's device_free_bytes) as the oracle: sharing takes only the
    copied chunks' memory, and the shared memory goes back with the last sharer."""
    chunk = 2 << 20
    tpc = chunk // (H * D * 2)  # bfloat16
    kv = jax_vmm.kv_arena(
        num_layers=LAYERS,
        num_kv_heads=H,
        head_dim=D,
        max_tokens=64 * tpc,
        max_seqs=2,
        dtype=jnp.bfloat16,
        device=gpu_device,
        chunk_bytes=chunk,
        commit_ahead_tokens=0,
    )
    try:
        n = 48 * tpc + tpc // 2  # 48 whole chunks per buffer, one partial
        kv.ensure_shareable(n, 0)
        kv.reclaim()
        free0 = kv.stats()["device_free_bytes"]
        got = kv.share_prefix(0, 1, n)
        free1 = kv.stats()["device_free_bytes"]
        assert got["mapped_bytes"] == 48 * chunk * 2 * LAYERS
        # One own chunk per buffer for dst (the partial one), not 49.
        assert free0 - free1 < 4 * chunk * 2 * LAYERS, (free0, free1)
        kv.release(0, wait=True)  # dst keeps the 48 shared chunks per buffer
        assert kv.stats()["device_free_bytes"] - free1 < 4 * chunk * 2 * LAYERS
        kv.release(1, wait=True)
        assert kv.stats()["device_free_bytes"] - free0 >= 40 * chunk * 2 * LAYERS
    finally:
        kv.close()


def test_a_sharer_shares_on_and_a_whole_sequence_is_all_mapped(vm):
    kv, tpc, n, data, _ = _shared(vm)
    got = kv.share_prefix(1, 2, n)  # from the second address: the same memory again
    assert got["mapped_bytes"] == 2 * kv.arena.chunk_bytes * 2 * LAYERS
    kv.release(0)
    kv.release(1)
    np.testing.assert_array_equal(_seq_tokens(kv, 2)[:, :, :n], data)
    kv.release(2)
    full = _tokens(kv, kv.max_tokens, seed=8)
    kv.ensure(kv.max_tokens, 0)
    _write(kv, 0, 0, full)
    assert kv.share_prefix(0, 1, kv.max_tokens)["copied_bytes"] == 0
    np.testing.assert_array_equal(_seq_tokens(kv, 1), full)
    kv.release(0)
    kv.release(1, wait=True)
    assert kv.stats()["held_bytes"] == 0


def test_writes_still_in_flight_land_before_the_prefix_turns_read_only(vm):
    kv, tpc = _kv(vm)
    n = int(2.5 * tpc)
    data = _tokens(kv, n, seed=7)
    kv.ensure(n, 0)
    step = jax.jit(
        lambda c, k, v: c.replace(
            0, jax_vmm.kv_write(c[0], k, v, seq=jnp.zeros(n, jnp.int32), pos=jnp.arange(n))
        )
    )
    cache = step(kv.cache(), data[0, 0], data[0, 1])  # dispatched, not waited for
    kv.share_prefix(0, 1, n)
    kv.check(cache)  # nothing dropped: the write ran before src became read-only
    np.testing.assert_array_equal(_seq_tokens(kv, 1)[0, :, :n], data[0])


def test_the_tables_the_kernels_read_stay_apart(host_vm):
    """The KV cache's metadata holds the writers' table, the readers' copy of it (CUDA
    changes that one in dispatch order) and the floors: through ensure, ensure_all,
    share_prefix, shrink and release each holds what the host mirror says, none written
    over by its neighbour (5 sequences: tables padded to 8 bytes)."""
    kv, tpc = _kv(host_vm, seqs=5, chunks_per_seq=2)
    tables = jax_vmm.testing.extension().kv_cache_tables

    def check(floors: list[int]) -> None:
        limits, read_limits, got_floors = tables(kv._core_cache)
        assert limits == read_limits == list(kv._core_cache.limits())
        assert got_floors == floors

    kv.ensure(tpc + 3, seq=0)
    check([0] * 5)
    _write(kv, 0, 0, _tokens(kv, tpc + 3, seed=1))
    kv.ensure_all([0, 7, 0, 0, 2 * tpc])
    check([0] * 5)
    kv.share_prefix(0, 2, tpc + 3)
    check([tpc, 0, tpc + 3, 0, 0])
    kv.shrink(2 * tpc - 1)  # every sequence: only sequence 4 holds more
    check([tpc, 0, tpc + 3, 0, 0])
    kv.release(1)
    kv.release(2)
    check([0, 0, 0, 0, 0])  # the last sharer gone, its source's floor drops at once
    assert list(kv._core_cache.limits()) == [tpc + 3, 0, 0, 0, 2 * tpc - 1]


@pytest.mark.parametrize("held_before", ["ensured", "kept", "prefetched"])
def test_a_refused_ensure_shareable_gives_back_only_what_it_committed(vm, held_before):
    """ensure_shareable that the budget refuses after committing the prefix's whole chunks
    changes nothing: the chunks the sequence held before (tokens ensured, a chunk kept by
    release(keep_tokens=), a prefetched one) stay backed and counted, and its next ensure
    and writes land. (It gave back either nothing, keeping the new chunks, or everything,
    leaving a chunk the arena still counted as backed unmapped.)"""
    tpc = _tokens_per_chunk(vm)
    budget = jax_vmm.MemoryBudget(3 * 2 * LAYERS * vm.chunk, vm.device)
    kv, _ = _kv(vm, seqs=4, budget=budget, commit_ahead_tokens=0)
    if held_before == "ensured":
        kv.ensure(10, 1)
    elif held_before == "kept":
        kv.ensure(tpc - 3, 1)
        kv.release(1, keep_tokens=tpc - 3)
    else:
        kv.prefetch(tpc - 3, 1)
        kv.wait_prefetch(1)
    kv.ensure(tpc, 0)  # 2 of the 3 chunks per buffer now held
    before = _state(kv), budget.stats()["used_bytes"], kv.is_backed(tpc - 3, 1)
    assert before[2]
    with pytest.raises(jax_vmm.OutOfMemoryError, match="budget"):
        kv.ensure_shareable(2 * tpc + tpc // 2, 1)  # its 2nd whole chunk fits, the rest not
    assert (_state(kv), budget.stats()["used_bytes"], kv.is_backed(tpc - 3, 1)) == before
    data = _tokens(kv, tpc - 3, seed=21)
    kv.ensure(tpc - 3, 1)
    _write(kv, 1, 0, data)
    kv.check()  # nothing dropped: the chunk is there
    np.testing.assert_array_equal(_seq_tokens(kv, 1)[:, :, : tpc - 3], data)


def test_a_share_that_maps_nothing_leaves_the_source_writable_after_the_others(vm):
    """A copy-only share (its prefix inside src's first chunk) does not read src's memory:
    once the share that maps src's chunks is released, src's floor drops, its writes land
    and it offloads, though the copy-only sharer is still in place."""
    kv, tpc = _kv(vm, seqs=3)
    n = 2 * tpc + tpc // 2
    kv.ensure_shareable(n, 0)
    _write(kv, 0, 0, _tokens(kv, n, seed=23))
    assert kv.share_prefix(0, 1, n)["mapped_bytes"] > 0
    assert kv.share_prefix(0, 2, tpc // 2)["mapped_bytes"] == 0
    kv.release(1)
    assert kv.stats()["sharing_seqs"] == [2]  # dst 2's own prefix stays read-only
    late = _tokens(kv, 1, seed=24)
    _write(kv, 0, tpc + 1, late)
    kv.check()  # landed, not dropped
    np.testing.assert_array_equal(_seq_tokens(kv, 0)[:, :, tpc + 1 : tpc + 2], late)
    kv.offload(0)
    kv.restore(0).wait()


def test_a_share_of_an_unshareable_allocation_says_so(vm, caplog):
    """Whole chunks of a prompt committed by a plain ensure (one allocation past the
    prefix) are copied, not mapped; the share says why and what to call instead."""
    kv, tpc = _kv(vm, handle_bytes=None)
    n = int(2.5 * tpc)
    kv.ensure(n, 0)
    _write(kv, 0, 0, _tokens(kv, n, seed=25))
    with caplog.at_level("WARNING", logger="jax_vmm"):
        got = kv.share_prefix(0, 1, n)
    assert got["mapped_bytes"] == 0
    assert "kv.ensure_shareable(n, seq)" in caplog.text
    whole = 2 * 2 * LAYERS * kv.arena.chunk_bytes  # 2 whole chunks of each buffer
    assert f"{whole} bytes of whole chunks were copied" in caplog.text, caplog.text
    caplog.clear()
    kv.release(1, wait=True)
    kv.release(0, wait=True)
    kv.ensure_shareable(n, 0)
    with caplog.at_level("WARNING", logger="jax_vmm"):
        assert kv.share_prefix(0, 1, n)["mapped_bytes"] > 0
    assert "ensure_shareable" not in caplog.text


# -- review cases --------------------------------------------------------------------------


@pytest.mark.parametrize("as_scalar", [int, np.int64, jnp.int32])
def test_a_sharer_released_with_keep_tokens_is_refused_for_every_integer(vm, as_scalar):
    """keep_tokens on a sharer would let the slot's next sequence write the shared chunks.
    A JAX scalar got past the check (it looked only at Python and NumPy ints), and the
    next writes landed in the source's read-only prefix."""
    kv, tpc, n, data, _ = _shared(vm)
    with pytest.raises(ValueError, match="its kept chunks would be written"):
        kv.release(as_scalar(1), keep_tokens=tpc)
    np.testing.assert_array_equal(_seq_tokens(kv, 0)[:, :, :n], data)
    assert kv.stats()["sharing_seqs"] == [0, 1]


def test_a_released_source_is_no_longer_named_in_the_stats(vm):
    """After the source's release its slot may take an unrelated request: the shares made
    from it show no source (the memory lives on in the sharers)."""
    kv, tpc, n, _, _ = _shared(vm)
    kv.share_prefix(1, 2, n)
    kv.release(0)
    kv.ensure(tpc // 2, 0)  # another request in slot 0
    assert [(r["src"], r["dst"]) for r in kv.stats()["shared_prefixes"]] == [(None, 1), (1, 2)]


def test_ensure_shareable_of_tokens_backed_ahead_says_why_they_will_be_copied(vm, caplog):
    """A prefetch backs the prefix as part of a larger allocation; ensure_shareable then
    cannot make it an allocation of its own, and share_prefix copies it. That was silent
    (share_prefix's warning advised the call just made)."""
    kv, tpc = _kv(vm, handle_bytes=None)
    n = int(2.5 * tpc)
    kv.prefetch(n, 0)
    kv.wait_prefetch(0)
    with caplog.at_level("WARNING", logger="jax_vmm"):
        kv.ensure_shareable(n, 0)
    assert "backed ahead already (kv.prefetch" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="jax_vmm"):
        kv.ensure_shareable(n, 0)  # ensured already: nothing to say
    assert caplog.text == ""


@pytest.mark.parametrize("whole_chunks", [2, 0], ids=["whole_chunks", "within_one_chunk"])
def test_ensure_shareable_backs_no_chunk_ahead_and_growth_resumes_it(vm, whole_chunks):
    """A prefix slot never writes past its prefix: a chunk committed ahead of it would be
    memory no sharer uses. A plain ensure to the same end does commit one (what the test
    would see if ensure_shareable scheduled it); a source that goes on growing gets commit
    ahead again once its backed end moves."""
    kv, tpc = _kv(vm, commit_ahead_tokens=_tokens_per_chunk(vm) // 4)
    end = max(whole_chunks, 1) * tpc
    n = end - tpc // 8  # within commit_ahead_tokens of its chunk end
    kv.ensure(n, 1)
    kv.ensure_shareable(n, 0)
    assert kv._ahead.wait_idle()
    assert kv.backed_tokens(1) == end + tpc  # plain ensure: the next chunk ahead
    assert kv.backed_tokens(0) == end  # ensure_shareable: none
    kv.ensure(end, 0)  # still within the backed chunks: still none
    assert kv._ahead.wait_idle()
    assert kv.backed_tokens(0) == end
    kv.ensure(end + 1, 0)  # past them: a commit, then commit ahead from the new end
    kv.ensure(end + tpc - tpc // 8, 0)
    assert kv._ahead.wait_idle()
    assert kv.backed_tokens(0) == end + 2 * tpc


def test_a_refused_ensure_shareable_leaves_commit_ahead_as_it_was(vm):
    kv, tpc = _kv(vm, commit_ahead_tokens=_tokens_per_chunk(vm) // 4)
    n = tpc - tpc // 8  # within commit_ahead_tokens of the first chunk's end
    kv.ensure(4, 0)
    kv.offload(0)
    with pytest.raises(ValueError, match="offload"):
        kv.ensure_shareable(n, 0)
    kv.restore(0)  # waits
    kv.ensure(n, 0)  # a plain ensure there: the next chunk ahead, as without the refusal
    assert kv._ahead.wait_idle()
    assert kv.backed_tokens(0) == 2 * tpc


@pytest.mark.parametrize("keep", [0, 1])
def test_the_next_sequence_in_a_prefix_slot_gets_commit_ahead(vm, keep):
    kv, tpc = _kv(vm, commit_ahead_tokens=_tokens_per_chunk(vm) // 4)
    n = tpc - tpc // 8
    kv.ensure_shareable(n, 0)
    kv.release(0, keep_tokens=keep)
    kv.ensure(n, 0)  # a new sequence there, as close to its chunk's end
    assert kv._ahead.wait_idle()
    assert kv.backed_tokens(0) == 2 * tpc


# -- review 3 cases ------------------------------------------------------------------------


def test_a_share_that_maps_nothing_blocks_neither_sleep_nor_offload(vm):
    """A share that mapped nothing (its prefix inside one chunk: all copied) leaves dst's
    memory its own: dst may sleep, offload and restore, and be released with keep_tokens,
    and the arena sleeps. Its floor stays through all of them: writes into its prefix are
    still dropped, and its data is intact. They were refused as moving shared memory,
    while stats said shared_bytes 0."""
    kv, n, data = _copy_only_share(vm, seed=41, ensure="ensure_shareable")
    assert kv.stats()["shared_bytes"] == 0

    def still_read_only():
        _write_one(kv, 1, 1, 7.0)
        with pytest.raises(jax_vmm.OutOfBoundsWrite, match="read-only"):
            kv.check()
        got = _seq_tokens(kv, 1)[:, :, :n]
        np.testing.assert_array_equal(got, data)
        np.testing.assert_array_equal(_seq_tokens(kv, 0)[:, :, :n], data)

    kv.sleep()
    kv.wake()
    still_read_only()
    kv.offload(1)
    kv.restore(1).wait()
    still_read_only()
    assert kv.stats()["sharing_seqs"] == [1]
    kv.release(1, keep_tokens=n)  # its kept chunk is its own
    assert kv.stats()["sharing_seqs"] == []


def test_a_shared_dst_still_refuses_to_move_after_a_copied_share(vm):
    """The refusals follow the memory: beside a copy-only share, a share that maps
    chunks still refuses sleep, and the offload of both of its sequences."""
    kv, tpc, n, data, got = _shared(vm)
    assert got["mapped_bytes"] > 0
    assert kv.share_prefix(0, 2, tpc // 2)["mapped_bytes"] == 0
    with pytest.raises(ValueError, match=r"sequences \[0, 1\] share memory"):
        kv.sleep()
    for q in (0, 1):
        with pytest.raises(ValueError, match=f"sequence {q} shares its first"):
            kv.offload(q)
    kv.offload(2)
    kv.restore(2).wait()
    kv.release(1)
    kv.sleep()
    kv.wake()
    np.testing.assert_array_equal(_seq_tokens(kv, 0)[:, :, :n], data)


def test_the_source_floor_ends_with_the_last_chunk_mapped(vm):
    """A whole chunk of the prefix in an allocation that reaches past it is copied, not
    mapped: src's writes into it land (it is src's own memory) and dst's copy keeps its
    bytes; the chunks mapped stay read-only for both. src's floor covered every whole
    chunk of the prefix, so its writes into the copied chunk were dropped."""
    kv, tpc = _kv(vm, chunks_per_seq=8, handle_bytes=None)
    kv.ensure_shareable(2 * tpc + tpc // 2, 0)  # chunks 0-1 | chunk 2
    kv.ensure(8 * tpc, 0)  # chunks 3-7: one allocation
    n = 4 * tpc + tpc // 2  # whole chunks 0-3; 3 is copied
    data = _tokens(kv, n, seed=42)
    _write(kv, 0, 0, data)
    got = kv.share_prefix(0, 1, n)
    c = kv.arena.chunk_bytes
    assert got["mapped_bytes"] == 3 * c * 2 * LAYERS, got
    late = _tokens(kv, 10, seed=43)
    _write(kv, 0, 3 * tpc + 5, late)
    kv.check()  # landed: chunk 3 is src's own
    np.testing.assert_array_equal(_seq_tokens(kv, 0)[:, :, 3 * tpc + 5 : 3 * tpc + 15], late)
    np.testing.assert_array_equal(_seq_tokens(kv, 1)[:, :, :n], data)
    for q in (0, 1):
        _write_one(kv, q, 3 * tpc - 1, 7.0)  # the last mapped chunk: read-only for both
        with pytest.raises(jax_vmm.OutOfBoundsWrite):
            kv.check()
    _write_one(kv, 1, 3 * tpc + 5, 7.0)  # dst's floor is n
    with pytest.raises(jax_vmm.OutOfBoundsWrite):
        kv.check()
    np.testing.assert_array_equal(_seq_tokens(kv, 1)[:, :, :n], data)
    assert kv.stats()["sharing_seqs"] == [0, 1]


@pytest.mark.parametrize(
    "keep, error",
    [(-1, ValueError), (1.5, TypeError), ("a", TypeError), (True, TypeError)]
    + [(np.array([1, 2]), TypeError)],
    ids=["-1", "1.5", "str", "True", "array"],
)
def test_keep_tokens_is_checked_before_the_sharing(vm, keep, error, monkeypatch):
    """A bad keep_tokens on a sharer is refused as it is on any sequence, before the
    sharing check, which may wait for the device (reclaim). It was refused for the
    sharing after that wait, and an array with NumPy's 'truth value ambiguous' (on any
    sequence)."""
    with pytest.raises(error, match="keep_tokens must be") as plain:
        _plain_release(vm, keep)
    kv, tpc, n, data, _ = _shared(vm)
    kv.share_prefix(0, 2, n)
    kv.release(2)  # a sharer released: the next sharing check reclaims its addresses
    reclaims = []
    real = kv.arena.reclaim
    monkeypatch.setattr(kv.arena, "reclaim", lambda: reclaims.append(1) or real())
    for q in (0, 1):
        with pytest.raises(plain.type) as got:
            kv.release(q, keep_tokens=keep)
        assert str(got.value) == str(plain.value)
    assert reclaims == []
    assert kv.stats()["sharing_seqs"] == [0, 1]


def _plain_release(vm, keep):
    """release(keep_tokens=keep) of a sequence that shares nothing."""
    kv, _ = _kv(vm)
    kv.ensure(4, 0)
    kv.release(0, keep_tokens=keep)


def test_a_closed_arena_lists_no_share(vm):
    """stats() after close reads 0 and empty (docs/errors.md), the shares too: it still
    listed sharing_seqs and shared_prefixes."""
    kv, tpc, n, data, _ = _shared(vm)
    kv.close()
    s = kv.stats()
    assert (s["backed_bytes"], s["shared_bytes"]) == (0, 0)
    assert (s["sharing_seqs"], s["shared_prefixes"]) == ([], [])


def test_bad_token_counts_and_sequences_name_the_method(vm):
    kv, _ = _kv(vm)
    kv.ensure_shareable(8, 0)
    for n in (0, -1):  # -1 said "must be >= 0" and no method, though 0 is refused too
        with pytest.raises(
            ValueError, match=rf"KVArena.share_prefix: num_tokens must be > 0, got {n}"
        ):
            kv.share_prefix(0, 1, n)
    with pytest.raises(ValueError, match=r"KVArena.ensure: num_tokens must be >= 0, got -1"):
        kv.ensure(-1, 0)
    with pytest.raises(ValueError, match=r"KVArena.share_prefix: seq must be >= 0, got -1"):
        kv.share_prefix(0, -1, 8)
    with pytest.raises(ValueError, match=r"KVArena.release: seq must be >= 0, got -1"):
        kv.release(-1)
    assert kv.backed_tokens(1) == 0
