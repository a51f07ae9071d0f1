"""The interleaved KV layout (``kv_arena(..., layout="interleaved")``): one buffer
``(S, T, 2L, H, D)`` holds every layer, layer l's K at slot 2l and its V at 2l + 1.

Oracles: the raw bytes of the buffer (read through a plain byte view, not through any
kernel) for where each write lands; a per-layer arena holding the same tokens for what
every reader returns (bitwise: same kernel, same values, only the addresses differ); a
float64 attention by the definition; the arena's independent backing oracle (the host's
``/proc/self/maps``, the driver on a GPU) for the memory a sequence takes."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
import jax_vmm.testing
from conftest import read_bytes
from jax_vmm.base.fp8 import FP8_DTYPE

BF16, F32 = jnp.bfloat16, jnp.float32
L, HKV, HQ, D = 2, 2, 4, 64
LAYER_TOKEN = HKV * D * 2  # bytes of one token of one layer's K (bf16)
ROW = 2 * L * LAYER_TOKEN  # bytes of one token of every layer: 1 KiB, divides every chunk


def make(vm, layout, *, B=3, T=128, dtype=BF16, **kw):
    return vm.kv(
        num_layers=L, num_kv_heads=HKV, head_dim=D, max_tokens=T, max_seqs=B, dtype=dtype,
        layout=layout, zero_fill=True, **kw,
    )  # fmt: skip


def tokens(rng, B, T):
    """Distinct bf16 K and V values for every (layer, sequence, position): (L, B, T, H, D)."""
    k = jnp.asarray(rng.standard_normal((L, B, T, HKV, D), np.float32)).astype(BF16)
    v = jnp.asarray(rng.standard_normal((L, B, T, HKV, D), np.float32)).astype(BF16)
    return k, v


def write_all(kv, k, v, lengths):
    """Each sequence's first lengths[b] tokens of every layer, in one jitted step that
    writes the cache layer by layer (the README's pattern), returning the cache."""
    B, T = k.shape[1], k.shape[2]
    slots = np.concatenate([b * T + np.arange(n) for b, n in enumerate(lengths)]).astype(np.int32)
    dev = kv.arena.device
    ks = [jax.device_put(k[l].reshape(B * T, HKV, D)[slots], dev) for l in range(L)]
    vs = [jax.device_put(v[l].reshape(B * T, HKV, D)[slots], dev) for l in range(L)]

    @jax.jit
    def step(cache, ks, vs):
        return jax_vmm.KVCache([jax_vmm.kv_write(cache[l], ks[l], vs[l], slots) for l in range(L)])

    for b, n in enumerate(lengths):
        kv.ensure(n, b)
    cache = step(kv.cache(), ks, vs)
    kv.check(cache)
    return cache


def wide_bytes(kv):
    """The interleaved buffer as (S, T, 2L, H, D) bf16, from its raw bytes."""
    (buf,) = kv.buffers
    B, T = kv.max_seqs, kv.max_tokens
    return jnp.asarray(read_bytes(buf).view(np.uint16).reshape(B, T, 2 * L, HKV, D)).view(BF16)


def ref64(q, k, v, n):
    """float64 decode attention of q (B, Hq, D) over k, v (B, T, H, D), lengths n."""
    q, k, v = (np.asarray(jnp.asarray(x).astype(F32), np.float64) for x in (q, k, v))
    out = np.zeros(q.shape)
    G = HQ // HKV
    for b in range(q.shape[0]):
        for h in range(HQ):
            if n[b] == 0:
                continue
            s = k[b, : n[b], h // G] @ q[b, h] / math.sqrt(D)
            p = np.exp(s - s.max())
            out[b, h] = p @ v[b, : n[b], h // G] / p.sum()
    return out


def same_layout_as_per_layer(got, want, device, name="auto"):
    """jax_vmm's kernels read the same values in the same order whatever the stride:
    bitwise equal. cuDNN (a GPU's "auto" route over an arena layer) may pick another
    engine for a strided tensor: equal to bf16 rounding."""
    got, want = np.asarray(got.astype(F32)), np.asarray(want.astype(F32))
    if device.platform == "cpu" or name not in ("auto", "cudnn"):
        np.testing.assert_array_equal(got, want, err_msg=name)
    else:
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2, err_msg=name)


def readers(device):
    """(name, fn(q, layer, lengths)) for every kernel that reads a cache layer here."""
    from jax_vmm.ops.attention import decode_attention_tuned
    from jax_vmm.ops.cudnn_attention import cudnn_attention, cudnn_available

    impls = ["auto", "stream", "stream_combine"]
    if device.platform != "cpu":
        impls += ["tensor_core", "tensor_core_u1", "simple", "stream_tma"]
    out = [(i, lambda q, l, n, i=i: decode_attention_tuned(q, l, n, impl=i)) for i in impls]
    if device.platform != "cpu" and cudnn_available():
        out.append(("cudnn", lambda q, l, n: cudnn_attention(q[:, None], l, n)[:, 0]))
    return out


def test_writes_land_in_their_layer_slot_and_every_reader_matches_per_layer(vm):
    rng = np.random.default_rng(1)
    B, T, lengths = 3, 128, [128, 37, 0]
    k, v = tokens(rng, B, T)
    wide = make(vm, "interleaved")
    flat = make(vm, "per_layer")
    wide_cache = write_all(wide, k, v, lengths)
    flat_cache = write_all(flat, k, v, lengths)

    held = wide_bytes(wide)
    for l in range(L):
        for b, n in enumerate(lengths):
            np.testing.assert_array_equal(np.asarray(held[b, :n, 2 * l]), np.asarray(k[l, b, :n]))
            np.testing.assert_array_equal(
                np.asarray(held[b, :n, 2 * l + 1]), np.asarray(v[l, b, :n])
            )
            assert not np.asarray(held[b, n:].astype(F32)).any(), "nothing past the lengths"

    dev = wide.arena.device
    q = jax.device_put(jnp.asarray(rng.standard_normal((B, HQ, D), np.float32)).astype(BF16), dev)
    n = jax.device_put(jnp.asarray(lengths, jnp.int32), dev)
    for name, read in readers(dev):
        fn = jax.jit(lambda c, q, n, read=read: [read(q, c[l], n) for l in range(L)])
        got, want = fn(wide_cache, q, n), fn(flat_cache, q, n)
        for l in range(L):
            same_layout_as_per_layer(got[l], want[l], dev, name)
            ref = ref64(q, k[l], v[l], lengths)
            err = np.abs(np.asarray(got[l].astype(F32)) - ref).max()
            assert err < 3e-2, f"{name} layer {l}: {err}"
    wide.check()


def test_several_queries_with_window_and_softcap(vm):
    """jax_vmm.attention's rows (S > 1, sliding window, soft-capping) over an interleaved
    layer: the same values as over a per-layer one."""
    rng = np.random.default_rng(2)
    B, T, lengths = 3, 128, [100, 5, 64]
    k, v = tokens(rng, B, T)
    wide, flat = make(vm, "interleaved"), make(vm, "per_layer")
    caches = write_all(wide, k, v, lengths), write_all(flat, k, v, lengths)
    dev = wide.arena.device
    q = jax.device_put(
        jnp.asarray(rng.standard_normal((B, 3, HQ, D), np.float32)).astype(BF16), dev
    )
    n = jax.device_put(jnp.asarray(lengths, jnp.int32), dev)
    fn = jax.jit(
        lambda c, q, n: [jax_vmm.attention(q, c[l], n, window=7, softcap=20.0) for l in range(L)]
    )
    got, want = (fn(c, q, n) for c in caches)
    for l in range(L):
        same_layout_as_per_layer(got[l], want[l], dev)


def test_fp8(vm):
    rng = np.random.default_rng(3)
    B, T, lengths = 2, 128, [90, 17]
    k, v = tokens(rng, B, T)
    scales = rng.uniform(0.5, 2.0, (2, L, HKV)).astype(np.float32)
    kw = dict(B=B, dtype=FP8_DTYPE, k_scales=scales[0], v_scales=scales[1])
    wide, flat = make(vm, "interleaved", **kw), make(vm, "per_layer", **kw)
    caches = write_all(wide, k, v, lengths), write_all(flat, k, v, lengths)
    dev = wide.arena.device
    q = jax.device_put(jnp.asarray(rng.standard_normal((B, HQ, D), np.float32)).astype(BF16), dev)
    n = jax.device_put(jnp.asarray(lengths, jnp.int32), dev)
    fn = jax.jit(lambda c, q, n: [jax_vmm.decode_attention(q, c[l], n) for l in range(L)])
    rows = jax.jit(
        lambda c, q, n: [jax_vmm.attention(q[:, None], c[l], n, window=9) for l in range(L)]
    )
    for f in (fn, rows):
        got, want = (f(c, q, n) for c in caches)
        for l in range(L):
            np.testing.assert_array_equal(
                np.asarray(got[l].astype(F32)), np.asarray(want[l].astype(F32))
            )


def test_a_sequence_takes_its_tokens_rounded_to_one_chunk_not_one_per_layer(vm):
    """10 tokens of one sequence: one chunk in the interleaved arena, 2L chunks (one per
    buffer) in the per-layer one, by the backing oracle."""
    chunk = 64 * 1024
    wide = make(
        vm, "interleaved", T=1024, chunk_bytes=None if vm.device.platform != "cpu" else chunk
    )
    flat = make(vm, "per_layer", T=1024, chunk_bytes=wide.arena.chunk_bytes)
    c = wide.arena.chunk_bytes
    for kv in (wide, flat):
        kv.ensure(10, 1)
    assert wide.arena.backed_bytes == c
    assert flat.arena.backed_bytes == 2 * L * c
    for kv in (wide, flat):
        oracle = vm.oracle(kv.arena)
        if oracle is None:
            continue
        if hasattr(oracle, "backed_bytes"):  # the host's /proc/self/maps
            assert oracle.backed_bytes() == kv.arena.backed_bytes
        else:  # the CUDA driver, chunk by chunk
            assert oracle.kinds().count("rw") * c == kv.arena.backed_bytes
    # From sequence 1's start (1 MiB into the buffer) to the end of its chunk.
    assert wide.backed_tokens(1) == min(1024, (c - 1024 * ROW % c) // ROW)
    assert wide.stats()["token_bytes_all_layers"] == ROW
    assert wide.stats()["preallocated_equivalent_bytes"] == 3 * 1024 * ROW
    wide.release(1, wait=True)
    assert wide.arena.backed_bytes == 0


def test_a_write_past_the_ensured_tokens_is_dropped_and_the_switch_shows_where_it_would_land(vm):
    rng = np.random.default_rng(4)
    B, T = 3, 128
    kv = make(vm, "interleaved")
    k, v = tokens(rng, B, T)
    write_all(kv, k, v, [0, 5, 0])  # 5 tokens of sequence 1; its chunk backs more
    before = wide_bytes(kv)
    dev = kv.arena.device
    new = jax.device_put(jnp.ones((1, HKV, D), BF16), dev)
    slot = np.array([1 * T + 5], np.int32)
    layer = jax.jit(jax_vmm.kv_write)(kv.cache()[1], new, new * 2, slot)
    with pytest.raises(jax_vmm.OutOfBoundsWrite) as info:
        kv.check(layer)
    assert info.value.count == 2  # its K and V rows
    np.testing.assert_array_equal(
        np.asarray(wide_bytes(kv).view(jnp.uint16)), np.asarray(before.view(jnp.uint16))
    )

    with jax_vmm.testing.limits_ignored():  # without the table the write lands...
        layer = jax.jit(lambda *a: jax_vmm.kv_write(*a))(kv.cache()[1], new, new * 2, slot)
    kv.check(layer)
    after = np.asarray(wide_bytes(kv).astype(F32))
    expect = np.array(before.astype(F32))
    expect[1, 5, 2] = 1.0  # ...in layer 1's K slot and V slot of that token, nowhere else
    expect[1, 5, 3] = 2.0
    np.testing.assert_array_equal(after, expect)


def test_share_prefix_maps_whole_chunks_and_reads_equal_a_private_copy(vm):
    rng = np.random.default_rng(5)
    B, T = 3, 4096  # a sequence is 4 MiB: whole chunks on every driver
    kv = make(vm, "interleaved", B=B, T=T)
    c = kv.arena.chunk_bytes
    prefix = c // ROW + 3  # one whole chunk and 3 tokens more
    k, v = tokens(rng, B, T)
    kv.ensure_shareable(prefix, 0)  # the prefix's chunks in allocations of their own
    write_all(kv, k, v, [prefix, 0, 0])
    backed = kv.arena.backed_bytes
    moved = kv.share_prefix(0, 1, prefix)
    assert moved["mapped_bytes"] == c  # once, not once per layer buffer
    assert moved["copied_bytes"] == 3 * ROW
    # Mapped at both addresses, held once: new physical memory is the copied tail's chunk.
    assert kv.stats()["shared_bytes"] == c
    assert kv.arena.backed_bytes - c == backed + c

    own = [prefix + 4, prefix + 4]
    dev = kv.arena.device
    kv.ensure(own[1], 1)
    slots = (1 * T + np.arange(prefix, own[1])).astype(np.int32)
    cache = kv.cache()
    layers = [
        jax.jit(jax_vmm.kv_write)(
            cache[l],
            jax.device_put(k[l, 1, prefix : own[1]], dev),
            jax.device_put(v[l, 1, prefix : own[1]], dev),
            slots,
        )
        for l in range(L)
    ]
    kv.check(layers)
    q = jax.device_put(jnp.asarray(rng.standard_normal((B, HQ, D), np.float32)).astype(BF16), dev)
    n = jax.device_put(jnp.asarray([prefix, own[1], 0], jnp.int32), dev)
    out = jax.jit(lambda c, q, n: [jax_vmm.decode_attention(q, c[l], n) for l in range(L)])(
        kv.cache(), q, n
    )
    for l in range(L):
        private = (
            k[l].at[1, :prefix].set(k[l, 0, :prefix]),
            v[l].at[1, :prefix].set(v[l, 0, :prefix]),
        )
        ref = ref64(q, *private, [prefix, own[1], 0])
        assert np.abs(np.asarray(out[l].astype(F32)) - ref).max() < 3e-2

    # A write into the shared prefix is dropped and counted; the source keeps its tokens.
    layer = jax.jit(jax_vmm.kv_write)(
        kv.cache()[0], jnp.ones((1, HKV, D), BF16), jnp.ones((1, HKV, D), BF16),
        np.array([1 * T + 2], np.int32),
    )  # fmt: skip
    with pytest.raises(jax_vmm.OutOfBoundsWrite):
        kv.check(layer)
    np.testing.assert_array_equal(
        np.asarray(wide_bytes(kv)[0, :prefix, 0]), np.asarray(k[0, 0, :prefix])
    )
    kv.release(0)
    assert kv.stats()["shared_bytes"] == 0
    np.testing.assert_array_equal(
        np.asarray(wide_bytes(kv)[1, :prefix, 1]), np.asarray(v[0, 0, :prefix])
    )


def test_offload_restore_and_sleep_wake_are_bit_exact(vm):
    rng = np.random.default_rng(6)
    kv = make(vm, "interleaved", T=2048)  # a sequence is 2 MiB: whole chunks everywhere
    k, v = tokens(rng, 3, 2048)
    write_all(kv, k, v, [2048, 40, 3])
    before = np.asarray(wide_bytes(kv).view(jnp.uint16))
    kv.offload(1)
    kv.restore(1)
    np.testing.assert_array_equal(np.asarray(wide_bytes(kv).view(jnp.uint16)), before)
    kv.sleep()
    kv.wake()
    np.testing.assert_array_equal(np.asarray(wide_bytes(kv).view(jnp.uint16)), before)


def test_views_dests_and_sharding_are_refused_with_what_to_use(vm):
    kv = make(vm, "interleaved")
    kv.ensure(4, 0)
    for get in (lambda: kv.k[0], lambda: kv.v[1], lambda: kv.cache()[0].k):
        with pytest.raises(
            TypeError, match="layout='interleaved'.*kv_write|interleaves every layer"
        ):
            get()
    with pytest.raises(TypeError, match="kv_write\\(kv.cache\\(\\)\\[layer\\]"):
        kv.dest(0)
    with pytest.raises(ValueError, match="layout must be one of"):
        make(vm, "token_major")
    mesh = jax.sharding.Mesh(np.array([vm.device]), ("x",))
    with pytest.raises(ValueError, match="sharded arena"):
        jax_vmm.kv_arena(
            num_layers=L, num_kv_heads=HKV, head_dim=D, max_tokens=64, max_seqs=2,
            sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")),
            layout="interleaved",
        )  # fmt: skip
    assert "layout=interleaved" in repr(kv)


def test_a_stale_cache_of_a_closed_interleaved_arena_is_refused(vm):
    """The stale handle: a cache made before kv.close() is refused by its write and its
    read (the layer's address inside the one buffer is checked against the buffer's base),
    and a step traced before the close refuses to run after it."""
    kv = make(vm, "interleaved")
    kv.ensure(4, 0)
    cache = kv.cache()
    dev = kv.arena.device
    new = jax.device_put(jnp.ones((1, HKV, D), BF16), dev)
    q = jax.device_put(jnp.zeros((3, HQ, D), BF16), dev)
    n = jax.device_put(jnp.asarray([4, 0, 0], jnp.int32), dev)

    @jax.jit
    def step(c, q, n):
        layer = jax_vmm.kv_write(c[1], new, new, np.array([3], np.int32))
        return jax_vmm.decode_attention(q, layer, n)

    jax.block_until_ready(step(cache, q, n))  # traced and run while the arena is open
    kv.close()
    closed = (jax_vmm.ArenaClosedError, jax.errors.JaxRuntimeError, ValueError)
    with pytest.raises(closed, match="closed"):
        jax.block_until_ready(step(cache, q, n))
    with pytest.raises(closed, match="closed"):
        jax.block_until_ready(jax_vmm.decode_attention(q, cache[0], n))
