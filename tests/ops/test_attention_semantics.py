"""jax_vmm's general attention (jax_vmm/ops/general_attention.py, exported as
``jax_vmm.attention``): S query rows per sequence, ragged ``q_lengths``, sliding
``window``, ``softcap`` and ``scale``, against a float64 numpy reference, over arrays and
over a KV arena layer, on the CPU and (params marked gpu) every CUDA split-K kernel.

Outputs come through the testing target with a NaN-filled output buffer (every element
must be written); K/V past each sequence's length hold NaN (never read); inputs are fresh
random draws per case. On the GPU each case runs tensor_core (bf16, fp16), tensor_core_u1,
simple (bf16, fp32): ``python3 -m pytest tests/ops/test_attention_semantics.py -m gpu``.
"""

from __future__ import annotations

import math
import signal
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
import jax_vmm.testing
from conftest import run_cpu_script
from jax_vmm.base.fp8 import FP8_DTYPE, quantize_fp8
from jax_vmm.ops.general_attention import attention_tuned, reference_attention

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
REL_TOL = {np.dtype(BF16): 1.5e-2, np.dtype(F16): 3e-3, np.dtype(F32): 1e-5}


def variants(device):
    """(dtype, impl) pairs: every CUDA split-K kernel on a GPU, each dtype on the CPU."""
    if device.platform == "cpu":
        return [(BF16, "auto"), (F16, "auto"), (F32, "auto")]
    return [
        (BF16, "tensor_core"),
        (F16, "tensor_core"),
        (BF16, "tensor_core_u1"),
        (BF16, "simple"),
        (F32, "simple"),
    ]


def ref64(q, k, v, lengths, q_lengths=None, window=None, softcap=None, scale=None):
    """float64 attention by the definition: row i of sequence b at position
    p = n - qn + i attends to tokens max(0, p - window + 1) .. p."""
    B, S, Hq, D = q.shape
    T, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = np.zeros((B, S, Hq, D))
    for b in range(B):
        n = min(max(int(lengths[b]), 0), T)
        qn = S if q_lengths is None else int(q_lengths[b])
        qn = min(max(qn, 0), S, n)
        for i in range(qn):
            p = n - qn + i
            lo = 0 if window is None else max(0, p - window + 1)
            for h in range(Hq):
                kk, vv = k[b, lo : p + 1, h // G], v[b, lo : p + 1, h // G]
                s = kk @ q[b, i, h] * scale
                if softcap is not None:
                    s = softcap * np.tanh(s / softcap)
                w = np.exp(s - s.max())
                out[b, i, h] = w @ vv / w.sum()
    return out


def draw(rng, shape, dtype):
    x = jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)
    return x, np.asarray(x.astype(jnp.float32), np.float64)


def poison_tail(x, lengths):
    """x (B, T, H, D) with NaN at every token at or past each length."""
    T = x.shape[1]
    dead = np.arange(T)[None, :] >= np.asarray(lengths)[:, None]
    return jnp.where(jnp.asarray(dead)[:, :, None, None], jnp.nan, x.astype(F32)).astype(x.dtype)


def assert_close(out, ref, dtype, what):
    out = np.asarray(jnp.asarray(out).astype(F32), np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    bad = np.argwhere(~np.isfinite(out))
    assert bad.size == 0, f"{what}: non-finite output (unwritten or NaN) at {bad[:5].tolist()}"
    tol = REL_TOL[np.dtype(dtype)]
    rel = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
    assert rel < tol, f"{what}: relative error {rel:.3g} >= {tol}"
    worst = np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert worst < 8 * tol, f"{what}: worst element error {worst:.3g}"
    zero_rows = np.all(ref == 0, axis=(-1, -2))
    assert np.all(out[zero_rows] == 0), f"{what}: rows without a live token must be exact zeros"


# Each case: S, Hq, Hkv, D, T, window, softcap, q_lengths mode, scale, chunk/splits.
CASES = [
    # S = 1 with each option alone (decode with a window / a softcap)
    (1, 8, 2, 128, 70, 5, None, None, None, (16, 3)),
    (1, 8, 2, 128, 70, None, 30.0, None, None, (0, 0)),
    (1, 4, 4, 64, 40, None, None, "ragged", None, (16, 2)),
    # S = 3 / 17, GQA 1/4/8, every option and combination
    (3, 4, 1, 64, 50, None, None, None, None, (16, 2)),
    (3, 8, 2, 128, 90, 1, None, "ragged", 0.3, (16, 4)),
    (17, 8, 1, 64, 120, 5, 2.0, "ragged", None, (32, 3)),
    (17, 4, 4, 64, 64, 1000, 30.0, None, None, (0, 0)),
    (17, 16, 2, 64, 100, 5, None, "ragged", None, (16, 5)),  # 136 rows: 9 row blocks
    (5, 8, 2, 256, 45, 7, 30.0, "ragged", None, (16, 2)),
    (3, 6, 2, 128, 33, None, 2.0, "zeros", None, (0, 0)),
]


def case_id(c):
    S, Hq, Hkv, D, T, w, cap, ql, sc, (ch, sp) = c
    return f"S{S}-G{Hq // Hkv}x{Hkv}-D{D}-T{T}-w{w}-cap{cap}-ql{ql}-sc{sc}-ch{ch}sp{sp}"


def make_lengths(rng, B, T, S, mode):
    lengths = np.array(([0, T, 1, min(T, 37)] + list(rng.integers(0, T + 1, size=B)))[:B])
    if mode is None:
        return lengths.astype(np.int32), None
    if mode == "zeros":
        return lengths.astype(np.int32), np.zeros(B, np.int32)
    ql = rng.integers(0, S + 1, size=B)
    ql[: min(B, 2)] = [S, 0][: min(B, 2)]
    return lengths.astype(np.int32), ql.astype(np.int32)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_float64_reference(device, case):
    S, Hq, Hkv, D, T, window, softcap, ql_mode, scale, (chunk, splits) = case
    B = 5
    rng = np.random.default_rng(abs(hash(case)) % 2**32)
    lengths, q_lengths = make_lengths(rng, B, T, S, ql_mode)
    for dtype, impl in variants(device):
        q, q64 = draw(rng, (B, S, Hq, D), dtype)
        k, k64 = draw(rng, (B, T, Hkv, D), dtype)
        v, v64 = draw(rng, (B, T, Hkv, D), dtype)
        k, v = poison_tail(k, lengths), poison_tail(v, lengths)
        q, k, v = (jax.device_put(x, device) for x in (q, k, v))
        opts = dict(window=window, softcap=softcap, scale=scale)
        if q_lengths is not None:
            opts["q_lengths"] = jax.device_put(jnp.asarray(q_lengths), device)
        out = jax_vmm.testing.decode_attention(
            q,
            k,
            v,
            jax.device_put(jnp.asarray(lengths), device),
            out_init=jnp.full(q.shape, jnp.nan, q.dtype),
            impl=impl,
            chunk=chunk,
            splits=splits,
            **opts,
        )
        assert out.dtype == q.dtype and out.shape == q.shape
        ref = ref64(q64, k64, v64, lengths, q_lengths, window, softcap, scale)
        assert_close(out, ref, dtype, f"{np.dtype(dtype)} {impl} {case_id(case)}")


def test_public_op_under_jit_and_the_plain_case_is_decode_attention(device):
    rng = np.random.default_rng(7)
    B, S, Hq, Hkv, D, T = 4, 6, 8, 2, 64, 80
    lengths = np.array([80, 0, 5, 33], np.int32)
    q, q64 = draw(rng, (B, S, Hq, D), BF16)
    k, k64 = draw(rng, (B, T, Hkv, D), BF16)
    v, v64 = draw(rng, (B, T, Hkv, D), BF16)
    q, k, v, n = (jax.device_put(x, device) for x in (q, k, v, jnp.asarray(lengths)))
    fn = jax.jit(lambda *a: jax_vmm.attention(*a, window=9, softcap=20.0))
    out = fn(q, k, v, n)
    assert_close(out, ref64(q64, k64, v64, lengths, None, 9, 20.0), BF16, "jit")
    # S = 1 without options: decode_attention's result, bit for bit.
    plain = jax_vmm.attention(q[:, -1:], k, v, n)
    np.testing.assert_array_equal(
        np.asarray(plain[:, 0].astype(F32)),
        np.asarray(jax_vmm.decode_attention(q[:, -1], k, v, n).astype(F32)),
    )


def test_reference_attention_matches_float64(device):
    rng = np.random.default_rng(3)
    B, S, Hq, Hkv, D, T = 3, 4, 4, 2, 64, 30
    lengths, q_lengths = np.array([30, 0, 3], np.int32), np.array([4, 2, 1], np.int32)
    q, q64 = draw(rng, (B, S, Hq, D), F32)
    k, k64 = draw(rng, (B, T, Hkv, D), F32)
    v, v64 = draw(rng, (B, T, Hkv, D), F32)
    kw = dict(q_lengths=q_lengths, window=3, softcap=2.0, scale=0.2)
    out = reference_attention(q, k, v, jnp.asarray(lengths), **kw)
    assert_close(out, ref64(q64, k64, v64, lengths, **kw), F32, "reference_attention")


@pytest.mark.parametrize("S,window,softcap", [(1, None, None), (3, 4, 30.0)])
def test_fp8_cache(device, S, window, softcap):
    """fp8 caches: S = 1 plain runs the streaming kernel; the options run split-K over
    the cache dequantized by XLA."""
    rng = np.random.default_rng(11)
    B, Hq, Hkv, D, T = 3, 8, 2, 128, 60
    lengths = np.array([60, 0, 17], np.int32)
    q, q64 = draw(rng, (B, S, Hq, D), BF16)
    scales = jnp.asarray([0.5, 2.0], F32)
    k8 = quantize_fp8(jnp.asarray(rng.standard_normal((B, T, Hkv, D)), F32), scales)
    v8 = quantize_fp8(jnp.asarray(rng.standard_normal((B, T, Hkv, D)), F32), scales)
    assert k8.dtype == FP8_DTYPE
    k64 = np.asarray(k8.astype(F32), np.float64) * np.asarray(scales)[None, None, :, None]
    v64 = np.asarray(v8.astype(F32), np.float64) * np.asarray(scales)[None, None, :, None]
    q, k8, v8, n, s = (jax.device_put(x, device) for x in (q, k8, v8, jnp.asarray(lengths), scales))
    out = jax_vmm.attention(q, k8, v8, n, window=window, softcap=softcap, k_scale=s, v_scale=s)
    assert_close(out, ref64(q64, k64, v64, lengths, None, window, softcap), BF16, "fp8")


def test_fp8_cache_with_a_large_scale_read_by_float16_queries(device):
    """The options' split-K path dequantized the cache to q's dtype: with a scale over 146
    a float16 token of 448 * scale was inf, and the result silently garbage (zeros over an
    arena layer) while plain decode was right. Float16 queries read it in float32 now
    (the output stays float16); the array form and the arena form against float64."""
    rng = np.random.default_rng(13)
    B, S, Hq, Hkv, D, T = 2, 3, 4, 2, 64, 24
    # K tokens past float16's 65504 once scaled; V's within it (so is the output).
    scales = [np.asarray(x, np.float32) for x in ([300.0, 1000.0], [100.0, 120.0])]
    x = [rng.uniform(-400, 400, (B, T, Hkv, D)).astype(np.float32) * c[:, None] for c in scales]
    k8, v8 = (quantize_fp8(jnp.asarray(a), jnp.asarray(c)) for a, c in zip(x, scales))
    k64, v64 = (
        np.asarray(a.astype(F32), np.float64) * c[:, None] for a, c in zip((k8, v8), scales)
    )
    q = jnp.asarray(rng.standard_normal((B, S, Hq, D)) / 4e5, F16)
    q64 = np.asarray(q.astype(F32), np.float64)
    lengths = np.array([T, 9], np.int32)
    ks, vs = (jax.device_put(jnp.asarray(c), device) for c in scales)
    q, k8, v8, n = (jax.device_put(a, device) for a in (q, k8, v8, jnp.asarray(lengths)))
    for window in (None, T):
        out = jax_vmm.attention(q, k8, v8, n, window=window, k_scale=ks, v_scale=vs)
        assert out.dtype == F16
        assert_close(out, ref64(q64, k64, v64, lengths, None, window), F16, f"window {window}")

    kv = jax_vmm.kv_arena(
        num_layers=1, num_kv_heads=Hkv, head_dim=D, max_tokens=T, max_seqs=B,
        dtype=FP8_DTYPE, k_scales=scales[0][None], v_scales=scales[1][None], device=device,
    )  # fmt: skip
    for b in range(B):
        kv.ensure(T, b)
    slots = jnp.arange(B * T, dtype=jnp.int32)
    flat = [jax.device_put(jnp.asarray(a.reshape(B * T, Hkv, D), F32), device) for a in x]
    layer = jax_vmm.kv_write(kv.cache()[0], *flat, jax.device_put(slots, device))
    got = jax.jit(lambda c, q, n: jax_vmm.attention(q, c, n, window=T))(layer, q, n)
    assert got.dtype == F16
    assert_close(got, ref64(q64, k64, v64, lengths, None, T), F16, "arena layer, window T")
    kv.check()


# -- over a KV arena layer ---------------------------------------------------------------


def _filled_arena(vm, rng, B, T, Hkv, D, dtype, ensured):
    kv = vm.kv(
        num_layers=1,
        num_kv_heads=Hkv,
        head_dim=D,
        max_tokens=T,
        max_seqs=B,
        dtype=dtype,
        zero_fill=True,
    )
    for b, n in enumerate(ensured):
        kv.ensure(n, b)
    k, k64 = draw(rng, (B * T, Hkv, D), dtype)
    v, v64 = draw(rng, (B * T, Hkv, D), dtype)
    slots = np.concatenate([b * T + np.arange(n) for b, n in enumerate(ensured)]).astype(np.int32)
    dev = kv.arena.device
    layer = jax.jit(jax_vmm.kv_write)(
        kv.cache()[0], jax.device_put(k[slots], dev), jax.device_put(v[slots], dev), slots
    )
    jax.block_until_ready(layer.token)
    kv.check()
    return kv, k64.reshape(B, T, Hkv, D), v64.reshape(B, T, Hkv, D)


def test_over_an_arena_layer(vm):
    rng = np.random.default_rng(5)
    B, S, Hq, Hkv, D, T = 4, 5, 8, 2, 64, 96
    ensured = [96, 3, 40, 0]
    kv, k64, v64 = _filled_arena(vm, rng, B, T, Hkv, D, BF16, ensured)
    dev = kv.arena.device
    q, q64 = draw(rng, (B, S, Hq, D), BF16)
    lengths, q_lengths = np.array(ensured, np.int32), np.array([5, 2, 0, 1], np.int32)
    fn = jax.jit(
        lambda c, q, n, qn: jax_vmm.attention(q, c[0], n, q_lengths=qn, window=6, softcap=30.0)
    )
    args = [jax.device_put(x, dev) for x in (q, jnp.asarray(lengths), jnp.asarray(q_lengths))]
    out = fn(kv.cache(), *args)
    kv.check(out)  # within the ensured tokens: nothing to report
    ref = ref64(q64, k64, v64, lengths, q_lengths, 6, 30.0)
    assert_close(out, ref, BF16, "arena layer")

    # Lengths past the ensured tokens: read only those (positions as if the length were
    # the ensured count), and kv.check() reports the sequences.
    too_long = jax.device_put(jnp.asarray([96, 10, 41, 0], jnp.int32), dev)
    clamped = fn(kv.cache(), args[0], too_long, args[2])
    with pytest.raises(jax_vmm.OutOfBoundsRead) as info:
        kv.check(clamped)  # a read-only step: check waits for the results it is given
    assert info.value.count == 2
    np.testing.assert_array_equal(np.asarray(clamped.astype(F32)), np.asarray(out.astype(F32)))


@pytest.mark.parametrize(
    "to_lengths",
    [
        lambda n: np.asarray(n, np.int16),
        lambda n: np.asarray(n, np.uint8),
        lambda n: np.asarray(n, np.int32),
        lambda n: np.asarray(n, np.int64),
        lambda n: np.asarray(n, np.uint32),
        lambda n: list(n),
        lambda n: jnp.asarray(n, jnp.int32),
    ],
    ids=["int16", "uint8", "int32", "int64", "uint32", "list", "jnp-int32"],
)
@pytest.mark.parametrize("S", [1, 3])
def test_a_length_past_the_capacity_is_counted_whatever_its_type(vm, to_lengths, S):
    """A length past T over a full arena layer reads the T tokens and is counted, in every
    integer type a user may pass (the wide ones are clamped before the int32 cast; before
    the fix only the narrow ones were counted)."""
    rng = np.random.default_rng(13)
    B, Hq, Hkv, D, T = 2, 4, 2, 64, 16
    kv, k64, v64 = _filled_arena(vm, rng, B, T, Hkv, D, F32, [T, T])
    q, q64 = draw(rng, (B, S, Hq, D), F32)
    q = jax.device_put(q, kv.arena.device)
    out = jax_vmm.attention(q, kv.cache()[0], to_lengths([100, T]))
    with pytest.raises(jax_vmm.OutOfBoundsRead) as info:
        kv.check(out)
    assert info.value.count == 1  # sequence 0 asked past its 16 ensured tokens
    assert_close(out, ref64(q64, k64, v64, [T, T]), F32, "length past T")


def _float32_qkv(seed, B, T, device, S=3, Hq=4, Hkv=2, D=64):
    """(q, k, v) on ``device`` and their float64 copies."""
    rng = np.random.default_rng(seed)
    pairs = [draw(rng, shape, F32) for shape in ((B, S, Hq, D), (B, T, Hkv, D), (B, T, Hkv, D))]
    return [jax.device_put(x, device) for x, _ in pairs], [x64 for _, x64 in pairs]


def test_wide_lengths_are_clamped_not_wrapped_everywhere(device):
    """2**32 + 1 (int64) means all T tokens, not 1: in attention, in reference_attention
    and as q_lengths."""
    B, T = 2, 20
    (q, k, v), (q64, k64, v64) = _float32_qkv(17, B, T, device)
    wide = np.full(B, 2**32 + 1, np.int64)
    want = ref64(q64, k64, v64, [T, T])
    assert_close(jax_vmm.attention(q, k, v, wide, q_lengths=wide), want, F32, "attention")
    assert_close(reference_attention(q, k, v, wide), want, F32, "reference_attention")
    assert_close(reference_attention(q, k, v, wide, q_lengths=wide), want, F32, "q_lengths")


def test_q_lengths_may_be_a_list_of_traced_scalars(device):
    """As lengths may: inside jit, a list built from traced values."""
    (q, k, v), (q64, k64, v64) = _float32_qkv(19, 2, 12, device)

    @jax.jit
    def fn(q, k, v, a, b):
        return jax_vmm.attention(q, k, v, [a + 9, b + 9], q_lengths=[a, b], window=4)

    out = fn(q, k, v, jnp.int32(3), jnp.int32(1))
    assert_close(out, ref64(q64, k64, v64, [12, 10], [3, 1], window=4), F32, "traced list")


@pytest.mark.parametrize(
    "options", [dict(softcap=30.0), dict(window=4), dict(q_lengths=np.ones(2, np.int32))]
)
def test_fp8_scales_are_checked_with_every_option(options):
    """The array form with options dequantizes in XLA; its scales get the same check as
    the plain call's (a (1,) scale would otherwise broadcast over every KV head)."""
    k8 = jnp.zeros((2, 10, 2, 64), FP8_DTYPE)
    q = jnp.zeros((2, 3, 4, 64), BF16)
    good = jnp.ones((2,), F32)
    for bad in (jnp.ones((1,), F32), jnp.ones((3,), F32), jnp.ones((2,), F16), 0.5):
        with pytest.raises(ValueError, match=r"k_scale must be float32 of shape \(2,\)"):
            jax_vmm.attention(q, k8, k8, [3, 4], k_scale=bad, v_scale=good, **options)
    with pytest.raises(ValueError, match="an fp8 cache needs k_scale and v_scale"):
        jax_vmm.attention(q, k8, k8, [3, 4], k_scale=good, **options)
    bf = jnp.zeros((2, 10, 2, 64), BF16)
    with pytest.raises(ValueError, match="k_scale/v_scale are for fp8 caches"):
        jax_vmm.attention(q, bf, bf, [3, 4], k_scale=good, v_scale=good, **options)


# -- validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(window=0), ValueError, "window must be >= 1"),
        (dict(window=-3), ValueError, "window must be >= 1"),
        (dict(window=2.5), TypeError, "window must be None or an int"),
        (dict(window=True), TypeError, "window must be None or an int"),
        (dict(softcap=0.0), ValueError, "softcap must be > 0 in float32"),
        (dict(softcap=-1.0), ValueError, "softcap must be > 0 in float32"),
        (dict(softcap=1e-46), ValueError, "softcap must be > 0 in float32"),  # 0: no cap
        (dict(softcap=1e-39), ValueError, "at least its smallest normal"),  # flushed to 0
        (dict(softcap=float("inf")), ValueError, r"softcap .* must be finite in float32"),
        (dict(softcap=1e39), ValueError, r"softcap .* must be finite in float32"),
        (dict(softcap=10**400), ValueError, r"softcap .* must be finite in float32"),
        (dict(softcap=float("nan")), ValueError, r"softcap .* must be finite in float32"),
        (dict(softcap="30"), TypeError, r"softcap .* must be a real number"),
        (dict(q_lengths=np.zeros(3, np.int32)), ValueError, r"q_lengths must have shape \(2,\)"),
        (dict(q_lengths=np.zeros(2, np.float32)), TypeError, "q_lengths must be integers"),
        (dict(scale="x"), TypeError, "scale .* must be a real number"),
        (dict(scale=1e39), ValueError, r"scale .* must be finite in float32"),  # was NaN out
    ],
)
def test_bad_options_are_refused(kw, exc, match):
    q = jnp.zeros((2, 3, 4, 64), BF16)
    k = jnp.zeros((2, 10, 2, 64), BF16)
    with pytest.raises(exc, match=match):
        jax_vmm.attention(q, k, k, jnp.array([3, 4]), **kw)


def test_options_as_concrete_jax_scalars_are_accepted():
    """window, softcap and scale as concrete JAX scalars (jnp.int32(2)) mean what the
    Python numbers mean (they were refused as not an int / not a real)."""
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 64)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 10, 2, 64)), jnp.float32)
    lengths = jnp.array([6, 9])
    want = jax_vmm.attention(q, k, k, lengths, window=2, softcap=2.0, scale=0.5)
    got = jax_vmm.attention(
        q, k, k, lengths, window=jnp.int32(2), softcap=jnp.float32(2), scale=jnp.float32(0.5)
    )
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_bad_shapes_are_refused():
    k = jnp.zeros((2, 10, 2, 64), BF16)
    with pytest.raises(ValueError, match=r"q must be \(batch, queries S >= 1"):
        jax_vmm.attention(jnp.zeros((2, 4, 64), BF16), k, k, jnp.array([3, 4]))
    with pytest.raises(ValueError, match=r"q must be \(batch, queries S >= 1"):
        jax_vmm.attention(jnp.zeros((2, 0, 4, 64), BF16), k, k, jnp.array([3, 4]))
    with pytest.raises(ValueError, match="not a multiple of kv_heads"):
        jax_vmm.attention(jnp.zeros((2, 3, 3, 64), BF16), k, k, jnp.array([3, 4]), window=2)
    with pytest.raises(TypeError, match="^attention: q, k, v must share one dtype"):
        jax_vmm.attention(jnp.zeros((2, 3, 4, 64), F16), k, k, jnp.array([3, 4]), window=2)
    with pytest.raises(ValueError, match="split-K kernels only"):
        attention_tuned(jnp.zeros((2, 3, 4, 64), BF16), k, k, jnp.array([3, 4]), impl="stream")


def test_fp8_arena_layer_with_options(vm):
    """An fp8 arena layer with several query rows and every option: the split-K kernels
    read a copy of its live tokens, dequantized (jax_vmm_kv_cache_copy_tokens); against
    float64 on the dequantized cache. Lengths past the ensured tokens are clamped and
    counted; with the table of ensured tokens ignored (testing switch) the same call reads
    past them, uncounted, and gives another result."""
    rng = np.random.default_rng(8)
    B, S, Hq, Hkv, D, T = 4, 5, 8, 2, 64, 96
    ensured = [96, 3, 40, 0]
    scales = rng.uniform(0.5, 2.0, (2, 1, Hkv)).astype(np.float32)
    kv = vm.kv(
        num_layers=1, num_kv_heads=Hkv, head_dim=D, max_tokens=T, max_seqs=B,
        dtype=FP8_DTYPE, k_scales=scales[0], v_scales=scales[1], zero_fill=True,
    )  # fmt: skip
    dev = kv.arena.device
    for b, n in enumerate(ensured):
        kv.ensure(n, b)
    k, _ = draw(rng, (B * T, Hkv, D), BF16)
    v, _ = draw(rng, (B * T, Hkv, D), BF16)
    slots = np.concatenate([b * T + np.arange(n) for b, n in enumerate(ensured)]).astype(np.int32)
    put = lambda x: jax.device_put(x, dev)  # noqa: E731
    layer = jax.jit(jax_vmm.kv_write)(kv.cache()[0], put(k[slots]), put(v[slots]), slots)
    jax.block_until_ready(layer.token)
    kv.check()

    def dequantized(x, scale):  # what the cache holds, as float64 (B, T, H, D)
        x8 = quantize_fp8(x, scale[0]).astype(F32) * scale[0][:, None]
        return np.asarray(x8, np.float64).reshape(B, T, Hkv, D)

    k64, v64 = dequantized(k, scales[0]), dequantized(v, scales[1])
    q, q64 = draw(rng, (B, S, Hq, D), BF16)
    lengths, q_lengths = np.array(ensured, np.int32), np.array([5, 2, 0, 1], np.int32)

    def attend(c, q, n, qn):
        return jax_vmm.attention(q, c[0], n, q_lengths=qn, window=6, softcap=30.0)

    args = [put(x) for x in (q, jnp.asarray(lengths), jnp.asarray(q_lengths))]
    out = jax.jit(attend)(kv.cache(), *args)
    kv.check(out)  # a read-only step: check waits for the results it is given
    assert_close(out, ref64(q64, k64, v64, lengths, q_lengths, 6, 30.0), BF16, "fp8 arena layer")
    plain = jax.jit(lambda c, q, n: jax_vmm.attention(q, c[0], n))(kv.cache(), args[0], args[1])
    assert_close(plain, ref64(q64, k64, v64, lengths), BF16, "fp8 arena layer, no option")

    too_long = put(jnp.asarray([96, 10, 41, 0], jnp.int32))
    clamped = jax.jit(attend)(kv.cache(), args[0], too_long, args[2])
    with pytest.raises(jax_vmm.OutOfBoundsRead) as info:
        kv.check(clamped)
    assert info.value.count == 2
    np.testing.assert_array_equal(np.asarray(clamped.astype(F32)), np.asarray(out.astype(F32)))
    with jax_vmm.testing.limits_ignored():
        unclamped = jax.jit(lambda c, q, n, qn: attend(c, q, n, qn))(
            kv.cache(), args[0], too_long, args[2]
        )
    kv.check(unclamped)  # nothing counted without the table
    assert not np.array_equal(np.asarray(unclamped.astype(F32)), np.asarray(out.astype(F32)))


@pytest.mark.parametrize("dtype", [BF16, FP8_DTYPE], ids=["bf16", "fp8"])
def test_a_closed_arena_layer_is_refused(cpu_device, dtype):
    """The stale handle: a cache made before kv.close(), read with several query rows,
    fails with the arena named closed (fp8: when traced; 16-bit: by the handler)."""
    kv = jax_vmm.kv_arena(
        num_layers=1, num_kv_heads=2, head_dim=64, max_tokens=32, max_seqs=2, dtype=dtype,
        device=cpu_device,
    )  # fmt: skip
    kv.ensure(4, 0)
    cache = kv.cache()
    kv.close()
    q = jnp.zeros((2, 3, 4, 64), BF16)
    with pytest.raises((jax_vmm.ArenaClosedError, jax.errors.JaxRuntimeError), match="closed"):
        jax.block_until_ready(jax_vmm.attention(q, cache[0], jnp.array([4, 0]), window=2))


_COPY_PROBE = textwrap.dedent("""
    import ctypes, sys
    import jax
    jax.config.update("jax_platforms", "cpu")
    import jax.numpy as jnp, numpy as np
    import jax_vmm
    import jax_vmm.testing

    B, T, H, D, Hq, S = 2, 512, 2, 64, 4, 3
    kv = jax_vmm.kv_arena(num_layers=1, num_kv_heads=H, head_dim=D, max_tokens=T,
                          dtype=jnp.float8_e4m3fn, max_seqs=B, chunk_bytes=4096,
                          zero_fill=True)  # unwritten tokens read as zeros: a finite output
    for s, n in enumerate((37, 100)):
        kv.ensure(n, seq=s)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for buf in (kv.k_buffers[0], kv.v_buffers[0]):
        for s in range(B):  # past the committed prefix of each sequence: no access at all
            lo = s * kv.seq_bytes + kv.backed_tokens(s) * kv.token_bytes
            if libc.mprotect(buf.address + lo, (s + 1) * kv.seq_bytes - lo, 0) != 0:
                raise OSError(ctypes.get_errno(), "mprotect")
    q = jnp.ones((B, S, Hq, D), jnp.bfloat16)
    attend = jax.jit(lambda c, q, n: jax_vmm.attention(q, c[0], n, window=8))
    lengths = jnp.asarray([T, T], jnp.int32)  # past the ensured tokens: clamped
    if sys.argv[1] == "no_limits":
        with jax_vmm.testing.limits_ignored():
            attend(kv.cache(), q, lengths).block_until_ready()
    else:
        out = attend(kv.cache(), q, lengths).block_until_ready()
        assert np.isfinite(np.asarray(out.astype(jnp.float32))).all()
        try:
            kv.check()
            raise AssertionError("no OutOfBoundsRead")
        except jax_vmm.OutOfBoundsRead as e:
            assert e.count == 2, e.count
    print("PROBE-OK")
""")


def test_fp8_copy_never_reads_past_the_ensured_tokens_cpu():
    """Real oracle: every page past each sequence's committed prefix is PROT_NONE, so one
    read kills the process. Attention with several query rows over the fp8 layer, asked
    for all T tokens, copies only the ensured ones (and counts the clamp); with the table
    ignored (testing switch) the same call reads past them and dies with SIGSEGV."""
    r = run_cpu_script(_COPY_PROBE, "production")
    assert r.returncode == 0 and "PROBE-OK" in r.stdout, (r.returncode, r.stderr[-3000:])
    r = run_cpu_script(_COPY_PROBE, "no_limits")
    assert r.returncode == -signal.SIGSEGV, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])


def test_a_refused_call_over_an_fp8_arena_layer_counts_no_read(cpu_device):
    """The fp8 copy path checks q (heads, head_dim, batch, dtype) before it copies the
    layer: a call that raises leaves the clamp count as it was (kv.check() passes)."""
    kv = jax_vmm.kv_arena(
        num_layers=1, num_kv_heads=2, head_dim=64, max_tokens=32, max_seqs=2,
        dtype=jnp.float8_e4m3fn, device=cpu_device,
    )  # fmt: skip
    kv.ensure(3, seq=0)
    layer, lengths = kv.cache()[0], jnp.array([10, 5])  # both past the 3 tokens ensured
    bad = [
        ((2, 2, 3, 64), BF16, ValueError, "not a multiple of kv_heads=2"),
        ((2, 2, 4, 32), BF16, ValueError, r"head_dim in \(64, 128, 256\), got 32"),
        ((3, 2, 4, 64), BF16, ValueError, "q has batch 3 but k/v have 2 sequences"),
        ((2, 2, 4, 64), jnp.int32, TypeError, "bfloat16 or float16, got int32"),
    ]
    for shape, dtype, error, match in bad:
        with pytest.raises(error, match=match):
            jax_vmm.attention(jnp.ones(shape, dtype), layer, lengths, window=2)
    assert kv.dropped_reads() == 0
    kv.check()
    jax_vmm.attention(jnp.ones((2, 2, 4, 64), BF16), layer, lengths, window=2)
    assert kv.dropped_reads() == 2  # the call that ran counts its clamps
    kv.close()


@pytest.mark.parametrize(
    "options", [{}, dict(softcap=30.0), dict(window=4), dict(q_lengths=np.ones(2, np.int32))]
)
@pytest.mark.parametrize("S", [1, 3])
def test_an_fp8_cache_takes_16_bit_queries_with_every_option(cpu_device, options, S):
    """The fp8 kernel reads 16-bit queries of head_dim 64/128/256. A call with options
    reads a dequantized copy instead, which would take a float32 query: the same cache
    then worked with a window and was refused without one. Every call refuses alike."""
    kv = jax_vmm.kv_arena(
        num_layers=1, num_kv_heads=2, head_dim=64, max_tokens=32, max_seqs=2,
        dtype=FP8_DTYPE, device=cpu_device,
    )  # fmt: skip
    kv.ensure(8, seq=0)
    kv.ensure(8, seq=1)
    k8 = jnp.zeros((2, 10, 2, 64), FP8_DTYPE)
    one = jnp.ones((2,), F32)
    lengths = jnp.array([5, 6])
    q32 = jnp.ones((2, S, 4, 64), F32)
    with pytest.raises(TypeError, match="an fp8 cache is read with q in bfloat16 or float16"):
        jax_vmm.attention(q32, kv.cache()[0], lengths, **options)
    with pytest.raises(TypeError, match="an fp8 cache is read with q in bfloat16 or float16"):
        jax_vmm.attention(q32, k8, k8, lengths, k_scale=one, v_scale=one, **options)
    k8_d32 = jnp.zeros((2, 10, 2, 32), FP8_DTYPE)
    with pytest.raises(ValueError, match=r"an fp8 cache is read with head_dim in \(64, 128"):
        jax_vmm.attention(
            jnp.ones((2, S, 4, 32), BF16), k8_d32, k8_d32, lengths, k_scale=one, v_scale=one,
            **options,
        )  # fmt: skip
    out = jax_vmm.attention(q32.astype(BF16), kv.cache()[0], lengths, **options)
    assert out.shape == (2, S, 4, 64) and out.dtype == BF16
    assert kv.dropped_reads() == 0
    kv.close()


def test_decode_attention_takes_one_query_row_and_names_attention_for_more(cpu_device):
    """decode_attention's q is (B, H_q, D). A (B, S, H_q, D) query ran jax_vmm.attention's
    causal rows unannounced (undocumented, and a (B, 1, H_q, D) result where the
    docs promise (B, H_q, D))."""
    k = jnp.zeros((2, 10, 2, 64), BF16)
    for shape in ((2, 1, 4, 64), (2, 3, 4, 64), (4, 64)):
        with pytest.raises(ValueError, match=r"decode_attention: q must be \(batch, q_heads, "):
            jax_vmm.decode_attention(jnp.zeros(shape, BF16), k, k, jnp.array([3, 4]))
    with pytest.raises(ValueError, match="use jax_vmm.attention"):
        jax_vmm.decode_attention(jnp.zeros((2, 3, 4, 64), BF16), jax_vmm.KVLayer.from_arrays(k, k),
                                 jnp.array([3, 4]))  # fmt: skip


def test_over_an_array_layer(device):
    rng = np.random.default_rng(21)
    B, S, Hq, Hkv, D, T = 3, 4, 8, 2, 128, 50
    lengths, q_lengths = np.array([50, 2, 0], np.int32), np.array([3, 4, 1], np.int32)
    q, q64 = draw(rng, (B, S, Hq, D), F16)
    k, k64 = draw(rng, (B, T, Hkv, D), F16)
    v, v64 = draw(rng, (B, T, Hkv, D), F16)
    q, k, v, n, qn = (
        jax.device_put(x, device) for x in (q, k, v, jnp.asarray(lengths), jnp.asarray(q_lengths))
    )
    layer = jax_vmm.KVLayer.from_arrays(k, v)
    out = jax.jit(lambda q, c, n, qn: jax_vmm.attention(q, c, n, q_lengths=qn, window=3))(
        q, layer, n, qn
    )
    assert_close(out, ref64(q64, k64, v64, lengths, q_lengths, 3), F16, "array layer")


# -- review cases --------------------------------------------------------------------------


def test_head_dim_256_batches_past_the_streaming_kernels_limit_stay_on_split_k():
    """impl="auto" takes the streaming kernel for head_dim 256 from 65536 cached tokens up;
    it serves batches of at most 1024, and a larger one was refused instead of taking the
    split-K kernel (Gemma 2's head_dim)."""
    rng = np.random.default_rng(11)
    B, T, H, D = 1025, 64, 1, 256
    q, q64 = draw(rng, (B, H, D), BF16)
    k, k64 = draw(rng, (B, T, H, D), BF16)
    lengths = rng.integers(0, T + 1, B).astype(np.int32)
    out = jax_vmm.decode_attention(q, k, k, jnp.asarray(lengths))
    want = ref64(q64[:, None], k64, k64, lengths, None)[:, 0]
    assert_close(out, want, BF16, "B1025 D256")


def test_layer_and_k_keywords():
    """The names the docs use: attention(q, layer=, lengths=), attention(q, k=, v=,
    lengths=), and the same for decode_attention; both or neither is refused."""
    k = jnp.asarray(np.random.default_rng(2).standard_normal((2, 8, 1, 16)), F32)
    layer, lengths = jax_vmm.KVLayer.from_arrays(k, k), jnp.array([3, 5])
    q = jnp.ones((2, 2, 1, 16), F32)
    want = jax_vmm.attention(q, layer, lengths)
    for got in (
        jax_vmm.attention(q, layer=layer, lengths=lengths),
        jax_vmm.attention(q, k=k, v=k, lengths=lengths),
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(
        np.asarray(jax_vmm.decode_attention(q[:, 1], layer=layer, lengths=lengths)),
        np.asarray(jax_vmm.decode_attention(q[:, 1], layer, lengths)),
    )
    with pytest.raises(TypeError, match="pass the layer once"):
        jax_vmm.attention(q, k, layer=layer, lengths=lengths)
    with pytest.raises(TypeError, match="got no layer or k"):
        jax_vmm.attention(q, lengths=lengths)
    with pytest.raises(TypeError, match="layer= must be a KVLayer"):
        jax_vmm.decode_attention(q[:, 1], layer=k, lengths=lengths)


def test_reference_attention_checks_its_inputs():
    q, k = jnp.ones((2, 3, 3, 16)), jnp.ones((2, 8, 2, 16))
    with pytest.raises(ValueError, match="H_q a multiple of H_kv"):
        reference_attention(q, k, k, [3, 4])
    with pytest.raises(ValueError, match=r"lengths must be integers of shape \(2,\)"):
        reference_attention(jnp.ones((2, 3, 2, 16)), k, k, [2.7, 8.0])
    with pytest.raises(ValueError, match="both k_scale and v_scale"):
        reference_attention(jnp.ones((2, 3, 2, 16)), k, k, [2, 8], k_scale=jnp.ones(2))


def test_an_fp8_cache_names_16_bit_queries_for_any_query_dtype(cpu_device):
    """An int32 query was told "use bfloat16, float16 or float32", then float32 refused."""
    kv = jax_vmm.kv_arena(
        num_layers=1, num_kv_heads=1, head_dim=64, max_tokens=8, max_seqs=2,
        dtype=FP8_DTYPE, device=cpu_device,
    )  # fmt: skip
    kv.ensure(3, seq=0)
    for dtype in (jnp.int32, F32):
        with pytest.raises(TypeError, match="an fp8 cache is read with q in bfloat16 or float16"):
            jax_vmm.decode_attention(jnp.ones((2, 1, 64), dtype), kv.cache()[0], [3, 0])
    kv.close()


def test_kv_write_takes_lists_of_tokens_and_of_traced_positions(cpu_device):
    """seq=[0], pos=[t] with a traced t (inside scan) raised a tracer conversion error; a
    nested list of tokens was reported as shape (); an empty write said float64."""
    kv = jax_vmm.kv_arena(
        num_layers=1, num_kv_heads=2, head_dim=16, max_tokens=8, max_seqs=1,
        dtype=F32, device=cpu_device,
    )  # fmt: skip
    kv.ensure(4, seq=0)

    def body(layer, t):
        tok = jnp.ones((1, 2, 16), F32) * (t + 1)
        return jax_vmm.kv_write(layer, tok, tok, seq=[0], pos=[t]), None

    layer, _ = jax.lax.scan(body, kv.cache()[0], jnp.arange(4))
    kv.check(layer)
    np.testing.assert_array_equal(np.asarray(kv.k[0])[0, :4, 0, 0], [1, 2, 3, 4])
    tok = (np.ones((2, 2, 16), np.float32) * 7).tolist()
    kv.check(jax_vmm.kv_write(kv.cache()[0], tok, tok, seq=[0, 0], pos=[0, 1]))
    np.testing.assert_array_equal(np.asarray(kv.k[0])[0, :4, 0, 0], [7, 7, 3, 4])
    empty = np.zeros((0, 2, 16), np.float32)
    kv.check(jax_vmm.kv_write(kv.cache()[0], empty, empty, seq=[], pos=[]))
    np.testing.assert_array_equal(np.asarray(kv.k[0])[0, :4, 0, 0], [7, 7, 3, 4])
    with pytest.raises(TypeError, match="seq must hold integers, got float32"):
        jax_vmm.kv_write(kv.cache()[0], tok, tok, seq=[0.5, 0], pos=[0, 1])
    kv.close()
