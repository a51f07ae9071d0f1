"""Validating one decode-attention call and choosing its kernel (split-K or streaming) and
plan: the argument checks of docs/errors.md, the softmax scale, the clamped lengths, the
FFI attributes, and the device it is planned for. ``jax_vmm.ops.array_attention`` (the
array ops), ``jax_vmm.ops.layer_ops`` and ``jax_vmm.testing`` build their custom calls from
a ``_Call``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..base.args import as_float32
from ..base.ffi import register
from ..base.fp8 import FP8_STORAGE
from ..base.loader import core as _core
from .lengths import clamped_counts
from .scratch import reserve as _scratch_reserve

_IMPLS = {"auto": 0, "tensor_core": 1, "simple": 2, "tensor_core_u1": 3}
# The streaming kernel's impl names -> (combine: 0 fused into the kernel (last arrival),
# 1 a second kernel; bulk: 0 tiles by cp.async, 1 by bulk copies (TMA) on mbarriers).
_STREAM_IMPLS = {"stream": (0, 0), "stream_combine": (1, 0), "stream_tma": (0, 1)}
_WORKSPACES = ("scratch", "xla")
_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))
SPLIT_K_TARGET = "jax_vmm_decode_attention"
_TENSOR_CORE_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_TENSOR_CORE_HEAD_DIMS = (64, 128, 256)


def check_fp8_query(q: jax.Array, op: str) -> None:
    """An fp8 cache is read by the streaming kernel, with 16-bit queries of head_dim 64,
    128 or 256: refuse anything else the same way for every option (the copy path that
    options take would accept more, then decode of the same cache would refuse it)."""
    if np.dtype(q.dtype) not in _TENSOR_CORE_DTYPES:
        raise TypeError(
            f"{op}: an fp8 cache is read with q in bfloat16 or float16, got {q.dtype}; "
            "cast the query (q.astype(jnp.bfloat16)) and the result back"
        )
    if q.shape[-1] not in _TENSOR_CORE_HEAD_DIMS:
        raise ValueError(
            f"{op}: an fp8 cache is read with head_dim in {_TENSOR_CORE_HEAD_DIMS}, got "
            f"{q.shape[-1]}"
        )


# impl="auto" runs the streaming kernel (stream_combine) for 16-bit caches of these head
# dims from this many cache tokens (B x T) up: there it read 1.2x faster than split-K and
# than cuDNN on the H200 (docs/attention.md); elsewhere split-K.
_AUTO_STREAM_HEAD_DIMS = (256,)
_AUTO_STREAM_MIN_TOKENS = 65536
_STREAM_MAX_BATCH = 1024  # kMaxBatch in ffi/src/ops/attention/stream_plan.h
_CPU_PARALLEL_UNITS = 8  # kCpuParallelUnits in ffi/src/ops/attention/attention_plan.h
_DEFAULT_SM_COUNT = 132  # H100/H200, when JAX does not report core_count


@dataclasses.dataclass(frozen=True)
class _Call:
    """One validated call: operands (split-K: q, k, v, int32 lengths; streaming: those and
    k_scale, v_scale), the FFI attributes, the output type, the plan, the device it is
    planned for, and whether it runs the streaming kernel."""

    operands: tuple
    attrs: dict
    out_type: jax.ShapeDtypeStruct
    plan: dict
    device: jax.Device
    stream: bool = False
    # Operands after every other one (split-K only): (q_lengths,) when given, else ().
    tail: tuple = ()


def prepare(
    q: Any,
    k: Any,
    v: Any,
    lengths: Any,
    *,
    scale: float | None,
    chunk: int = 0,
    splits: int = 0,
    impl: str = "auto",
    workspace: str = "scratch",
    k_scale: Any = None,
    v_scale: Any = None,
    ctas: int = 0,
    stages: int = 0,
    min_tiles: int = 0,
    q_lengths: Any = None,
    window: int = 0,
    softcap: float = 0.0,
) -> _Call | None:
    """Validates a call, picks the kernel (split-K or streaming) and registers the
    targets; None for an empty batch (the result is then all zeros without a custom call).
    Shared with jax_vmm.testing's variant. A rank-4 q ``(B, S, H_q, D)`` with q_lengths
    (int32 ``(B,)``, validated by the caller), window (0 = none) and softcap (0 = none)
    is jax_vmm's general attention (jax_vmm/ops/general_attention.py): split-K kernels only."""
    # k, v may be ShapeDtypeStructs: the shapes of an arena layer (jax_vmm/ops/layer_ops.py).
    q, k, v = (
        x if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) else jnp.asarray(x) for x in (q, k, v)
    )
    lengths = _clamped_lengths(lengths, k)
    if impl not in _IMPLS and impl not in _STREAM_IMPLS:
        raise ValueError(
            f"impl must be one of {sorted(_IMPLS) + sorted(_STREAM_IMPLS)}, got {impl!r}"
        )
    fp8 = np.dtype(k.dtype) in FP8_STORAGE and np.dtype(q.dtype) not in FP8_STORAGE
    rows = q.ndim == 4
    if rows and (fp8 or impl in _STREAM_IMPLS or k_scale is not None or v_scale is not None):
        raise ValueError(
            "attention with (B, S, H_q, D) queries runs the split-K kernels only: no "
            f"impl={impl!r} (the streaming kernel) and no fp8 cache here (the caller "
            "dequantizes one)"
        )
    if impl == "auto" and not rows and _auto_picks_stream(q, k, chunk, splits, workspace):
        impl = "stream_combine"
    if fp8 or impl in _STREAM_IMPLS or k_scale is not None or v_scale is not None:
        _refuse_knobs_of("split-K", ("chunk", chunk), ("splits", splits))
        return _prepare_stream(
            q,
            k,
            v,
            lengths,
            scale=scale,
            k_scale=k_scale,
            v_scale=v_scale,
            impl="stream" if impl == "auto" else impl,
            ctas=ctas,
            stages=stages,
            min_tiles=min_tiles,
            workspace=workspace,
        )
    _refuse_knobs_of("streaming", ("ctas", ctas), ("stages", stages), ("min_tiles", min_tiles))
    B, Hq, D, T, Hkv = _check(q, k, v, lengths)
    if workspace not in _WORKSPACES:
        raise ValueError(f"workspace must be one of {_WORKSPACES}, got {workspace!r}")
    if impl.startswith("tensor_core") and (
        q.dtype not in _TENSOR_CORE_DTYPES or D not in _TENSOR_CORE_HEAD_DIMS
    ):
        raise ValueError(
            f"impl='tensor_core' needs bfloat16/float16 and head_dim in {_TENSOR_CORE_HEAD_DIMS}; "
            f"got {q.dtype} and head_dim={D} (use impl='auto')"
        )
    _check_plan_values(("chunk", chunk), ("splits", splits))
    scale = _softmax_scale(scale, D)
    lengths = lengths.astype(jnp.int32)
    if B == 0:
        return None

    device, units = _target(q, k, v, lengths)
    _register(device.platform)
    S = q.shape[1] if rows else 1
    plan = attention_plan(
        B, T, Hq, Hkv, D, parallel_units=units, chunk=chunk, splits=splits, q_len=S
    )
    if device.platform != "cpu" and workspace == "scratch":
        # Belt and braces: the handler grows the scratch at XLA's initialize stage, which
        # XLA runs before it records a CUDA graph. Should a capture ever come first, the
        # handler falls back to the device's default workspace, sized here.
        _scratch_reserve(plan["workspace_bytes"], device)
    attrs = dict(
        scale=np.float32(scale),
        chunk=np.int64(plan["chunk"]),
        splits=np.int64(plan["splits"]),
        impl=np.int64(_IMPLS[impl]),
        window=np.int64(window),
        softcap=np.float32(softcap),
    )
    tail = () if q_lengths is None else (q_lengths,)
    out_type = jax.ShapeDtypeStruct(q.shape, q.dtype)
    return _Call((q, k, v, lengths), attrs, out_type, plan, device, tail=tail)


def run_split_k(call: _Call) -> jax.Array:
    """The split-K array target on a prepared call (not streaming), partials in the
    graph-safe scratch."""
    ffi = jax.ffi.ffi_call(SPLIT_K_TARGET, call.out_type, vmap_method="sequential")
    return ffi(*call.operands, *call.tail, **call.attrs)


def _auto_picks_stream(q: Any, k: Any, chunk: int, splits: int, workspace: str) -> bool:
    """Whether impl="auto" takes the streaming kernel: a 16-bit cache (q of the same dtype)
    of a head dim in _AUTO_STREAM_HEAD_DIMS with at least _AUTO_STREAM_MIN_TOKENS tokens
    and a batch the streaming kernel serves, and no split-K knob (chunk, splits,
    workspace="xla") asked for."""
    if chunk or splits or workspace != "scratch" or len(k.shape) != 4:
        return False
    dtype = np.dtype(k.dtype)
    return (
        dtype in _TENSOR_CORE_DTYPES
        and np.dtype(q.dtype) == dtype
        and k.shape[3] in _AUTO_STREAM_HEAD_DIMS
        and k.shape[0] * k.shape[1] >= _AUTO_STREAM_MIN_TOKENS
        and k.shape[0] <= _STREAM_MAX_BATCH
    )


def _clamped_lengths(lengths: Any, k: jax.Array) -> jax.Array:
    """``lengths`` as an array, integers of 32 bits or more clamped to [0, T + 1] before
    the int32 cast (``lengths.clamped_counts``: 2**32 + 1 must not become 1). T + 1, not
    T: a length past the capacity still exceeds every sequence's ensured tokens, so an
    arena layer counts it whatever its dtype; every kernel clamps to T itself."""
    T = k.shape[1] if k.ndim == 4 else None
    return clamped_counts(lengths, None if T is None else T + 1)


def checked_fp8_scales(k_scale: Any, v_scale: Any, kv_heads: int, op: str) -> list[jax.Array]:
    """The per-KV-head scales of an fp8 cache as float32 ``(kv_heads,)`` arrays, or a
    ValueError that says what they must be."""
    if k_scale is None or v_scale is None:
        raise ValueError(
            f"{op}: an fp8 cache needs k_scale and v_scale, float32 of shape ({kv_heads},): "
            "the per-KV-head scales it was quantized with"
        )
    scales = []
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        x = jnp.asarray(x)
        if x.shape != (kv_heads,) or np.dtype(x.dtype) != np.float32:
            raise ValueError(
                f"{op}: {name} must be float32 of shape ({kv_heads},), one scale per KV "
                f"head; got {x.dtype} {x.shape}"
            )
        scales.append(x)
    return scales


def _prepare_stream(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    scale: float | None,
    k_scale: Any,
    v_scale: Any,
    impl: str,
    ctas: int,
    stages: int,
    min_tiles: int,
    workspace: str,
) -> _Call | None:
    """_prepare for the streaming kernel (fp8 caches, impl "stream*")."""
    if impl not in _STREAM_IMPLS:
        raise ValueError(
            f"decode_attention: an fp8 cache or k_scale/v_scale needs impl 'auto' or one "
            f"of {sorted(_STREAM_IMPLS)}, got {impl!r}"
        )
    if workspace != "scratch":
        raise ValueError(
            "decode_attention: the streaming kernel keeps its partials in the graph-safe "
            "scratch only (workspace='scratch')"
        )
    fp8 = np.dtype(k.dtype) in FP8_STORAGE
    B, Hq, D, T, Hkv = _check(q, k, v, lengths, kv_dtypes=FP8_STORAGE if fp8 else None)
    if np.dtype(q.dtype) not in _TENSOR_CORE_DTYPES:
        raise TypeError(
            f"decode_attention: the streaming kernel needs q in bfloat16 or float16, got {q.dtype}"
        )
    if D not in _TENSOR_CORE_HEAD_DIMS:
        raise ValueError(
            f"decode_attention: the streaming kernel needs head_dim in {_TENSOR_CORE_HEAD_DIMS}, "
            f"got {D}"
        )
    if not fp8 and (k_scale is not None or v_scale is not None):
        raise ValueError(f"decode_attention: k_scale/v_scale are for fp8 caches; k is {k.dtype}")
    if fp8:
        scales = checked_fp8_scales(k_scale, v_scale, Hkv, "decode_attention")
    else:
        scales = [jnp.ones((Hkv,), jnp.float32)] * 2
    _check_plan_values(("ctas", ctas), ("stages", stages), ("min_tiles", min_tiles))
    if stages and not 2 <= stages <= 8:
        raise ValueError(f"stages must be 2..8 (or 0 = automatic), got {stages}")
    scale = _softmax_scale(scale, D)
    lengths = lengths.astype(jnp.int32)
    if B == 0:
        return None

    device, units = _target(q, k, v, lengths)
    plan = stream_attention_plan(
        B,
        T,
        Hq,
        Hkv,
        D,
        ctas=ctas,
        min_tiles=min_tiles,
        fp8=fp8,
        parallel_units=0 if device.platform == "cpu" else units,
    )
    if plan["unsupported"]:
        raise ValueError(
            f"decode_attention: the streaming kernel cannot serve this shape: {plan['unsupported']}"
        )
    _register(device.platform)
    if device.platform != "cpu":
        _scratch_reserve(plan["workspace_bytes"], device)  # as in _prepare
    combine, bulk = _STREAM_IMPLS[impl]
    attrs = dict(
        scale=np.float32(scale),
        ctas=np.int64(ctas),
        stages=np.int64(stages),
        min_tiles=np.int64(min_tiles),
        combine=np.int64(combine),
        bulk=np.int64(bulk),
    )
    return _Call(
        (q, k, v, lengths, *scales),
        attrs,
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        plan,
        device,
        stream=True,
    )


def _check_plan_values(*knobs: tuple[str, Any]) -> None:
    """Each (name, value) is an integer >= 0 (0 = automatic)."""
    for name, value in knobs:
        if not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0 (0 = automatic), got {value!r}")


def _refuse_knobs_of(kernel: str, *knobs: tuple[str, Any]) -> None:
    """The plan knobs of `kernel` ("split-K" or "streaming"), which the call does not run,
    must be left at 0: a knob that would be ignored is an error."""
    for name, value in knobs:
        if value:
            raise ValueError(
                f"{name}={value!r} is a plan knob of the {kernel} kernel, which this "
                f"call does not run (impl and the cache dtype pick the kernel)"
            )


def _softmax_scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    return as_float32(scale, "scale (the softmax scale)")


def _check(
    q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, kv_dtypes: tuple | None = None
) -> tuple[int, int, int, int, int]:
    """Trace-time validation; returns (B, H_q, D, T, H_kv). kv_dtypes: k and v may have
    one of these dtypes instead of q's (an fp8 cache)."""
    if q.ndim not in (3, 4):
        raise ValueError(
            "decode_attention: q must be (batch, q_heads, head_dim) (attention: (batch, "
            f"queries, q_heads, head_dim)), got shape {q.shape}"
        )
    if k.ndim != 4:
        raise ValueError(
            "decode_attention: k must be (batch, max_tokens, kv_heads, head_dim), got shape "
            f"{k.shape} "
            "(a per-sequence KV arena: kv_arena(..., max_seqs=batch))"
        )
    if v.shape != k.shape:
        raise ValueError(f"decode_attention: v has shape {v.shape}, expected k's shape {k.shape}")
    B, Hq, D = q.shape[0], q.shape[-2], q.shape[-1]
    kb, T, Hkv, kd = k.shape
    if kb != B:
        raise ValueError(f"decode_attention: q has batch {B} but k/v have {kb} sequences {k.shape}")
    if kd != D:
        raise ValueError(f"decode_attention: q has head_dim {D} but k/v have head_dim {kd}")
    if Hq == 0 or Hkv == 0 or D == 0:
        raise ValueError(
            f"decode_attention: heads and head_dim must be > 0 (q {q.shape}, k {k.shape})"
        )
    if Hq % Hkv:
        raise ValueError(
            f"decode_attention: q_heads={Hq} is not a multiple of kv_heads={Hkv}; grouped-query "
            "attention needs H_q % H_kv == 0"
        )
    if kv_dtypes is not None:
        if np.dtype(k.dtype) not in kv_dtypes or v.dtype != k.dtype:
            raise TypeError(
                f"decode_attention: an fp8 cache needs k and v of one dtype out of "
                f"{[str(d) for d in kv_dtypes]}, got {k.dtype}, {v.dtype}"
            )
        check_fp8_query(q, "decode_attention")
        dtypes = {np.dtype(q.dtype)}
    else:
        dtypes = {np.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1:
        raise TypeError(
            f"decode_attention: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if np.dtype(q.dtype) not in _DTYPES:
        raise TypeError(
            f"decode_attention: dtype {q.dtype} is not supported; use bfloat16, float16 or float32"
        )
    if lengths.shape != (B,):
        raise ValueError(f"decode_attention: lengths must have shape ({B},), got {lengths.shape}")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"decode_attention: lengths must be integers (int32), got {lengths.dtype}")
    return B, Hq, D, T, Hkv


def _target(*arrays: jax.Array) -> tuple[jax.Device, int]:
    """(device, parallel units) the call will most likely run on: the device of a
    concrete input, else JAX's default device. Only the split-K plan depends on it (a
    wrong guess costs speed, never correctness: every plan is valid on every device)."""
    device = None
    for a in arrays:
        if isinstance(a, jax.core.Tracer):
            continue
        try:
            devices = a.devices()
        except Exception:  # noqa: BLE001 - e.g. a deleted array; fall back to the default
            continue
        if len(devices) == 1:
            device = next(iter(devices))
            break
    if device is None:
        device = jax.devices()[0]
    if device.platform == "cpu":
        return device, _CPU_PARALLEL_UNITS
    return device, int(getattr(device, "core_count", 0) or _DEFAULT_SM_COUNT)


def _register(platform: str) -> None:
    """Registers jax_vmm's targets; on a GPU the module must have its CUDA kernels."""
    register()
    if platform != "cpu" and not _core.built_with_cuda_kernels:
        raise RuntimeError(
            "decode_attention on a GPU needs jax_vmm built with CUDA kernels "
            "(jax_vmm._core.built_with_cuda_kernels is False): reinstall with nvcc on PATH, "
            "or run on the CPU"
        )


def attention_plan(
    batch: int,
    max_tokens: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    *,
    parallel_units: int | None = None,
    chunk: int = 0,
    splits: int = 0,
    q_len: int = 1,
) -> dict:
    """The split-K plan for these static shapes: ``chunk`` (tokens per chunk), ``splits``
    (partials per sequence and head), ``head_group`` (query rows per CUDA block),
    ``row_blocks``, ``max_chunks`` and ``workspace_bytes``. ``q_len``: query rows per
    sequence (jax_vmm attention; decode 1). ``parallel_units`` defaults to the SM count
    of JAX's default device (8 on the CPU)."""
    if parallel_units is None:
        parallel_units = _target()[1]
    if q_len == 1:  # the decode plan, also with a jax_vmm._core that predates q_len
        return dict(
            _core.attention_plan(
                batch, max_tokens, q_heads, kv_heads, head_dim, parallel_units, chunk, splits
            )
        )
    return dict(
        _core.attention_plan(
            batch, max_tokens, q_heads, kv_heads, head_dim, parallel_units, chunk, splits, q_len
        )
    )


def stream_attention_plan(
    batch: int,
    max_tokens: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    *,
    ctas: int = 0,
    min_tiles: int = 0,
    fp8: bool = False,
    parallel_units: int | None = None,
) -> dict:
    """Plan of the streaming kernel (ffi/src/ops/attention/stream_plan.h): ``ctas`` (grid
    size; by default 2 per SM, 1 for 16-bit head_dim 256, 3 for fp8 head_dim <= 128; the
    CPU model uses 16),
    ``head_group``, ``unit_groups``, ``min_tiles``, ``tile_tokens`` (tokens per tile: 16, or
    32 for K/V rows of at most 128 bytes), ``workspace_bytes`` and
    ``unsupported`` (why the shape cannot be served, or ""). ``parallel_units``: the SM
    count to plan for (0: the CPU model); default JAX's default device."""
    if parallel_units is None:
        device, parallel_units = _target()
        if device.platform == "cpu":
            parallel_units = 0
    return dict(
        _core.attention_stream_plan(
            batch,
            max_tokens,
            q_heads,
            kv_heads,
            head_dim,
            1 if fp8 else 2,
            parallel_units,
            ctas,
            min_tiles,
        )
    )
