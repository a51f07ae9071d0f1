"""Decode attention over KV-cache views: one new query token per sequence, reading only
each sequence's live tokens.

``decode_attention(q, k, v, lengths)`` is an XLA FFI custom call (CPU and CUDA). With
per-sequence KV buffers (``kv_arena(..., max_seqs=B)``, shape ``(B, T, H_kv, D)``) each
sequence is contiguous, so a plain (non-paged) split-K "flash-decoding" kernel serves a
cache that grows underneath it: tokens at or past ``lengths[b]`` -- including pages that
are not committed at all -- are never read. fp8 caches (float8_e4m3fn with per-KV-head
scales, jax_vmm/base/fp8.py) and the private ``impl="stream*"`` choices run the streaming
("stream-K") kernel, target ``jax_vmm_decode_attention_v2``. See docs/attention.md.

This module is the entry point: it dispatches an array cache to the kernels
(``array_attention``) and a cache layer to the layer ops (``layer_ops``,
``sharded_ops``).
"""

from __future__ import annotations

from typing import Any

import jax

from ..base.fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8
from ..cache.pytree import KVCache, KVLayer
from . import layer_ops, sharded_ops
from .arena_leaves import checked_arena_layer
from .array_attention import attention_stats, decode_attention_arrays, reference_decode_attention
from .attention_backend import routes_to_cudnn
from .attention_call import attention_plan, stream_attention_plan
from .cudnn_attention import cudnn_attention

__all__ = [
    "decode_attention",
    "reference_decode_attention",
    "attention_plan",
    "stream_attention_plan",
    "attention_stats",
    "dequantize_fp8",
    "FP8_DTYPE",
    "FP8_MAX",
]


def decode_attention(
    q: jax.Array,
    k: Any = None,
    v: Any = None,
    lengths: Any = None,
    *,
    layer: KVLayer | None = None,
    scale: float | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """Attention of one new query token per sequence over that sequence's live KV tokens.

    Two forms: ``decode_attention(q, layer, lengths)`` over a :class:`~jax_vmm.KVLayer`
    (the cache API), and ``decode_attention(q, k, v, lengths)`` over arrays.

    Args:
      q: ``(B, H_q, D)``, the query of each sequence's new token.
      layer: ``cache[l]`` of ``kv.cache()`` (a ``kv_arena(..., max_seqs=B)``) or an array
        layer, in k's place or as ``layer=``. An arena layer is read in place (the kernel
        finds the arena by the layer's identity; no copy) after the writes that produced
        the layer (its token is an operand), and each length is clamped to the tokens its
        sequence ensured: a sequence asked to read past them is counted, and ``kv.check()`` raises
        :class:`~jax_vmm.OutOfBoundsRead`. An fp8 layer carries its scales.
      k, v: ``(B, T, H_kv, D)`` arrays (any, arena views or not); the same dtype as ``q``
        (bfloat16, float16 or float32). Grouped-query attention when ``H_q`` is a
        multiple of ``H_kv``: query head ``h`` reads KV head ``h // (H_q // H_kv)``.
      lengths: ``(B,)`` integers, live tokens per sequence (cast to int32). Only tokens
        ``[0, lengths[b])`` of sequence ``b`` are read; values are clamped to ``[0, T]``.
        A sequence of length 0 gets an all-zero output.
      scale: softmax scale, default ``1 / sqrt(D)``.
      k_scale, v_scale: (array form) for an fp8 cache (``k``/``v`` of dtype
        float8_e4m3fn, or uint8 holding its bits; ``q`` bfloat16 or float16, head_dim 64,
        128 or 256): float32 ``(H_kv,)`` dequantization scales, one per KV head (the cache
        holds ``k / k_scale`` rounded to fp8, see ``jax_vmm.kv_write_fp8``). Required for
        fp8 caches, refused otherwise.

    Returns:
      ``(B, H_q, D)`` in ``q``'s dtype: ``softmax(scale * q . k[:len]) @ v[:len]`` per
      sequence and head, accumulated in float32.

    Works under ``jax.jit`` (and ``vmap``, sequentially); inside CUDA graphs the kernel
    reads ``lengths`` from device memory, so captured steps stay correct as sequences
    grow. Not differentiable.
    """
    ndim = getattr(q, "ndim", None)
    if ndim is not None and ndim != 3:
        raise ValueError(
            f"decode_attention: q must be (batch, q_heads, head_dim), got shape {q.shape}; "
            "for several query rows per sequence, (batch, S, q_heads, head_dim), use "
            "jax_vmm.attention"
        )
    k = layer_or_k("decode_attention", layer, k)
    return decode_attention_tuned(q, k, v, lengths, scale=scale, k_scale=k_scale, v_scale=v_scale)


def layer_or_k(op: str, layer: Any, k: Any) -> Any:
    """The layer given as ``layer=`` or in k's place (``op(q, layer, lengths)``), or k."""
    if layer is None:
        if k is None:
            raise TypeError(
                f"{op} takes (q, layer, lengths) or (q, k, v, lengths); got no layer or k"
            )
        return k
    if k is not None:
        raise TypeError(f"{op}: got layer= and k; pass the layer once (or k and v, no layer)")
    if not isinstance(layer, KVLayer):
        raise TypeError(
            f"{op}: layer= must be a KVLayer (kv.cache()[l]), got {type(layer).__name__}"
        )
    return layer


def refuse_misplaced_cache(op: str, q: Any, k: Any) -> None:
    """A whole KVCache or KV arena as the layer, a (k, v) pair, or a cache object where q
    belongs: say so."""
    if isinstance(k, KVCache):
        raise TypeError(
            f"{op}(q, layer, lengths): got a whole KVCache as the layer; pass one layer, cache[l]"
        )
    if callable(getattr(k, "cache", None)) and callable(getattr(k, "ensure", None)):
        # a KV arena (the kv layer sits above ops: known by its methods)
        raise TypeError(
            f"{op}(q, layer, lengths): got the KV arena ({type(k).__name__}) as the layer; "
            "pass one layer of its cache, kv.cache()[l]"
        )
    if isinstance(k, (tuple, list)):
        raise TypeError(
            f"{op}: got a {type(k).__name__} where the layer or k belongs; pass k and v as "
            f"two arguments, {op}(q, k, v, lengths), or a cache layer, kv.cache()[l]"
        )
    if isinstance(q, (KVCache, KVLayer)):
        raise TypeError(
            f"{op}(q, layer, lengths): the first argument is the query array, got a "
            f"{type(q).__name__}"
        )


def decode_attention_tuned(
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
    """decode_attention with the knobs that tests and benchmarks need.

    impl: the split-K kernel: "auto", "tensor_core", "tensor_core_u1" (one tile in
    flight per warp) or "simple" (CUDA kernel choice; the CPU has one), with its plan
    knobs chunk / splits (0 = automatic); or the streaming kernel (fp8 caches always run
    it, "auto" included): "stream" (combine fused, last arrival), "stream_combine"
    (combine as a second kernel), "stream_tma" (tiles by bulk copies), with its plan knobs
    ctas (grid size), stages (ring slots per warp, 2..8) and min_tiles (fewest tiles per
    CTA; a tile is 16 tokens, or 32 for K/V rows of at most 128 bytes), 0 = automatic.
    workspace: "scratch" keeps the partials in jax_vmm's graph-safe scratch (grown at the
    FFI initialize stage); "xla" (split-K only) makes them a second, discarded output that
    XLA allocates.

    ``k`` may be a KVLayer: ``decode_attention_tuned(q, layer, lengths)`` (or with ``v=None``
    and ``lengths=``), with the same knobs.
    """
    refuse_misplaced_cache("decode_attention", q, k)
    if isinstance(k, KVLayer):
        if lengths is not None and v is not None:
            raise TypeError("decode_attention(q, layer, lengths): too many arguments")
        if lengths is None and v is None:
            raise TypeError("decode_attention(q, layer, lengths): lengths is missing")
        if k_scale is not None or v_scale is not None:
            raise ValueError(
                "decode_attention(q, layer, lengths): an fp8 layer carries its scales; "
                "k_scale/v_scale are for the array form"
            )
        if k.is_arena:  # an fp8 layer reads with the arena's own scales
            k = checked_arena_layer(k, "decode_attention")
            knobs = (impl, chunk, splits, ctas, stages, min_tiles, workspace)
            default_knobs = knobs == ("auto", 0, 0, 0, 0, 0, "scratch")
            if routes_to_cudnn(dtype_of(q), k.id, default_knobs=default_knobs):
                return cudnn_attention(q, k, v if lengths is None else lengths, scale=scale)
        layer_attention = sharded_ops.attention if _sharded(k) else layer_ops.attention
        return layer_attention(
            q,
            k,
            v if lengths is None else lengths,
            scale=scale,
            chunk=chunk,
            splits=splits,
            impl=impl,
            workspace=workspace,
            ctas=ctas,
            stages=stages,
            min_tiles=min_tiles,
        )
    return decode_attention_arrays(
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


def dtype_of(x: Any) -> Any:
    return x.dtype if hasattr(x, "dtype") else jax.numpy.asarray(x).dtype


def _sharded(layer: KVLayer) -> bool:
    """A layer of a sharded KV arena: its ops run per device through ``shard_map``."""
    return layer.is_arena and layer.id.sharded
