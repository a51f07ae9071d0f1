"""Decode attention over arrays (the kernels' custom calls), its plain-JAX reference and
the handler counters. The entry point users call, for arrays and cache layers alike, is
:func:`jax_vmm.decode_attention` (jax_vmm/ops/attention.py)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from ..base.fp8 import dequantize_fp8
from ..base.loader import core as _core
from .attention_call import prepare
from .stats import AttentionStats

__all__ = ["decode_attention_arrays", "reference_decode_attention", "attention_stats"]

_TARGET = "jax_vmm_decode_attention"
_TARGET_XLA_WORKSPACE = "jax_vmm_decode_attention_xla_workspace"
_TARGET_STREAM = "jax_vmm_decode_attention_v2"


def decode_attention_arrays(
    q: Any,
    k: Any,
    v: Any = None,
    lengths: Any = None,
    *,
    scale: float | None = None,
    chunk: int = 0,
    splits: int = 0,
    impl: str = "auto",
    workspace: str = "scratch",
    k_scale: Any = None,
    v_scale: Any = None,
    ctas: int = 0,
    stages: int = 0,
    min_tiles: int = 0,
) -> jax.Array:
    """The array form of ``jax_vmm.ops.attention.decode_attention_tuned`` (same knobs)."""
    if v is None or lengths is None:
        raise TypeError(
            "decode_attention takes (q, layer, lengths) or (q, k, v, lengths); got "
            f"k of type {type(k).__name__} and a missing {'v' if v is None else 'lengths'}"
        )
    call = prepare(
        q,
        k,
        v,
        lengths,
        scale=scale,
        chunk=chunk,
        splits=splits,
        impl=impl,
        workspace=workspace,
        k_scale=k_scale,
        v_scale=v_scale,
        ctas=ctas,
        stages=stages,
        min_tiles=min_tiles,
    )
    if call is None:
        return jnp.zeros(jnp.shape(q), jnp.asarray(q).dtype)
    if call.stream or workspace == "scratch":
        target = _TARGET_STREAM if call.stream else _TARGET
        ffi = jax.ffi.ffi_call(target, call.out_type, vmap_method="sequential")
        return ffi(*call.operands, **call.attrs)
    ws_type = jax.ShapeDtypeStruct((call.plan["workspace_bytes"],), jnp.uint8)
    ffi = jax.ffi.ffi_call(
        _TARGET_XLA_WORKSPACE, (call.out_type, ws_type), vmap_method="sequential"
    )
    return ffi(*call.operands, **call.attrs)[0]


def attention_stats() -> AttentionStats:
    """Process-wide handler counters: cpu_calls, cuda_initialize_calls,
    cuda_execute_calls, cuda_captured_calls (execute calls under CUDA-graph capture),
    cuda_tensor_core_launches, cuda_simple_launches."""
    stats: AttentionStats = dict(_core.attention_stats())  # type: ignore[assignment]
    return stats


_FULL = jax.lax.Precision.HIGHEST


def reference_decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    scale: float | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """Plain-JAX decode attention with the same semantics (masking every token at or past
    the length; length 0 gives zeros), softmax in float32, output in q's dtype. XLA reads
    all T tokens of every sequence: the baseline the custom call is measured against.
    An fp8 cache (with k_scale, v_scale) is dequantized to float32 first. Products run at
    full precision (a GPU would otherwise take float32 through TF32)."""
    if k_scale is not None:
        k, v = dequantize_fp8(k, k_scale), dequantize_fp8(v, v_scale)
    B, Hq, D = q.shape
    T, Hkv = k.shape[1], k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    group = Hq // Hkv
    qg = q.reshape(B, Hkv, group, D)
    s = jnp.einsum("bhgd,bthd->bhgt", qg, k, preferred_element_type=jnp.float32, precision=_FULL)
    s = s * scale
    n = jnp.clip(lengths.astype(jnp.int32), 0, T)
    live = jnp.arange(T)[None, :] < n[:, None]  # (B, T)
    s = jnp.where(live[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum(
        "bhgt,bthd->bhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=_FULL
    )
    o = jnp.where(denom > 0, o / jnp.where(denom > 0, denom, 1.0), 0.0)
    return o.reshape(B, Hq, D).astype(q.dtype)
