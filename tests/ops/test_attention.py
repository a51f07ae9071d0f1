"""decode_attention: correctness against a float64 reference, every output element
written, only live tokens read, trace-time validation, the split-K plan, GPU kernels.

The `device` fixture runs each device-generic test on the CPU and (marked gpu) on the
first CUDA GPU. "Never reads the unbacked tail" is proven on the CPU with a real oracle:
the tail pages are made PROT_NONE, so any read kills the (sub)process; the same test with
the testing target that reads every token (jax_vmm.testing.decode_attention) must die,
showing that it would see a read.
"""

from __future__ import annotations

import math
import signal
import subprocess
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
import jax_vmm.testing
from conftest import run_cpu_script, write_bytes
from jax_vmm.ops.attention import attention_plan, attention_stats, decode_attention_tuned

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
# ||out - ref|| / ||ref|| bounds: float32 accumulation everywhere; the output (and on
# the GPU tensor-core path, the softmax weights) are rounded to the input dtype.
REL_TOL = {np.dtype(BF16): 1e-2, np.dtype(F16): 2e-3, np.dtype(F32): 1e-5}


# -- helpers -----------------------------------------------------------------------


def random_inputs(rng: np.random.Generator, B: int, T: int, Hq: int, Hkv: int, D: int, dtype):
    """q, k, v as arrays of `dtype` (values representable in it), plus float64 copies."""

    def draw(shape):
        x = jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)
        return x, np.asarray(x.astype(jnp.float32), np.float64)

    (q, q64), (k, k64), (v, v64) = draw((B, Hq, D)), draw((B, T, Hkv, D)), draw((B, T, Hkv, D))
    return (q, k, v), (q64, k64, v64)


def reference(q64, k64, v64, lengths, scale=None) -> np.ndarray:
    """float64 decode attention over tokens [0, clamp(length, 0, T)) only."""
    B, Hq, D = q64.shape
    T, Hkv = k64.shape[1], k64.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    G = Hq // Hkv
    out = np.zeros((B, Hq, D))
    for b in range(B):
        n = int(min(max(int(lengths[b]), 0), T))
        if n == 0:
            continue
        for h in range(Hq):
            kk, vv = k64[b, :n, h // G], v64[b, :n, h // G]
            s = kk @ q64[b, h] * scale
            p = np.exp(s - s.max())
            out[b, h] = p @ vv / p.sum()
    return out


def assert_close(out, ref: np.ndarray, dtype, what: str = "") -> None:
    out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.isfinite(out).all(), (
        f"{what}: non-finite output at {np.argwhere(~np.isfinite(out))[:5]}"
    )
    tol = REL_TOL[np.dtype(dtype)]
    denom = max(np.linalg.norm(ref), 1e-30)
    rel = np.linalg.norm(out - ref) / denom
    assert rel < tol, f"{what}: relative error {rel:.3g} >= {tol}"
    # and no single element far off (a mis-indexed head or token shows up here)
    worst = np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert worst < 8 * tol, f"{what}: worst element error {worst:.3g} (relative to max |ref|)"


def on(device, *arrays):
    return [jax.device_put(a, device) for a in arrays]


def gpu_dtypes_and_impls(device):
    """(dtype, impl) pairs to run on `device`: every GPU kernel, the CPU's one handler."""
    if device.platform == "cpu":
        return [(BF16, "auto"), (F16, "auto"), (F32, "auto")]
    return [
        (BF16, "tensor_core"),
        (F16, "tensor_core"),
        (BF16, "tensor_core_u1"),
        (BF16, "simple"),
        (F32, "simple"),
        (F16, "simple"),
    ]


# -- correctness -------------------------------------------------------------------

SHAPES = [
    # B, T, Hq, Hkv, D
    (4, 100, 4, 4, 64),  # MHA
    (4, 300, 8, 2, 128),  # GQA 4
    (3, 77, 16, 2, 64),  # GQA 8
    (2, 64, 6, 1, 64),  # GQA 6: head group 6 (not a power of two)
    (2, 50, 12, 1, 128),  # GQA 12: two tensor-core head tiles
    (2, 40, 32, 1, 64),  # GQA 32: head group 16, two blocks per KV head
    (2, 33, 4, 2, 256),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}Hq{}Hkv{}D{}".format(*s))
def test_matches_reference(device, shape):
    B, T, Hq, Hkv, D = shape
    rng = np.random.default_rng(hash(shape) % 2**32)
    # length 0, 1, a non-multiple of any tile/chunk, T, and random ones
    lengths = np.array(([0, 1, min(T, 37), T] + list(rng.integers(0, T + 1, size=B)))[:B], np.int32)
    for dtype, impl in gpu_dtypes_and_impls(device):
        (q, k, v), (q64, k64, v64) = random_inputs(rng, B, T, Hq, Hkv, D, dtype)
        q, k, v, lens = on(device, q, k, v, jnp.asarray(lengths))
        out = jax.jit(lambda *a: decode_attention_tuned(*a, impl=impl))(q, k, v, lens)
        assert out.dtype == q.dtype and out.shape == q.shape
        assert_close(
            out, reference(q64, k64, v64, lengths), dtype, f"{dtype.__name__} {impl} {shape}"
        )
        zero = np.asarray(out.astype(jnp.float32))[lengths == 0]
        assert (zero == 0).all(), "length 0 must give exact zeros"


@pytest.mark.parametrize("chunk,splits", [(16, 1), (16, 3), (32, 2), (48, 5), (64, 0), (0, 1)])
def test_forced_plans(device, chunk, splits):
    """Many chunks per split (round robin), splits with no chunk, partial last chunks."""
    B, T, Hq, Hkv, D = 3, 200, 8, 2, 64
    rng = np.random.default_rng(1000 + chunk * 7 + splits)
    lengths = np.array([200, 17, 129], np.int32)
    for dtype, impl in gpu_dtypes_and_impls(device)[:2]:
        (q, k, v), (q64, k64, v64) = random_inputs(rng, B, T, Hq, Hkv, D, dtype)
        q, k, v, lens = on(device, q, k, v, jnp.asarray(lengths))
        out = decode_attention_tuned(q, k, v, lens, chunk=chunk, splits=splits, impl=impl)
        assert_close(
            out, reference(q64, k64, v64, lengths), dtype, f"chunk={chunk} splits={splits} {impl}"
        )


def test_every_output_element_written(device):
    """The output buffer starts as NaN (aliased out_init); every element is overwritten,
    including the zeros of empty sequences."""
    B, T, Hq, Hkv, D = 4, 96, 8, 2, 64
    rng = np.random.default_rng(7)
    lengths = np.array([0, 1, 50, 96], np.int32)
    for dtype, impl in gpu_dtypes_and_impls(device):
        (q, k, v), (q64, k64, v64) = random_inputs(rng, B, T, Hq, Hkv, D, dtype)
        q, k, v, lens = on(device, q, k, v, jnp.asarray(lengths))
        poison = jax.device_put(jnp.full(q.shape, jnp.nan, q.dtype), device)
        out = jax.jit(
            lambda *a: jax_vmm.testing.decode_attention(*a[:4], impl=impl, out_init=a[4])
        )(q, k, v, lens, poison)
        assert_close(out, reference(q64, k64, v64, lengths), dtype, f"poisoned {impl}")


def test_poison_check_sees_unwritten_output(device):
    """The check above would see an unwritten element: with the testing switch that skips
    the output write, the aliased NaN buffer comes back untouched."""
    q = jax.device_put(jnp.ones((2, 4, 64), BF16), device)
    k = jax.device_put(jnp.ones((2, 8, 2, 64), BF16), device)
    lens = jax.device_put(jnp.array([3, 0], jnp.int32), device)
    poison = jax.device_put(jnp.full(q.shape, jnp.nan, BF16), device)
    out = jax_vmm.testing.decode_attention(q, k, k, lens, out_init=poison, skip_output=True)
    assert np.isnan(np.asarray(out.astype(jnp.float32))).all()
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close(out, np.ones(q.shape), BF16)
    out = jax_vmm.testing.decode_attention(
        q, k, k, lens, out_init=poison
    )  # the real thing overwrites it
    assert_close(out, np.concatenate([np.ones((1, 4, 64)), np.zeros((1, 4, 64))]), BF16)


def test_lengths_are_clamped(device):
    B, T, Hq, Hkv, D = 3, 40, 4, 2, 64
    rng = np.random.default_rng(3)
    (q, k, v), (q64, k64, v64) = random_inputs(
        rng, B, T, Hq, Hkv, D, F32 if device.platform == "cpu" else BF16
    )
    lengths = np.array([-5, 41, 10**9], np.int32)
    q, k, v, lens = on(device, q, k, v, jnp.asarray(lengths))
    out = jax_vmm.decode_attention(q, k, v, lens)
    assert_close(out, reference(q64, k64, v64, np.clip(lengths, 0, T)), q.dtype)


def test_wide_lengths_are_clamped_not_wrapped(device):
    """Lengths wider than int32 are clamped to [0, T] before the int32 cast: 2**32 + 1
    must mean "all T tokens", not 1 (its low 32 bits)."""
    B, T, Hq, Hkv, D = 3, 40, 4, 2, 64
    rng = np.random.default_rng(5)
    (q, k, v), (q64, k64, v64) = random_inputs(
        rng, B, T, Hq, Hkv, D, F32 if device.platform == "cpu" else BF16
    )
    q, k, v = on(device, q, k, v)
    wide = [2**32 + 1, -(2**40), 2**63 - 1]
    want = reference(q64, k64, v64, [T, 0, T])
    for lengths in (np.array(wide, np.int64), wide, np.array([2**32 + 1, 0, 2**64 - 1], np.uint64)):
        assert_close(jax_vmm.decode_attention(q, k, v, lengths), want, q.dtype)
    with jax.enable_x64(True):
        lens = jax.device_put(jnp.array(wide, jnp.int64), device)
        assert_close(jax_vmm.decode_attention(q, k, v, lens), want, q.dtype)
        jitted = jax.jit(jax_vmm.decode_attention)(q, k, v, lens)
        assert_close(jitted, want, q.dtype)


def test_scale_and_xla_workspace(device):
    B, T, Hq, Hkv, D = 2, 130, 8, 4, 128
    rng = np.random.default_rng(11)
    lengths = np.array([130, 65], np.int32)
    (q, k, v), (q64, k64, v64) = random_inputs(rng, B, T, Hq, Hkv, D, BF16)
    q, k, v, lens = on(device, q, k, v, jnp.asarray(lengths))
    ref = reference(q64, k64, v64, lengths, scale=0.3)
    for workspace in ("scratch", "xla"):
        out = jax.jit(lambda *a: decode_attention_tuned(*a, scale=0.3, workspace=workspace))(
            q, k, v, lens
        )
        assert_close(out, ref, BF16, workspace)


def test_vmap_is_sequential(device):
    B, T, Hq, Hkv, D = 2, 24, 4, 2, 64
    rng = np.random.default_rng(5)
    (q, k, v), (q64, k64, v64) = random_inputs(
        rng, B, T, Hq, Hkv, D, F32 if device.platform == "cpu" else BF16
    )
    qs = jnp.stack([q, q[::-1]])
    lens = jnp.asarray(np.array([[24, 3], [5, 0]], np.int32))
    qs, k, v, lens = on(device, qs, k, v, lens)
    out = jax.vmap(jax_vmm.decode_attention, in_axes=(0, None, None, 0))(qs, k, v, lens)
    assert_close(out[0], reference(q64, k64, v64, [24, 3]), q.dtype)
    assert_close(out[1], reference(q64[::-1], k64, v64, [5, 0]), q.dtype)


# -- the KV arena: growth, poison past the length, the unbacked tail ---------------------


def _fill_kv(
    kv: jax_vmm.KVArena,
    rng: np.random.Generator,
    seq: int,
    start: int,
    stop: int,
    dtype,
    values: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Write tokens [start, stop) of sequence `seq` (layer 0, K and V) through memcpy."""
    H, D = kv.num_kv_heads, kv.head_dim
    out = []
    for buf in (kv.k_buffers[0], kv.v_buffers[0]):
        if values is None:
            data = np.asarray(
                jnp.asarray(rng.standard_normal((stop - start, H, D), dtype=np.float32)).astype(
                    dtype
                )
            )
        else:
            data = np.broadcast_to(
                np.asarray(jnp.asarray(values).astype(dtype)), (stop - start, H, D)
            ).copy()
        write_bytes(buf, (seq * kv.max_tokens + start) * kv.token_bytes, data.view(np.uint8))
        out.append(np.asarray(jnp.asarray(data).astype(jnp.float32), np.float64))
    return out[0], out[1]


def test_growth_under_jit_with_poison_past_length(vm):
    """A jitted step over arena views: tokens past each length but inside committed
    chunks hold NaN/inf (never read: output finite and right); the cache grows with
    kv.ensure and the same executable serves the longer sequences, no retrace."""
    dtype = BF16
    B, T, Hkv, D, Hq = 3, 256, 2, 64, 8
    kv = vm.kv(
        num_layers=1,
        num_kv_heads=Hkv,
        head_dim=D,
        max_tokens=T,
        dtype=dtype,
        max_seqs=B,
        chunk_bytes=max(vm.chunk, 4096),
    )
    rng = np.random.default_rng(21)
    k64 = np.zeros((B, T, Hkv, D))
    v64 = np.zeros((B, T, Hkv, D))
    current = np.zeros(B, np.int32)
    poisoned = 0

    def grow(new):
        nonlocal poisoned
        for s, n in enumerate(new):
            n = int(n)
            kv.ensure(n, seq=s)
            if n > current[s]:
                k64[s, current[s] : n], v64[s, current[s] : n] = _fill_kv(
                    kv, rng, s, int(current[s]), n, dtype
                )
            current[s] = n
            backed = kv.backed_tokens(s)
            if backed > n:  # committed but past the length: poison it
                _fill_kv(kv, rng, s, n, backed, dtype, values=np.float32(np.nan))
                _fill_kv(kv, rng, s, n, n + 1, dtype, values=np.float32(np.inf))
                poisoned += backed - n

    traces = []

    @jax.jit
    def step(q, k, v, lens):
        traces.append(1)
        return jax_vmm.decode_attention(q, k, v, lens)

    tokens_per_chunk = kv.arena.chunk_bytes // kv.token_bytes
    for new in ([1, 20, 0], [2, 45, 17], [min(T, tokens_per_chunk + 3), 130, 17]):
        new = np.array(new, np.int32)
        grow(new)
        q = jnp.asarray(rng.standard_normal((B, Hq, D), dtype=np.float32)).astype(dtype)
        q64 = np.asarray(q.astype(jnp.float32), np.float64)
        q, lens = on(vm.device, q, jnp.asarray(new))
        out = step(q, kv.k[0], kv.v[0], lens)
        assert_close(out, reference(q64, k64, v64, new), dtype, f"lengths {new.tolist()}")
    assert poisoned > 0, "test bug: no committed token past a length was poisoned"
    assert len(traces) == 1, "growing the cache must not retrace the step"


_PROBE = textwrap.dedent("""
    import ctypes, functools, sys
    import jax
    jax.config.update("jax_platforms", "cpu")
    import jax.numpy as jnp, numpy as np
    import jax_vmm
    import jax_vmm.testing
    from jax_vmm.ops.attention import decode_attention_tuned

    read_all = sys.argv[1] == "read_all"
    B, T, H, D, Hq = 2, 512, 2, 64, 4
    kv = jax_vmm.kv_arena(num_layers=1, num_kv_heads=H, head_dim=D, max_tokens=T,
                          dtype=jnp.bfloat16, max_seqs=B, chunk_bytes=4096)
    lengths = [37, 100]
    rng = np.random.default_rng(0)
    for s, n in enumerate(lengths):
        kv.ensure(n, seq=s)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    data = {}
    for name, buf in (("k", kv.k_buffers[0]), ("v", kv.v_buffers[0])):
        x = jnp.asarray(rng.standard_normal((B, T, H, D), dtype=np.float32)).astype(jnp.bfloat16)
        x = np.asarray(x)
        for s, n in enumerate(lengths):
            row = x[s, :n].view(np.uint8)
            ctypes.memmove(buf.address + s * kv.seq_bytes, row.ctypes.data, row.nbytes)
            # everything past the committed prefix of this sequence: no access at all
            lo = s * kv.seq_bytes + kv.backed_tokens(s) * kv.token_bytes
            hi = (s + 1) * kv.seq_bytes
            assert lo % 4096 == 0 and hi > lo
            if libc.mprotect(buf.address + lo, hi - lo, 0) != 0:
                raise OSError(ctypes.get_errno(), "mprotect")
        data[name] = x.astype(np.float32)
    q = jnp.asarray(rng.standard_normal((B, Hq, D), dtype=np.float32)).astype(jnp.bfloat16)
    attend = (functools.partial(jax_vmm.testing.decode_attention, read_all_tokens=True)
              if read_all else decode_attention_tuned)
    out = attend(q, kv.k[0], kv.v[0], jnp.asarray(lengths, jnp.int32)).block_until_ready()
    out = np.asarray(out.astype(jnp.float32))
    qf = np.asarray(q.astype(jnp.float32))
    for s, n in enumerate(lengths):
        for h in range(Hq):
            sc = data["k"][s, :n, h // 2] @ qf[s, h] / np.sqrt(D)
            p = np.exp(sc - sc.max())
            ref = p @ data["v"][s, :n, h // 2] / p.sum()
            assert np.allclose(out[s, h], ref, rtol=2e-2, atol=2e-2), (s, h)
    print("PROBE-OK")
""")


def _run_probe(mode: str) -> subprocess.CompletedProcess:
    return run_cpu_script(_PROBE, mode)


def test_unbacked_tail_is_never_read_cpu():
    """Real oracle: the tail of every sequence (past its committed prefix) is PROT_NONE,
    so a single read kills the process. decode_attention runs and is correct."""
    r = _run_probe("production")
    assert r.returncode == 0 and "PROBE-OK" in r.stdout, (
        r.returncode,
        r.stdout[-2000:],
        r.stderr[-4000:],
    )


def test_unbacked_tail_oracle_detects_a_read_cpu():
    """The same probe through the testing target that touches every token up to T must
    die with SIGSEGV: the oracle above would catch a kernel that read the tail."""
    r = _run_probe("read_all")
    assert r.returncode == -signal.SIGSEGV, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])


# -- validation and plan -------------------------------------------------------------


def test_trace_time_validation():
    q = jnp.zeros((2, 8, 64), BF16)
    k = jnp.zeros((2, 16, 2, 64), BF16)
    L = jnp.zeros((2,), jnp.int32)
    cases = [
        (dict(q=q[0]), ValueError, "q must be"),
        (dict(k=k[0]), ValueError, "k must be"),
        (dict(v=k[:, :8]), ValueError, "v has shape"),
        (dict(q=jnp.zeros((3, 8, 64), BF16)), ValueError, "batch"),
        (dict(q=jnp.zeros((2, 8, 32), BF16)), ValueError, "head_dim"),
        (
            dict(
                q=jnp.zeros((2, 6, 64), BF16),
                k=jnp.zeros((2, 16, 4, 64), BF16),
                v=jnp.zeros((2, 16, 4, 64), BF16),
            ),
            ValueError,
            "multiple of kv_heads",
        ),
        (dict(q=q.astype(F16)), TypeError, "share one dtype"),
        (
            dict(q=q.astype(jnp.int8), k=k.astype(jnp.int8), v=k.astype(jnp.int8)),
            TypeError,
            "not supported",
        ),
        (dict(lengths=jnp.zeros((3,), jnp.int32)), ValueError, "lengths must have shape"),
        (dict(lengths=jnp.zeros((2,), jnp.float32)), TypeError, "integers"),
    ]
    for override, exc, msg in cases:
        args = dict(q=q, k=k, v=k, lengths=L) | override
        with pytest.raises(exc, match=msg):
            jax.jit(lambda **a: jax_vmm.decode_attention(**a))(**args)
    with pytest.raises(ValueError, match="impl"):
        decode_attention_tuned(q, k, k, L, impl="fast")
    with pytest.raises(ValueError, match="tensor_core"):
        decode_attention_tuned(q.astype(F32), k.astype(F32), k.astype(F32), L, impl="tensor_core")
    with pytest.raises(ValueError, match="scale"):
        jax_vmm.decode_attention(q, k, k, L, scale=float("nan"))
    for bad in ("x", "0.5", [0.5], True):
        with pytest.raises(TypeError, match=r"scale .*must be a real number"):
            jax_vmm.decode_attention(q, k, k, L, scale=bad)
    # int64 / int16 lengths are accepted (cast to int32)
    out = jax_vmm.decode_attention(q, k, k, jnp.array([3, 0], jnp.int16))
    assert out.shape == q.shape


@pytest.mark.parametrize(
    "B,T,Hq,Hkv,D,units",
    [
        (32, 8192, 32, 8, 128, 132),
        (1, 8192, 32, 8, 128, 132),
        (4, 1000, 8, 8, 64, 132),
        (8, 131072, 64, 8, 128, 132),
        (2, 5, 12, 1, 64, 8),
        (3, 1, 40, 2, 64, 8),
        (1, 16, 1, 1, 256, 1),
    ],
)
def test_plan_invariants(B, T, Hq, Hkv, D, units):
    p = attention_plan(B, T, Hq, Hkv, D, parallel_units=units)
    G = Hq // Hkv
    assert p["chunk"] % 16 == 0 and 16 <= p["chunk"] <= (256 if p["head_group"] > 8 else 512)
    assert G % p["head_group"] == 0 and 1 <= p["head_group"] <= 16
    assert p["max_chunks"] == math.ceil(T / p["chunk"])
    assert 1 <= p["splits"] <= p["max_chunks"]
    assert p["workspace_bytes"] >= B * Hq * p["splits"] * (D + 2) * 4
    assert p["workspace_bytes"] % 256 == 0
    forced = attention_plan(B, T, Hq, Hkv, D, parallel_units=units, chunk=20, splits=3)
    assert forced["chunk"] == 32 and forced["splits"] == min(3, math.ceil(T / 32))


def test_plan_for_the_benchmark_shape():
    """batch 32, ctx 8k, H_kv 8, D 128 on 132 SMs: 512-token chunks, 16 splits,
    4096 blocks (31 per SM), partials 2% of the KV bytes."""
    p = attention_plan(32, 8192, 32, 8, 128, parallel_units=132)
    assert (p["chunk"], p["splits"], p["head_group"]) == (512, 16, 4)
    kv_bytes = 2 * 32 * 8192 * 8 * 128 * 2
    assert p["workspace_bytes"] < 0.02 * kv_bytes


def test_cpu_handler_counts_calls():
    before = attention_stats()["cpu_calls"]
    # Pin to the CPU: on a GPU machine the default device would run the CUDA handler.
    with jax.default_device(jax.devices("cpu")[0]):
        q = jnp.ones((1, 2, 64), F32)
        k = jnp.ones((1, 4, 1, 64), F32)
        jax_vmm.decode_attention(q, k, k, jnp.array([2], jnp.int32)).block_until_ready()
    assert attention_stats()["cpu_calls"] == before + 1


# -- GPU only --------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_kernels_agree_on_the_benchmark_shape(gpu_device):
    """Tensor-core and simple kernels against the reference at a realistic size."""
    B, T, Hq, Hkv, D = 8, 2048, 32, 8, 128
    rng = np.random.default_rng(99)
    lengths = rng.integers(0, T + 1, size=B).astype(np.int32)
    lengths[0], lengths[1] = T, 1
    (q, k, v), (q64, k64, v64) = random_inputs(rng, B, T, Hq, Hkv, D, BF16)
    q, k, v, lens = on(gpu_device, q, k, v, jnp.asarray(lengths))
    ref = reference(q64, k64, v64, lengths)
    before = attention_stats()
    for impl in ("tensor_core", "tensor_core_u1", "simple"):
        assert_close(decode_attention_tuned(q, k, v, lens, impl=impl), ref, BF16, impl)
    after = attention_stats()
    assert after["cuda_tensor_core_launches"] > before["cuda_tensor_core_launches"]
    assert after["cuda_simple_launches"] > before["cuda_simple_launches"]


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["auto", "stream"])
def test_gpu_step_is_captured_and_replays_with_device_lengths(gpu_device, impl):
    """A jitted decode step over 5 layers (XLA turns >= 5 adjacent commands into a CUDA
    graph) is captured; with every buffer address stable -- the lengths live in an arena
    buffer updated in place between steps -- later steps replay the graph without calling
    the handler, yet each step reads that step's lengths from device memory and is
    correct while the arena grows under the captured graph."""
    dtype = BF16
    L, B, T, Hkv, D, Hq = 5, 4, 4096, 8, 128, 32
    kv = jax_vmm.kv_arena(
        num_layers=L,
        num_kv_heads=Hkv,
        head_dim=D,
        max_tokens=T,
        dtype=dtype,
        max_seqs=B,
        device=gpu_device,
    )
    lens_arena = jax_vmm.Arena(1 << 21, device=gpu_device)
    try:
        lens_buf = lens_arena.allocate((B,), jnp.int32, name="lengths")
        lens_buf.commit()
        rng = np.random.default_rng(5)
        k64 = np.zeros((L, B, T, Hkv, D))
        v64 = np.zeros((L, B, T, Hkv, D))
        qs = jax.device_put(
            jnp.asarray(rng.standard_normal((L, B, Hq, D), dtype=np.float32)).astype(dtype),
            gpu_device,
        )
        q64 = np.asarray(qs.astype(jnp.float32), np.float64)
        ks, vs = [kv.k[l] for l in range(L)], [kv.v[l] for l in range(L)]

        @jax.jit
        def step(qs, ks, vs, lens):
            return [decode_attention_tuned(qs[l], ks[l], vs[l], lens, impl=impl) for l in range(L)]

        lengths = np.zeros(B, np.int32)
        calls = []
        schedule = (
            [5, 1, 0, 300],
            [6, 2, 1, 301],
            [600, 3, 2, 302],
            [601, 1500, 3, 303],
            [602, 1501, 4, 4096],
            [603, 1502, 5, 4096],
        )
        for i, new in enumerate(schedule):
            new = np.array(new, np.int32)
            for s in range(B):
                kv.ensure(int(new[s]), seq=s)  # commits pages under the captured graph
                if new[s] > lengths[s]:
                    for l in range(L):
                        for buf, ref in ((kv.k_buffers[l], k64), (kv.v_buffers[l], v64)):
                            x = jnp.asarray(
                                rng.standard_normal((new[s] - lengths[s], Hkv, D), dtype=np.float32)
                            ).astype(dtype)
                            write_bytes(
                                buf,
                                (s * T + int(lengths[s])) * kv.token_bytes,
                                np.asarray(x).view(np.uint8),
                            )
                            ref[l, s, lengths[s] : new[s]] = np.asarray(x.astype(jnp.float32))
            lengths = new
            write_bytes(lens_buf, 0, lengths.view(np.uint8))  # same address, new contents
            before = attention_stats()["cuda_execute_calls"]
            outs = step(qs, ks, vs, lens_buf.array)
            for l in range(L):
                assert_close(
                    outs[l],
                    reference(q64[l], k64[l], v64[l], lengths),
                    dtype,
                    f"step {i} layer {l}",
                )
            del outs  # let the next step's outputs reuse the same addresses
            calls.append(attention_stats()["cuda_execute_calls"] - before)
        stats = attention_stats()
        print(f"handler execute calls per step: {calls}; stats {stats}")
        assert stats["cuda_captured_calls"] > 0, f"never captured into a CUDA graph: {stats}"
        assert min(calls[2:]) == 0, (
            f"handler calls per step {calls}: no step was a pure graph "
            "replay (did a buffer address change every step?)"
        )
    finally:
        kv.close()
        lens_arena.close()


def test_a_shape_past_the_cuda_grid_is_refused_on_the_cpu_too():
    """The CUDA split kernel refuses S x q_heads > 65535 head blocks (the simple kernel,
    which float32 runs) and batch > 65535; the CPU ran such calls, so a CPU-tested
    program failed on a GPU. Both refuse now; one row fewer runs."""
    T, Hq, D = 16, 32, 8
    k = jnp.zeros((1, T, 1, D), F32)
    lengths = jnp.array([1], jnp.int32)
    with pytest.raises((jax.errors.JaxRuntimeError, ValueError), match="CUDA grid limit of 65535"):
        jax.block_until_ready(jax_vmm.attention(jnp.zeros((1, 2048, Hq, D), F32), k, k, lengths))
    out = jax_vmm.attention(jnp.ones((1, 2047, Hq, D), F32), k, k, lengths)
    assert out.shape == (1, 2047, Hq, D)


def test_a_splits_override_is_clamped_to_what_the_combine_takes():
    """The CUDA combine keeps one float per split in 48 KiB of shared memory: 11772 splits
    at most. The CPU took more, and such a plan failed to launch on a GPU."""
    plan = attention_plan(1, 16 * 20000, 8, 8, 64, parallel_units=8, chunk=16, splits=20000)
    assert plan["max_chunks"] == 20000
    assert plan["splits"] == 48 * 1024 // 4 - 516
