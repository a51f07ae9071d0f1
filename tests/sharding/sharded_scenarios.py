"""Scenarios of sharded KV arenas on 4 host devices, run in one child process.

CI runs ``pytest tests`` once without XLA_FLAGS, and JAX fixes the number of host
devices when it starts, so tests/sharding/test_sharded_kv.py runs this file as a script
with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``. Each scenario prints one JSON
line ``{"name", "ok", "error"}``; the parent turns each line into a test.

The oracles: ``conftest.raw_bytes`` (a memcpy from a shard's buffer address, no JAX
view) for what each device's arena holds, ``/proc/self/maps`` (tests/oracles/maps_oracle)
for what each device's reservation has backed, and a single-device arena run through the
same step for the expected bytes and attention results.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

# Run as a script (multidevice.child_results): this folder is on sys.path; tests/ (conftest),
# the oracles and jax_vmm are on the PYTHONPATH the parent gives.
import jax
import jax.numpy as jnp
import multidevice
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from multidevice import raises

import jax_vmm
import jax_vmm.testing
from conftest import hold_commit_ahead, mo, raw_bytes

L, S, T, H, HQ, D = 2, 4, 64, 4, 8, 16
DT = np.float32
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")

SCENARIOS: dict[str, Callable[[], None]] = {}


def scenario(fn: Callable[[], None]) -> Callable[[], None]:
    SCENARIOS[fn.__name__] = fn
    return fn


def mesh_1d() -> Mesh:
    return Mesh(np.array(jax.devices()[:4]), ("tp",))


def mesh_2d() -> Mesh:
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))


#: (mesh, spec) pairs every equality scenario runs: a 1-device mesh, heads over 2 and 4,
#: sequences over 4, sequences x heads over 2 x 2, heads over 2 with the other mesh axis
#: replicated. The first two run on one and two GPUs too (tests/sharding/test_sharded_gpu.py).
LAYOUTS = {
    "one_device": (lambda: Mesh(np.array(jax.devices()[:1]), ("tp",)), P(None, None, "tp")),
    "heads_over_two": (lambda: Mesh(np.array(jax.devices()[:2]), ("tp",)), P(None, None, "tp")),
    "heads": (mesh_1d, P(None, None, "tp")),
    "seqs": (lambda: Mesh(np.array(jax.devices()[:4]), ("dp",)), P("dp")),
    "seqs_x_heads": (mesh_2d, P("dp", None, "tp")),
    "heads_replicated": (mesh_2d, P(None, None, "tp")),
}


def make(spec_mesh=None, spec=None, **kw):
    kw = (
        dict(
            num_layers=L,
            num_kv_heads=H,
            head_dim=D,
            max_tokens=T,
            max_seqs=S,
            dtype=DT,
            zero_fill=True,
            commit_ahead_tokens=0,
        )
        | kw
    )
    if spec is not None:
        kw["sharding"] = NamedSharding(spec_mesh, spec)
    return jax_vmm.kv_arena(**kw)


def step_fn(cache, q, new_k, new_v, slots, lengths):
    """Every layer: write the new tokens, then attend over them (read after write)."""
    outs = []
    for layer in range(len(cache)):
        written = jax_vmm.kv_write(cache[layer], new_k[layer], new_v[layer], slots)
        outs.append(jax_vmm.decode_attention(q[layer], written, lengths))
        cache = cache.replace(layer, written)
    return cache, jnp.stack(outs)


STEP = jax.jit(step_fn)


def tokens(n: int, seed: int, d: int = D) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "k": rng.standard_normal((L, n, H, d)).astype(DT),
        "v": rng.standard_normal((L, n, H, d)).astype(DT),
        "q": rng.standard_normal((L, S, HQ, d)).astype(DT),
    }


def shard_block(kv, shard_index: int, layout_arr: np.ndarray) -> np.ndarray:
    """The block of a global (S, T, H, D) array that shard ``shard_index`` holds."""
    lay = kv._layout
    s0, h0 = lay.seq_start[shard_index], lay.head_start[shard_index]
    ls, _, lh, _ = lay.local_shape
    return layout_arr[s0 : s0 + ls, :, h0 : h0 + lh]


def raw_layer(shard, side: int, layer: int) -> np.ndarray:
    buf = (shard.k_buffers if side == 0 else shard.v_buffers)[layer]
    return raw_bytes(buf).view(DT).reshape(buf.shape)


def backed_by_maps(shard) -> int:
    """Bytes the kernel has memfd-mapped read-write in this shard's reservation."""
    shard.reclaim()
    a = shard.arena
    return sum(hi - lo for lo, hi in mo.ranges_of(mo.layout(a.base, a.reserved_bytes), mo.BACKED))


def run_equal_to_single_device(name: str) -> None:
    mesh_of, spec = LAYOUTS[name]
    kv, ref = make(mesh_of(), spec), make()
    for q in range(S):
        kv.ensure(9, q)
        ref.ensure(9, q)
    cache, ref_cache = kv.cache(), ref.cache()
    lengths = np.zeros(S, np.int32)
    for pos in range(3):  # three steps, each sequence one token further
        t = tokens(S, seed=pos)
        slots = (np.arange(S) * T + pos).astype(np.int32)
        lengths = lengths + 1
        cache, out = STEP(cache, t["q"], t["k"], t["v"], slots, lengths)
        ref_cache, ref_out = STEP(ref_cache, t["q"], t["k"], t["v"], slots, lengths)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-6, atol=1e-6)
    kv.check(out)
    ref.check(ref_out)
    # Several query rows per sequence with every option: each device runs the split-K
    # kernels on its shard; ragged q_lengths, a row count past a length, an empty sequence.
    rows = jax.jit(
        lambda c, q, n, ql: jnp.stack(
            [
                jax_vmm.attention(q[layer], c[layer], n, q_lengths=ql, window=3, softcap=2.5)
                for layer in range(L)
            ]
        )
    )
    q_rows = np.random.default_rng(9).standard_normal((L, S, 3, HQ, D)).astype(DT)
    n, ql = np.array([9, 5, 2, 0], np.int32), np.array([3, 1, 3, 2], np.int32)
    got, want = rows(cache, q_rows, n, ql), rows(ref_cache, q_rows, n, ql)
    kv.check(got)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(want)).max() > 0 and not np.asarray(want)[:, 3].any()
    for side in (0, 1):
        for layer in range(L):
            want = raw_layer(ref, side, layer)
            for i, shard in enumerate(kv.shards):
                np.testing.assert_array_equal(
                    raw_layer(shard, side, layer), shard_block(kv, i, want), err_msg=f"shard {i}"
                )
    kv.close()
    ref.close()


for _name in LAYOUTS:
    SCENARIOS[f"equal_to_single_device_{_name}"] = lambda n=_name: run_equal_to_single_device(n)


@scenario
def views_are_global_zero_copy_arrays():
    kv = make(mesh_2d(), P("dp", None, "tp"))
    for q in range(S):
        kv.ensure(5, q)
    k = kv.k[1]
    assert k.shape == (S, T, H, D) and k.sharding == kv.sharding, (k.shape, k.sharding)
    by_device = {s.arena.device: s for s in kv.shards}
    assert len(k.addressable_shards) == 4
    for piece in k.addressable_shards:
        shard = by_device[piece.device]
        assert piece.data.shape == (S // 2, T, H // 2, D)
        assert piece.data.unsafe_buffer_pointer() == shard.k_buffers[1].address, piece.device
    # What a step wrote is what the global view shows.
    t = tokens(S, 0)
    slots = (np.arange(S) * T).astype(np.int32)
    cache, _ = STEP(kv.cache(), t["q"], t["k"], t["v"], slots, np.ones(S, np.int32))
    kv.check(cache)
    np.testing.assert_array_equal(np.asarray(kv.k[1])[:, 0], t["k"][1])
    np.testing.assert_array_equal(np.asarray(cache[1].v)[:, 0], t["v"][1])
    kv.close()


@scenario
def eager_scan_and_no_retrace():
    """Eager calls, a lax.scan of steps (the cache as the carry) and a fresh kv.cache()
    all work on a sharded arena; the same arena never retraces."""
    mesh_of, spec = LAYOUTS["seqs_x_heads"]
    kv, ref = make(mesh_of(), spec), make()
    for q in range(S):
        kv.ensure(8, q)
        ref.ensure(8, q)
    t = tokens(S, 11)
    slots = (np.arange(S) * T).astype(np.int32)
    layer = jax_vmm.kv_write(kv.cache()[0], t["k"][0], t["v"][0], slots)  # eager
    out = jax_vmm.decode_attention(t["q"][0], layer, np.ones(S, np.int32))
    kv.check(out)
    np.testing.assert_array_equal(np.asarray(kv.k[0])[:, 0], t["k"][0])
    jax_vmm.kv_write(ref.cache()[0], t["k"][0], t["v"][0], slots)
    steps = 6
    ks = np.random.default_rng(1).standard_normal((steps, L, S, H, D)).astype(DT)

    def scan_steps(cache, ks):
        def body(c, x):
            k, pos = x
            sl = (jnp.arange(S, dtype=jnp.int32) * T + pos).astype(jnp.int32)
            c, o = step_fn(c, jnp.asarray(t["q"]), k, k, sl, jnp.full((S,), pos + 1, jnp.int32))
            return c, o

        return jax.lax.scan(body, cache, (ks, jnp.arange(1, steps + 1, dtype=jnp.int32)))

    scan = jax.jit(scan_steps)
    cache, outs = scan(kv.cache(), ks)
    ref_cache, ref_outs = scan(ref.cache(), ks)
    kv.check(outs)
    np.testing.assert_allclose(np.asarray(outs), np.asarray(ref_outs), rtol=1e-6, atol=1e-6)
    size = scan._cache_size()
    scan(kv.cache(), ks)  # a fresh cache of the same arena: the same executable
    scan(cache, ks)
    assert scan._cache_size() == size, (scan._cache_size(), size)
    for i, shard in enumerate(kv.shards):
        np.testing.assert_array_equal(
            raw_layer(shard, 1, 1), shard_block(kv, i, raw_layer(ref, 1, 1))
        )
    kv.close()
    ref.close()


@scenario
def no_layout_per_sequence_shards_heads():
    kv = make(mesh_1d(), P(None, "tp"), max_seqs=None)
    ref = make(max_seqs=None)
    kv.ensure(20)
    ref.ensure(20)
    t = tokens(6, 3)
    slots = np.array([0, 5, 19, 2, 7, 11], np.int32)
    write = jax.jit(lambda c, k, v, s: c.replace(0, jax_vmm.kv_write(c[0], k, v, s)))
    cache = write(kv.cache(), t["k"][0], t["v"][0], slots)
    write(ref.cache(), t["k"][0], t["v"][0], slots)
    kv.check(cache)
    want = raw_layer(ref, 0, 0)
    for i, shard in enumerate(kv.shards):
        h0 = kv._layout.head_start[i]
        np.testing.assert_array_equal(raw_layer(shard, 0, 0), want[:, h0 : h0 + 1])
    kv.close()
    ref.close()


@scenario
def fp8_sharded_equals_single_device():
    rng = np.random.default_rng(7)
    scales = rng.uniform(0.5, 2.0, (2, L, H)).astype(np.float32)
    # The fp8 (streaming) kernel takes head_dim 64, 128 or 256 and bf16 queries.
    kw = dict(dtype=jnp.float8_e4m3fn, k_scales=scales[0], v_scales=scales[1], head_dim=64)
    kv, ref = make(mesh_2d(), P("dp", None, "tp"), **kw), make(**kw)
    for q in range(S):
        kv.ensure(4, q)
        ref.ensure(4, q)
    t = tokens(S, 5, d=64)
    t["q"] = t["q"].astype(jnp.bfloat16)
    slots = (np.arange(S) * T + 1).astype(np.int32)
    lengths = np.full(S, 2, np.int32)
    cache, out = STEP(kv.cache(), t["q"], t["k"], t["v"], slots, lengths)
    ref_cache, ref_out = STEP(ref.cache(), t["q"], t["k"], t["v"], slots, lengths)
    kv.check(out)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-6, atol=1e-6)
    # Several query rows: per device, a dequantized copy of the shard's live tokens.
    rows = jax.jit(lambda c, q, n, qn: jax_vmm.attention(q, c[0], n, q_lengths=qn, window=3))
    q_rows = np.stack([t["q"][0]] * 3, axis=1)
    n, qn = np.array([4, 2, 3, 0], np.int32), np.array([3, 1, 2, 2], np.int32)
    got, want = rows(cache, q_rows, n, qn), rows(ref_cache, q_rows, n, qn)
    kv.check(got)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(want)).max() > 0
    for i, shard in enumerate(kv.shards):
        got = raw_bytes(shard.k_buffers[0]).reshape(shard.k_buffers[0].shape)
        want = raw_bytes(ref.k_buffers[0]).reshape(ref.k_buffers[0].shape)
        np.testing.assert_array_equal(got, shard_block(kv, i, want))
    kv.close()
    ref.close()


@scenario
def compiled_step_moves_no_cache_between_devices():
    check_no_collectives(mesh_2d(), P("dp", None, "tp"))


def check_no_collectives(mesh: Mesh, spec: P) -> None:
    """The compiled HLO of a decode step over the sharded cache has no collective at all
    (the cache never is an XLA value); the same detector finds the all-gather XLA inserts
    when the cache is a plain sharded array fed to the single-device custom call."""
    kv = make(mesh, spec)
    t = tokens(S, 0)
    seqs, heads_axis = spec[0], spec[2]
    q_sharding = NamedSharding(mesh, P(None, seqs, heads_axis))
    heads = NamedSharding(mesh, P(None, None, heads_axis))
    args = (
        jax.device_put(t["q"], q_sharding),
        jax.device_put(t["k"], heads),
        jax.device_put(t["v"], heads),
        np.zeros(S, np.int32),
        np.ones(S, np.int32),
    )
    text = STEP.lower(kv.cache(), *args).compile().as_text()
    found = [c for c in COLLECTIVES if c in text]
    assert not found, f"collectives in the sharded step: {found}"
    assert "jax_vmm_kv_cache_write" in text and "jax_vmm_decode_attention" in text
    # The detector is live: plain sharded arrays through the array-level custom call.
    k = jax.device_put(np.zeros((S, T, H, D), DT), kv.sharding)
    naive = jax.jit(lambda q, k, v, n: jax_vmm.decode_attention(q, k, v, n))
    naive_text = naive.lower(args[0][0], k, k, args[4]).compile().as_text()
    naive_found = [c for c in COLLECTIVES if c in naive_text]
    assert naive_found, "the detector would not see a gathered cache"
    kv.close()


@scenario
def per_device_memory_follows_the_sequences_by_maps():
    kv = make(mesh_2d(), P("dp", None, "tp"), max_tokens=4096)
    assert all(backed_by_maps(s) == 0 for s in kv.shards)
    kv.ensure(1000, 3)  # sequence 3 lives on the second block of sequences: devices 2, 3
    holders = [i for i, s in enumerate(kv.shards) if backed_by_maps(s)]
    assert holders == [2, 3], holders
    for s in kv.shards:
        assert backed_by_maps(s) == s.arena.backed_bytes
    tb = (H // 2) * D * 4  # bytes per token on a device: half the heads
    assert kv.shards[2].arena.backed_bytes >= 2 * L * 1000 * tb
    kv.ensure(10, 0)
    assert [bool(backed_by_maps(s)) for s in kv.shards] == [True, True, True, True]
    assert kv.stats()["backed_bytes"] == sum(backed_by_maps(s) for s in kv.shards)
    kv.release(3)
    assert [backed_by_maps(s) for s in kv.shards][2:] == [0, 0]
    kv.shrink(0)
    assert all(backed_by_maps(s) == 0 for s in kv.shards)
    kv.close()


@scenario
def a_recycled_slot_keeps_the_next_prompts_memory_on_every_holder():
    kv = make(mesh_2d(), P("dp", None, "tp"), max_tokens=4096, zero_fill=False)
    kv.ensure(3000, 3)  # sequence 3: devices 2 and 3, one allocation per buffer
    before = [s.arena.backed_bytes for s in kv.shards]
    kv.release(3, keep_tokens=10)  # the next prompt: 10 tokens
    after = [s.arena.backed_bytes for s in kv.shards]
    assert after[:2] == [0, 0] and 0 < after[2] < before[2] and 0 < after[3] < before[3], (
        before,
        after,
    )
    for s in kv.shards[2:]:  # the rest of that allocation stays mapped, parked
        assert backed_by_maps(s) == s.arena.backed_bytes + s.arena.stats()["parked_bytes"]
    assert kv.backed_tokens(3) >= 10
    calls = [s.arena.stats()["commit_calls"] for s in kv.shards]
    assert kv.ensure(10, 3) == 0
    assert [s.arena.stats()["commit_calls"] for s in kv.shards] == calls
    try:
        kv.release(3, keep_tokens=-1)
    except ValueError as e:
        assert "keep_tokens" in str(e), e
    else:
        raise AssertionError("a negative keep_tokens was accepted")
    kv.close()


@scenario
def a_prefetched_prompt_is_backed_on_every_holder_only():
    kv = make(mesh_2d(), P("dp", None, "tp"), max_tokens=4096, zero_fill=False)
    kv.prefetch(3000, 3)  # sequence 3: devices 2 and 3
    assert kv.wait_prefetch(3, timeout=30) and kv.is_backed(3000, 3)
    assert not kv.is_backed(3000, 0)
    backed = [s.arena.backed_bytes for s in kv.shards]
    assert backed[:2] == [0, 0] and backed[2] > 0 and backed[3] > 0, backed
    assert [backed_by_maps(s) for s in kv.shards] == backed
    assert all(s._core_cache.limits() == [0, 0] for s in kv.shards)  # nothing ensured
    calls = [s.arena.stats()["commit_calls"] for s in kv.shards]
    assert kv.ensure(3000, 3) == 0
    assert [s.arena.stats()["commit_calls"] for s in kv.shards] == calls
    raises(ValueError, lambda: kv.prefetch(-1, 3), "num_tokens")
    kv.close()


def rollback_case(skip_rollback: bool) -> list[str]:
    """Arm one device's next physical allocation to fail, grow every sequence; return what
    differs afterwards from before (per device: backing by the maps oracle, the table of
    ensured tokens, the bookkeeping)."""
    with jax_vmm.testing.fault_injection() as faults:
        kv = make(mesh_1d(), P(None, None, "tp"), max_tokens=4096, zero_fill=False)
    kv.ensure(100, 1)

    def state():
        return [
            (
                backed_by_maps(s),
                s._core_cache.limits(),
                s.backed_tokens(1),
                s.stats()["backed_bytes"],
            )
            for s in kv.shards
        ]

    before = state()
    faults.arm(kv.shards[2], "create", 1)
    diffs = []
    for grow in (lambda: kv.ensure(3000, 1), lambda: kv.ensure_all([2000, 3000, 0, 10])):
        ctx = jax_vmm.testing.sharded_rollback_skipped() if skip_rollback else _nothing()
        with ctx:
            try:
                grow()
                diffs.append("the growth did not fail")
            except jax_vmm.testing.InjectedFault:
                pass
        after = state()
        diffs += [
            f"device {i}: {b} -> {a}" for i, (b, a) in enumerate(zip(before, after)) if a != b
        ]
        faults.arm(kv.shards[2], "create", 1)
    faults.disarm(kv.shards[2])
    if not skip_rollback:
        kv.ensure(3000, 1)  # the same growth works once the device does
        assert all(s.backed_tokens(1) >= 3000 for s in kv.shards)
    kv.close()
    return diffs


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@scenario
def a_failed_commit_on_one_device_rolls_back_the_others():
    diffs = rollback_case(skip_rollback=False)
    assert not diffs, diffs


@scenario
def without_the_rollback_the_other_devices_keep_memory():
    diffs = rollback_case(skip_rollback=True)
    assert any(d.startswith("device 0") for d in diffs), diffs


@scenario
def dropped_writes_and_clamped_reads_are_counted_over_the_shards():
    kv = make(mesh_2d(), P("dp", None, "tp"))
    kv.ensure(4, 0)
    kv.ensure(4, 3)
    t = tokens(3, 1)
    # seq 0 pos 2 (ensured), seq 3 pos 40 (not ensured), a slot past the cache.
    slots = np.array([2, 3 * T + 40, S * T + 5], np.int32)
    write = jax.jit(lambda c, k, v, s: c.replace(0, jax_vmm.kv_write(c[0], k, v, s)))
    cache = write(kv.cache(), t["k"][0], t["v"][0], slots)
    try:
        kv.check(cache)
        raise AssertionError("no OutOfBoundsWrite")
    except jax_vmm.OutOfBoundsWrite as e:
        # Two tokens dropped, each on the 2 devices holding its heads, for K and V.
        assert e.count == 2 * 2 * 2, (e.count, str(e))
    kv.check()  # reset on every shard
    q = tokens(S, 2)["q"][0]
    out = jax.jit(lambda c, q, n: jax_vmm.decode_attention(q, c[0], n))(
        cache, q, np.array([3, 0, 0, 50], np.int32)
    )
    try:
        kv.check(out)
        raise AssertionError("no OutOfBoundsRead")
    except jax_vmm.OutOfBoundsRead as e:
        assert e.count == 2, e.count  # seq 3 asked past its 4 tokens, on its 2 devices
    # The same with two query rows and a window (the split-K path per device).
    q2 = np.stack([q, q], axis=1)
    out = jax.jit(lambda c, q, n: jax_vmm.attention(q, c[0], n, window=2))(
        cache, q2, np.array([3, 0, 0, 50], np.int32)
    )
    try:
        kv.check(out)
        raise AssertionError("no OutOfBoundsRead")
    except jax_vmm.OutOfBoundsRead as e:
        assert e.count == 2, e.count
    raises(
        ValueError,
        lambda: jax_vmm.attention(q2[:2], cache[0], np.zeros(S, np.int32), window=2),
        "q must be (max_seqs=4, S, num_q_heads, head_dim=16)",
    )
    raises(
        ValueError,
        lambda: jax_vmm.attention(q2, cache[0], np.zeros(2, np.int32), window=2),
        "lengths must be (4,)",
    )
    kv.close()


@scenario
def lengths_as_lists_and_wide_integers_read_what_int32_arrays_read():
    """The natural forms of ``lengths`` over a sharded layer: a Python list (in and out of
    jit), and int64 past 2**32 (all T tokens, clamped and counted, never wrapped to 1 by
    shard_map's cast to int32) give what the int32 array gives. (A jitted function's
    int64 argument is cast by JAX at the jit boundary, before jax_vmm sees it, so the
    wide case is eager.)"""
    kv = make(mesh_2d(), P("dp", None, "tp"))
    for q in range(S):
        kv.ensure(T, q)
    t = tokens(S * T, 3)
    slots = np.arange(S * T, dtype=np.int32)
    write = jax.jit(lambda c, k, v, s: c.replace(0, jax_vmm.kv_write(c[0], k, v, s)))
    cache = write(kv.cache(), t["k"][0], t["v"][0], slots)
    q = tokens(S, 4)["q"][0]
    q_rows = np.stack([q, q], axis=1)

    def decode(n):
        return jax_vmm.decode_attention(q, cache[0], n)

    def rows(n):
        return jax_vmm.attention(q_rows, cache[0], n, window=4)

    full = np.full(S, T, np.int32)
    wide = np.full(S, 2**32 + 1, np.int64)
    for attend in (decode, rows):
        want = np.asarray(jax.jit(attend)(full))
        if attend is decode:  # T tokens and 1 token differ
            assert np.abs(want - np.asarray(decode(np.ones(S, np.int32)))).max() > 1e-3
        for got in (jax.jit(attend)(full.tolist()), attend(full.tolist()), attend(wide)):
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
        try:
            kv.check(got)  # the last: 2**32 + 1 asked past the T ensured tokens
            raise AssertionError("no OutOfBoundsRead for lengths past T")
        except jax_vmm.OutOfBoundsRead:
            pass
    kv.check()
    kv.close()


@scenario
def bad_shardings_are_refused_clearly():
    m1, m2 = mesh_1d(), mesh_2d()
    live = len(jax_vmm.cache.registry.live_arenas())
    raises(
        ValueError,
        lambda: make(m1, P(None, None, "tp"), num_kv_heads=6),
        "num_kv_heads=6",
        "divisible",
    )
    raises(ValueError, lambda: make(m1, P("tp"), max_seqs=6), "max_seqs=6")
    raises(ValueError, lambda: make(m1, P(None, "tp")), "tokens axis")
    raises(ValueError, lambda: make(m1, P(None, None, None, "tp")), "head_dim axis")
    raises(ValueError, lambda: make(m1, P(None, None, None, None, "tp")), "5 entries")
    raises(ValueError, lambda: make(m1, P("tp"), max_seqs=None), "tokens axis")
    raises(
        TypeError,
        lambda: make(sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])),
        "NamedSharding",
    )
    raises(ValueError, lambda: make(m1, P(None, None, "tp"), device=jax.devices()[0]), "not both")
    # A spec naming an axis the mesh lacks (jax refuses it already when it is built).
    try:
        NamedSharding(m2, P("x"))
    except ValueError:
        pass
    else:
        raises(ValueError, lambda: make(m2, P("x")), "'x'")
    # fp8 scales of the wrong shape: the message names the global shape, not a shard's.
    f8 = dict(dtype=jnp.float8_e4m3fn, head_dim=64)
    raises(
        ValueError,
        lambda: make(m1, P(None, None, "tp"), k_scales=np.ones((L, H + 1), np.float32), **f8),
        f"shape {(L, H)}",
        "global KV heads",
        f"got float32 {(L, H + 1)}",
    )
    # Nothing is left behind by a refusal.
    assert len(jax_vmm.cache.registry.live_arenas()) == live
    # What a sharded arena does not offer says so, and what to do instead.
    kv = make(m1, P(None, None, "tp"))
    for op, call, hint in (
        ("sleep", kv.sleep, "close()"),
        ("wake", kv.wake, "cannot sleep"),
        ("offload", lambda: kv.offload(0), "release(seq)"),
        ("restore", lambda: kv.restore(0), "cannot offload"),
        ("dest", lambda: kv.dest(0), "kv_write(cache[l]"),
    ):
        raises(NotImplementedError, call, f"ShardedKVArena.{op} is not supported", hint)
    kv.close()


@scenario
def inputs_on_other_devices_and_closed_arenas_are_refused():
    kv = make(Mesh(np.array(jax.devices()[:2]), ("tp",)), P(None, None, "tp"))
    kv.ensure(4, 0)
    t = tokens(1, 0)
    other = jax.device_put(t["k"][0], jax.devices()[3])  # committed to a device off the mesh
    write = jax.jit(lambda c, k, s: c.replace(0, jax_vmm.kv_write(c[0], k, k, s)))
    raises(ValueError, lambda: write(kv.cache(), other, np.zeros(1, np.int32)), "devices")
    # The same outside jit: said plainly (JAX's own error named an internal function).
    off_mesh = "is committed to ['cpu:3'], off the cache's mesh"
    raises(
        ValueError,
        lambda: jax_vmm.kv_write(kv.cache()[0], other, other, np.zeros(1, np.int32)),
        off_mesh,
    )
    q_off = jax.device_put(np.ones((S, HQ, D), DT), jax.devices()[3])
    raises(
        ValueError,
        lambda: jax_vmm.decode_attention(q_off, kv.cache()[0], np.full(S, 4, np.int32)),
        off_mesh,
    )
    cache = kv.cache()
    slot = np.zeros(1, np.int32)
    jax.block_until_ready(write(cache, t["k"][0], slot))  # compiled while open
    kv.close()
    # A write traced now is refused at the call (it surfaced only when its result was
    # waited for, and again at exit).
    raises(
        jax_vmm.ArenaClosedError,
        lambda: jax_vmm.kv_write(cache[0], t["k"][0], t["k"][0], slot),
        "kv_write: the arena is closed",
    )
    # The step compiled before the close refuses at run time, on every device.
    try:
        jax.block_until_ready(write(cache, t["k"][0], np.zeros(1, np.int32)))
        raise AssertionError("a closed sharded arena was written")
    except jax.errors.JaxRuntimeError as e:
        assert "closed" in str(e), e
    raises(jax_vmm.ArenaClosedError, kv.cache)
    for op, call in (
        ("ensure", lambda: kv.ensure(5, 0)),
        ("ensure_all", lambda: kv.ensure_all([1] * S)),
        ("ensure_shareable", lambda: kv.ensure_shareable(1, 0)),
        ("prefetch", lambda: kv.prefetch(1, 0)),
    ):  # named by the call made, not an internal one (KvCache.set_limits)
        raises(jax_vmm.ArenaClosedError, call, f"ShardedKVArena.{op}: the arena is closed")
    # JAX keeps raising the failed step's error from every effects barrier (at exit too)
    # until a later step with a side effect succeeds: run one.
    live = make()
    live.ensure(1, 0)
    write(live.cache(), t["k"][0], np.zeros(1, np.int32))
    live.check()
    live.close()


@scenario
def a_shard_cannot_join_twice_or_with_another_geometry():
    from jax_vmm.base.loader import core

    kv = make(Mesh(np.array(jax.devices()[:2]), ("tp",)), P(None, None, "tp"))
    shard = kv.shards[0]
    buf_ids = [b.id for b in shard.k_buffers], [b.id for b in shard.v_buffers]
    args = (S, True, T, H // 2, D, "float32", 4)
    raises(
        ValueError,
        lambda: core.create_kv_cache(shard.arena._handle, *buf_ids, *args, 0, kv.uid),
        "has a shard already",
    )
    raises(
        ValueError,
        lambda: core.create_kv_cache(
            shard.arena._handle, *buf_ids, S, True, T, H // 2, D // 2, "float32", 4, 2, kv.uid
        ),
        "geometry",
    )
    raises(
        ValueError,
        lambda: core.create_kv_cache(shard.arena._handle, *buf_ids, *args, 2, 12345),
        "no live KV cache",
    )
    assert (
        core.find_kv_cache(kv.uid, 1) == "found" and core.find_kv_cache(kv.uid, 2) == "other_device"
    )
    kv.close()


@scenario
def a_prefix_is_shared_per_device():
    # 1024 tokens of 128 bytes per shard: each sequence spans two 64 KiB host chunks.
    # zero_fill: the layers the prefix was not written to must read zero below.
    kv = make(mesh_2d(), P("dp", None, "tp"), max_tokens=1024, zero_fill=True)
    n = 700  # one whole chunk (512 tokens) mapped, 188 tokens copied, per shard and buffer
    kv.ensure_shareable(n, 0)
    t = tokens(n, 5)
    write = jax.jit(lambda c, k, v, s: c.replace(0, jax_vmm.kv_write(c[0], k, v, s)))
    kv.check(write(kv.cache(), t["k"][0], t["v"][0], np.arange(n, dtype=np.int32)))
    got = kv.share_prefix(0, 1, n)
    holders = kv._holders(0, "test")
    assert len(holders) == 2 and [s for s, _ in holders] == [s for s, _ in kv._holders(1, "t")]
    chunk = holders[0][0].arena.chunk_bytes
    assert got["mapped_bytes"] == len(holders) * 2 * L * chunk, got
    for shard, q in holders:
        assert shard.stats()["shared_bytes"] == 2 * L * chunk
        for side in (0, 1):
            for layer in range(L):
                r = raw_layer(shard, side, layer)
                assert np.array_equal(r[q + 1, :n], r[q, :n])
                assert r[q, :n].any() == (layer == 0)  # the prefix was written to layer 0
    raises(ValueError, lambda: kv.share_prefix(0, 3, n), "different devices")
    kv.release(0)
    kv.release(1)
    assert all(s.stats()["held_bytes"] == 0 for s in kv.shards)
    kv.close()


@scenario
def a_share_right_after_a_release_waits_for_each_shards_commit():
    # On each shard holding dst, a commit ahead of dst's old sequence's next chunk is
    # overtaken by dst's release and commits its first buffer after it (void), then is
    # held (up to 1 s) when the share comes: the share waits for those commits to end and
    # give that back, before it takes the shards' locks (under which they end); without
    # the wait it refuses dst as holding memory.
    kv = make(
        mesh_2d(), P("dp", None, "tp"), max_tokens=1024, zero_fill=False, commit_ahead_tokens=64
    )
    n = 700
    kv.ensure_shareable(n, 0)
    released, held = threading.Event(), []
    for shard, q in kv._holders(1, "test"):
        tpc = shard.arena.chunk_bytes // shard.token_bytes
        shard.ensure(tpc // 2, q)
        assert shard._ahead.wait_idle()
        start = lambda: shard.ensure(tpc - tpc // 8, q)  # noqa: E731
        held.append(hold_commit_ahead(shard, start, 1.0, after=released))
    try:
        kv.release(1)
        released.set()
        assert all(h.inside.wait(30) for h in held)
        got = kv.share_prefix(0, 1, n)
    finally:
        released.set()
        for h in held:
            h.go.set()
    holders = kv._holders(0, "test")
    chunk = holders[0][0].arena.chunk_bytes
    assert got["mapped_bytes"] == len(holders) * 2 * L * chunk, got
    kv.release(0)
    kv.release(1)
    assert all(s._ahead.wait_idle() for s in kv.shards)
    assert all(s.stats()["held_bytes"] == 0 for s in kv.shards)
    kv.close()


@scenario
def sharing_refusals_name_the_global_sequences():
    # Global sequences 2 and 3 live on the second row of the mesh, as its shards' local
    # sequences 0 and 1. A refusal of theirs names them and the sharded arena, so that its
    # advice acts on them: it named the local sequences and KVArena (kv.release(1) would
    # have released global sequence 1). A shrink refused on one row changes no row (the
    # first row shrank before the second refused).
    kv = make(mesh_2d(), P("dp", None, "tp"), max_tokens=1024, zero_fill=False)
    n = 700  # per shard: one whole 512-token chunk mapped, the rest copied
    kv.ensure_shareable(n, 2)
    kv.share_prefix(2, 3, n)
    op = "ShardedKVArena.share_prefix"
    raises(
        ValueError,
        lambda: kv.share_prefix(2, 3, n),
        f"{op}: sequence 3 holds memory",
        "kv.release(3) first",
    )
    raises(
        ValueError,
        lambda: kv.share_prefix(2, 3, n + 1),
        f"{op}: sequence 2 has {n} tokens ensured",
        f"kv.ensure({n + 1}, 2)",
    )
    raises(ValueError, lambda: kv.share_prefix(2, 2, n), "both 2")
    for q, floor in ((2, 512), (3, n)):
        raises(
            ValueError,
            lambda q=q: kv.release(q, keep_tokens=4),
            f"ShardedKVArena.release: sequence {q} shares its first {floor} tokens",
        )
    kv.ensure(n, 0)  # on the first row
    backed = kv.backed_tokens(0)
    raises(
        ValueError,
        lambda: kv.shrink(10),
        "ShardedKVArena.shrink: sequence 2 shares its first 512 tokens",
        f"shrink to at least {n} tokens",
    )
    assert kv.backed_tokens(0) == backed, (kv.backed_tokens(0), backed)
    one = np.ones((1, H, D), DT)
    write = jax.jit(lambda c, k, v, s: c.replace(0, jax_vmm.kv_write(c[0], k, v, s)))
    cache = write(kv.cache(), one, one, np.array([3 * 1024 + 5], np.int32))
    raises(jax_vmm.OutOfBoundsWrite, lambda: kv.check(cache), f"{{2: 512, 3: {n}}}")
    kv.release(3)
    kv.release(2)
    kv.shrink(10)  # nothing shared any more
    kv.close()


@scenario
def jax_refuses_a_vmap_with_spmd_axis_name_over_sharded_writes():
    """A sharded arena's kv_write under vmap(spmd_axis_name=) is not seen by the vmap check
    (its shard_map batches it apart, ops/vmap_reads.py), so a read after it in the same
    vmap would see every element's writes. JAX refuses such a vmap itself in every layout
    here; a JAX version that runs one fails this scenario, and the gap is open."""
    two = Mesh(np.array(jax.devices()[:2]), ("tp",))
    cases = (
        (mesh_1d(), "tp", ValueError, "spmd_axis_name cannot appear in shard_map"),
        (mesh_2d(), "dp", ValueError, "spmd_axis_name cannot appear in shard_map"),
        (two, "dp", KeyError, "dp"),  # an axis outside the arena's mesh
    )
    for mesh, spmd, exc, words in cases:
        kv = make(mesh, P(None, None, "tp"))
        try:
            for s in range(S):
                kv.ensure(8, s)
            cache = kv.cache()

            def write_then_read(q, new, cache=cache):
                layer = jax_vmm.kv_write(cache[0], new, new, jnp.array([3], jnp.int32))
                return jax_vmm.decode_attention(q, layer, jnp.full((S,), 4, jnp.int32))

            q, new = jnp.ones((2, S, HQ, D), DT), jnp.ones((2, 1, H, D), DT)
            batched = jax.jit(jax.vmap(write_then_read, spmd_axis_name=spmd))
            raises(exc, lambda b=batched: b(q, new), words)
        finally:
            kv.close()


if __name__ == "__main__":
    sys.exit(multidevice.main(SCENARIOS, sys.argv[1:]))
