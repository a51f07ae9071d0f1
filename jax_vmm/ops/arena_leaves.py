"""The leaves of an arena layer checked before a cache op uses them: its int32 ordering
token and an fp8 arena's float32 scales, which are the arena's, not data.

A ``jax.tree.map`` over a cache (an ``astype``, a scaling) changes them. The token is
refused (before JAX's own aliasing check would say so with an internal message). An fp8
arena's scales are fixed when it is made, so both the write (which quantizes) and
attention (which dequantizes) always use the arena's own: concrete scale leaves that
differ from them are refused, traced ones (unknown until the step runs) are replaced by
the arena's.
"""

from __future__ import annotations

import jax
import numpy as np

from ..cache.pytree import KVLayer
from ..cache.registry import arena_of
from . import vmap_reads


def checked_arena_layer(layer: KVLayer, op: str) -> KVLayer:
    """``layer`` (an arena layer) with its leaves checked for ``op`` (``kv_write``,
    ``decode_attention``), and an fp8 layer's scales the arena's own."""
    lid = layer.id
    token = layer.token
    dtype, shape = getattr(token, "dtype", None), getattr(token, "shape", None)
    # One scalar per layer (a sharded layer's token has one element per device instead).
    misshapen = dtype is not None and not lid.sharded and tuple(shape) != ()
    if dtype is None or np.dtype(dtype) != np.int32 or misshapen:
        if dtype is None:
            what = f"a {type(token).__name__} token"
        elif misshapen:
            what = f"a {np.dtype(dtype)} token of shape {tuple(shape)} (a scalar belongs there)"
        else:
            what = f"a {np.dtype(dtype)} token"
        if misshapen and len(shape) == 1:  # what vmap's default out_axes=0 makes of it
            cause = (
                "Was the cache returned from a jax.vmap with out_axes=0 (the default)? "
                "Return it with out_axes=None for the cache: every element wrote the one "
                "arena"
            )
        else:
            cause = (
                "Was the cache passed through jax.tree.map (e.g. astype, or a stack)? Map "
                "only over your own arrays, and pass kv.cache() layers as they are"
            )
        raise TypeError(
            f"{op}: {lid.describe()} has {what}; an arena layer's leaves are its int32 "
            f"ordering token (and an fp8 arena's float32 scales), not K/V data. {cause}"
        )
    if op != "kv_write":
        layer = vmap_reads.fenced(layer, op)
    if not lid.fp8:
        return layer
    kv = arena_of(lid, op)
    own = kv.scales(lid.layer)
    given = (layer.k_scale, layer.v_scale)
    for name, x, mine in zip(("k_scale", "v_scale"), given, own):
        if np.dtype(getattr(x, "dtype", None)) != np.float32 or tuple(x.shape) != mine.shape:
            raise TypeError(
                f"{op}: {lid.describe()}'s {name} leaf is {getattr(x, 'dtype', x)} "
                f"{getattr(x, 'shape', '')}; an fp8 arena's scales are float32 "
                f"{mine.shape}, fixed by kv_arena(k_scales=, v_scales=). Pass kv.cache() "
                "layers as they are (no jax.tree.map over them)"
            )
        if x is mine or isinstance(x, jax.core.Tracer):
            continue
        if not np.array_equal(np.asarray(x), np.asarray(mine)):
            raise ValueError(
                f"{op}: {lid.describe()}'s {name} {np.asarray(x)} is not the arena's "
                f"{np.asarray(mine)}: an fp8 arena's scales are fixed by kv_arena(k_scales=, "
                "v_scales=) and every token in it is quantized with them. Pass kv.cache() "
                "layers as they are (no jax.tree.map over their scales); for other scales "
                "make another arena"
            )
    # layer.token: the fenced one for a read (a DCE before batching would drop the fence
    # if its output went unused).
    return KVLayer._arena(lid, layer.token, tuple(own))
