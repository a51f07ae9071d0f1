"""``jax_vmm.kv_write``: the one entry point of a KV-cache write. A :class:`~jax_vmm.KVLayer`
goes to the layer ops (``layer_ops``, or ``sharded_ops`` for a sharded arena's layer),
arrays to the array-level custom calls (``array_writes``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..cache.pytree import KVCache, KVLayer
from . import layer_ops, sharded_ops
from .arena_leaves import checked_arena_layer
from .array_writes import KVDest, kv_write_arrays
from .lengths import clamped_int32

__all__ = ["kv_write"]


def kv_write(
    cache: Any,
    *args: Any,
    seq: Any = None,
    pos: Any = None,
    dest: KVDest | None = None,
) -> Any:
    """Write ``n`` tokens into a KV cache. Two forms:

    ``kv_write(layer, new_k, new_v, *, seq, pos) -> KVLayer`` (the cache API): ``layer``
    is a :class:`~jax_vmm.KVLayer` (``cache[l]`` of ``kv.cache()``, or an array layer);
    token ``i`` goes to position ``pos[i]`` of sequence ``seq[i]``. For an arena layer the
    arena holds the tokens when the call returns (eager) or runs (inside ``jit``, donated
    or not, CPU or GPU, in any loop): one custom call finds the arena buffers by the
    layer's static identity, nothing is copied, and the returned layer's token orders
    every later read of it (``decode_attention(q, layer, lengths)``) after the write.
    Return the cache from the step: a jitted step that writes and returns the cache takes
    JAX's fast dispatch path, and ``kv.check()`` waits for the writes through the
    returned tokens (a write whose layer nothing uses still runs, with a
    :class:`~jax_vmm.KVWriteResultUnusedWarning`). An fp8 arena layer quantizes float
    tokens with its scales. For an array layer it is a checked functional scatter. Put the
    result back with ``cache.replace(l, layer)``.

    ``seq``, ``pos``: integer ``(n,)``. ``seq = -1`` is an idle row (skipped, not
    counted). A ``pos`` outside ``[0, max_tokens)``, a ``seq`` outside ``[0, max_seqs)``
    (a layer without ``max_seqs``: only seq 0) or a position past the tokens its sequence
    ensured (``kv.ensure``) is never written, never lands in another sequence, and is
    counted: ``kv.check()`` raises :class:`~jax_vmm.OutOfBoundsWrite` (an array layer
    drops it uncounted).

    ``kv_write(layer, new_k, new_v, slots)``: the same with flat slots ``seq * max_tokens
    + pos`` (int32 ``(n,)``, negative skipped); a wrong stride lands in another sequence
    unnoticed, so prefer ``seq=``/``pos=``.

    ``kv_write(k, v, new_k, new_v, slots, dest=None) -> (k, v)`` (array level, for power
    users): ``k``, ``v`` are arrays (or arena views ``kv.k[l]``, ``kv.v[l]``), seen as
    ``(num_slots, H, D)``; returns them updated. Inside ``jit`` the arena is written only
    with ``dest=kv.dest(l)`` (or with the cache donated on a GPU): without it, a call on
    arrays shaped like a live KV arena's layer warns (:class:`~jax_vmm.ArenaNotWrittenWarning`).
    A slot out of range, on a page not committed, or past the tokens its sequence ensured
    is not written and is counted.

    ``new_k``, ``new_v``: ``(n, H, D)``; over a KVLayer of an fp8 arena float32, bfloat16
    or float16 (quantized with the arena's scales), else in the cache's dtype (an fp8 array
    cache takes kv_write_fp8).
    """
    _check_first_argument(cache, args)
    if isinstance(cache, KVLayer):
        if dest is not None:
            raise TypeError(
                "kv_write(layer, ...): a KVLayer names its arena itself; dest= is for the "
                "array form kv_write(k, v, new_k, new_v, slots, dest=kv.dest(l))"
            )
        if seq is not None or pos is not None:
            if len(args) != 2:
                raise TypeError(
                    "kv_write(layer, new_k, new_v, *, seq, pos): give the tokens' place either "
                    f"as seq=/pos= or as flat slots, not both; got {len(args)} positional "
                    "arguments after the layer with seq=/pos="
                )
            new_k, new_v = (_as_array(x) for x in args)
            seq, pos = _as_array(seq, jnp.int32), _as_array(pos, jnp.int32)
            slots = seq_pos_slots(cache, new_k, seq, pos)
            args = (new_k, new_v, slots)
        elif len(args) != 3:
            raise TypeError(
                "kv_write(layer, new_k, new_v, *, seq, pos) needs seq= and pos= (int (n,): "
                "sequence and position of each new token); got "
                f"{len(args)} positional arguments after the layer and no seq=/pos="
            )
        if cache.is_arena:
            cache = checked_arena_layer(cache, "kv_write")
        write = sharded_ops.write if cache.is_arena and cache.id.sharded else layer_ops.write
        return write(cache, *args)
    if seq is not None or pos is not None:
        raise TypeError(
            "kv_write: seq=/pos= are for the cache form kv_write(layer, new_k, new_v, seq=, "
            "pos=) on a KVLayer (kv.cache()[l]); the array form takes flat slots"
        )
    if len(args) != 4:
        raise TypeError(
            "kv_write takes (layer, new_k, new_v, seq=, pos=) or (k, v, new_k, new_v, slots, "
            f"dest=...); got {1 + len(args)} positional arguments"
        )
    return kv_write_arrays(cache, *args, dest=dest)


def _check_first_argument(cache: Any, args: tuple) -> None:
    """A whole cache, or a layer in another position, is a misuse of the layer form: say
    so rather than count the arguments."""
    if isinstance(cache, KVCache):
        raise TypeError(
            "kv_write: the first argument must be a KVLayer (cache[l]), got a whole KVCache; "
            "write one layer and put it back: "
            "cache = cache.replace(l, jax_vmm.kv_write(cache[l], new_k, new_v, seq=seq, pos=pos))"
        )
    if not isinstance(cache, KVLayer):
        for i, arg in enumerate(args, start=2):
            if isinstance(arg, (KVLayer, KVCache)):
                raise TypeError(
                    f"kv_write: the first argument must be a KVLayer (cache[l]), got "
                    f"{type(cache).__name__} first and a {type(arg).__name__} as argument "
                    f"{i}; call jax_vmm.kv_write(cache[l], new_k, new_v, seq=seq, pos=pos)"
                )


def _as_array(x: Any, empty_dtype: Any = None) -> Any:
    """A Python list or tuple (of numbers, or of traced scalars inside jit) as an array;
    an empty one as ``empty_dtype`` (``[]`` is float32 to JAX). Anything else as given."""
    if not isinstance(x, (list, tuple)):
        return x
    if len(x) == 0 and empty_dtype is not None:
        return jnp.zeros((0,), empty_dtype)
    return jnp.asarray(x)


def seq_pos_slots(layer: KVLayer, new_k: Any, seq: Any, pos: Any) -> jax.Array:
    """The flat int32 slots of ``(seq, pos)`` for ``layer``: ``seq * T + pos`` where both
    are in range, -1 for an idle row (``seq == -1``), and ``num_slots`` (past the cache:
    dropped and counted) for anything else, so that no position ever reaches another
    sequence."""
    if seq is None or pos is None:
        missing = "seq" if seq is None else "pos"
        raise TypeError(f"kv_write(layer, new_k, new_v, *, seq, pos): {missing}= is missing")
    k_shape = tuple(getattr(new_k, "shape", ()))
    if len(k_shape) != 3:
        raise ValueError(
            f"kv_write: new_k must be (n, num_kv_heads, head_dim), one row per new token; got "
            f"shape {k_shape} (one token: new_k[None])"
        )
    n = k_shape[:1]
    for name, x in (("seq", seq), ("pos", pos)):
        shape = tuple(np.shape(x))
        if shape != n:
            raise ValueError(
                f"kv_write: {name} must have shape {n}, one entry per new token (new_k "
                f"{tuple(getattr(new_k, 'shape', ()))}); got {shape}"
            )
        dtype = np.dtype(getattr(x, "dtype", None) or np.asarray(x).dtype)
        if not np.issubdtype(dtype, np.integer):
            raise TypeError(f"kv_write: {name} must hold integers, got {dtype}")
    shape = layer.shape
    tokens = shape[-3]
    seqs = shape[0] if len(shape) == 4 else 1
    # Clamped to one past each end before the int32 cast: 2**32 + 1 must stay out of
    # range (dropped, counted), not wrap to 1; -1 (idle) only where the user gave -1.
    seq = clamped_int32(seq, -2, seqs).astype(jnp.int32)
    pos = clamped_int32(pos, -1, tokens).astype(jnp.int32)
    valid = (seq >= 0) & (seq < seqs) & (pos >= 0) & (pos < tokens)
    dropped = jnp.int32(seqs * tokens)
    slots = jnp.where(valid, seq * tokens + pos, jnp.where(seq == -1, -1, dropped))
    return slots.astype(jnp.int32)
