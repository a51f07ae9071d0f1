"""Attention on cuDNN SDPA graphs inside jax_vmm's own custom call (private for now).

``cudnn_attention(q, k, v, lengths, *, q_lengths=None, window=None, softcap=None,
scale=None)`` has the semantics of ``jax_vmm.attention``:

* ``q`` is ``(B, S, H_q, D)`` (or ``(B, H_q, D)`` for one token): for sequence ``b`` the
  last ``q_lengths[b]`` (default ``S``) of its ``lengths[b]`` cached tokens. Query row
  ``i`` sits at position ``lengths[b] - q_lengths[b] + i`` and attends to the cached
  positions up to its own (causal mask aligned bottom-right, per sequence).
* ``q_lengths[b]`` is clamped to ``[0, min(S, lengths[b])]``; rows past it, and every row of
  a sequence of length 0, are zeros.
* ``window``: a query attends to at most the ``window`` most recent positions, itself
  included. ``softcap``: logits become ``softcap * tanh(logits / softcap)`` before the
  softmax. ``scale`` defaults to ``1/sqrt(D)``.
* ``k``, ``v`` are ``(B, T, H_kv, D)`` (arena views included) with ``H_q % H_kv == 0``;
  bfloat16 or float16; ``D`` a multiple of 8 up to 256. Or a KVLayer:
  ``cudnn_attention(q, layer, lengths)`` reads an arena layer by the cache's identity
  after its writes, lengths clamped to the tokens ensured (counted; ``kv.check()``).

cuDNN is the one jaxlib's CUDA plugin loaded (``libcudnn.so.9``); the graphs are built at
the custom call's initialize stage and their workspace lives in jax_vmm's graph-safe
scratch, so the call can be captured into command buffers. The backend exists only when
the module was built with the cuDNN headers (``jax_vmm._core.built_with_cudnn``).
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import math
import os
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..base.args import as_float32, as_softcap, as_window
from ..base.ffi import register
from ..base.loader import core as _core
from ..cache.pytree import KVLayer
from . import layer_ops as _layer_ops
from . import vmap_reads
from .lengths import clamped_counts
from .scratch import _ordinal
from .scratch import reserve as _scratch_reserve

_TARGET = "jax_vmm_cudnn_attention"
_TARGET_INTO = "jax_vmm_cudnn_attention_into"
_TARGET_CACHE = "jax_vmm_cudnn_attention_cache"
_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_MAX_HEAD_DIM = 256

_load_lock = threading.Lock()
_load_error: str | None = None  # None: not tried yet; "": loaded


def cudnn_built() -> bool:
    """Whether this build of jax_vmm has the cuDNN attention backend."""
    return bool(getattr(_core, "built_with_cudnn", False))


def _nvidia_paths(pattern: str) -> list[str]:
    """Files matching ``pattern`` under the ``nvidia`` wheels' folders of this Python."""
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec else []
    return sorted(p for root in roots for p in glob.glob(os.path.join(root, pattern)))


def _library_hints() -> tuple[str, str]:
    """Paths of the libcudnn and libcudart the nvidia wheels installed (jaxlib's own), for
    when the process has not loaded them yet; '' when there are none."""
    cudnn = _nvidia_paths("cudnn/lib/libcudnn.so.9")
    # XLA links the CUDA runtime statically; the frontend's few runtime calls need a shared
    # one: a wheel's, else the toolkit's.
    cudart = _nvidia_paths("*/lib/libcudart.so.13") or sorted(
        glob.glob("/usr/local/cuda*/lib64/libcudart.so.13")
    )
    return (cudnn[0] if cudnn else "", cudart[0] if cudart else "")


def _ensure_loaded() -> str:
    """Loads libcudnn once (after JAX's CUDA backend started, so that the cuDNN jaxlib
    loaded is found first); '' on success, else why not."""
    global _load_error
    if not cudnn_built():
        return (
            "jax_vmm was built without the cuDNN attention backend "
            "(jax_vmm._core.built_with_cudnn is False): rebuild with the CUDA toolkit, cudnn.h "
            "and the nvidia-cudnn-frontend headers (CMake option JAX_VMM_CUDNN=ON)"
        )
    with _load_lock:
        if _load_error == "":
            return ""
        try:
            jax.devices("cuda")
        except RuntimeError:
            _load_error = "JAX has no CUDA backend in this process"
            return _load_error
        _load_error = _core.cudnn_load(*_library_hints())
        return _load_error


def cudnn_available() -> bool:
    """Whether cudnn_attention can run here: the backend is built, JAX has a CUDA backend,
    and libcudnn loaded."""
    return _ensure_loaded() == ""


def cudnn_info() -> dict:
    """The backend's state: built, loaded, cuDNN version and path, the cuDNN and frontend
    versions it was compiled against, and the load error if any."""
    if not cudnn_built():
        return {"built": False, "loaded": False, "error": _ensure_loaded()}
    err = _ensure_loaded()
    info = dict(_core.cudnn_info())
    info["built"] = True
    if err:
        info["error"] = err
    return info


def cudnn_attention_stats() -> dict:
    """Counters of the handlers and the graph cache (graphs built, build failures, calls,
    captured calls, the initialize stages' host time ``initialize_ns``); empty without the
    backend."""
    return dict(_core.cudnn_attention_stats()) if cudnn_built() else {}


def _check_int_vector(name: str, x: Any, B: int) -> jax.Array:
    x = x if isinstance(x, jax.Array) else jnp.asarray(x)
    if x.shape != (B,) or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(
            f"cudnn_attention: {name} must be an integer array of shape (B,) = ({B},); got "
            f"{x.dtype}{tuple(x.shape)}"
        )
    return x


def _device_of(*arrays: Any) -> jax.Device:
    """The device of a concrete input, else JAX's default device (inside jit)."""
    for a in arrays:
        if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
            try:
                devices = a.devices()
            except Exception:  # noqa: BLE001 - a deleted array: the call itself will say so
                continue
            if len(devices) == 1:
                return next(iter(devices))
    return jax.devices()[0]


def _prepare(
    device: jax.Device, dtype: Any, dims: tuple, window: int, softcap: float, scale: float
) -> None:
    """Builds the call's cuDNN graph now (at trace time, never under capture), so that a
    configuration cuDNN cannot run fails here with cuDNN's message, and grows the device's
    default scratch to its workspace. The handler's initialize stage does both again on the
    device XLA runs it on; this is the belt to those braces."""
    io = 0 if np.dtype(dtype) == np.dtype(jnp.bfloat16) else 1
    try:
        ws = _core.cudnn_prepare(
            _ordinal(device),
            io,
            *dims,
            int(window),
            float(np.float32(softcap)),
            float(np.float32(scale)),
        )
    except RuntimeError as exc:
        raise RuntimeError(f"cudnn_attention: {exc}") from None
    if ws > 0:
        _scratch_reserve(ws, device)


@dataclasses.dataclass(frozen=True)
class _Call:
    """One validated call: q as (B, S, H_q, D), whether to drop S again, the clamped int32
    lengths and q_lengths, the FFI attributes and the output type."""

    q: jax.Array
    squeeze: bool
    lengths: jax.Array
    requested: jax.Array  # lengths before the clamp to T: an arena layer counts past ensured
    q_lengths: jax.Array
    attrs: dict
    out_type: jax.ShapeDtypeStruct
    empty: bool


def _validate(
    q: Any,
    k: Any,
    v: Any,
    lengths: Any,
    q_lengths: Any,
    window: int | None,
    softcap: float | None,
    scale: float | None,
    zero_rows: bool,
) -> _Call:
    """Checks one call (k, v: arrays or ShapeDtypeStructs), registers the targets and
    builds the graph now (see _prepare)."""
    q = q if isinstance(q, jax.Array) else jnp.asarray(q)
    squeeze = q.ndim == 3
    if squeeze:
        q = q[:, None]
    if q.ndim != 4 or len(k.shape) != 4 or tuple(v.shape) != tuple(k.shape):
        raise ValueError(
            "cudnn_attention: q must be (B, S, H_q, D) or (B, H_q, D), k and v both "
            f"(B, T, H_kv, D); got q {q.shape}, k {k.shape}, v {v.shape}"
        )
    B, S, Hq, D = q.shape
    T, Hkv = k.shape[1], k.shape[2]
    if k.shape[0] != B or k.shape[3] != D or Hkv == 0 or Hq % Hkv:
        raise ValueError(
            f"cudnn_attention: k {k.shape} does not fit q {q.shape}: same B and D, and H_q a "
            "multiple of H_kv"
        )
    dtypes = {np.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPES:
        raise TypeError(
            "cudnn_attention: q, k and v must all be bfloat16 or all float16; got "
            f"{q.dtype}, {k.dtype}, {v.dtype} (fp8 caches: use jax_vmm.decode_attention)"
        )
    if D % 8 or D > _MAX_HEAD_DIM:
        raise ValueError(f"cudnn_attention: head_dim must be a multiple of 8 up to 256, got {D}")
    window = as_window(window, "cudnn_attention") or None
    softcap = as_softcap(softcap, "cudnn_attention") or None
    scale = 1.0 / math.sqrt(D) if scale is None else as_float32(scale, "cudnn_attention: scale")
    # Counted against the ensured tokens over an arena layer before the clamp to T (T + 1:
    # see attention_call._clamped_lengths); cuDNN itself gets [0, T].
    requested = _check_int_vector("lengths", clamped_counts(lengths, T + 1), B)
    lengths = jnp.clip(requested, 0, T).astype(jnp.int32)
    decode = q_lengths is None and S == 1
    if decode:
        # One query token: row 0 is valid exactly when lengths > 0; a constant needs no
        # device op before the call.
        q_eff = jnp.ones((B,), jnp.int32)
    else:
        q_req = jnp.full((B,), S, jnp.int32) if q_lengths is None else q_lengths
        q_req = _check_int_vector("q_lengths", clamped_counts(q_req, S), B)
        q_eff = jnp.clip(q_req, 0, jnp.minimum(lengths, S)).astype(jnp.int32)
    arrays = [x for x in (q, k, v) if isinstance(x, jax.Array)]
    device = _device_of(*arrays)
    if device.platform not in ("gpu", "cuda"):
        raise ValueError(
            f"cudnn_attention runs on CUDA devices only; the inputs are on {device} "
            "(use jax_vmm.attention, or jax_vmm.decode_attention for one query row: both "
            "have a CPU path)"
        )
    if err := _ensure_loaded():
        raise RuntimeError(f"cudnn_attention: the cuDNN backend is not available: {err}")
    register()
    empty = B == 0 or S == 0
    if not empty:
        _prepare(device, q.dtype, (B, S, T, Hq, Hkv, D), window or 0, softcap or 0.0, scale)
    attrs = dict(
        scale=np.float32(scale),
        softcap=np.float32(softcap or 0.0),
        window=np.int64(window or 0),
        # cuDNN's decode graph writes +0 into the row of a length-0 sequence (measured on
        # the H200, cuDNN 9.19, and asserted by test_cudnn_attention's
        # test_decode_graph_writes_zeros_for_empty_sequences), so decode needs no zero-rows
        # kernel after it: one kernel fewer per layer and step.
        zero_rows=np.int64(1 if zero_rows and not decode else 0),
    )
    out_type = jax.ShapeDtypeStruct(q.shape, q.dtype)
    return _Call(q, squeeze, lengths, requested.astype(jnp.int32), q_eff, attrs, out_type, empty)


def cudnn_attention(
    q: Any,
    k: Any,
    v: Any = None,
    lengths: Any = None,
    *,
    q_lengths: Any = None,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    zero_rows: bool = True,
    out: Any = None,
) -> jax.Array:
    """Attention of ``q`` over the cache ``k``, ``v`` (see the module docstring).

    Two forms: ``cudnn_attention(q, k, v, lengths)`` over arrays (arena views included),
    and ``cudnn_attention(q, layer, lengths)`` over a :class:`~jax_vmm.KVLayer` (an arena
    layer is read by the cache's identity, after the layer's writes, with lengths clamped
    to the tokens ensured, as ``jax_vmm.decode_attention(q, layer, lengths)`` does).

    ``zero_rows=False`` skips the small kernel that zeroes the rows cuDNN does not write
    (rows past ``q_lengths``, sequences of length 0): only for measuring it. Decode (one
    query token, no ``q_lengths``) never runs it: cuDNN writes zeros there itself. ``out``
    (array form): a ``(B, S, H_q, D)`` array the result is written into (aliased; donate
    it under jit to avoid a copy).
    """
    if isinstance(k, KVLayer):
        if lengths is not None or v is None or out is not None:
            raise TypeError(
                "cudnn_attention takes (q, layer, lengths) or (q, k, v, lengths); `out` is for "
                "the array form"
            )
        return _over_layer(q, k, v, q_lengths, window, softcap, scale, zero_rows)
    if v is None or lengths is None:
        raise TypeError("cudnn_attention takes (q, layer, lengths) or (q, k, v, lengths)")
    k, v = (x if isinstance(x, jax.Array) else jnp.asarray(x) for x in (k, v))
    call = _validate(q, k, v, lengths, q_lengths, window, softcap, scale, zero_rows)
    q = call.q
    if call.empty:
        res = jnp.zeros(q.shape, q.dtype)
    elif out is None:
        ffi = jax.ffi.ffi_call(_TARGET, call.out_type, vmap_method="sequential")
        res = ffi(q, k, v, call.lengths, call.q_lengths, **call.attrs)
    else:
        out = out[:, None] if call.squeeze and out.ndim == 3 else out
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(
                f"cudnn_attention: out must be {q.dtype}{q.shape}; got {out.dtype}{out.shape}"
            )
        ffi = jax.ffi.ffi_call(
            _TARGET_INTO, call.out_type, vmap_method="sequential", input_output_aliases={5: 0}
        )
        res = ffi(q, k, v, call.lengths, call.q_lengths, out, **call.attrs)
    return res[:, 0] if call.squeeze else res


def _over_layer(
    q: Any,
    layer: Any,
    lengths: Any,
    q_lengths: Any,
    window: int | None,
    softcap: float | None,
    scale: float | None,
    zero_rows: bool,
) -> jax.Array:
    """The layer form: an array layer runs the array form; an arena layer the cache target."""
    kw = dict(q_lengths=q_lengths, window=window, softcap=softcap, scale=scale)
    if not layer.is_arena:
        if layer.k_scale is not None:
            raise TypeError("cudnn_attention: fp8 caches are not for cuDNN (use decode_attention)")
        return cudnn_attention(q, layer.k, layer.v, lengths, zero_rows=zero_rows, **kw)
    layer = vmap_reads.fenced(layer, "cudnn_attention")
    lid = layer.id
    if lid.sharded:
        raise NotImplementedError(
            "cudnn_attention over a sharded arena layer is not implemented yet; use "
            "jax_vmm.decode_attention(q, layer, lengths)"
        )
    if len(lid.shape) != 4:
        raise ValueError(
            f"cudnn_attention: {lid.describe()} has shape {lid.shape}; attention needs one "
            "buffer row per sequence (kv_arena(..., max_seqs=batch))"
        )
    spec = jax.ShapeDtypeStruct(lid.shape, np.dtype(lid.dtype))
    call = _validate(q, spec, spec, lengths, q_lengths, window, softcap, scale, zero_rows)
    q = call.q
    if call.empty:
        res = jnp.zeros(q.shape, q.dtype)
    else:
        # The lengths clamped to the ensured tokens, by a call that names the cache and no
        # layer: XLA merges the identical clamps of a step's layers into one.
        clamp = jax.ffi.ffi_call(
            _layer_ops._targets.read_lengths,
            jax.ShapeDtypeStruct((q.shape[0],), jnp.int32),
            vmap_method="sequential",
        )
        read_lengths = clamp(call.requested, cache_uid=np.uint64(lid.cache_uid))
        ffi = jax.ffi.ffi_call(_TARGET_CACHE, call.out_type, vmap_method="sequential")
        res = ffi(
            q,
            read_lengths,
            call.q_lengths,
            layer.token,
            cache_uid=np.uint64(lid.cache_uid),
            layer=np.int64(lid.layer),
            **call.attrs,
        )
    return res[:, 0] if call.squeeze else res
