"""``jax_vmm.attention``: S >= 1 query tokens per sequence over its cached tokens, causal,
with an optional sliding window and logit softcap (docs/attention.md, "General
attention").

``attention(q, layer, lengths)`` / ``attention(q, k, v, lengths)``: query row ``i`` of
sequence ``b`` is the token at position ``p = lengths[b] - qn + i`` (``qn`` =
``q_lengths[b]``, default S, clamped to ``[0, min(S, lengths[b])]``) and attends to the
cached tokens ``j`` with ``max(0, p - window + 1) <= j <= p``; rows ``i >= qn`` and
sequences of length 0 give zeros. The plain case (S = 1, no option) is
``decode_attention`` unchanged (every kernel, fp8 caches included); the others run the
split-K kernels (attention_ffi.h ``Semantics``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..base.args import as_softcap, as_window
from ..base.fp8 import FP8_STORAGE, dequantize_fp8, dequantized_for_split_k
from ..cache.pytree import KVLayer
from . import attention_call as _call
from . import layer_ops, sharded_ops
from .arena_leaves import checked_arena_layer
from .attention import decode_attention_tuned, dtype_of, layer_or_k, refuse_misplaced_cache
from .attention_backend import routes_to_cudnn
from .cudnn_attention import cudnn_attention
from .lengths import clamped_counts

__all__ = ["attention", "reference_attention"]

_TARGET_XLA_WORKSPACE = "jax_vmm_decode_attention_xla_workspace"
_FULL = jax.lax.Precision.HIGHEST


def attention(
    q: jax.Array,
    k: Any = None,
    v: Any = None,
    lengths: Any = None,
    *,
    layer: KVLayer | None = None,
    q_lengths: Any = None,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of the last S tokens of each sequence over its cached tokens.

    Two forms: ``attention(q, layer, lengths)`` over a :class:`~jax_vmm.KVLayer` (or
    ``attention(q, layer=layer, lengths=lengths)``) and ``attention(q, k, v, lengths)``
    over ``(B, T, H_kv, D)`` arrays.

    Args:
      q: ``(B, S, H_q, D)``, S >= 1: the queries of the last ``q_lengths[b]`` (default S)
        of the ``lengths[b]`` cached tokens of sequence b, in order. bfloat16, float16 or
        float32 (k/v of the same dtype, or an fp8 cache with a 16-bit q).
      lengths: ``(B,)`` integers, cached tokens per sequence (clamped to ``[0, T]``; over
        an arena layer also to the tokens ensured, counted for ``kv.check()``).
      q_lengths: ``(B,)`` integers or None: live query rows per sequence, clamped to
        ``[0, min(S, lengths[b])]``; row ``i`` sits at position
        ``lengths[b] - q_lengths[b] + i``; rows past ``q_lengths[b]`` give zeros.
      window: None or an int >= 1: a query attends to at most the ``window`` most recent
        positions, itself included (Hugging Face ``sliding_window``).
      softcap: None or a finite number > 0: logits (after ``scale``) become
        ``softcap * tanh(logits / softcap)`` before the softmax (Gemma 2).
      scale: softmax scale, default ``1 / sqrt(D)``.
      k_scale, v_scale: the array form's fp8 scales, as for ``decode_attention``.

    Returns:
      ``(B, S, H_q, D)`` in q's dtype, softmax and accumulation in float32.

    The plain case (S = 1 without q_lengths/window/softcap) is ``decode_attention``
    exactly. Otherwise the split-K kernels run (CUDA: tensor cores for 16-bit q with
    head_dim 64/128/256, else the simple kernel); an fp8 cache is then dequantized with
    XLA first (it reads every token: correct, not fast; over an arena layer, a copy of
    its live tokens), and a sharded arena layer runs them per device.
    """
    try:
        return attention_tuned(
            q,
            layer_or_k("attention", layer, k),
            v,
            lengths,
            q_lengths=q_lengths,
            window=window,
            softcap=softcap,
            scale=scale,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    except (TypeError, ValueError) as e:
        # The checks are decode_attention's, shared: name the call the user made.
        prefix = "decode_attention: "
        if type(e) in (TypeError, ValueError) and str(e).startswith(prefix):
            raise type(e)("attention: " + str(e)[len(prefix) :]) from None
        raise


def attention_tuned(
    q: Any,
    k_or_layer: Any,
    v: Any = None,
    lengths: Any = None,
    *,
    q_lengths: Any = None,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    k_scale: Any = None,
    v_scale: Any = None,
    impl: str = "auto",
    chunk: int = 0,
    splits: int = 0,
    workspace: str = "scratch",
) -> jax.Array:
    """attention with the split-K knobs of ``decode_attention_tuned`` (impl "auto",
    "tensor_core", "tensor_core_u1", "simple"; chunk; splits; workspace)."""
    layer = k_or_layer if isinstance(k_or_layer, KVLayer) else None
    if layer is not None:
        if lengths is not None and v is not None:
            raise TypeError("attention(q, layer, lengths): too many arguments")
        lengths = v if lengths is None else lengths
        if k_scale is not None or v_scale is not None:
            raise ValueError(
                "attention(q, layer, lengths): an fp8 layer carries its scales; k_scale/v_scale "
                "are for the array form"
            )
        k = None
    else:
        k = k_or_layer
        refuse_misplaced_cache("attention", q, k)
        if v is None or lengths is None:
            raise TypeError(
                "attention takes (q, layer, lengths) or (q, k, v, lengths); got k of type "
                f"{type(k).__name__} and a missing {'v' if v is None else 'lengths'}"
            )
    if lengths is None:
        raise TypeError("attention(q, layer, lengths): lengths is missing")
    q = q if isinstance(q, jax.Array) else jnp.asarray(q)
    if q.ndim != 4 or q.shape[1] < 1:
        raise ValueError(
            f"attention: q must be (batch, queries S >= 1, q_heads, head_dim), got shape {q.shape}"
        )
    if _reads_fp8(layer, k):
        _call.check_fp8_query(q, "attention")
    knobs = dict(impl=impl, chunk=chunk, splits=splits)
    if _is_plain(q, q_lengths, window, softcap):
        if layer is not None:
            out = decode_attention_tuned(
                q[:, 0], layer, lengths, scale=scale, workspace=workspace, **knobs
            )
        else:
            out = decode_attention_tuned(
                q[:, 0], k, v, lengths, scale=scale, k_scale=k_scale, v_scale=v_scale,
                workspace=workspace, **knobs,
            )  # fmt: skip
        return out[:, None]
    if layer is not None:
        if not layer.is_arena:
            k, v, k_scale, v_scale = layer.k, layer.v, layer.k_scale, layer.v_scale
        else:
            return _arena_attention(
                q, layer, lengths, q_lengths, window, softcap, scale, workspace, knobs
            )
    v = v if isinstance(v, jax.Array) else jnp.asarray(v)
    k = k if isinstance(k, jax.Array) else jnp.asarray(k)
    out_dtype = None
    if np.dtype(k.dtype) in FP8_STORAGE:
        kv_heads = k.shape[2] if k.ndim == 4 else 0
        k_scale, v_scale = _call.checked_fp8_scales(k_scale, v_scale, kv_heads, "attention")
        # The split-K kernels read 16-bit or float32 caches: every token, dequantized (in
        # float32 for float16 queries, whose range a scaled token may leave).
        q, k, v, out_dtype = dequantized_for_split_k(q, k, v, k_scale, v_scale)
        k_scale = v_scale = None
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"attention: k_scale/v_scale are for fp8 caches; k is {k.dtype}")
    q, options = checked_options(q, k, dict(q_lengths=q_lengths, window=window, softcap=softcap))
    call = _call.prepare(
        q, k, v, lengths, scale=scale, workspace=workspace, k_scale=k_scale, v_scale=v_scale,
        **knobs, **options,
    )  # fmt: skip
    out_dtype = q.dtype if out_dtype is None else out_dtype
    if call is None:
        return jnp.zeros(q.shape, out_dtype)
    if workspace == "scratch":
        out = _call.run_split_k(call)
    else:
        ws_type = jax.ShapeDtypeStruct((call.plan["workspace_bytes"],), jnp.uint8)
        ffi = jax.ffi.ffi_call(
            _TARGET_XLA_WORKSPACE, (call.out_type, ws_type), vmap_method="sequential"
        )
        out = ffi(*call.operands, *call.tail, **call.attrs)[0]
    return out.astype(out_dtype)


def _reads_fp8(layer: KVLayer | None, k: Any) -> bool:
    if layer is not None:
        return layer.id.fp8 if layer.is_arena else np.dtype(layer.k.dtype) in FP8_STORAGE
    return np.dtype(dtype_of(k)) in FP8_STORAGE


def _arena_attention(
    q: jax.Array,
    layer: Any,
    lengths: Any,
    q_lengths: Any,
    window: Any,
    softcap: Any,
    scale: Any,
    workspace: str,
    knobs: dict,
) -> jax.Array:
    """The general attention over an arena layer: cuDNN where the routing takes it, else
    the split-K cache target (per device on a sharded layer); lengths clamped to the
    tokens ensured, counted."""
    layer = checked_arena_layer(layer, "attention")  # its token; an fp8 arena's own scales
    lid = layer.id
    if len(lid.shape) != 4:
        raise ValueError(
            f"attention: {lid.describe()} has shape {lid.shape}; attention needs one buffer "
            "row per sequence (kv_arena(..., max_seqs=batch))"
        )
    if workspace != "scratch":
        raise ValueError("attention over an arena layer keeps its partials in scratch")
    spec = layer_ops._spec(lid)
    q, options = checked_options(q, spec, dict(q_lengths=q_lengths, window=window, softcap=softcap))
    default_knobs = knobs == dict(impl="auto", chunk=0, splits=0)
    if routes_to_cudnn(q.dtype, lid, default_knobs=default_knobs):
        return cudnn_attention(
            q, layer, lengths, q_lengths=options["q_lengths"], scale=scale,
            window=options["window"] or None, softcap=options["softcap"] or None,
        )  # fmt: skip
    if lid.sharded:
        # An array before shard_map (sharded_ops.attention says why).
        lengths = clamped_counts(lengths, lid.shape[1] + 1)
        _check_sharded_rows(q, lid, lengths)
        return sharded_ops.rows_attention(q, layer, lengths, options, scale=scale, knobs=knobs)
    return layer_ops.rows_attention(q, layer, lengths, options, scale=scale, knobs=knobs)


def _check_sharded_rows(q: jax.Array, lid: Any, lengths: Any) -> None:
    """What shard_map would refuse less clearly: q's batch, heads and head_dim against the
    sharded layer's global shape, and lengths one per sequence."""
    B, _, Hkv, D = lid.shape
    if q.shape[0] != B or q.shape[3] != D or q.shape[2] % Hkv:
        raise ValueError(
            f"attention: q must be (max_seqs={B}, S, num_q_heads, head_dim={D}) with "
            f"num_q_heads a multiple of the {Hkv} KV heads for {lid.describe()}, got {q.shape}"
        )
    if tuple(np.shape(lengths)) != (B,):
        raise ValueError(
            f"attention: lengths must be ({B},), one per sequence, got shape "
            f"{tuple(np.shape(lengths))}"
        )


def _is_plain(q: jax.Array, q_lengths: Any, window: Any, softcap: Any) -> bool:
    return q.shape[1] == 1 and q_lengths is None and window is None and softcap is None


def checked_options(q: Any, k: Any, options: dict) -> tuple[jax.Array, dict]:
    """Trace-time validation of q (B, S, H_q, D) and the options; returns q and the
    _prepare keywords (q_lengths as int32 (B,) or None, window and softcap as numbers, 0
    = none)."""
    q = q if isinstance(q, (jax.Array, jax.ShapeDtypeStruct)) else jnp.asarray(q)
    unknown = set(options) - {"q_lengths", "window", "softcap"}
    if unknown:
        raise TypeError(f"attention: unknown options {sorted(unknown)}")
    if q.ndim != 4 or q.shape[1] < 1:
        raise ValueError(
            f"attention: q must be (batch, queries S >= 1, q_heads, head_dim), got shape {q.shape}"
        )
    B, S = q.shape[0], q.shape[1]
    return q, dict(
        q_lengths=_checked_q_lengths(options.get("q_lengths"), B, S),
        window=as_window(options.get("window"), "attention"),
        softcap=as_softcap(options.get("softcap"), "attention"),
    )


def _checked_q_lengths(q_lengths: Any, batch: int, q_len: int) -> jax.Array | None:
    """int32 (B,), wide integers clamped to [0, S] before the cast (no wrap)."""
    if q_lengths is None:
        return None
    q_lengths = clamped_counts(q_lengths, q_len)
    if q_lengths.shape != (batch,):
        raise ValueError(
            f"attention: q_lengths must have shape ({batch},) (live query rows per sequence), "
            f"got {q_lengths.shape}"
        )
    if not jnp.issubdtype(q_lengths.dtype, jnp.integer):
        raise TypeError(f"attention: q_lengths must be integers (int32), got {q_lengths.dtype}")
    return q_lengths.astype(jnp.int32)


def _check_reference_shapes(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    ok = q.ndim == 4 and k.ndim == 4 and v.shape == k.shape
    if ok:
        (B, _, Hq, D), (kb, _, Hkv, kd) = q.shape, k.shape
        ok = kb == B and kd == D and Hkv > 0 and Hq % Hkv == 0
    if not ok:
        raise ValueError(
            "reference_attention: q must be (B, S, H_q, D) and k, v (B, T, H_kv, D) with the "
            f"same B and D and H_q a multiple of H_kv; got q {q.shape}, k {k.shape}, v {v.shape}"
        )


def reference_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    q_lengths: Any = None,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """Plain-JAX attention with the semantics of :func:`attention` (masked softmax over
    all T tokens; float32, or float64 inputs under ``jax_enable_x64`` for a float64
    reference), output in q's dtype. An fp8 cache is dequantized first."""
    q, k, v = (x if isinstance(x, jax.Array) else jnp.asarray(x) for x in (q, k, v))
    _check_reference_shapes(q, k, v)
    if (k_scale is None) != (v_scale is None):
        raise ValueError(
            "reference_attention: an fp8 cache needs both k_scale and v_scale, other caches neither"
        )
    if k_scale is not None:
        k, v = dequantize_fp8(k, k_scale), dequantize_fp8(v, v_scale)
    B, S, Hq, D = q.shape
    T, Hkv = k.shape[1], k.shape[2]
    for name, x in (("lengths", lengths), ("q_lengths", q_lengths)):
        if x is None:
            continue
        dtype = dtype_of(x)
        if np.shape(x) != (B,) or not jnp.issubdtype(dtype, jnp.integer):
            raise ValueError(
                f"reference_attention: {name} must be integers of shape ({B},), got "
                f"{dtype} {np.shape(x)}"
            )
    window = as_window(window, "attention")
    softcap = as_softcap(softcap, "attention")
    scale = _call._softmax_scale(scale, D)
    acc = jnp.promote_types(jnp.float32, jnp.result_type(q.dtype, k.dtype))
    n = jnp.clip(clamped_counts(lengths, T).astype(jnp.int32), 0, T)
    qn = n.clip(0, S) if q_lengths is None else clamped_counts(q_lengths, S).astype(jnp.int32)
    qn = jnp.clip(qn, 0, jnp.minimum(S, n))
    qg = q.astype(acc).reshape(B, S, Hkv, Hq // Hkv, D)
    s = jnp.einsum("bshgd,bthd->bshgt", qg, k.astype(acc), precision=_FULL) * scale
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    i = jnp.arange(S)[None, :]
    pos = n[:, None] - qn[:, None] + i  # (B, S)
    live_row = i < qn[:, None]
    t = jnp.arange(T)[None, None, :]
    mask = (t <= pos[:, :, None]) & live_row[:, :, None]
    if window:
        mask &= t > pos[:, :, None] - window
    s = jnp.where(mask[:, :, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bshgt,bthd->bshgd", p, v.astype(acc), precision=_FULL)
    # Zeros only for rows without a live token; a NaN logit gives a NaN row, as softmax's.
    o = jnp.where(denom == 0, 0.0, o / jnp.where(denom == 0, 1.0, denom))
    return o.reshape(B, S, Hq, D).astype(q.dtype)
