"""The fp8 KV-cache format of jax_vmm: float8_e4m3fn values with one float32 scale per
KV head (and layer).

``jax_vmm.kv_write_fp8`` stores ``fp8(x * (1 / scale[h]))`` (round to nearest even,
saturated to +-:data:`FP8_MAX`, NaN kept) and ``jax_vmm.decode_attention(...,
k_scale=, v_scale=)`` reads ``fp8 * scale[h]``. :func:`quantize_fp8` and
:func:`dequantize_fp8` are the plain-JAX references of the two directions. A uint8 array
holding float8_e4m3fn bits is accepted wherever an fp8 cache is (the fallback where a
runtime cannot import float8 DLPack views).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "FP8_STORAGE",
    "MIN_FP8_SCALE",
    "check_scale_values",
    "quantize_fp8",
    "dequantize_fp8",
    "dequantized_for_split_k",
]

#: Storage dtype of an fp8 KV cache.
FP8_DTYPE = np.dtype(jnp.float8_e4m3fn)
#: Largest finite float8_e4m3fn value (quantization saturates to +-FP8_MAX).
FP8_MAX = 448.0
#: The dtypes an fp8 cache may have: float8_e4m3fn, or uint8 holding its bits.
FP8_STORAGE = (FP8_DTYPE, np.dtype(np.uint8))


#: Smallest scale accepted: float32's smallest normal. Below it 1 / scale overflows to inf
#: in float32, and a zero token quantizes to 0 * inf = NaN.
MIN_FP8_SCALE = float(np.finfo(np.float32).tiny)


def check_scale_values(values: np.ndarray, name: str) -> None:
    """Refuse fp8 scales that are not finite or below :data:`MIN_FP8_SCALE` (zero,
    negative, or so small that 1 / scale is inf)."""
    if not (np.all(np.isfinite(values)) and np.all(values >= MIN_FP8_SCALE)):
        raise ValueError(
            f"{name} must be finite and at least {MIN_FP8_SCALE:.4g} (float32's smallest "
            f"normal: the cache holds x * (1 / scale)), got {values}"
        )


def quantize_fp8(x: jax.Array, scale: jax.Array) -> jax.Array:
    """Plain-JAX reference of kv_write_fp8's quantization of ``x`` ``(..., H, D)`` with
    per-head ``scale`` ``(H,)``: float8_e4m3fn of ``x * (1 / scale)`` (float32), round
    to nearest even, saturated to +-448; NaN stays NaN."""
    inv = 1.0 / jnp.asarray(scale, jnp.float32)
    y = x.astype(jnp.float32) * inv[:, None]
    return jnp.where(jnp.isnan(y), y, jnp.clip(y, -FP8_MAX, FP8_MAX)).astype(FP8_DTYPE)


def dequantize_fp8(x: jax.Array, scale: jax.Array) -> jax.Array:
    """float32 values of an fp8 cache ``(..., H_kv, D)`` (float8_e4m3fn, or uint8 bits)
    with per-KV-head ``scale`` ``(H_kv,)``: ``x * scale``."""
    if np.dtype(x.dtype) == np.uint8:
        x = jax.lax.bitcast_convert_type(x, FP8_DTYPE)
    return x.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)[:, None]


def dequantized_for_split_k(
    q: jax.Array, k: jax.Array, v: jax.Array, k_scale: Any, v_scale: Any
) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
    """``q`` and an fp8 cache ``k``, ``v`` in the dtype the split-K kernels read them in,
    and the dtype their output goes back to (q's). That is q's own, except float32 for
    float16, whose range a scaled token may leave (448 * a scale over 146 is past
    float16's 65504); bfloat16 has float32's range."""
    dtype = jnp.float32 if np.dtype(q.dtype) == np.dtype(jnp.float16) else q.dtype
    k, v = dequantize_fp8(k, k_scale).astype(dtype), dequantize_fp8(v, v_scale).astype(dtype)
    return q.astype(dtype), k, v, q.dtype
