"""The cuDNN attention backend (jax_vmm.ops.cudnn_attention): jax_vmm's attention semantics on
cuDNN SDPA graphs inside our own custom call.

Against a float64 numpy reference of the semantics (bottom-right causal over the cache,
q_lengths, window, softcap, GQA), for decode (S = 1) and several query tokens, bf16/fp16,
D 64/128/256; over plain arrays and arena views; eagerly, under jit, and captured into a
command buffer. Rows cuDNN does not compute must come back as zeros even when the output
buffer held NaNs. Without a GPU or without the backend built, the GPU tests skip; the
input checks and the "not built" report run everywhere.

Run on a GPU with ``-s`` to see the cuDNN version, paths and graph counters.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
from conftest import cuda_vmm_device
from jax_vmm.ops import cudnn_attention as ca

BF16, F16 = jnp.bfloat16, jnp.float16


# -- the reference ----------------------------------------------------------------------


def reference(q, k, v, lengths, q_lengths=None, window=None, softcap=None, scale=None):
    """float64 attention with jax_vmm.attention's semantics; q (B, S, Hq, D)."""
    q, k, v = (np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64) for x in (q, k, v))
    B, S, Hq, D = q.shape
    T, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = np.zeros_like(q)
    for b in range(B):
        L = int(np.clip(lengths[b], 0, T))
        want = S if q_lengths is None else int(q_lengths[b])
        ql = int(np.clip(want, 0, min(S, L)))
        for i in range(ql):
            pos = L - ql + i
            lo = 0 if window is None else max(0, pos - window + 1)
            kk = np.repeat(k[b, lo : pos + 1], group, axis=1)  # (n, Hq, D)
            vv = np.repeat(v[b, lo : pos + 1], group, axis=1)
            logits = np.einsum("hd,nhd->hn", q[b, i], kk) * scale
            if softcap is not None:
                logits = softcap * np.tanh(logits / softcap)
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            out[b, i] = np.einsum("hn,nhd->hd", p, vv)
    return out


def _tolerance(dtype) -> float:
    return 2e-2 if np.dtype(dtype) == np.dtype(BF16) else 5e-3


def _check(got, want, dtype, what=""):
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    assert not np.isnan(got).any(), f"{what}: NaN in the output (rows left unwritten?)"
    err = np.abs(got - want).max()
    assert err <= _tolerance(dtype) * max(1.0, np.abs(want).max()), f"{what}: max error {err}"


def _data(rng, B, S, T, Hq, Hkv, D, dtype, device):
    mk = lambda *shape: jax.device_put(  # noqa: E731
        jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype), device
    )
    return mk(B, S, Hq, D), mk(B, T, Hkv, D), mk(B, T, Hkv, D)


# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu():
    dev, why = cuda_vmm_device()
    if dev is None:
        pytest.skip(f"needs a CUDA GPU: {why}")
    if not ca.cudnn_built():
        pytest.skip("jax_vmm was built without the cuDNN attention backend (JAX_VMM_CUDNN)")
    info = ca.cudnn_info()
    print(f"\n[cudnn] {info}")
    if not ca.cudnn_available():
        pytest.fail(f"the backend is built but cannot load cuDNN: {info.get('error')}")
    return dev


# -- everywhere (CI included) -------------------------------------------------------------


def test_core_reports_whether_the_backend_was_built():
    assert isinstance(jax_vmm._core.built_with_cudnn, bool)
    assert ca.cudnn_built() == jax_vmm._core.built_with_cudnn
    if not ca.cudnn_built():
        assert not ca.cudnn_available()
        assert "built without" in ca.cudnn_info()["error"]


def test_bad_inputs_are_refused_with_a_message():
    q = jnp.zeros((2, 1, 4, 64), BF16)
    k = jnp.zeros((2, 16, 2, 64), BF16)
    n = jnp.array([3, 4], jnp.int32)
    with pytest.raises(ValueError, match="multiple of H_kv"):
        ca.cudnn_attention(jnp.zeros((2, 1, 3, 64), BF16), k, k, n)
    with pytest.raises(TypeError, match="bfloat16 or all float16"):
        ca.cudnn_attention(q.astype(jnp.float32), k, k, n)
    with pytest.raises(ValueError, match="window"):
        ca.cudnn_attention(q, k, k, n, window=0)
    for cap in (-1.0, 0.0, 1e-46, 1e-39):  # 0 in float32, or flushed to 0: no cap
        with pytest.raises(ValueError, match="cudnn_attention: softcap must be > 0 in float32"):
            ca.cudnn_attention(q, k, k, n, softcap=cap)
    with pytest.raises(ValueError, match="lengths"):
        ca.cudnn_attention(q, k, k, jnp.array([1, 2, 3], jnp.int32))
    with pytest.raises(ValueError, match="head_dim"):
        ca.cudnn_attention(
            jnp.zeros((2, 1, 4, 12), BF16),
            jnp.zeros((2, 16, 2, 12), BF16),
            jnp.zeros((2, 16, 2, 12), BF16),
            n,
        )


def test_cpu_inputs_are_refused():
    cpu = jax.devices("cpu")[0]
    q = jax.device_put(jnp.zeros((2, 1, 4, 64), BF16), cpu)
    k = jax.device_put(jnp.zeros((2, 16, 2, 64), BF16), cpu)
    with pytest.raises(ValueError, match="CUDA devices only"):
        ca.cudnn_attention(q, k, k, jax.device_put(jnp.array([3, 4], jnp.int32), cpu))


def test_the_reference_agrees_with_jax_nn_where_it_can_express_the_mask():
    """The oracle itself, on the CPU: decode over ragged lengths (padding only), and full
    sequences with S == T (bottom-right causal == top-left causal), with a window."""
    rng = np.random.default_rng(1)
    B, T, Hq, Hkv, D = 3, 40, 4, 2, 16
    cpu = jax.devices("cpu")[0]
    q, k, v = _data(rng, B, 1, T, Hq, Hkv, D, jnp.float32, cpu)
    n = np.array([40, 1, 17], np.int32)
    want = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=jnp.asarray(n))
    np.testing.assert_allclose(reference(q, k, v, n), np.asarray(want), atol=1e-5)
    q, k, v = _data(rng, B, T, T, Hq, Hkv, D, jnp.float32, cpu)
    n = np.full(B, T, np.int32)
    for window in (None, 7):
        want = jax.nn.dot_product_attention(
            q, k, v, is_causal=True, local_window_size=None if window is None else (window - 1, 0)
        )
        np.testing.assert_allclose(
            reference(q, k, v, n, window=window), np.asarray(want), atol=1e-5
        )
    # q_lengths: the last rows of a full sequence are those rows of the full computation
    ql = np.array([T, 5, 0], np.int32)
    full = reference(q, k, v, n)
    got = reference(q[:, -5:], k, v, n, np.minimum(ql, 5))
    np.testing.assert_allclose(got[1], full[1, -5:], atol=1e-12)
    assert not got[2].any()


# -- on the GPU ---------------------------------------------------------------------------

# (B, S, T, Hq, Hkv, D)
DECODE = [(4, 1, 256, 8, 2, 64), (3, 1, 300, 8, 2, 128), (2, 1, 512, 4, 4, 256)]
MULTI = [(3, 16, 256, 8, 2, 128), (2, 64, 320, 4, 1, 64), (2, 7, 128, 8, 8, 256)]


def _lengths(rng, B, T):
    n = rng.integers(1, T + 1, size=B)
    n[0] = T  # a full sequence
    if B > 2:
        n[-1] = 0  # an idle slot: zeros
    return n.astype(np.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape", DECODE + MULTI, ids=lambda s: "B{}S{}T{}Hq{}Hkv{}D{}".format(*s))
def test_matches_the_reference(gpu, shape, dtype):
    B, S, T, Hq, Hkv, D = shape
    rng = np.random.default_rng(sum(shape))
    q, k, v = _data(rng, B, S, T, Hq, Hkv, D, dtype, gpu)
    n = _lengths(rng, B, T)
    got = ca.cudnn_attention(q, k, v, jnp.asarray(n))
    _check(got, reference(q, k, v, n), dtype, "default q_lengths")
    if S > 1:
        ql = rng.integers(0, S + 1, size=B).astype(np.int32)
        ql[0] = S
        got = ca.cudnn_attention(q, k, v, jnp.asarray(n), q_lengths=jnp.asarray(ql))
        _check(got, reference(q, k, v, n, ql), dtype, f"q_lengths {ql}")


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 1, 5, 100])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("S", [1, 24])
def test_window_and_softcap(gpu, window, softcap, S):
    B, T, Hq, Hkv, D = 3, 384, 8, 2, 128
    rng = np.random.default_rng(7 + S)
    q, k, v = _data(rng, B, S, T, Hq, Hkv, D, BF16, gpu)
    q = q * 4  # larger logits so that the cap matters
    n = _lengths(rng, B, T)
    ql = np.array([S, max(1, S // 2), S], np.int32)
    got = ca.cudnn_attention(
        q, k, v, jnp.asarray(n), q_lengths=jnp.asarray(ql), window=window, softcap=softcap
    )
    _check(got, reference(q, k, v, n, ql, window, softcap), BF16, f"w={window} cap={softcap}")


@pytest.mark.gpu
def test_scale_and_three_dim_decode_q(gpu):
    B, T, Hq, Hkv, D = 2, 200, 4, 2, 64
    rng = np.random.default_rng(3)
    q, k, v = _data(rng, B, 1, T, Hq, Hkv, D, F16, gpu)
    n = np.array([200, 17], np.int32)
    got = ca.cudnn_attention(q[:, 0], k, v, jnp.asarray(n), scale=0.3)
    assert got.shape == (B, Hq, D)
    _check(got[:, None], reference(q, k, v, n, scale=0.3), F16, "scale 0.3")


@pytest.mark.gpu
@pytest.mark.parametrize("S", [1, 16])
def test_unwritten_rows_are_zeros_in_a_nan_buffer(gpu, S):
    """Rows past q_lengths and sequences of length 0 are zeros, although cuDNN does not
    compute them: the output buffer starts as NaN. With zero_rows=False the same call
    shows (printed) whether cuDNN leaves those rows unwritten."""
    B, T, Hq, Hkv, D = 4, 256, 8, 2, 128
    rng = np.random.default_rng(11)
    q, k, v = _data(rng, B, S, T, Hq, Hkv, D, BF16, gpu)
    n = np.array([T, 0, 100, 3], np.int32)
    ql = np.array([S, S, 0, S], np.int32)
    want = reference(q, k, v, n, ql)
    nan = jnp.full(q.shape, jnp.nan, BF16)
    got = ca.cudnn_attention(q, k, v, jnp.asarray(n), q_lengths=jnp.asarray(ql), out=nan)
    _check(got, want, BF16, "NaN-prefilled output")
    raw = ca.cudnn_attention(
        q,
        k,
        v,
        jnp.asarray(n),
        q_lengths=jnp.asarray(ql),
        out=jnp.full(q.shape, jnp.nan, BF16),
        zero_rows=False,
    )
    raw = np.asarray(raw.astype(jnp.float32))
    print(
        f"\n[cudnn] S={S} zero_rows=False: NaN rows per sequence "
        f"{[int(np.isnan(raw[b]).any(axis=(1, 2)).sum()) for b in range(B)]} "
        f"(lengths {n.tolist()}, q_lengths {ql.tolist()})"
    )


_PAST_LENGTHS_CASES = [(1, {}), (1, {"window": 40}), (1, {"softcap": 20.0}), (16, {})]


@pytest.mark.gpu
@pytest.mark.parametrize("S,option", _PAST_LENGTHS_CASES, ids=["decode", "window", "cap", "S16"])
@pytest.mark.parametrize("garbage", ["nan", "inf", "huge"])
def test_keys_and_values_past_the_lengths_do_not_reach_the_output(gpu, S, option, garbage):
    """Every row past the lengths holds NaN (or +inf keys, -inf values): bytes of memory
    backed but not written for the sequence. cuDNN's multi-query, windowed and soft-capped
    graphs read whole 128-token tiles and mask only the scores, and a masked probability
    times a NaN value is NaN. Over an arena layer the output must equal the reference over
    the tokens alone: the call first zeroes the non-finite values in each sequence's tile
    past its length, and touches nothing else. Over arrays (XLA's immutable operands) cuDNN
    runs as it is, and the S = 16 case shows that it does reach them there, so the layer's
    check would catch a call without the clearing. Huge finite values (1e30) stay: a
    mask that replaces the scores (not one added to them) keeps them out."""
    B, T, Hq, Hkv, D = 4, 256, 8, 2, 128
    rng = np.random.default_rng(23)
    q, k, v = _data(rng, B, S, T, Hq, Hkv, D, BF16, gpu)
    n = np.array([1, 63, 100, 130], np.int32)  # none a multiple of the tile
    fill = {"nan": (np.nan, np.nan), "inf": (np.inf, -np.inf), "huge": (1e30, 1e30)}[garbage]
    k_host, v_host = (np.array(x.astype(jnp.float32)) for x in (k, v))  # writable copies
    for b, L in enumerate(n):
        k_host[b, L:], v_host[b, L:] = fill
    k_bad, v_bad = (jax.device_put(jnp.asarray(x).astype(BF16), gpu) for x in (k_host, v_host))
    ql = np.minimum(n, S).astype(np.int32)
    want = reference(q, k, v, n, ql, **option)  # the clean arrays: rows < n only
    q_lengths = None if S == 1 else jnp.asarray(ql)
    kv = _full_arena(gpu, B, T, Hkv, D, fill=(0, k_bad, v_bad))
    try:
        got = ca.cudnn_attention(q, kv.cache()[0], jnp.asarray(n), q_lengths=q_lengths, **option)
        _check(got, want, BF16, f"{garbage} past the lengths, S={S} {option}, arena layer")
        tile_end = np.minimum(-(-n // 128) * 128, T)
        for name, buf, bad in [("k", kv.k_buffers[0], k_bad), ("v", kv.v_buffers[0], v_bad)]:
            after, before = _read_bf16_bits(buf, bad.shape), _bf16_bits(bad)
            cleared = np.zeros(bad.shape, bool)
            if (S, option) != (1, {}) and garbage != "huge":
                for b in range(B):
                    cleared[b, n[b] : tile_end[b]] = True
            assert (after[cleared] == 0).all(), f"{name}: the tile past the lengths kept a NaN/inf"
            np.testing.assert_array_equal(
                after[~cleared], before[~cleared], err_msg=f"{name}: bytes outside the tile changed"
            )
    finally:
        kv.close()
    over_arrays = np.asarray(
        ca.cudnn_attention(q, k_bad, v_bad, jnp.asarray(n), q_lengths=q_lengths, **option)
        .astype(jnp.float32)
    )  # fmt: skip
    not_finite = int((~np.isfinite(over_arrays)).any(axis=(1, 2, 3)).sum())
    print(f"\n[cudnn] {garbage} past the lengths over arrays, S={S} {option}: {not_finite} of {B}")
    if S == 16 and garbage != "huge":
        assert not np.isfinite(over_arrays).all(), (
            "cuDNN's S = 16 graph no longer lets NaN/inf past the lengths through over arrays: "
            "this test no longer shows that the arena layer's clearing is needed"
        )


def _bf16_bits(x) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16))


def _read_bf16_bits(buf, shape) -> np.ndarray:
    """The buffer's bytes, read by a device-to-host copy (not through the library)."""
    cupy = pytest.importorskip("cupy")
    host = np.empty(shape, np.uint16)
    cupy.cuda.runtime.memcpy(
        host.ctypes.data, buf.address, host.nbytes, cupy.cuda.runtime.memcpyDeviceToHost
    )
    return host


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("option", [{}, {"window": 48}, {"softcap": 20.0}])
def test_decode_graph_writes_zeros_for_empty_sequences(gpu, D, option):
    """Decode (S = 1, no q_lengths) runs no zero-rows kernel: cuDNN's graph itself writes +0
    into the row of a length-0 sequence. The output starts as NaN, so a cuDNN that left
    the row unwritten fails here; the S = 2 call shows that the NaN fill sees such rows
    (cuDNN leaves a length-0 sequence's rows unwritten there, and only the kernel zeroes
    them)."""
    B, T, Hq, Hkv = 6, 320, 8, 2
    rng = np.random.default_rng(D)
    q, k, v = _data(rng, B, 1, T, Hq, Hkv, D, BF16, gpu)
    n = np.array([T, 0, 77, 0, 1, 300], np.int32)
    nan = jnp.full(q.shape, jnp.nan, BF16)
    got = ca.cudnn_attention(q[:, 0], k, v, jnp.asarray(n), out=nan[:, 0], **option)
    raw = np.asarray(got.astype(jnp.float32))
    empty = raw[n == 0]
    assert (empty == 0).all() and not np.signbit(empty).any(), (
        f"cuDNN's decode graph did not write +0 for length-0 sequences (NaN: "
        f"{int(np.isnan(empty).sum())} of {empty.size}); decode needs the zero-rows kernel"
    )
    _check(got[:, None], reference(q, k, v, n, **option), BF16, f"decode D={D} {option}")

    q2 = jnp.concatenate([q, q], axis=1)
    raw2 = ca.cudnn_attention(
        q2, k, v, jnp.asarray(n), out=jnp.full(q2.shape, jnp.nan, BF16), zero_rows=False
    )
    assert np.isnan(np.asarray(raw2.astype(jnp.float32))[n == 0]).all(), (
        "the S = 2 graph wrote the rows of a length-0 sequence: the NaN fill no longer "
        "shows that rows are left unwritten (docs/cudnn_attention.md)"
    )


@pytest.mark.gpu
def test_under_jit_matches_eager(gpu):
    B, S, T, Hq, Hkv, D = 4, 8, 256, 8, 2, 128
    rng = np.random.default_rng(5)
    q, k, v = _data(rng, B, S, T, Hq, Hkv, D, BF16, gpu)
    n, ql = jnp.asarray(_lengths(rng, B, T)), jnp.array([8, 3, 1, 8], jnp.int32)
    f = jax.jit(lambda q, k, v, n, ql: ca.cudnn_attention(q, k, v, n, q_lengths=ql, window=32))
    got = f(q, k, v, n, ql)
    _check(got, reference(q, k, v, np.asarray(n), np.asarray(ql), 32), BF16, "jit")
    eager = ca.cudnn_attention(q, k, v, n, q_lengths=ql, window=32)
    assert np.array_equal(
        np.asarray(got.astype(jnp.float32)), np.asarray(eager.astype(jnp.float32))
    )


def _copy_into(buf, src) -> None:
    src = jax.block_until_ready(src)
    cupy = pytest.importorskip("cupy")
    cupy.cuda.runtime.memcpy(
        buf.address, src.unsafe_buffer_pointer(), src.nbytes, cupy.cuda.runtime.memcpyDeviceToDevice
    )


def _full_arena(device, B, T, Hkv, D, *, layers=1, fill=None):
    """A bf16 kv_arena with every token of its B sequences ensured; ``fill`` (layer, k, v)
    copies k and v into that layer's buffers."""
    kv = jax_vmm.kv_arena(
        num_layers=layers, num_kv_heads=Hkv, head_dim=D, max_tokens=T, dtype=BF16,
        device=device, max_seqs=B, initial_tokens=T,
    )  # fmt: skip
    try:
        if fill is not None:
            layer, k, v = fill
            _copy_into(kv.k_buffers[layer], k)
            _copy_into(kv.v_buffers[layer], v)
    except BaseException:
        kv.close()
        raise
    return kv


@pytest.mark.gpu
@pytest.mark.parametrize("S", [1, 32])
def test_over_arena_views(gpu, S):
    B, T, Hq, Hkv, D = 4, 512, 8, 2, 128
    rng = np.random.default_rng(13)
    q, k, v = _data(rng, B, S, T, Hq, Hkv, D, BF16, gpu)
    kv = _full_arena(gpu, B, T, Hkv, D, layers=2, fill=(1, k, v))
    try:
        n = _lengths(rng, B, T)
        got = ca.cudnn_attention(q, kv.k[1], kv.v[1], jnp.asarray(n), softcap=20.0, window=200)
        _check(got, reference(q, k, v, n, None, 200, 20.0), BF16, "arena views")
    finally:
        kv.close()


@pytest.mark.gpu
@pytest.mark.parametrize("S", [1, 8])
def test_over_a_cache_layer(gpu, S):
    """The layer form: the arena layer is found by the cache's identity (eager and under
    jit with the cache as an argument); lengths past the ensured tokens are clamped to
    them and counted (kv.check() raises OutOfBoundsRead)."""
    B, T, Hq, Hkv, D = 3, 256, 8, 2, 64
    rng = np.random.default_rng(19)
    q, k, v = _data(rng, B, S, T, Hq, Hkv, D, BF16, gpu)
    kv = _full_arena(gpu, B, T, Hkv, D, layers=2, fill=(0, k, v))
    try:
        n = np.array([T, 100, 0], np.int32)
        want = reference(q, k, v, n, None, 50, 10.0)
        cache = kv.cache()
        got = ca.cudnn_attention(q, cache[0], jnp.asarray(n), window=50, softcap=10.0)
        _check(got, want, BF16, "layer, eager")
        f = jax.jit(lambda q, cache, n: ca.cudnn_attention(q, cache[0], n, window=50, softcap=10.0))
        _check(f(q, cache, jnp.asarray(n)), want, BF16, "layer, jit")
        kv.check()  # nothing clamped so far
    finally:
        kv.close()
    kv = _full_arena(gpu, B, T, Hkv, D, layers=1, fill=(0, k, v))
    try:
        kv.release(1, keep_tokens=64)  # sequence 1 keeps the bytes of its first 64 tokens
        kv.ensure(64, seq=1)  # ... and has 64 tokens ensured
        n = np.array([T, 200, 30], np.int32)
        got = ca.cudnn_attention(q, kv.cache()[0], jnp.asarray(n))
        _check(got, reference(q, k, v, np.array([T, 64, 30])), BF16, "clamped to ensured")
        with pytest.raises(jax_vmm.OutOfBoundsRead):
            kv.check()
    finally:
        kv.close()


def _tail(x):  # more kernels around the call: XLA only forms command buffers of some size
    y = x.astype(jnp.float32)
    for _ in range(4):
        y = jnp.tanh(y) * 1.5 + jnp.mean(y, axis=(2, 3), keepdims=True)
    return x, jnp.sum(y)


@pytest.mark.gpu
@pytest.mark.parametrize("S", [1, 16])
def test_captured_in_a_command_buffer(gpu, S):
    """The call is recorded into a command buffer (the handler runs on a capturing stream,
    with the graph built before the capture) and stays right across calls with new
    lengths."""
    B, T, Hq, Hkv, D = 4, 256, 8, 2, 128
    rng = np.random.default_rng(17)
    q, k, v = _data(rng, B, S, T, Hq, Hkv, D, BF16, gpu)

    def step(q, k, v, n):
        q = q * 1.0 + 0.0  # an op before, so the call sits inside a sequence of kernels
        return _tail(ca.cudnn_attention(q, k, v, n, window=64))

    f = jax.jit(step).lower(q, k, v, jnp.zeros((B,), jnp.int32)).compile()
    before = ca.cudnn_attention_stats()
    for trial in range(4):
        n = rng.integers(0, T + 1, size=B).astype(np.int32)
        got, _ = f(q, k, v, jax.device_put(jnp.asarray(n), gpu))
        _check(got, reference(q, k, v, n, None, 64), BF16, f"replay {trial}")
    after = ca.cudnn_attention_stats()
    print(f"\n[cudnn] S={S} stats before {before} after {after}")
    assert after["captured_calls"] > before["captured_calls"], (
        "the custom call never ran under stream capture: XLA did not put it into a command "
        f"buffer ({after})"
    )
    assert after["execute_failures"] == 0


# -- routing: jax_vmm.attention / decode_attention over an arena layer ------------------


@pytest.mark.gpu
@pytest.mark.parametrize("S", [1, 16])
def test_auto_attention_over_an_arena_layer_runs_cudnn(gpu, S, monkeypatch):
    """The natural call (`jax_vmm.attention(q, layer, lengths)`, and `decode_attention` for
    S = 1) runs cuDNN when the build has it (its execution counter moves) and gives what
    jax_vmm's kernels give (JAX_VMM_ATTENTION=kernels) and the float64 reference, under
    jit with the cache as an argument."""
    B, T, Hq, Hkv, D = 3, 256, 8, 2, 128
    rng = np.random.default_rng(23)
    q, k, v = _data(rng, B, S, T, Hq, Hkv, D, BF16, gpu)
    kv = _full_arena(gpu, B, T, Hkv, D, fill=(0, k, v))
    try:
        n = jnp.asarray(np.array([T, 100, 0], np.int32))
        opts = {} if S == 1 else dict(window=40, softcap=30.0)

        def step(cache, q, n):
            if S == 1:
                return jax_vmm.decode_attention(q[:, 0], cache[0], n)[:, None]
            return jax_vmm.attention(q, cache[0], n, **opts)

        before = ca.cudnn_attention_stats()["execute_calls"]
        got = jax.jit(step)(kv.cache(), q, n)
        assert ca.cudnn_attention_stats()["execute_calls"] > before, "cuDNN did not run"
        monkeypatch.setenv("JAX_VMM_ATTENTION", "kernels")
        before = ca.cudnn_attention_stats()["execute_calls"]
        # The choice is made at trace time: jit caches traces per function, so a new one.
        ours = jax.jit(lambda *a: step(*a))(kv.cache(), q, n)
        assert ca.cudnn_attention_stats()["execute_calls"] == before
        want = reference(q, k, v, np.asarray(n), None, opts.get("window"), opts.get("softcap"))
        _check(got, want, BF16, "auto (cuDNN)")
        _check(ours, want, BF16, "kernels")
        kv.check()
    finally:
        kv.close()


@pytest.mark.gpu
def test_a_step_clamps_its_lengths_once_for_all_layers(gpu):
    """A decode step over 4 arena layers runs 4 cuDNN calls and one lengths clamp: the
    clamp names the cache and no layer, so XLA merges the layers' identical clamps. The
    merged clamp still clamps every layer's read to the ensured tokens (counted once per
    step and sequence), and under limits_ignored() no layer is clamped."""
    L, B, T, Hq, Hkv, D = 4, 3, 256, 8, 2, 128
    rng = np.random.default_rng(29)
    kv = _full_arena(gpu, B, T, Hkv, D, layers=L)
    try:
        ks, vs = [], []
        for layer in range(L):
            _, k, v = _data(rng, B, 1, T, Hq, Hkv, D, BF16, gpu)
            _copy_into(kv.k_buffers[layer], k)
            _copy_into(kv.v_buffers[layer], v)
            ks.append(k)
            vs.append(v)
        kv.shrink(100)  # every sequence: 100 tokens ensured, the chunk stays backed
        q = jax.device_put(jnp.asarray(rng.standard_normal((B, Hq, D)), BF16), gpu)

        def step(cache, q, n):
            outs = [jax_vmm.decode_attention(q, cache[layer], n) for layer in range(L)]
            return jnp.stack(outs)

        hlo = jax.jit(step).lower(kv.cache(), q, jnp.zeros((B,), jnp.int32)).compile().as_text()
        calls = [line for line in hlo.splitlines() if "custom-call(" in line]
        clamps = sum("jax_vmm_kv_cache_read_lengths" in line for line in calls)
        attends = sum("jax_vmm_cudnn_attention_cache" in line for line in calls)
        assert (clamps, attends) == (1, L), f"clamps {clamps}, cuDNN calls {attends} (want 1, {L})"

        n = jax.device_put(jnp.asarray([T, 100, 40], jnp.int32), gpu)
        got = jax.jit(step)(kv.cache(), q, n)
        with pytest.raises(jax_vmm.OutOfBoundsRead) as info:
            kv.check(got)
        assert info.value.count == 1, "one sequence asked past its ensured tokens, one step"
        read = np.array([100, 100, 40], np.int32)
        for layer in range(L):
            want = reference(q[:, None], ks[layer], vs[layer], read)
            _check(got[layer][:, None], want, BF16, f"layer {layer}, clamped to 100")
        with jax_vmm.testing.limits_ignored():
            unclamped = jax.jit(lambda *a: step(*a))(kv.cache(), q, n)
        kv.check(unclamped)  # not counted without the table
        for layer in range(L):
            assert not np.allclose(
                np.asarray(unclamped[layer, 0].astype(jnp.float32)),
                np.asarray(got[layer, 0].astype(jnp.float32)),
            ), f"layer {layer}: limits_ignored() read the same 100 tokens"
    finally:
        kv.close()
