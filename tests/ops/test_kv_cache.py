"""The KV cache as a JAX pytree (issue #10): ``kv.cache()`` -> ``KVCache`` of
``KVLayer`` s; ``kv_write(layer, ...)`` -> ``KVLayer``; ``decode_attention(q, layer,
lengths)``; ``cache.replace(l, layer)``.

What must hold whatever the user does with the cache (donated or not, eager, ``jit``,
``lax.scan`` of 64 steps, ``fori_loop``, ``while_loop``; CPU and GPU):

* after the step the arena holds every written token. The oracle reads the arena memory
  without JAX: a memcpy from its address on the host, a device-to-host cudaMemcpy on a GPU
  (conftest.raw_bytes);
* attention later in the same step reads them (checked against a float64 reference of
  the tokens written so far: the write is ordered before the read by the layer's token);
* dropped writes (slot out of range, unbacked, past the ensured tokens) and reads past
  the ensured tokens are counted where ``kv.check()`` sees them;
* the same arena never retraces (trace counter), two arenas and an array cache go
  through the same step.

Each safety test is shown to catch its failure with the protection removed through
``jax_vmm.testing``: ``identity_stripped()`` (the cache pytree carries the arena views
as arrays: XLA copies them and the arena is not written), ``limits_ignored()`` (no table
of ensured tokens: a write past them lands and a read past them is not counted).
"""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
import jax_vmm.testing
from conftest import child_env, raw_bytes

L, B, T, HKV, HQ, D = 2, 2, 128, 2, 4, 64
#: How a refused step fails: JaxRuntimeError through JAX's Python dispatch, ValueError (the
#: handler's INVALID_ARGUMENT) through its C++ fast path, which a cache step takes.
_RUN_ERRORS = (jax.errors.JaxRuntimeError, ValueError)
DT = np.float32


def _kv(vm, **kw):
    """A test KV arena; zero-filled, so that tokens never written read as zeros."""
    kw = (
        dict(
            num_layers=L,
            num_kv_heads=HKV,
            head_dim=D,
            max_tokens=T,
            max_seqs=B,
            dtype=DT,
            zero_fill=True,
        )
        | kw
    )
    return vm.kv(**kw)


def _tokens(steps: int, seed: int) -> dict[str, np.ndarray]:
    """Per step: new K/V (L, B, H_kv, D) and q (L, B, H_q, D), finite and distinct."""
    rng = np.random.default_rng(seed)
    return {
        "k": rng.standard_normal((steps, L, B, HKV, D)).astype(DT),
        "v": rng.standard_normal((steps, L, B, HKV, D)).astype(DT),
        "q": rng.standard_normal((steps, L, B, HQ, D)).astype(DT),
    }


def _step(cache, q, new_k, new_v, pos):
    """One decode step: every sequence writes the token at `pos` into every layer, then
    attends over tokens [0, pos]."""
    slots = (jnp.arange(B, dtype=jnp.int32) * T + pos).astype(jnp.int32)
    lengths = jnp.full((B,), pos + 1, jnp.int32)
    outs = []
    for layer in range(L):
        written = jax_vmm.kv_write(cache[layer], new_k[layer], new_v[layer], slots)
        outs.append(jax_vmm.decode_attention(q[layer], written, lengths))
        cache = cache.replace(layer, written)
    return cache, jnp.stack(outs)


def _reference(data: dict, step: int) -> np.ndarray:
    """float64 attention of step `step` over the tokens of steps 0..step: (L, B, H_q, D)."""
    k = data["k"][: step + 1].astype(np.float64)  # (t, L, B, H, D)
    v = data["v"][: step + 1].astype(np.float64)
    q = data["q"][step].astype(np.float64)  # (L, B, H_q, D)
    g = HQ // HKV
    s = np.einsum("lbhgd,tlbhd->lbhgt", q.reshape(L, B, HKV, g, D), k) / np.sqrt(D)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("lbhgt,tlbhd->lbhgd", p, v).reshape(L, B, HQ, D)


def _run(how: str, kv, data: dict, steps: int, donate_scan: bool = True):
    """Runs `steps` decode steps the way `how` says; returns the final cache and the
    attention outputs (steps, L, B, H_q, D). The scan donates its cache unless told not
    to."""
    cache = kv.cache()
    dev = kv.arena.device
    put = lambda x: jax.device_put(jnp.asarray(x), dev)  # noqa: E731
    q, nk, nv = put(data["q"]), put(data["k"]), put(data["v"])
    if how in ("eager", "jit", "jit_donated"):
        fn = {
            "eager": _step,
            "jit": jax.jit(_step),
            "jit_donated": jax.jit(_step, donate_argnums=0),
        }[how]
        outs = []
        for i in range(steps):
            cache, out = fn(cache, q[i], nk[i], nv[i], jnp.int32(i))
            outs.append(out)
        return cache, jnp.stack(outs)
    if how == "scan":

        def body(c, x):
            return _step(c, *x)

        donate = (0,) if donate_scan else ()
        run = jax.jit(lambda c, xs: jax.lax.scan(body, c, xs), donate_argnums=donate)
        return run(cache, (q[:steps], nk[:steps], nv[:steps], jnp.arange(steps, dtype=jnp.int32)))
    out0 = jnp.zeros((steps, L, B, HQ, D), DT)
    if how == "fori":

        def fbody(i, carry):
            c, outs = carry
            c, out = _step(c, q[i], nk[i], nv[i], i)
            return c, outs.at[i].set(out)

        return jax.jit(lambda c, o: jax.lax.fori_loop(0, steps, fbody, (c, o)))(cache, out0)
    if how == "while":

        def wbody(carry):
            i, c, outs = carry
            c, out = _step(c, q[i], nk[i], nv[i], i)
            return i + 1, c, outs.at[i].set(out)

        run = jax.jit(lambda c, o: jax.lax.while_loop(lambda s: s[0] < steps, wbody, (0, c, o)))
        _, c, outs = run(cache, out0)
        return c, outs
    raise AssertionError(how)


def _arena_tokens(kv, side: str, layer: int, steps: int) -> np.ndarray:
    """What the arena holds at positions [0, steps) of every sequence: (steps, B, H, D)."""
    buf = (kv.k_buffers if side == "k" else kv.v_buffers)[layer]
    raw = raw_bytes(buf).view(DT).reshape(B, T, HKV, D)
    return raw[:, :steps].transpose(1, 0, 2, 3)


def _assert_arena_holds(kv, data: dict, steps: int) -> None:
    for layer in range(L):
        for side in ("k", "v"):
            np.testing.assert_array_equal(
                _arena_tokens(kv, side, layer, steps),
                data[side][:steps, layer],
                err_msg=f"arena {side}{layer} does not hold the written tokens",
            )


HOWS = [
    ("eager", 3),
    ("jit", 4),
    ("jit_donated", 4),
    ("scan", 64),
    ("fori", 16),
    ("while", 16),
]


@pytest.mark.parametrize("how,steps", HOWS, ids=[h for h, _ in HOWS])
def test_the_arena_holds_every_token_and_attention_reads_them(vm, how, steps):
    kv = _kv(vm)
    for seq in range(B):
        kv.ensure(steps, seq)
    data = _tokens(steps, seed=steps)
    cache, outs = _run(how, kv, data, steps)
    kv.check(outs, cache)  # nothing dropped, nothing read past the ensured tokens
    _assert_arena_holds(kv, data, steps)
    outs = np.asarray(outs)
    for i in range(steps):
        np.testing.assert_allclose(
            outs[i], _reference(data, i), rtol=2e-5, atol=2e-5, err_msg=f"{how} step {i}"
        )
    # The cache that came back names the same arena: a concrete read sees the tokens.
    np.testing.assert_array_equal(
        np.asarray(cache[1].v)[:, :steps].transpose(1, 0, 2, 3), data["v"][:steps, 1]
    )


@pytest.mark.parametrize("how", ["jit", "scan"])
def test_with_the_identity_stripped_the_arena_misses_the_tokens(vm, how):
    """The oracle of the test above catches the naive cache pytree (the arena views as
    leaves, not donated): XLA writes its copy and the arena keeps zeros. (Donated, a GPU
    hands a view's memory over in place and XLA's copy is the arena itself.)"""
    kv = _kv(vm)
    for seq in range(B):
        kv.ensure(8, seq)
    data = _tokens(8, seed=3)
    with jax_vmm.testing.identity_stripped():
        cache, outs = _run(how, kv, data, 8 if how == "scan" else 2, donate_scan=False)
        jax.block_until_ready(outs)
    assert not cache[0].is_arena  # the copies came back as an array cache
    assert not np.any(_arena_tokens(kv, "k", 0, 2)), "the arena was written after all"
    with pytest.raises(AssertionError, match="does not hold the written tokens"):
        _assert_arena_holds(kv, data, 2)


def test_the_cache_is_a_pytree_that_carries_no_big_array(vm):
    kv = _kv(vm)
    cache = kv.cache()
    leaves, treedef = jax.tree_util.tree_flatten(cache)
    assert len(cache) == L and len(leaves) == L
    assert all(np.shape(x) == () and np.dtype(x.dtype) == np.int32 for x in leaves)
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert again[1].id == cache[1].id and again[1].is_arena
    assert jax.tree_util.tree_structure(kv.cache()) == treedef  # the same arena: same key
    other = _kv(vm)
    assert jax.tree_util.tree_structure(other.cache()) != treedef
    assert cache[0].id.cache_uid == kv.uid and cache[0].id.shape == (B, T, HKV, D)
    assert hash(cache[0].id) == hash(kv.cache()[0].id)
    # Nothing big is an XLA value: the step's arguments and results are a few bytes.
    data = _tokens(1, 0)
    lowered = jax.jit(_step).lower(
        cache,
        jnp.asarray(data["q"][0]),
        jnp.asarray(data["k"][0]),
        jnp.asarray(data["v"][0]),
        jnp.int32(0),
    )
    mem = lowered.compile().memory_analysis()
    cache_bytes = 2 * L * B * T * HKV * D * np.dtype(DT).itemsize
    if mem is not None:
        assert mem.argument_size_in_bytes < cache_bytes / 8
        assert mem.output_size_in_bytes < cache_bytes / 8


def test_the_same_arena_never_retraces_another_one_does(vm):
    kv, other = _kv(vm), _kv(vm)
    for a in (kv, other):
        for seq in range(B):
            a.ensure(4, seq)
    traces = []

    @jax.jit
    def step(cache, q, nk, nv, pos):
        traces.append(1)
        return _step(cache, q, nk, nv, pos)

    data = _tokens(3, 1)

    def args(i):
        return jnp.asarray(data["q"][i]), jnp.asarray(data["k"][i]), jnp.asarray(data["v"][i])

    cache = kv.cache()
    for i in range(3):
        cache, _ = step(cache, *args(i), jnp.int32(i))
    step(kv.cache(), *args(0), jnp.int32(0))  # a fresh cache of the same arena
    assert len(traces) == 1
    step(other.cache(), *args(0), jnp.int32(0))
    assert len(traces) == 2, "another arena must not reuse the first arena's executable"
    kv.check()
    other.check()
    np.testing.assert_array_equal(_arena_tokens(other, "k", 0, 1), data["k"][:1, 0])


def test_two_arenas_and_an_array_cache_in_one_step(vm):
    a, b = _kv(vm), _kv(vm)
    for x in (a, b):
        for seq in range(B):
            x.ensure(4, seq)
    zeros = lambda: jax.device_put(jnp.zeros((B, T, HKV, D), DT), vm.device)  # noqa: E731
    plain = jax_vmm.KVCache.from_arrays([zeros() for _ in range(L)], [zeros() for _ in range(L)])
    data = _tokens(2, 5)

    @jax.jit
    def step(ca, cb, cp, q, nk, nv, pos):
        ca, oa = _step(ca, q, nk, nv, pos)
        cb, ob = _step(cb, q, nv, nk, pos)  # the other arena gets k and v swapped
        cp, op = _step(cp, q, nk, nv, pos)
        return ca, cb, cp, oa, ob, op

    caches = (a.cache(), b.cache(), plain)
    for i in range(2):
        *caches, oa, ob, op = step(
            *caches,
            jnp.asarray(data["q"][i]),
            jnp.asarray(data["k"][i]),
            jnp.asarray(data["v"][i]),
            jnp.int32(i),
        )
        np.testing.assert_allclose(np.asarray(oa), _reference(data, i), rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(np.asarray(op), np.asarray(oa), rtol=1e-6, atol=1e-6)
    a.check()
    b.check()
    _assert_arena_holds(a, data, 2)
    swapped = {"k": data["v"], "v": data["k"]}
    _assert_arena_holds(b, swapped, 2)
    # The array cache holds the same tokens, in its own arrays.
    got = np.asarray(caches[2][0].k)[:, :2].transpose(1, 0, 2, 3)
    np.testing.assert_array_equal(got, data["k"][:2, 0])


def test_an_array_cache_drops_slots_outside_it_and_skips_padding(cpu_device):
    k = jnp.zeros((B, T, HKV, D), DT)
    layer = jax_vmm.KVLayer.from_arrays(k, k)
    new = jnp.ones((3, HKV, D), DT)
    out = jax.jit(jax_vmm.kv_write)(layer, new, 2 * new, jnp.array([-1, 5, B * T], jnp.int32))
    flat = np.asarray(out.v).reshape(-1, HKV, D)
    assert np.all(flat[5] == 2) and np.count_nonzero(flat) == HKV * D
    assert not out.is_arena and np.asarray(layer.k).sum() == 0  # functional


# -- what kv.check() reports -----------------------------------------------------------------


def _write_one(kv, slot: int, value: float = 1.0):
    """A jitted kv_write of one token at `slot` in layer 0 (not donated)."""
    new = jax.device_put(jnp.full((1, HKV, D), value, DT), kv.arena.device)
    layer = jax.jit(jax_vmm.kv_write)(kv.cache()[0], new, new, jnp.array([slot], jnp.int32))
    return layer


@pytest.mark.parametrize(
    "where", ["out_of_range", "past_the_ensured_tokens", "unbacked"], ids=lambda w: w
)
def test_dropped_writes_are_reported_by_check(vm, where):
    kv = _kv(vm)
    kv.ensure(10, 0)  # sequence 0: 10 tokens ensured; its chunk backs more (rounding)
    slot = {"out_of_range": B * T, "past_the_ensured_tokens": 50, "unbacked": T + 3}[where]
    if where == "past_the_ensured_tokens":
        assert kv.backed_tokens(0) > 50, "the token must lie in a backed chunk"
    if where == "unbacked" and kv.backed_tokens(1) > 3:
        pytest.skip("this device's chunk backs sequence 1 too")
    before = raw_bytes(kv.k_buffers[0])
    _write_one(kv, slot)
    with pytest.raises(jax_vmm.OutOfBoundsWrite) as info:
        kv.check()
    assert info.value.count == 2  # k and v
    kv.check()  # reset
    np.testing.assert_array_equal(raw_bytes(kv.k_buffers[0]), before)


def test_a_write_past_the_ensured_tokens_needs_the_table(vm):
    """#11.7: without the table of ensured tokens the write lands in the chunk that
    rounding backs, and check() passes: the test above would see it."""
    kv = _kv(vm)
    kv.ensure(10, 0)
    with jax_vmm.testing.limits_ignored():
        _write_one(kv, 50, 7.0)
    kv.check()  # nothing counted
    got = raw_bytes(kv.k_buffers[0]).view(DT).reshape(B, T, HKV, D)[0, 50]
    assert np.all(got == 7.0), "the unchecked write should have landed"


def test_a_token_a_release_took_away_is_never_written(vm):
    """A neighbour's release can take a chunk a sequence only got by rounding: writes
    there are dropped because they were never ensured, not because the page is gone."""
    kv = _kv(vm)
    kv.ensure(T, 0)
    kv.ensure(2, 1)
    kv.release(0)
    _write_one(kv, T + 1)  # ensured: lands (sequence 1's own chunk is backed)
    _write_one(kv, T + 5)  # not ensured: dropped, whatever backs it
    with pytest.raises(jax_vmm.OutOfBoundsWrite) as info:
        kv.check()
    assert info.value.count == 2
    tokens = raw_bytes(kv.k_buffers[0]).view(DT).reshape(B, T, HKV, D)[1]
    assert np.all(tokens[1] == 1.0) and not np.any(tokens[5])


def _attend(kv, lengths, q=None):
    cache = kv.cache()
    q = jnp.ones((B, HQ, D), DT) if q is None else q
    fn = jax.jit(lambda c, q, n: jax_vmm.decode_attention(q, c[0], n))
    return np.asarray(
        fn(cache, jax.device_put(q, kv.arena.device), jnp.asarray(lengths, jnp.int32))
    )


def test_reads_past_the_ensured_tokens_are_clamped_and_reported(vm):
    """#11.5: lengths beyond the ensured tokens read only those, and check() says so."""
    kv = _kv(vm)
    kv.ensure(4, 0)
    kv.ensure(6, 1)
    data = _tokens(1, 9)
    slots = np.concatenate([np.arange(8), T + np.arange(8)]).astype(np.int32)
    with jax_vmm.testing.limits_ignored():  # tokens past the ensured ones, in backed chunks
        new = jnp.asarray(np.random.default_rng(9).standard_normal((16, HKV, D)), DT)
        jax.jit(jax_vmm.kv_write)(kv.cache()[0], new, new, jnp.asarray(slots))
    kv.check()
    q = jnp.asarray(data["q"][0, 0])
    exact = _attend(kv, [4, 6], q)
    kv.check()  # within the ensured tokens: nothing to report
    clamped = _attend(kv, [8, 6], q)
    with pytest.raises(jax_vmm.OutOfBoundsRead) as info:
        kv.check()
    assert info.value.count == 1
    np.testing.assert_array_equal(clamped, exact)
    with jax_vmm.testing.limits_ignored():
        unclamped = _attend(kv, [8, 6], q)
    kv.check()  # not counted without the table: the test above would see it
    assert not np.allclose(unclamped[0], exact[0]), "without the clamp tokens 4..7 are read"


def test_wide_lengths_are_clamped_before_the_int32_cast(vm):
    kv = _kv(vm)
    kv.ensure(T, 0)
    kv.ensure(T, 1)
    out = _attend(kv, np.array([2**32 + 1, 3], np.int64))
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize(
    "seq,pos",
    [
        (0, 2**32 + 1),  # wrapped to position 1
        (2**32 + 1, 0),  # wrapped to sequence 1
        (0, -(2**32) + 2),  # wrapped to position 2
        (2**32 - 1, 0),  # wrapped to -1: an idle row, skipped uncounted
        (np.uint32(2**32 - 1), 0),
    ],
)
def test_a_write_out_of_the_int32_range_is_dropped_and_counted(vm, seq, pos):
    """seq / pos past int32 never wrap into the cache: the write is dropped and counted,
    and no token of any sequence changes."""
    kv = _kv(vm)
    kv.ensure(T, 0)
    kv.ensure(T, 1)
    before = [raw_bytes(b).tobytes() for b in kv.buffers]
    new = jax.device_put(jnp.full((1, HKV, D), 9.0, DT), vm.device)
    dtype = np.uint32 if isinstance(seq, np.uint32) else np.int64
    layer = jax_vmm.kv_write(
        kv.cache()[0], new, new, seq=np.array([seq], dtype), pos=np.array([pos], np.int64)
    )
    with pytest.raises(jax_vmm.OutOfBoundsWrite) as info:
        kv.check(layer)
    assert info.value.count == 2  # K and V
    assert [raw_bytes(b).tobytes() for b in kv.buffers] == before


@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.uint16, jnp.uint32, np.uint32, np.uint64])
@pytest.mark.parametrize("jit", [False, True])
def test_a_write_at_unsigned_coordinates_lands(vm, dtype, jit):
    """seq / pos of an unsigned type write where they say. (A uint32 jax array was clamped
    with the lower bound -2 wrapped to 2**32 - 2, so every write was dropped.)"""
    kv = _kv(vm)
    kv.ensure(T, 1)
    new = jax.device_put(jnp.full((1, HKV, D), 5.0, DT), vm.device)
    seq, pos = (
        (jnp.asarray if dtype in (jnp.uint8, jnp.uint16, jnp.uint32) else np.asarray)([1], dtype),
        np.asarray([2], dtype),
    )

    def write(cache, seq, pos):
        return jax_vmm.kv_write(cache[0], new, new, seq=seq, pos=pos)

    layer = (jax.jit(write) if jit else write)(kv.cache(), seq, pos)
    kv.check(layer)
    got = raw_bytes(kv.k_buffers[0], kv.seq_bytes, 2 * kv.seq_bytes).view(DT)
    got = got.reshape(T, HKV, D)
    assert np.all(got[2] == 5.0) and np.count_nonzero(got) == HKV * D


def test_a_token_without_its_n_axis_is_named_in_the_error(vm):
    kv = _kv(vm, initial_tokens=4)
    one = jnp.ones((HKV, D), DT)
    with pytest.raises(ValueError, match=r"new_k must be \(n, num_kv_heads, head_dim\)"):
        jax_vmm.kv_write(kv.cache()[0], one, one, seq=np.array([0]), pos=np.array([1]))


def test_an_arena_of_2_31_slots_or_more_is_refused():
    with pytest.raises(ValueError, match="token slots: kv_write addresses a token by an int32"):
        jax_vmm.kv_arena(
            num_layers=1, num_kv_heads=1, head_dim=8, max_tokens=2**20, max_seqs=2**11,
            dtype=DT,
        )  # fmt: skip


# -- identity: closed, destroyed, other devices --------------------------------------------------


def test_a_closed_or_destroyed_cache_refuses_to_run(vm):
    kv = jax_vmm.kv_arena(
        num_layers=L,
        num_kv_heads=HKV,
        head_dim=D,
        max_tokens=T,
        max_seqs=B,
        dtype=DT,
        device=vm.device,
        initial_tokens=4,
    )
    cache = kv.cache()
    new = jax.device_put(jnp.ones((1, HKV, D), DT), vm.device)
    step = jax.jit(lambda c, x: jax_vmm.kv_write(c[0], x, x, jnp.array([1], jnp.int32)))
    jax.block_until_ready(step(cache, new))
    kv.close()
    # A compiled step that fails in JAX's C++ fast path surfaces the handler's
    # INVALID_ARGUMENT as ValueError, through the Python path as JaxRuntimeError.
    with pytest.raises(_RUN_ERRORS, match=r"KV cache \d+ was closed"):
        jax.block_until_ready(step(cache, new))
    with pytest.raises(jax.errors.JaxRuntimeError, match="was closed"):
        jax.block_until_ready(
            jax.jit(lambda c, q: jax_vmm.decode_attention(q, c[0], jnp.ones((B,), jnp.int32)))(
                cache, jax.device_put(jnp.ones((B, HQ, D), DT), vm.device)
            )
        )
    with pytest.raises(jax_vmm.ArenaClosedError, match="KVLayer.k: the arena is closed"):
        cache[0].k  # noqa: B018
    with pytest.raises(jax_vmm.ArenaClosedError):
        kv.cache()
    del kv
    gc.collect()
    with pytest.raises(_RUN_ERRORS, match=r"KV cache \d+ no longer exists"):
        jax.block_until_ready(step(cache, new))
    with pytest.raises(ValueError, match="no longer exists"):
        cache[0].k  # noqa: B018


def test_kv_write_on_a_layer_refuses_bad_arguments(vm):
    kv = _kv(vm)
    layer = kv.cache()[0]
    new = jnp.ones((1, HKV, D), DT)
    slot = jnp.array([0], jnp.int32)
    with pytest.raises(TypeError, match="dest= is for the array form"):
        jax_vmm.kv_write(layer, new, new, slot, dest=kv.dest(0))
    with pytest.raises(TypeError, match="needs seq= and pos="):
        jax_vmm.kv_write(layer, new, new)
    with pytest.raises(TypeError, match="has dtype float16"):
        jax_vmm.kv_write(layer, new.astype(jnp.float16), new, slot)
    with pytest.raises(ValueError, match="new_k must have shape"):
        jax_vmm.kv_write(layer, jnp.ones((1, HKV, D + 1), DT), new, slot)
    with pytest.raises(TypeError, match="slots must be int32"):
        jax_vmm.kv_write(layer, new, new, slot.astype(jnp.float32))
    with pytest.raises(ValueError, match="cannot take its place"):
        kv.cache().replace(0, layer.__class__._arena(kv.cache()[1].id, layer.token))
    with pytest.raises(ValueError, match="view of arena buffer 'k0'"):
        jax_vmm.KVLayer.from_arrays(kv.k[0], kv.v[0])
    with pytest.raises(TypeError, match="inside jit an arena layer has no k array"):
        jax.jit(lambda c: c[0].k)(kv.cache())
    with pytest.raises(ValueError, match="an fp8 layer carries its scales|k_scale/v_scale"):
        jax_vmm.decode_attention(
            jnp.ones((B, HQ, D), DT),
            layer,
            jnp.ones(B, jnp.int32),
            k_scale=jnp.ones(HKV, jnp.float32),
        )


def test_kv_write_says_the_first_argument_must_be_a_layer(vm):
    kv = _kv(vm, initial_tokens=4)
    cache, new, slot = kv.cache(), jnp.ones((1, HKV, D), DT), jnp.array([1], jnp.int32)
    first = r"the first argument must be a KVLayer \(cache\[l\]\)"
    with pytest.raises(TypeError, match=first + ", got a whole KVCache"):
        jax_vmm.kv_write(cache, new, new, slot)
    with pytest.raises(TypeError, match=first + ", got ArrayImpl first and a KVLayer as arg"):
        jax_vmm.kv_write(new, cache[0], new, slot)
    with pytest.raises(TypeError, match="has a bfloat16 token; an arena layer's leaves"):
        jax_vmm.kv_write(jax.tree.map(lambda x: x.astype(jnp.bfloat16), cache)[0], new, new, slot)
    with pytest.raises(TypeError, match="has a bfloat16 token"):  # inside jit too
        jax.jit(lambda c: jax_vmm.kv_write(c[0], new, new, slot))(
            jax.tree.map(lambda x: x.astype(jnp.bfloat16), cache)
        )


def test_mapped_tokens_of_any_kind_are_refused_by_every_op(vm):
    """A token stacked to another shape, or replaced by a Python scalar or None, is named
    (not JAX's lowering error, not an AttributeError from inside the check)."""
    kv = _kv(vm, initial_tokens=4)
    cache, new, slot = kv.cache(), jnp.ones((1, HKV, D), DT), jnp.array([1], jnp.int32)
    q, lengths = jnp.ones((B, 2 * HKV, D), DT), jnp.ones((B,), jnp.int32)
    mapped = {
        "int32 token of shape (2,)": jax.tree.map(lambda x: jnp.stack([x, x]), cache),
        "int token": jax.tree.map(lambda x: 0, cache),
        "NoneType token": jax.tree.map(lambda x: None, cache),
    }
    for words, bad in mapped.items():
        with pytest.raises(TypeError, match=f"has a {re.escape(words)}.*an arena layer's leaves"):
            jax_vmm.kv_write(bad[0], new, new, slot)
        with pytest.raises(TypeError, match=f"has a {re.escape(words)}"):
            jax_vmm.decode_attention(q, bad[0], lengths)


def test_attention_names_arguments_in_the_wrong_place(vm):
    kv = _kv(vm, initial_tokens=4)
    cache = kv.cache()
    q, lengths = jnp.ones((B, 2 * HKV, D), DT), jnp.ones((B,), jnp.int32)
    whole = r"got a whole KVCache as the layer; pass one layer, cache\[l\]"
    with pytest.raises(TypeError, match="decode_attention.*" + whole):
        jax_vmm.decode_attention(q, cache, lengths)
    with pytest.raises(TypeError, match="attention.*" + whole):
        jax_vmm.attention(q[:, None], cache, lengths)
    with pytest.raises(TypeError, match="the first argument is the query array, got a KVLayer"):
        jax_vmm.attention(cache[0], q[:, None], lengths)
    with pytest.raises(
        TypeError, match=r"decode_attention\(q, layer, lengths\): lengths is missing"
    ):
        jax_vmm.decode_attention(q, cache[0])
    # The arena itself, or a (k, v) pair, where the layer belongs (the message said "a
    # missing lengths" though lengths was passed).
    arena = (
        r"got the KV arena \(KVArena\) as the layer; pass one layer of its cache, kv.cache\(\)\[l\]"
    )
    with pytest.raises(TypeError, match="decode_attention.*" + arena):
        jax_vmm.decode_attention(q, kv, lengths)
    with pytest.raises(TypeError, match="attention.*" + arena):
        jax_vmm.attention(q[:, None], kv, lengths, window=2)
    pair = r"got a tuple where the layer or k belongs; pass k and v as two arguments"
    with pytest.raises(TypeError, match=pair):
        jax_vmm.attention(q[:, None], (cache[0].k, cache[0].v), lengths)
    with pytest.raises(TypeError, match=pair):
        jax_vmm.decode_attention(q, (cache[0].k, cache[0].v), lengths)


def test_a_layer_read_outside_jit_waits_for_its_writes(vm):
    kv = _kv(vm)
    kv.ensure(4, 1)
    layer = _write_one(kv, T + 2, 3.0)
    view = layer.v  # waits for the write, then a fresh zero-copy view
    assert view.unsafe_buffer_pointer() == kv.v_buffers[0].address
    assert np.all(np.asarray(view)[1, 2] == 3.0)


# -- reads by plain XLA ops ----------------------------------------------------------------------


def test_ordered_views_let_xla_read_the_arena_after_the_writes(vm):
    """The "jax_vmm + cuDNN" pattern: a write step, then a read step over the views that
    takes the layer (XLA starts it once the writes' token is ready)."""
    kv = _kv(vm)
    for seq in range(B):
        kv.ensure(4, seq)
    data = _tokens(3, 11)

    @jax.jit
    def write(cache, nk, nv, pos):
        slots = (jnp.arange(B, dtype=jnp.int32) * T + pos).astype(jnp.int32)
        return cache.replace(0, jax_vmm.kv_write(cache[0], nk[0], nv[0], slots))

    @jax.jit
    def read(cache, kview, vview, q, pos):
        k, v = jax_vmm.ordered_views(cache[0], kview, vview)
        lengths = jnp.full((B,), pos + 1, jnp.int32)
        return jax_vmm.ops.attention.reference_decode_attention(q[0], k, v, lengths)

    cache = kv.cache()
    for i in range(3):
        pos = jnp.int32(i)
        cache = write(cache, jnp.asarray(data["k"][i]), jnp.asarray(data["v"][i]), pos)
        out = read(cache, kv.k[0], kv.v[0], jnp.asarray(data["q"][i]), pos)
        np.testing.assert_allclose(np.asarray(out), _reference(data, i)[0], rtol=2e-5, atol=2e-5)
    # Eager: checks the views and waits for the layer's writes.
    k, v = jax_vmm.ordered_views(cache[0], kv.k[0], kv.v[0])
    assert k.unsafe_buffer_pointer() == kv.k_buffers[0].address
    with pytest.raises(ValueError, match="not a view of"):
        jax_vmm.ordered_views(cache[0], kv.k[1], kv.v[0])


@pytest.mark.parametrize("write_in", ["the step", "a nested jit"])
def test_ordered_views_refuse_a_layer_written_in_the_same_function(vm, write_in):
    """Also a layer a jitted helper wrote: XLA inlines it, so its write is this
    computation's (the step read the views before it: sum 0, not 16). It was not
    refused, since the layer rebuilt from the helper's result carried no mark."""
    kv = _kv(vm)
    kv.ensure(2, 0)
    new = jnp.ones((1, HKV, D), DT)

    def write(layer):
        return jax_vmm.kv_write(layer, new, new, jnp.array([0], jnp.int32))

    if write_in == "a nested jit":
        write = jax.jit(write)

    def step(cache, k, v):
        return jax_vmm.ordered_views(write(cache[0]), k, v)

    with pytest.raises(ValueError, match="written by a kv_write in this same computation"):
        jax.jit(step)(kv.cache(), kv.k[0], kv.v[0])


def _sum_k_before_each_write(kv, loop: str):
    """A jitted loop of 4 steps: step t reads the sum of sequence 0's K tokens before t
    through ordered_views, then writes one token of ones (K and V) at position t. Nothing
    orders the read before the same step's write (jax 0.11's XLA:CPU ran the write first),
    so the read covers only tokens the step does not write, as a decode step's does."""
    new = jnp.ones((1, HKV, D), DT)

    def body(t, carry):
        cache, k, v, sums = carry
        kk, _ = jax_vmm.ordered_views(cache[0], k, v)
        per_token = kk[0].sum(axis=(1, 2))  # loop-invariant for XLA without the barrier
        sums = sums.at[t].set(jnp.where(jnp.arange(per_token.shape[0]) < t, per_token, 0).sum())
        layer = jax_vmm.kv_write(cache[0], new, new, seq=jnp.zeros(1, jnp.int32), pos=t[None])
        return cache.replace(0, layer), k, v, sums

    def run(cache, k, v):
        carry = (cache, k, v, jnp.zeros(4, DT))
        if loop == "scan":
            carry, _ = jax.lax.scan(lambda c, t: (body(t, c), None), carry, jnp.arange(4))
        elif loop == "fori_loop":
            carry = jax.lax.fori_loop(0, 4, lambda t, c: body(jnp.int32(t), c), carry)
        else:  # a while loop, the read in a nested jit
            carry = jax.lax.while_loop(
                lambda c: c[0] < 4,
                lambda c: (c[0] + 1, jax.jit(body)(c[0], c[1])),
                (jnp.int32(0), carry),
            )[1]
        return carry[0], carry[3]

    return jax.jit(run)(kv.cache(), kv.k[0], kv.v[0])


@pytest.mark.parametrize("loop", ["scan", "fori_loop", "while_loop"])
def test_ordered_views_in_a_loop_read_the_earlier_iterations_writes(vm, loop):
    """In a loop body (a scan, a fori_loop, a while loop with the read in a nested jit)
    each iteration reads K after the writes of the iterations before: 0, 1, 2, 3 tokens
    of ones, sums 0, 128, 256, 384. The control takes the views as they came, without the
    barrier on the layer's token: XLA:CPU then hoists the read out of the loop, and every
    iteration reads K as it was before the loop (it did so, silently, all zeros). XLA:GPU
    kept the read in the loop without the barrier here (H100, jax 0.11.2), which nothing
    promises."""
    kv = _kv(vm)
    kv.ensure(4, 0)
    want = [i * HKV * D for i in range(4)]
    cache, sums = _sum_k_before_each_write(kv, loop)
    kv.check(cache)
    assert np.asarray(sums).tolist() == want
    kv.release(0, wait=True)
    kv.ensure(4, 0)
    with jax_vmm.testing.loop_views_unbarriered():
        cache, sums = _sum_k_before_each_write(kv, loop)
    kv.check(cache)
    if vm.is_host:  # XLA:CPU hoists the read; XLA:GPU happened not to in this program
        assert np.asarray(sums).tolist() != want


def test_ordered_views_in_a_loop_still_check_the_buffers(vm):
    """The barrier keeps the check: another layer's view handed in fails the loop."""
    kv = _kv(vm)
    kv.ensure(2, 0)

    def run(cache, k, v):
        def body(i, acc):
            kk, _ = jax_vmm.ordered_views(cache[0], k, v)
            return acc + kk.sum()

        return jax.lax.fori_loop(0, 2, body, jnp.zeros((), DT))

    assert float(jax.jit(run)(kv.cache(), kv.k[0], kv.v[0])) == 0.0
    with pytest.raises(jax.errors.JaxRuntimeError, match="not KV cache .* layer 0's k buffer"):
        jax.block_until_ready(jax.jit(run)(kv.cache(), kv.k[1], kv.v[0]))


def test_ordered_views_refuse_a_copy_of_the_arena(vm):
    """A view that reaches the step as XLA's copy (another layer's buffer here, or a view
    donated on the CPU) fails the step instead of reading stale memory."""
    kv = _kv(vm)
    kv.ensure(2, 0)
    step = jax.jit(lambda c, k, v: jax_vmm.ordered_views(c[0], k, v)[0].sum())
    assert float(step(kv.cache(), kv.k[0], kv.v[0])) == 0.0
    with pytest.raises(jax.errors.JaxRuntimeError, match="not KV cache .* layer 0's k buffer"):
        jax.block_until_ready(step(kv.cache(), kv.k[1], kv.v[0]))
    copy = jax.device_put(jnp.zeros((B, T, HKV, D), DT), vm.device)
    with pytest.raises(jax.errors.JaxRuntimeError, match="memory outside the arena"):
        jax.block_until_ready(step(kv.cache(), copy, kv.v[0]))


# -- the array level without dest -------------------------------------------------------------


def test_an_arena_shaped_array_write_without_dest_warns_and_misses_the_arena(cpu_device):
    """The issue's repro: jax.jit(jax_vmm.kv_write)(kv.k[0], kv.v[0], ...) returns correct
    arrays but leaves the arena unwritten on the CPU; now it warns at trace time."""
    kv = jax_vmm.kv_arena(
        num_layers=1,
        num_kv_heads=HKV,
        head_dim=D,
        max_tokens=T,
        max_seqs=B,
        dtype=DT,
        initial_tokens=4,
        zero_fill=True,
    )
    try:
        new = jnp.ones((1, HKV, D), DT)
        slot = jnp.array([1], jnp.int32)
        with pytest.warns(jax_vmm.ArenaNotWrittenWarning, match="the arena is NOT written"):
            k, v = jax.jit(jax_vmm.kv_write)(kv.k[0], kv.v[0], new, new, slot)
        assert np.all(np.asarray(k)[0, 1] == 1.0)  # the returned arrays hold the token ...
        assert not np.any(raw_bytes(kv.k_buffers[0]))  # ... the arena does not
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            jax.jit(lambda *a: jax_vmm.kv_write(*a, dest=kv.dest(0)))(
                kv.k[0], kv.v[0], new, new, slot
            )
            jax.block_until_ready(jax.jit(jax_vmm.kv_write)(kv.cache()[0], new, new, slot).token)
        assert np.all(raw_bytes(kv.k_buffers[0]).view(DT).reshape(B, T, HKV, D)[0, 1] == 1)
    finally:
        kv.close()


def _small_kv(**kw):
    args = dict(num_layers=1, num_kv_heads=HKV, head_dim=D, max_tokens=T, max_seqs=B)
    return jax_vmm.kv_arena(**(args | dict(dtype=DT, initial_tokens=4, zero_fill=True) | kw))


def test_an_array_layer_of_traced_arena_views_warns_and_misses_the_arena(cpu_device):
    """KVLayer.from_arrays refuses concrete arena views; inside jit the views are tracers
    (passed in, or kept in a model's own cache dict), the write lands in XLA's copy, and
    the arena stays unwritten: it warns at trace time, as the array-level kv_write does."""
    kv = _small_kv()
    try:
        new = jnp.ones((1, HKV, D), DT)
        slot = jnp.array([1], jnp.int32)

        def step(own):  # a model's own cache dict of arena views
            cache = jax_vmm.KVCache.from_arrays(own["k"], own["v"])
            return jax_vmm.kv_write(cache[0], new, new, slot).k

        with pytest.warns(jax_vmm.ArenaNotWrittenWarning, match="does NOT write the arena"):
            k = jax.jit(step)({"k": [kv.k[0]], "v": [kv.v[0]]})
        assert np.all(np.asarray(k)[0, 1] == 1.0)  # the returned array holds the token ...
        assert not np.any(raw_bytes(kv.k_buffers[0]))  # ... the arena does not
        with pytest.warns(jax_vmm.ArenaNotWrittenWarning, match="k is shaped like a layer"):
            jax.jit(lambda k, v: jax_vmm.KVLayer.from_arrays(k, v).k)(kv.k[0], kv.v[0])
        with warnings.catch_warnings():  # arrays of another shape are not suspect
            warnings.simplefilter("error")
            other = jnp.zeros((B, T // 2, HKV, D), DT)
            jax.jit(lambda k, v: jax_vmm.KVLayer.from_arrays(k, v).k)(other, other)
    finally:
        kv.close()


def test_an_fp8_arena_layer_writes_with_the_arenas_scales_only(cpu_device):
    """The scales of an fp8 arena are fixed: scale leaves a jax.tree.map changed must not
    quantize tokens into it (they would read back off by that factor). Concrete ones are
    refused; traced ones (unknown when the step is traced) are replaced by the arena's."""
    f8 = jnp.float8_e4m3fn
    scales = np.full((1, HKV), 0.5, np.float32)
    kv = _small_kv(dtype=f8, k_scales=scales, v_scales=scales)
    try:
        new = jnp.full((1, HKV, D), 1.5, jnp.float32)
        slot = jnp.array([1], jnp.int32)

        def doubled(cache):
            return jax.tree.map(lambda x: x * 2 if x.dtype == jnp.float32 else x, cache)

        with pytest.raises(ValueError, match="is not the arena's"):
            jax_vmm.kv_write(doubled(kv.cache())[0], new, new, slot)
        closed_over = doubled(kv.cache())
        with pytest.raises(ValueError, match="is not the arena's"):  # a jit that closes over it
            jax.jit(lambda: jax_vmm.kv_write(closed_over[0], new, new, slot).token)()

        @jax.jit
        def step(cache, slot):
            return jax_vmm.kv_write(cache[0], new, new, slot).token

        want = np.asarray(jax_vmm.base.fp8.quantize_fp8(new, jnp.asarray(scales[0])))
        for i, cache in enumerate((doubled(kv.cache()), kv.cache())):  # traced leaves
            jax.block_until_ready(step(cache, slot + i))
            for buf in (kv.k_buffers[0], kv.v_buffers[0]):
                got = raw_bytes(buf).view(f8).reshape(B, T, HKV, D)[0, 1 + i]
                np.testing.assert_array_equal(got.view(np.uint8), want[0].view(np.uint8))
    finally:
        kv.close()


def test_an_fp8_arena_layer_is_read_with_the_arenas_scales_only(cpu_device):
    """Attention over an fp8 arena layer dequantizes with the arena's scales, as the write
    quantizes with them: scale leaves a jax.tree.map changed are refused when concrete and
    replaced by the arena's when traced (else the read is off by that factor)."""
    f8 = jnp.float8_e4m3fn
    scales = np.full((1, HKV), 0.5, np.float32)
    kv = _small_kv(dtype=f8, k_scales=scales, v_scales=scales)
    try:
        kv.ensure_all(np.full(B, 4, np.int64))
        rng = np.random.default_rng(3)
        new = jnp.asarray(rng.standard_normal((4, HKV, D)), jnp.float32)
        kv.check(jax_vmm.kv_write(kv.cache()[0], new, 2 * new, jnp.arange(4, dtype=jnp.int32)))
        q = jnp.asarray(rng.standard_normal((B, HQ, D)), jnp.bfloat16)
        lengths = jnp.array([4] + [0] * (B - 1), jnp.int32)

        def doubled(cache):
            return jax.tree.map(lambda x: x * 2 if x.dtype == jnp.float32 else x, cache)

        with pytest.raises(ValueError, match="decode_attention: .* is not the arena's"):
            jax_vmm.decode_attention(q, doubled(kv.cache())[0], lengths)
        read = jax.jit(lambda cache: jax_vmm.decode_attention(q, cache[0], lengths))
        want = np.asarray(read(kv.cache()))
        np.testing.assert_array_equal(np.asarray(read(doubled(kv.cache()))), want)
        assert np.abs(want[0]).max() > 0
        # Several query rows (the dequantized copy) and the same rule.
        q2 = jnp.stack([q, q], axis=1)
        with pytest.raises(ValueError, match="attention: .* is not the arena's"):
            jax_vmm.attention(q2, doubled(kv.cache())[0], lengths, window=3)
        rows = jax.jit(lambda cache: jax_vmm.attention(q2, cache[0], lengths, window=3))
        want2 = np.asarray(rows(kv.cache()))
        np.testing.assert_array_equal(np.asarray(rows(doubled(kv.cache()))), want2)
        assert np.abs(want2[0]).max() > 0
    finally:
        kv.close()


# -- fp8 arenas and the streaming kernel -------------------------------------------------------


def test_an_fp8_arena_layer_quantizes_writes_and_dequantizes_reads(vm):
    d = 64
    scales = np.array([[0.5, 2.0]] * L, np.float32)
    kv = _kv(vm, head_dim=d, dtype=jnp.float8_e4m3fn, k_scales=scales, v_scales=2 * scales)
    for seq in range(B):
        kv.ensure(8, seq)
    rng = np.random.default_rng(2)
    new_k = jnp.asarray(rng.standard_normal((B * 8, HKV, d)), jnp.bfloat16)
    new_v = jnp.asarray(rng.standard_normal((B * 8, HKV, d)), jnp.bfloat16)
    slots = jnp.asarray(np.concatenate([np.arange(8), T + np.arange(8)]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((B, HQ, d)), jnp.bfloat16)
    lengths = jnp.array([8, 5], jnp.int32)

    @jax.jit
    def step(cache, q):
        layer = jax_vmm.kv_write(cache[1], new_k, new_v, slots)
        return cache.replace(1, layer), jax_vmm.decode_attention(q, layer, lengths)

    cache, out = step(kv.cache(), q)
    kv.check(out)
    layer = cache[1]
    assert layer.fp8 and layer.k_scale.shape == (HKV,)
    want = np.asarray(jax_vmm.base.fp8.quantize_fp8(new_k, jnp.asarray(scales[1])))
    got = raw_bytes(kv.k_buffers[1]).view(jnp.float8_e4m3fn).reshape(B, T, HKV, d)
    np.testing.assert_array_equal(
        got[:, :8].reshape(-1, HKV, d).view(np.uint8), want.view(np.uint8)
    )
    ref = jax_vmm.ops.attention.reference_decode_attention(
        q,
        jnp.asarray(got),
        jnp.asarray(raw_bytes(kv.v_buffers[1]).view(jnp.float8_e4m3fn).reshape(B, T, HKV, d)),
        lengths,
        k_scale=jnp.asarray(scales[1]),
        v_scale=jnp.asarray(2 * scales[1]),
    )
    err = np.linalg.norm(np.asarray(out, np.float32) - np.asarray(ref, np.float32))
    assert err / np.linalg.norm(np.asarray(ref, np.float32)) < 1e-2


def test_the_streaming_kernel_reads_an_arena_layer_as_split_k_does(vm):
    kv = _kv(vm, num_layers=1, dtype=jnp.bfloat16)
    kv.ensure(40, 0)
    kv.ensure(17, 1)
    rng = np.random.default_rng(4)
    new = jnp.asarray(rng.standard_normal((57, HKV, D)), jnp.bfloat16)
    slots = jnp.asarray(np.concatenate([np.arange(40), T + np.arange(17)]), jnp.int32)
    layer = jax_vmm.kv_write(kv.cache()[0], new, new * 2, slots)
    q = jnp.asarray(rng.standard_normal((B, HQ, D)), jnp.bfloat16)
    lengths = jnp.array([40, 17], jnp.int32)
    split = jax_vmm.ops.attention.decode_attention_tuned(q, layer, lengths=lengths)
    stream = jax_vmm.ops.attention.decode_attention_tuned(q, layer, lengths=lengths, impl="stream")
    ref = jax_vmm.ops.attention.reference_decode_attention(q, kv.k[0], kv.v[0], lengths)
    for got in (split, stream):
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=2e-2, atol=2e-2
        )
    kv.check()


def test_vmap_over_queries_with_the_layer_unbatched(vm):
    kv = _kv(vm)
    kv.ensure(3, 0)
    kv.ensure(3, 1)
    layer = kv.cache()[0]
    qs = jax.device_put(jnp.ones((5, B, HQ, D), DT), vm.device)
    lengths = jnp.array([3, 2], jnp.int32)
    outs = jax.jit(jax.vmap(lambda q, c: jax_vmm.decode_attention(q, c, lengths), (0, None)))(
        qs, layer
    )
    single = jax_vmm.decode_attention(qs[0], layer, lengths)
    np.testing.assert_allclose(np.asarray(outs), np.broadcast_to(np.asarray(single), outs.shape))


def _candidates(vm, seed: int):
    """A zero-filled arena with 3 tokens ensured per sequence, three candidate tokens for
    slot (0, 2), a query, and what each candidate gives over a cache of its own."""
    kv = _kv(vm)
    kv.ensure(3, 0)
    kv.ensure(3, 1)
    rng = np.random.default_rng(seed)
    news = jnp.asarray(rng.standard_normal((3, 1, HKV, D)), DT)
    seq, pos = jnp.zeros((3, 1), jnp.int32), jnp.full((3, 1), 2, jnp.int32)
    q = jnp.asarray(rng.standard_normal((B, HQ, D)), DT)
    lengths = jnp.array([3, 3], jnp.int32)

    def own_copy(new):
        k = jnp.zeros((B, T, HKV, D), DT).at[0, 2].set(new[0])
        return np.asarray(jax_vmm.decode_attention(q, k, k, lengths))

    return kv, news, seq, pos, q, lengths, np.stack([own_copy(n) for n in news])


def test_a_read_in_the_vmap_that_wrote_the_layer_is_refused(vm):
    """vmap over candidate tokens at one slot, each read back: an array cache is copied
    per element, so each element attends to its own candidate; the arena is one memory,
    so each would attend to the last one written. Refused (jit(vmap) and vmap alike);
    with the refusal switched off the same call gives every element the last candidate,
    which is what the refusal prevents. Reading another layer in the vmap, or the written
    layer after it, is allowed."""
    kv = _kv(vm)
    kv.ensure(3, 0)
    kv.ensure(3, 1)
    rng = np.random.default_rng(5)
    news = jnp.asarray(rng.standard_normal((3, 1, HKV, D)), DT)
    seq, pos = jnp.zeros((3, 1), jnp.int32), jnp.full((3, 1), 2, jnp.int32)
    q = jnp.asarray(rng.standard_normal((B, HQ, D)), DT)
    lengths = jnp.array([3, 3], jnp.int32)

    def write_then_read(cache, new, s, p):
        layer = jax_vmm.kv_write(cache[0], new, new, seq=s, pos=p)
        return jax_vmm.decode_attention(q, layer, lengths)

    def own_copy(new):  # what an array cache gives element i: its candidate only
        k = jnp.zeros((B, T, HKV, D), DT).at[0, 2].set(new[0])
        return jax_vmm.decode_attention(q, k, k, lengths)

    want = np.stack([np.asarray(own_copy(n)) for n in news])
    in_axes = (None, 0, 0, 0)
    for run in (jax.vmap(write_then_read, in_axes), jax.jit(jax.vmap(write_then_read, in_axes))):
        with pytest.raises(ValueError, match="written by a kv_write batched by this same vmap"):
            run(kv.cache(), news, seq, pos)
    with jax_vmm.testing.vmapped_reads_allowed():
        got = np.asarray(jax.vmap(write_then_read, in_axes)(kv.cache(), news, seq, pos))
    assert not np.allclose(got[0], want[0], atol=1e-5)  # element 0 read candidate 2
    np.testing.assert_allclose(got[0], want[2], atol=1e-5)

    def write_read_other(cache, new, s, p):
        layer = jax_vmm.kv_write(cache[0], new, new, seq=s, pos=p)
        return cache.replace(0, layer), jax_vmm.decode_attention(q, cache[1], lengths)

    cache, _ = jax.vmap(write_read_other, in_axes, (None, 0))(kv.cache(), news, seq, pos)
    after = jax_vmm.decode_attention(q, cache[0], lengths)  # every write has landed
    np.testing.assert_allclose(np.asarray(after), want[2], atol=1e-5)
    kv.check()


def _nested(form: str, write_then_read):
    """``write_then_read(cache, new, s, p)`` with its read (or both calls) in a body JAX
    traces apart from the vmap and batches later."""
    if form == "jit":
        return jax.jit(write_then_read)
    if form == "checkpoint":
        return jax.checkpoint(write_then_read)
    if form == "cond":  # an unbatched predicate: vmap batches both branches' bodies
        return lambda c, n, s, p: jax.lax.cond(
            c[0].token >= 0, write_then_read, lambda *a: write_then_read(*a) * 0, c, n, s, p
        )
    if form == "fori_loop":
        return lambda c, n, s, p: jax.lax.fori_loop(
            0, 1, lambda i, out: write_then_read(c, n, s, p), jnp.zeros((B, HQ, D), DT)
        )
    if form == "inner_vmap":  # an inner vmap over nothing the write takes
        return lambda c, n, s, p: jax.vmap(lambda i: write_then_read(c, n, s, p))(jnp.arange(1))[0]
    raise AssertionError(form)


@pytest.mark.parametrize("form", ["jit", "checkpoint", "cond", "fori_loop", "inner_vmap"])
def test_a_read_nested_in_the_vmap_that_wrote_the_layer_is_refused(vm, form):
    """The same candidates at one slot as above, the step in a body JAX traces on its own
    (``vmap(jit(step))``, a checkpoint, a cond branch, a loop body, an inner vmap): the
    check sits in the batching rules, which see the nested body when vmap batches it. With
    the refusal switched off the same call gives element 0 the last candidate."""
    kv, news, seq, pos, q, lengths, want = _candidates(vm, 6)

    def write_then_read(cache, new, s, p):
        layer = jax_vmm.kv_write(cache[0], new, new, seq=s, pos=p)
        return jax_vmm.decode_attention(q, layer, lengths)

    in_axes = (None, 0, 0, 0)
    step = _nested(form, write_then_read)
    for run in (jax.vmap(step, in_axes), jax.jit(jax.vmap(step, in_axes))):
        with pytest.raises(ValueError, match="written by a kv_write batched by this same vmap"):
            run(kv.cache(), news, seq, pos)
    with jax_vmm.testing.vmapped_reads_allowed():
        step = _nested(form, write_then_read)  # a fresh function: no trace from above
        got = np.asarray(jax.jit(jax.vmap(step, in_axes))(kv.cache(), news, seq, pos))
    assert not np.allclose(got[0], want[0], atol=1e-5)
    np.testing.assert_allclose(got[0], want[2], atol=1e-5)
    kv.check()


@pytest.mark.parametrize("helper", ["jitted read", "jitted write", "checkpointed read"])
def test_a_body_jax_batched_before_is_checked_again(vm, helper):
    """JAX caches a batched body by the vmap's size: a helper vmapped once legitimately
    (a read over several queries, a write returned with out_axes=None) came back from
    that cache in a later vmap without running the rules, and a read after a batched
    write there was not refused."""
    kv, news, seq, pos, q, lengths, want = _candidates(vm, 8)
    read = lambda qq, layer: jax_vmm.decode_attention(qq, layer, lengths)  # noqa: E731
    write = lambda layer, n, s, p: jax_vmm.kv_write(layer, n, n, seq=s, pos=p)  # noqa: E731
    if helper == "jitted read":
        read = jax.jit(read)
        jax.vmap(read, (0, None))(jnp.stack([q] * 3), kv.cache()[0])
    elif helper == "checkpointed read":
        read = jax.checkpoint(read)
        jax.vmap(read, (0, None))(jnp.stack([q] * 3), kv.cache()[0])
    else:
        write = jax.jit(write)
        jax.vmap(write, (None, 0, 0, 0), None)(kv.cache()[0], news, seq, pos)

    def step(cache, new, s, p):
        return read(q + 0 * new.sum(), write(cache[0], new, s, p))

    with pytest.raises(ValueError, match="written by a kv_write batched by this same vmap"):
        jax.vmap(step, (None, 0, 0, 0))(kv.cache(), news, seq, pos)
    with jax_vmm.testing.vmapped_reads_allowed():
        got = np.asarray(jax.vmap(step, (None, 0, 0, 0))(kv.cache(), news, seq, pos))
    assert not np.allclose(got[0], want[0], atol=1e-5)
    np.testing.assert_allclose(got[0], want[2], atol=1e-5)


def test_a_body_another_thread_batches_meanwhile_is_still_checked(vm, monkeypatch):
    """JAX's batched-body caches are shared by threads and keyed by the vmap's size: thread
    B evicted a jitted read's batched form, thread A (a legitimate vmap of the same read)
    stored it again, and B took it from the cache without running the rules (1 refusal in
    60 went through). Staged here: B pauses after its eviction until A has stored its
    form, A keeps it until B has looked (each waits 0.5 s at most). A lock around the
    batching of such bodies, and an eviction after it, keep B's lookup from finding it."""
    import threading

    from jax_vmm.ops import vmap_reads

    kv, news, seq, pos, q, lengths, _ = _candidates(vm, 12)
    shared = jax.jit(lambda qq, layer: jax_vmm.decode_attention(qq, layer, lengths))
    qs = jnp.stack([q] * 3)
    a_stored, b_looked = threading.Event(), threading.Event()
    scope_of, settle, b_calls = vmap_reads._scope, vmap_reads._Scope.settle, []

    def pausing_scope():  # B's second call: in the hook, just after evicting `shared`
        if threading.current_thread().name == "B":
            b_calls.append(1)
            if len(b_calls) == 2:
                a_stored.wait(0.5)
        return scope_of()

    def pausing_settle(scope):  # A's body scope, popped: its form is in JAX's cache now
        if (
            threading.current_thread().name == "A"
            and scope.parent is not None
            and scope not in vmap_reads._state.scopes
            and not a_stored.is_set()
        ):
            a_stored.set()
            b_looked.wait(0.5)
        settle(scope)

    monkeypatch.setattr(vmap_reads, "_scope", pausing_scope)
    monkeypatch.setattr(vmap_reads._Scope, "settle", pausing_settle)

    def step(c, n, s, p):
        return shared(q + 0 * n.sum(), jax_vmm.kv_write(c[0], n, n, seq=s, pos=p))

    outcome = {}

    def thread_b():
        try:
            jax.vmap(step, (None, 0, 0, 0))(kv.cache(), news, seq, pos)
            outcome["b"] = "not refused"
        except ValueError as e:
            outcome["b"] = str(e)
        b_looked.set()

    b = threading.Thread(target=thread_b, name="B")
    a = threading.Thread(target=lambda: jax.vmap(shared, (0, None))(qs, kv.cache()[0]), name="A")
    b.start()
    while len(b_calls) < 2 and b.is_alive():
        b.join(0.01)
    a.start()
    a.join(30)
    b.join(30)
    assert "written by a kv_write batched by this same vmap" in outcome["b"], outcome


def test_a_cond_branch_does_not_see_its_siblings_write(vm):
    """Only one branch of a cond runs: a write in one branch does not refuse a read in the
    other (a prefill/decode switch), and a branch that reads before it writes runs as the
    same code outside a cond does (JAX batches the branches twice; the second pass saw
    the first's note)."""
    kv, news, seq, pos, q, lengths, _ = _candidates(vm, 9)

    def write_branch(layer, new, s, p):
        return jax_vmm.kv_write(layer, new, new, seq=s, pos=p), jnp.zeros((B, HQ, D), DT)

    def read_branch(layer, new, s, p):
        return layer, jax_vmm.decode_attention(q + 0 * new.sum(), layer, lengths)

    def switch(prefill, cache, new, s, p):
        layer, out = jax.lax.cond(prefill, write_branch, read_branch, cache[0], new, s, p)
        return cache.replace(0, layer), out

    _, got = jax.vmap(switch, (None, None, 0, 0, 0), (None, 0))(
        jnp.bool_(False), kv.cache(), news, seq, pos
    )
    want = jax_vmm.decode_attention(q, kv.cache()[0], lengths)
    np.testing.assert_allclose(np.asarray(got), np.stack([np.asarray(want)] * 3), atol=1e-5)

    before = jnp.array([2, 2], jnp.int32)  # positions 0 and 1; the write fills position 2

    def read_then_write(layer, new, s, p):
        out = jax_vmm.decode_attention(q + 0 * new.sum(), layer, before)
        return jax_vmm.kv_write(layer, new, new, seq=s, pos=p), out

    def nothing(layer, new, s, p):
        return layer, jnp.zeros((B, HQ, D), DT)

    def in_cond(cache, new, s, p):
        return jax.lax.cond(cache[0].token >= 0, read_then_write, nothing, cache[0], new, s, p)[1]

    got = jax.vmap(in_cond, (None, 0, 0, 0))(kv.cache(), news, seq, pos)
    want = jax_vmm.decode_attention(q, kv.cache()[0], before)
    np.testing.assert_allclose(np.asarray(got), np.stack([np.asarray(want)] * 3), atol=1e-5)
    kv.check()


@pytest.mark.parametrize("carry", ["batched", "unbatched"])
def test_a_loop_body_that_reads_then_writes_a_layer_in_a_vmap_is_refused(vm, carry):
    """From the second iteration on the read sees every element's write of the first. It
    was refused or not depending on whether JAX batched the body once or twice (an
    unbatched carry that turns batched); with the refusal off each element reads the
    last candidate."""
    kv, news, seq, pos, q, _, _ = _candidates(vm, 10)
    first = jnp.array([1, 1], jnp.int32)

    def step(cache, new, s, p):
        def body(i, c):
            layer, _ = c
            out = jax_vmm.decode_attention(q + 0 * new.sum(), layer, first)
            return jax_vmm.kv_write(layer, new, new, seq=s, pos=jnp.zeros_like(p)), out

        init = jnp.zeros((B, HQ, D), DT) + (0 * new.sum() if carry == "batched" else 0)
        return jax.lax.fori_loop(0, 2, body, (cache[0], init))[1]

    with pytest.raises(ValueError, match="read and then written in a loop body"):
        jax.vmap(step, (None, 0, 0, 0))(kv.cache(), news, seq, pos)

    def own(new):
        k = jnp.zeros((B, T, HKV, D), DT).at[0, 0].set(new[0])
        return np.asarray(jax_vmm.decode_attention(q, k, k, first))

    with jax_vmm.testing.vmapped_reads_allowed():
        got = np.asarray(jax.vmap(step, (None, 0, 0, 0))(kv.cache(), news, seq, pos))
    assert not np.allclose(got[0], own(news[0]), atol=1e-5)
    np.testing.assert_allclose(got[0], own(news[2]), atol=1e-5)


def test_a_while_condition_that_reads_what_its_body_writes_in_a_vmap_is_refused(vm):
    """The condition of a while_loop runs before each iteration and reads what the body
    wrote in the last: batched, every element's condition sees every element's writes.
    The cond and body bodies were given separate read sets, so it was not refused."""
    kv, news, seq, pos, q, lengths, _ = _candidates(vm, 14)

    def step(cache, new, s, p):
        def cond(c):
            layer, i = c
            return (i < 2) & (jax_vmm.decode_attention(q, layer, lengths).sum() < 1e30)

        def body(c):
            layer, i = c
            return jax_vmm.kv_write(layer, new, new, seq=s, pos=p), i + 1

        return jax.lax.while_loop(cond, body, (cache[0], 0))[1]

    with pytest.raises(ValueError, match="read and then written in a loop body"):
        jax.vmap(step, (None, 0, 0, 0))(kv.cache(), news, seq, pos)


def test_an_fp8_read_under_grad_in_a_vmap_is_refused(vm):
    """An fp8 layer's read dropped the fenced token for the arena's scales, so a DCE
    before batching (grad of a checkpoint) removed the fence and nothing was refused."""
    L8 = 2
    kv = vm.kv(
        num_layers=L8, num_kv_heads=HKV, head_dim=D, max_tokens=T, max_seqs=B,
        dtype=jnp.float8_e4m3fn, k_scales=np.ones((L8, HKV), np.float32),
        v_scales=np.ones((L8, HKV), np.float32), zero_fill=True,
    )  # fmt: skip
    kv.ensure(3, 0)
    kv.ensure(3, 1)
    rng = np.random.default_rng(11)
    news = jnp.asarray(rng.standard_normal((3, 1, HKV, D)), jnp.bfloat16)
    seq, pos = jnp.zeros((3, 1), jnp.int32), jnp.full((3, 1), 2, jnp.int32)
    q = jnp.asarray(rng.standard_normal((B, HQ, D)), jnp.bfloat16)
    lengths = jnp.array([3, 3], jnp.int32)

    def loss(x, cache, new, s, p):
        layer = jax_vmm.kv_write(cache[0], new, new, seq=s, pos=p)
        return (x * jax_vmm.decode_attention(q, layer, lengths).astype(jnp.float32)).sum()

    grad = jax.grad(jax.checkpoint(loss))
    with pytest.raises(ValueError, match="written by a kv_write batched by this same vmap"):
        jax.vmap(grad, (None, None, 0, 0, 0))(1.0, kv.cache(), news, seq, pos)
    kv.check()


def test_a_layer_a_vmap_returned_is_read_in_the_next_vmap(vm):
    """Two vmaps in one jit: the first writes (the cache returned with out_axes=None), the
    second reads every candidate's query against the written layer. Not refused: the
    first vmap's writes have all landed, as with an array cache returned unbatched."""
    kv = _kv(vm)
    kv.ensure(3, 0)
    kv.ensure(3, 1)
    rng = np.random.default_rng(7)
    news = jnp.asarray(rng.standard_normal((3, 1, HKV, D)), DT)
    seq = jnp.array([[0], [1], [0]], jnp.int32)
    pos = jnp.array([[0], [0], [1]], jnp.int32)
    qs = jnp.asarray(rng.standard_normal((3, B, HQ, D)), DT)
    lengths = jnp.array([2, 1], jnp.int32)

    def write(cache, new, s, p):
        return cache.replace(0, jax_vmm.kv_write(cache[0], new, new, seq=s, pos=p))

    @jax.jit
    def write_then_read(cache):
        cache = jax.vmap(write, (None, 0, 0, 0), None)(cache, news, seq, pos)
        read = jax.vmap(jax.jit(lambda qq: jax_vmm.decode_attention(qq, cache[0], lengths)))
        return cache, read(qs)

    _, got = write_then_read(kv.cache())
    k = jnp.zeros((B, T, HKV, D), DT)
    k = k.at[0, 0].set(news[0, 0]).at[1, 0].set(news[1, 0]).at[0, 1].set(news[2, 0])
    want = np.stack([np.asarray(jax_vmm.decode_attention(qq, k, k, lengths)) for qq in qs])
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    kv.check()


# -- devices ---------------------------------------------------------------------------------------

_DEVICES_CHILD = """
import jax, jax.numpy as jnp, numpy as np, jax_vmm
cpu0, cpu1 = jax.devices("cpu")[:2]
kv = jax_vmm.kv_arena(num_layers=1, num_kv_heads=2, head_dim=8, max_tokens=16, max_seqs=2,
                      dtype=jnp.float32, device=cpu1, initial_tokens=4)
new = jax.device_put(jnp.ones((1, 2, 8), jnp.float32), cpu1)
step = jax.jit(lambda c, x: jax_vmm.kv_write(c[0], x, x, jnp.array([1], jnp.int32)))
jax.block_until_ready(step(kv.cache(), new).token)
kv.check()
assert float(np.asarray(kv.k[0])[0, 1].sum()) == 16.0
moved = jax.device_put(kv.cache(), cpu0)
try:
    jax.block_until_ready(step(moved, jax.device_put(new, cpu0)).token)
except jax.errors.JaxRuntimeError as e:
    print("REFUSED:", str(e).splitlines()[0])
"""


def test_the_cpu_hands_handlers_each_host_device_ordinal(tmp_path):
    """The handlers find a cache by (uid, device ordinal), which XLA's CPU runtime hands
    them too: a cache of cpu:1 works there and is refused on cpu:0."""
    env = child_env(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", _DEVICES_CHILD], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lives on host device 1, but the call runs on device 0" in proc.stdout, proc.stdout


def test_array_level_writes_into_a_kv_arena_respect_the_ensured_tokens(vm):
    """#11.7 holds for every write whose target is a KV arena's buffer, not only the cache
    API: kv_write_through reports status 4 (not ensured) for a slot in a backed chunk, and
    kv_write_fp8 drops it too."""
    kv = _kv(vm)
    kv.ensure(10, 0)
    new = jax.device_put(jnp.ones((2, HKV, D), DT), vm.device)
    slots = jnp.array([9, 50], jnp.int32)  # ensured; backed by the chunk only
    status = jax_vmm.kv_write_through(kv.k[0], kv.v[0], new, new, slots, dest=kv.dest(0))
    np.testing.assert_array_equal(
        np.asarray(status), [[jax_vmm.ops.WRITTEN, jax_vmm.ops.DROPPED_NOT_ENSURED]] * 2
    )
    with pytest.raises(jax_vmm.OutOfBoundsWrite) as info:
        kv.check()
    assert info.value.count == 2
    fp8 = _kv(vm, num_layers=1, dtype=jnp.float8_e4m3fn)
    fp8.ensure(10, 0)
    scale = jnp.ones((HKV,), jnp.float32)
    jax.block_until_ready(
        jax_vmm.kv_write_fp8(fp8.k[0], fp8.v[0], new, new, slots, scale, scale, dest=fp8.dest(0))
    )
    with pytest.raises(jax_vmm.OutOfBoundsWrite) as info:
        fp8.check()
    assert info.value.count == 2
    codes = raw_bytes(fp8.k_buffers[0]).reshape(B, T, HKV, D)
    assert np.all(codes[0, 9] != 0) and not np.any(codes[0, 50])


def test_every_way_of_ensuring_publishes_the_table(vm):
    """ensure (also within chunks already backed: no commit), ensure_all (one copy of the
    table), shrink and release all move the device table the kernels check."""
    kv = _kv(vm)
    kv.ensure_all([5, 3])
    _write_one(kv, 4)  # ensured
    _write_one(kv, T + 3)  # sequence 1 ensured 3 tokens: dropped
    with pytest.raises(jax_vmm.OutOfBoundsWrite) as info:
        kv.check()
    assert info.value.count == 2
    kv.ensure_all([5, 4])  # within the backed chunk: the fast path
    kv.ensure(6, 0)  # the same
    _write_one(kv, T + 3)
    _write_one(kv, 5)
    kv.check()
    kv.shrink(2)
    _write_one(kv, 3)  # past the shrunk table
    with pytest.raises(jax_vmm.OutOfBoundsWrite):
        kv.check()
    kv.release(0)
    _write_one(kv, 0)
    with pytest.raises(jax_vmm.OutOfBoundsWrite):
        kv.check()
    assert kv._core_cache.limits() == [0, 2]


def test_a_cache_returned_from_vmap_with_out_axes_0_names_out_axes(vm):
    """vmap's default out_axes=0 gives each arena layer a (N,) token; the next read says
    to return the cache with out_axes=None (it blamed jax.tree.map)."""
    kv = _kv(vm)
    for seq in range(B):
        kv.ensure(3, seq)
    new = jnp.ones((B, 1, HKV, D), DT)

    def write(cache, k, s):
        return cache.replace(0, jax_vmm.kv_write(cache[0], k, k, seq=s[None], pos=jnp.array([2])))

    cache = jax.vmap(write, in_axes=(None, 0, 0))(kv.cache(), new, jnp.arange(B))
    q = jnp.ones((B, HQ, D), DT)
    with pytest.raises(TypeError, match="out_axes=None for the cache"):
        jax_vmm.decode_attention(q, cache[0], jnp.full((B,), 3, jnp.int32))
    kv.check()


def test_an_array_layer_from_numpy_takes_an_eager_write(cpu_device):
    """KVLayer.from_arrays of NumPy arrays: an eager kv_write works as under jit (it
    raised AttributeError: 'numpy.ndarray' object has no attribute 'at')."""
    k = np.zeros((B, T, HKV, D), np.float32)
    layer = jax_vmm.KVLayer.from_arrays(k, k.copy())
    x = np.ones((1, HKV, D), np.float32)
    eager = jax_vmm.kv_write(layer, x, x, seq=[1], pos=[2])
    jitted = jax.jit(lambda lay: jax_vmm.kv_write(lay, x, x, seq=[1], pos=[2]))(layer)
    for got in (eager, jitted):
        assert np.asarray(got.k)[1, 2].sum() == HKV * D and np.asarray(got.k).sum() == HKV * D


def test_fp8_scales_too_small_for_their_inverse_are_refused(vm):
    """A scale below float32's smallest normal passed the old check (positive, finite),
    then 1 / scale was inf and a zero token quantized to NaN (attention returned NaN)."""
    tiny = np.full((L, HKV), 1e-40, np.float32)
    for where in ("k_scales", "v_scales"):
        with pytest.raises(ValueError, match="at least 1.175e-38"):
            _kv(vm, dtype=jnp.float8_e4m3fn, **{where: tiny})
    k = jnp.zeros((B, T, HKV, D), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_scale must be finite and at least"):
        jax_vmm.KVLayer.from_arrays(
            k, k, k_scale=jnp.full((HKV,), 1e-40), v_scale=jnp.ones((HKV,), jnp.float32)
        )
    ok = np.full((L, HKV), np.finfo(np.float32).tiny, np.float32)  # the smallest accepted
    _kv(vm, dtype=jnp.float8_e4m3fn, k_scales=ok, v_scales=ok).close()


def test_array_writes_into_an_fp8_arena_keep_its_scales(vm):
    """kv_write over an fp8 array with bf16 tokens pointed at .astype(float8), which
    stores unscaled values (3.0 read back as 0.03 by the cache API); it names the calls
    that quantize, and kv_write_fp8 with the arena's scales writes what the cache reads."""
    scales = np.full((L, HKV), 0.01, np.float32)
    kv = _kv(vm, dtype=jnp.float8_e4m3fn, k_scales=scales, v_scales=scales)
    kv.ensure(1, 0)
    x = jnp.full((1, HKV, D), 3.0, jnp.bfloat16)
    slot = jnp.array([0], jnp.int32)
    with pytest.raises(TypeError, match="write it with jax_vmm.kv_write\\(kv.cache"):
        jax_vmm.kv_write(kv.k[0], kv.v[0], x, x, slot, dest=kv.dest(0))
    k_scale, v_scale = kv.scales(0)
    jax_vmm.kv_write_fp8(kv.k[0], kv.v[0], x, x, slot, k_scale, v_scale, dest=kv.dest(0))
    kv.check()
    got = np.asarray(kv.k[0]).astype(np.float32)[0, 0] * 0.01
    np.testing.assert_allclose(got, 3.0, rtol=0.07)
    kv.close()


def test_an_array_write_with_dest_under_vmap_says_why(vm):
    """vmap of an array-level kv_write into an arena's buffers gave JAX's bare
    "vmap is only supported for the ffi_call primitive when vmap_method is ..."."""
    kv = _kv(vm)
    kv.ensure(2, 0)
    new = jnp.ones((3, 1, HKV, D), DT)
    slots = jnp.array([[0], [1], [0]], jnp.int32)

    def write(x, s):
        return jax_vmm.kv_write(kv.k[0], kv.v[0], x, x, s, dest=kv.dest(0))[0].sum()

    with pytest.raises(ValueError, match="under jax.vmap: the arena is one cache"):
        jax.vmap(write)(new, slots)
    kv.check()
    kv.close()
