"""The streaming decode attention (target jax_vmm_decode_attention_v2; impl="stream",
"stream_combine", "stream_tma"; every fp8 cache): correctness against a float64
reference for bf16 / fp16 and float8_e4m3fn caches, every output element written (through
the testing target, jax_vmm.testing.decode_attention), the stream-K partition's
invariants, and validation. The `device` fixture runs each test on the CPU (the kernel's
C++ model: same partition, slots and combine) and, marked gpu, on the CUDA kernel.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention import BF16, F16, assert_close, on, random_inputs, reference

import jax_vmm
import jax_vmm.testing
from jax_vmm.ops import quantize_fp8
from jax_vmm.ops.attention import (
    FP8_DTYPE,
    decode_attention_tuned,
    dequantize_fp8,
    stream_attention_plan,
)

FP8 = jnp.float8_e4m3fn
# fp8 tolerance: against float64 on the *dequantized* cache, so only the kernel's own
# rounding counts (queries rounded to fp16, weights to fp16, output to q's dtype).
FP8_REL_TOL = {np.dtype(BF16): 1e-2, np.dtype(F16): 3e-3}


def fp8_inputs(rng, B, T, Hq, Hkv, D, q_dtype):
    """q in q_dtype, an fp8 cache quantized with per-head scales, and float64 copies of
    q and of the dequantized cache."""
    q = jnp.asarray(rng.standard_normal((B, Hq, D), dtype=np.float32)).astype(q_dtype)
    ks = jnp.asarray(rng.uniform(0.002, 0.02, Hkv), jnp.float32)
    vs = jnp.asarray(rng.uniform(0.002, 0.02, Hkv), jnp.float32)
    k = quantize_fp8(jnp.asarray(rng.standard_normal((B, T, Hkv, D), dtype=np.float32)), ks)
    v = quantize_fp8(jnp.asarray(rng.standard_normal((B, T, Hkv, D), dtype=np.float32)), vs)
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    return (q, k, v, ks, vs), (
        f64(q.astype(jnp.float32)),
        f64(dequantize_fp8(k, ks)),
        f64(dequantize_fp8(v, vs)),
    )


def close_fp8(out, ref, q_dtype, what=""):
    out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    assert np.isfinite(out).all(), f"{what}: non-finite output"
    rel = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
    assert rel < FP8_REL_TOL[np.dtype(q_dtype)], f"{what}: relative error {rel:.3g}"


SHAPES = [
    # B, T, Hq, Hkv, D: GQA groups 1, 2, 4, 8 (and 16: two head tiles), head_dim 64/128/256
    (4, 100, 4, 4, 64),
    (3, 300, 8, 4, 128),
    (4, 257, 8, 2, 64),
    (3, 77, 16, 2, 128),
    (2, 130, 16, 1, 64),
    (2, 70, 4, 2, 256),
    (2, 40, 16, 1, 256),  # two head tiles at head_dim 256 (the largest register footprint)
    (2, 64, 12, 1, 128),  # a head group of 12: the second head tile half used
    (3, 50, 6, 1, 64),  # a head group of 6 (not a power of two)
]


def lengths_for(rng, B, T):
    return np.array(([0, 1, min(T, 37), T] + list(rng.integers(0, T + 1, size=B)))[:B], np.int32)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}Hq{}Hkv{}D{}".format(*s))
@pytest.mark.parametrize("impl", ["stream", "stream_combine", "stream_tma"])
def test_stream_matches_reference(device, shape, impl):
    B, T, Hq, Hkv, D = shape
    rng = np.random.default_rng(hash((shape, impl)) % 2**32)
    lengths = lengths_for(rng, B, T)
    for dtype in (BF16, F16):
        (q, k, v), (q64, k64, v64) = random_inputs(rng, B, T, Hq, Hkv, D, dtype)
        q, k, v, lens = on(device, q, k, v, jnp.asarray(lengths))
        out = jax.jit(lambda *a: decode_attention_tuned(*a, impl=impl))(q, k, v, lens)
        assert out.dtype == q.dtype and out.shape == q.shape
        assert_close(
            out, reference(q64, k64, v64, lengths), dtype, f"{dtype.__name__} {impl} {shape}"
        )
        assert (np.asarray(out.astype(jnp.float32))[lengths == 0] == 0).all()


@pytest.mark.parametrize("ctas,min_tiles", [(1, 1), (3, 1), (7, 2), (64, 1), (500, 1), (0, 1000)])
def test_forced_partitions(device, ctas, min_tiles):
    """One CTA for everything; pieces of one tile; more CTAs than tiles; few CTAs."""
    B, T, Hq, Hkv, D = 3, 200, 8, 2, 64
    rng = np.random.default_rng(ctas * 31 + min_tiles)
    lengths = np.array([200, 17, 129], np.int32)
    (q, k, v), (q64, k64, v64) = random_inputs(rng, B, T, Hq, Hkv, D, BF16)
    q, k, v, lens = on(device, q, k, v, jnp.asarray(lengths))
    ref = reference(q64, k64, v64, lengths)
    for impl in ("stream", "stream_combine", "stream_tma"):
        out = decode_attention_tuned(q, k, v, lens, impl=impl, ctas=ctas, min_tiles=min_tiles)
        assert_close(out, ref, BF16, f"ctas={ctas} min_tiles={min_tiles} {impl}")


@pytest.mark.parametrize("storage", ["fp8", "bf16"])
@pytest.mark.parametrize("ctas,min_tiles", [(0, 0), (5, 1), (1, 1)])
def test_lengths_at_the_edges_of_32_token_tiles(device, storage, ctas, min_tiles):
    """K/V rows of <= 128 bytes (fp8 at head_dim 128, 16-bit at 64) stream in tiles of 32
    tokens, two tensor-core tiles each: lengths on either side of 16, 32 and 48 mask the
    right rows of each half, and pieces that start and end mid-unit combine."""
    D = 128 if storage == "fp8" else 64
    lengths = np.array([15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 1, 0], np.int32)
    B, T, Hq, Hkv = len(lengths), 64, 8, 2
    plan = stream_attention_plan(B, T, Hq, Hkv, D, fp8=storage == "fp8", parallel_units=0)
    assert plan["tile_tokens"] == 32
    rng = np.random.default_rng(ctas * 7 + min_tiles)
    knobs = dict(ctas=ctas, min_tiles=min_tiles)
    impls = ("stream", "stream_combine", "stream_tma")
    if storage == "fp8":
        (q, k, v, ks, vs), (q64, k64, v64) = fp8_inputs(rng, B, T, Hq, Hkv, D, BF16)
        q, k, v, ks, vs, lens = on(device, q, k, v, ks, vs, jnp.asarray(lengths))
        ref = reference(q64, k64, v64, lengths)
        for impl in impls:
            out = decode_attention_tuned(q, k, v, lens, k_scale=ks, v_scale=vs, impl=impl, **knobs)
            close_fp8(out, ref, BF16, f"fp8 {impl} {knobs}")
    else:
        (q, k, v), (q64, k64, v64) = random_inputs(rng, B, T, Hq, Hkv, D, BF16)
        q, k, v, lens = on(device, q, k, v, jnp.asarray(lengths))
        ref = reference(q64, k64, v64, lengths)
        for impl in impls:
            out = decode_attention_tuned(q, k, v, lens, impl=impl, **knobs)
            assert_close(out, ref, BF16, f"bf16 {impl} {knobs}")


@pytest.mark.parametrize(
    "shape",
    [(3, 300, 8, 2, 128), (2, 70, 4, 4, 64), (2, 50, 16, 2, 256), (2, 90, 8, 1, 64)],
    ids=lambda s: "B{}T{}Hq{}Hkv{}D{}".format(*s),
)
def test_fp8_matches_reference_on_the_dequantized_cache(device, shape):
    B, T, Hq, Hkv, D = shape
    rng = np.random.default_rng(sum(shape))
    lengths = lengths_for(rng, B, T)
    for q_dtype in (BF16, F16):
        (q, k, v, ks, vs), (q64, k64, v64) = fp8_inputs(rng, B, T, Hq, Hkv, D, q_dtype)
        q, k, v, ks, vs, lens = on(device, q, k, v, ks, vs, jnp.asarray(lengths))
        out = jax.jit(lambda *a: jax_vmm.decode_attention(*a[:4], k_scale=a[4], v_scale=a[5]))(
            q, k, v, lens, ks, vs
        )
        assert out.dtype == q.dtype
        close_fp8(
            out, reference(q64, k64, v64, lengths), q_dtype, f"fp8 q {q_dtype.__name__} {shape}"
        )
        tma = decode_attention_tuned(q, k, v, lens, k_scale=ks, v_scale=vs, impl="stream_tma")
        close_fp8(
            tma, reference(q64, k64, v64, lengths), q_dtype, f"fp8 tma {q_dtype.__name__} {shape}"
        )
        # uint8 holding the same bits is the same cache
        k8, v8 = (jax.lax.bitcast_convert_type(x, jnp.uint8) for x in (k, v))
        out8 = jax_vmm.decode_attention(q, k8, v8, lens, k_scale=ks, v_scale=vs)
        assert np.array_equal(
            np.asarray(out8.astype(jnp.float32)), np.asarray(out.astype(jnp.float32))
        )


def test_fp8_large_queries_and_extreme_scales(device):
    """bf16 queries far outside fp16's range (the kernel rescales each head by a power of
    two before rounding to fp16) and tiny / large cache scales."""
    B, T, Hq, Hkv, D = 2, 64, 4, 2, 128
    rng = np.random.default_rng(3)
    (q, k, v, ks, vs), (q64, k64, v64) = fp8_inputs(rng, B, T, Hq, Hkv, D, BF16)
    q = (q.astype(jnp.float32) * jnp.array([1e-30, 1e30])[:, None, None] * 1e-3).astype(BF16)
    q64 = np.asarray(q.astype(jnp.float32), np.float64)
    ks = ks * jnp.array([1e6, 1e-6], jnp.float32)[None].reshape(-1)
    k64 = np.asarray(dequantize_fp8(k, ks), np.float64)
    lengths = np.array([64, 33], np.int32)
    q, k, v, ks, vs, lens = on(device, q, k, v, ks, vs, jnp.asarray(lengths))
    out = jax_vmm.decode_attention(q, k, v, lens, k_scale=ks, v_scale=vs, scale=1.0)
    close_fp8(out, reference(q64, k64, v64, lengths, scale=1.0), BF16, "extreme")


def test_every_output_element_written(device):
    B, T, Hq, Hkv, D = 4, 96, 8, 2, 64
    rng = np.random.default_rng(7)
    lengths = np.array([0, 1, 50, 96], np.int32)
    (q, k, v), (q64, k64, v64) = random_inputs(rng, B, T, Hq, Hkv, D, BF16)
    q, k, v, lens = on(device, q, k, v, jnp.asarray(lengths))
    poison = jax.device_put(jnp.full(q.shape, jnp.nan, q.dtype), device)
    for impl in ("stream", "stream_combine", "stream_tma"):
        out = jax.jit(
            lambda *a: jax_vmm.testing.decode_attention(
                *a[:4], impl=impl, out_init=a[4], ctas=5, min_tiles=1
            )
        )(q, k, v, lens, poison)
        assert_close(out, reference(q64, k64, v64, lengths), BF16, f"poisoned {impl}")
    # the check can fail: with the output write skipped, the NaNs come back
    out = jax_vmm.testing.decode_attention(
        q, k, v, lens, impl="stream", out_init=poison, skip_output=True
    )
    assert np.isnan(np.asarray(out.astype(jnp.float32))).all()


def test_matches_the_split_kernel(device):
    """Same inputs, the split-K path and the streaming path agree (both bf16 outputs)."""
    B, T, Hq, Hkv, D = 4, 500, 32, 8, 128
    rng = np.random.default_rng(11)
    lengths = np.array([500, 3, 257, 0], np.int32)
    (q, k, v), (q64, k64, v64) = random_inputs(rng, B, T, Hq, Hkv, D, BF16)
    q, k, v, lens = on(device, q, k, v, jnp.asarray(lengths))
    a = np.asarray(decode_attention_tuned(q, k, v, lens).astype(jnp.float32))
    b = np.asarray(decode_attention_tuned(q, k, v, lens, impl="stream").astype(jnp.float32))
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 1e-2


# -- partition and plan ------------------------------------------------------------------


@pytest.mark.parametrize("tile_tokens", [16, 32])
@pytest.mark.parametrize(
    "lengths,groups,ctas,min_tiles",
    [
        ([8192] * 32, 8, 264, 16),
        ([6000, 1, 0, 17, 16, 15], 4, 37, 1),
        ([0, 0, 5], 2, 16, 1),
        ([1000], 8, 264, 16),
        ([33] * 7, 1, 100, 1),
        ([16 * 9] * 3, 3, 4, 1),
    ],
)
def test_partition_covers_every_tile_once_with_balanced_ctas(
    lengths, groups, ctas, min_tiles, tile_tokens
):
    parts = jax_vmm.testing.stream_partition(lengths, 8192, groups, ctas, min_tiles, tile_tokens)
    tiles = [math.ceil(n / tile_tokens) for n in lengths]
    covered = {}
    per_cta = []
    for c, pieces in enumerate(parts):
        per_cta.append(sum(p[3] for p in pieces))
        slots = [p[4] for p in pieces if p[4] >= 0]
        assert slots.count(0) <= 1 and slots.count(1) <= 1, f"CTA {c} reuses a slot: {pieces}"
        for i, (b, hg, first, count, slot, owner0, owner1) in enumerate(pieces):
            for t in range(first, first + count):
                assert (b, hg, t) not in covered, f"tile {(b, hg, t)} twice"
                covered[(b, hg, t)] = c
            whole = first == 0 and count == tiles[b]
            assert (slot == -1) == whole
            assert (slot == -1) == (owner0 == owner1)
            if slot >= 0:
                assert slot == (1 if first == 0 else 0) and owner0 <= c <= owner1
                assert (slot == 1) == (c == owner0)
            if 0 < i < len(pieces) - 1:
                assert whole, "only a CTA's first and last pieces may be partial"
    want = {(b, hg, t) for b, n in enumerate(tiles) for hg in range(groups) for t in range(n)}
    assert set(covered) == want
    if per_cta:
        assert max(per_cta) - min(per_cta) <= 1, per_cta
        assert len(per_cta) <= ctas and (min_tiles <= min(per_cta) or len(per_cta) == 1)


def test_plan_and_workspace():
    p = stream_attention_plan(32, 8192, 32, 8, 128, parallel_units=132)
    assert (p["ctas"], p["head_group"], p["unit_groups"]) == (264, 4, 8)
    rows = 264 * 2 * 4
    assert p["workspace_bytes"] >= rows * (128 + 2) * 4 + 32 * 8 * 4
    assert stream_attention_plan(8, 1024, 16, 8, 256, parallel_units=132)["ctas"] == 132
    assert stream_attention_plan(8, 1024, 16, 8, 256, parallel_units=132, fp8=True)["ctas"] == 264
    # fp8 rows of <= 128 bytes: three CTAs per SM
    assert stream_attention_plan(32, 8192, 32, 8, 128, parallel_units=132, fp8=True)["ctas"] == 396
    assert stream_attention_plan(32, 8192, 32, 8, 64, parallel_units=132, fp8=True)["ctas"] == 396
    # tiles of 32 tokens for K/V rows of <= 128 bytes, else 16 (the same bytes per ring tile)
    for D, fp8, want in [(128, False, 16), (256, False, 16), (64, False, 32), (64, True, 32)]:
        for units in (0, 132):
            p = stream_attention_plan(4, 1024, 8, 8, D, parallel_units=units, fp8=fp8)
            assert p["tile_tokens"] == want, (D, fp8, units)
            assert p["min_tiles"] * want == 256  # the automatic floor: 256 tokens per CTA
    assert (
        stream_attention_plan(4, 1024, 8, 8, 128, fp8=True, parallel_units=0)["tile_tokens"] == 32
    )
    assert (
        stream_attention_plan(4, 1024, 8, 8, 256, fp8=True, parallel_units=0)["tile_tokens"] == 16
    )
    assert stream_attention_plan(2000, 64, 8, 8, 64, parallel_units=132)["unsupported"]
    assert stream_attention_plan(4, 64, 8, 8, 64, parallel_units=132, ctas=9)["ctas"] == 9


# -- validation ------------------------------------------------------------------------------


def test_validation():
    q = jnp.zeros((2, 8, 64), BF16)
    k = jnp.zeros((2, 16, 2, 64), BF16)
    k8 = jnp.zeros((2, 16, 2, 64), FP8)
    L = jnp.zeros((2,), jnp.int32)
    s = jnp.ones((2,), jnp.float32)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        jax_vmm.decode_attention(q, k8, k8, L)
    with pytest.raises(ValueError, match="for fp8 caches"):
        jax_vmm.decode_attention(q, k, k, L, k_scale=s, v_scale=s)
    with pytest.raises(ValueError, match=r"float32 of shape \(2,\)"):
        jax_vmm.decode_attention(q, k8, k8, L, k_scale=jnp.ones((3,), jnp.float32), v_scale=s)
    with pytest.raises(ValueError, match=r"float32 of shape \(2,\)"):
        jax_vmm.decode_attention(q, k8, k8, L, k_scale=s.astype(BF16), v_scale=s)
    with pytest.raises(TypeError, match="one dtype"):
        jax_vmm.decode_attention(q, k8, k, L, k_scale=s, v_scale=s)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        jax_vmm.decode_attention(q.astype(jnp.float32), k8, k8, L, k_scale=s, v_scale=s)
    with pytest.raises(ValueError, match="head_dim"):
        jax_vmm.decode_attention(
            jnp.zeros((2, 8, 32), BF16), k8[..., :32], k8[..., :32], L, k_scale=s, v_scale=s
        )
    with pytest.raises(ValueError, match="impl"):
        decode_attention_tuned(q, k8, k8, L, k_scale=s, v_scale=s, impl="tensor_core")
    with pytest.raises(ValueError, match="stages"):
        decode_attention_tuned(q, k, k, L, impl="stream", stages=9)
    with pytest.raises(ValueError, match="scratch"):
        decode_attention_tuned(q, k, k, L, impl="stream", workspace="xla")
    assert FP8_DTYPE == np.dtype(FP8)


# -- GPU only --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_gpu_ring_depths_agree(gpu_device, stages):
    B, T, Hq, Hkv, D = 8, 2048, 32, 8, 128
    rng = np.random.default_rng(stages)
    lengths = rng.integers(0, T + 1, size=B).astype(np.int32)
    lengths[0], lengths[1] = T, 1
    (q, k, v), (q64, k64, v64) = random_inputs(rng, B, T, Hq, Hkv, D, BF16)
    q, k, v, lens = on(gpu_device, q, k, v, jnp.asarray(lengths))
    ref = reference(q64, k64, v64, lengths)
    for impl in ("stream", "stream_combine", "stream_tma"):
        assert_close(
            decode_attention_tuned(q, k, v, lens, impl=impl, stages=stages),
            ref,
            BF16,
            f"{impl} {stages}",
        )


@pytest.mark.gpu
def test_gpu_same_inputs_same_bits(gpu_device):
    """Deterministic: the fixed-order merges give the same bits on every run (a moving
    result would be a race)."""
    B, T, Hq, Hkv, D = 4, 3000, 16, 4, 128
    rng = np.random.default_rng(2)
    (q, k, v), _ = random_inputs(rng, B, T, Hq, Hkv, D, BF16)
    q, k, v, lens = on(gpu_device, q, k, v, jnp.asarray([3000, 1, 2999, 1500], jnp.int32))
    for impl in ("stream", "stream_tma"):
        runs = [
            np.asarray(
                decode_attention_tuned(q, k, v, lens, impl=impl, min_tiles=1).astype(jnp.float32)
            )
            for _ in range(5)
        ]
        assert all(np.array_equal(runs[0], r) for r in runs[1:]), impl
    # the two copy mechanisms feed identical tiles: identical results
    assert np.array_equal(
        runs[0],
        np.asarray(
            decode_attention_tuned(q, k, v, lens, impl="stream", min_tiles=1).astype(jnp.float32)
        ),
    )


@pytest.mark.gpu
def test_gpu_fp8_arena_views(gpu_device):
    """An fp8 kv_arena: kv_write_fp8 fills it, decode_attention reads it."""
    B, T, Hq, Hkv, D = 2, 256, 8, 2, 128
    kv = jax_vmm.kv_arena(
        num_layers=1,
        num_kv_heads=Hkv,
        head_dim=D,
        max_tokens=T,
        dtype=FP8,
        max_seqs=B,
        initial_tokens=T,
        device=gpu_device,
    )
    try:
        rng = np.random.default_rng(4)
        n = np.array([256, 77])
        slots = np.concatenate([s * T + np.arange(m) for s, m in enumerate(n)]).astype(np.int32)
        nk = jnp.asarray(rng.standard_normal((len(slots), Hkv, D)), BF16)
        nv = jnp.asarray(rng.standard_normal((len(slots), Hkv, D)), BF16)
        ks = jnp.array([0.01, 0.02], jnp.float32)
        vs = jnp.array([0.015, 0.005], jnp.float32)
        nk, nv, sl, ks, vs = on(gpu_device, nk, nv, jnp.asarray(slots), ks, vs)
        jax_vmm.kv_write_fp8(kv.k[0], kv.v[0], nk, nv, sl, ks, vs)
        q = jax.device_put(jnp.asarray(rng.standard_normal((B, Hq, D)), BF16), gpu_device)
        out = jax_vmm.decode_attention(
            q,
            kv.k[0],
            kv.v[0],
            jax.device_put(jnp.asarray(n, jnp.int32), gpu_device),
            k_scale=ks,
            v_scale=vs,
        )
        k64 = np.asarray(dequantize_fp8(kv.k[0], ks), np.float64)
        v64 = np.asarray(dequantize_fp8(kv.v[0], vs), np.float64)
        close_fp8(
            out,
            reference(np.asarray(q.astype(jnp.float32), np.float64), k64, v64, n),
            BF16,
            "arena",
        )
    finally:
        kv.close()


def _target_of(q, k, v, lengths, **kw) -> str:
    """Which custom-call target decode_attention lowers to for these shapes (kw: the
    private knobs of decode_attention_tuned; none: the public call)."""
    fn = (lambda *a: decode_attention_tuned(*a, **kw)) if kw else jax_vmm.decode_attention
    text = jax.jit(fn).lower(q, k, v, lengths).as_text()
    return "v2" if "jax_vmm_decode_attention_v2" in text else "v1"


@pytest.mark.parametrize(
    "B,T,D,dtype,kw,want",
    [
        (16, 8192, 256, BF16, {}, "v2"),  # head_dim 256, >= 64k tokens: streaming
        (2, 32768, 256, F16, {}, "v2"),
        (2, 1024, 256, BF16, {}, "v1"),  # small: split-K
        (32, 8192, 128, BF16, {}, "v1"),  # head_dim 128: split-K
        (16, 8192, 256, jnp.float32, {}, "v1"),  # float32: split-K only
        (16, 8192, 256, BF16, {"workspace": "xla"}, "v1"),  # a split-K knob keeps split-K
        (16, 8192, 256, BF16, {"splits": 4}, "v1"),
        (16, 8192, 256, BF16, {"impl": "tensor_core"}, "v1"),  # asked for by name
    ],
)
def test_auto_takes_the_streaming_kernel_only_for_large_head_dim_256_caches(
    B, T, D, dtype, kw, want
):
    S = jax.ShapeDtypeStruct
    q, k = S((B, 16, D), dtype), S((B, T, 8, D), dtype)
    assert _target_of(q, k, k, S((B,), jnp.int32), **kw) == want


def test_auto_at_head_dim_256_matches_the_reference(device):
    """The natural call (no impl) on a cache where auto streams, against float64."""
    B, T, Hq, Hkv, D = 2, 32768, 2, 1, 256
    rng = np.random.default_rng(256)
    lengths = np.array([300, 1000], np.int32)
    (q, k, v), (q64, k64, v64) = random_inputs(rng, B, T, Hq, Hkv, D, BF16)
    q, k, v, lens = on(device, q, k, v, jnp.asarray(lengths))
    assert _target_of(q, k, v, lens) == "v2"
    out = jax.jit(jax_vmm.decode_attention)(q, k, v, lens)
    assert_close(out, reference(q64, k64, v64, lengths), BF16, "auto at head_dim 256")


def test_a_ring_a_gpu_cannot_hold_is_refused_on_the_cpu_too():
    """stages=4 at head_dim 256 needs 256 KiB of ring in a CTA's 227 KiB: the CUDA handler
    refused it, the CPU model (which does not use the ring) ran it."""
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((1, 8, 256)), BF16)
    k = jnp.asarray(rng.standard_normal((1, 64, 1, 256)), BF16)
    L = jnp.array([64], jnp.int32)
    with pytest.raises((jax.errors.JaxRuntimeError, ValueError), match="stages=4 does not fit"):
        jax.block_until_ready(decode_attention_tuned(q, k, k, L, impl="stream", stages=4))
    out = decode_attention_tuned(q, k, k, L, impl="stream", stages=3)
    f64 = [np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k)]
    assert_close(out, reference(f64[0], f64[1], f64[1], np.asarray(L)), BF16)
