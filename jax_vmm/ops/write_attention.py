"""``jax_vmm.kv_write_attention``: a layer's kv_write and the attention over it, as one call
where one custom call can do both.

A decode step writes each layer's new tokens and then attends over the layer. As two
custom calls, a command buffer holds two traced jax_vmm commands per layer: XLA updates
each at every re-record of the buffer and replays each as a child graph. Where the
attention runs cuDNN inside jax_vmm's call (an arena layer on a GPU that
``attention_backend.routes_to_cudnn`` sends there), one target does the write and then
the attention (``jax_vmm_cudnn_attention_cache_write``). Everywhere else (the CPU, jax_vmm's
own kernels, fp8, sharded or array layers, the testing layer's write variants) this is
exactly ``kv_write`` followed by ``attention``: same checks, same results.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ..cache.pytree import KVLayer
from . import array_writes as _ops
from . import cudnn_attention as _cudnn
from . import layer_ops, vmap_reads
from .arena_leaves import checked_arena_layer
from .attention import decode_attention
from .attention_backend import routes_to_cudnn
from .cache_write import write_token_and_read
from .general_attention import attention, checked_options
from .writes import _as_array, kv_write, seq_pos_slots

__all__ = ["kv_write_attention"]

_TARGET = "jax_vmm_cudnn_attention_cache_write"


def kv_write_attention(
    q: Any,
    layer: KVLayer,
    new_k: Any,
    new_v: Any,
    slots: Any = None,
    *,
    seq: Any = None,
    pos: Any = None,
    lengths: Any,
    q_lengths: Any = None,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
) -> tuple[jax.Array, KVLayer]:
    """Write new tokens into ``layer``, then attend over it: ``(out, written_layer)``.

    The same as ::

        written = jax_vmm.kv_write(layer, new_k, new_v, seq=seq, pos=pos)  # or slots
        out = jax_vmm.attention(q, written, lengths, q_lengths=..., window=..., ...)

    (``jax_vmm.decode_attention(q, written, lengths)`` for a ``(B, H_q, D)`` q), in one
    custom call where the attention runs cuDNN inside jax_vmm (a 16-bit arena layer on a
    GPU): one command per layer and step in a command buffer instead of two. Put
    ``written_layer`` back into the cache (``cache.replace(l, written_layer)``) and return
    the cache, as after ``kv_write``.

    ``q``: ``(B, H_q, D)`` (one query row; the result is ``(B, H_q, D)``) or
    ``(B, S, H_q, D)`` (``jax_vmm.attention``'s form), with ``attention``'s options. The
    tokens' places: ``seq=``, ``pos=`` or flat ``slots``, as ``kv_write``. ``lengths``
    (required): cached tokens per sequence after the write.

    Under ``vmap`` of a jitted step the one-call target is refused (NotImplementedError):
    call ``kv_write`` and then the attention there.
    """
    if not isinstance(layer, KVLayer):
        raise TypeError(
            "kv_write_attention(q, layer, new_k, new_v, *, seq, pos, lengths): layer must be a "
            f"KVLayer (kv.cache()[l]), got {type(layer).__name__}"
        )
    q = q if isinstance(q, jax.Array) else jnp.asarray(q)
    if q.ndim not in (3, 4):
        raise ValueError(
            "kv_write_attention: q must be (B, H_q, D) (decode) or (B, S, H_q, D), got shape "
            f"{q.shape}"
        )
    if (slots is None) == (seq is None and pos is None):
        raise TypeError(
            "kv_write_attention: give the new tokens' places either as seq= and pos= or as "
            "flat slots (seq * max_tokens + pos), one of the two"
        )
    options = dict(q_lengths=q_lengths, window=window, softcap=softcap)
    plain = q.ndim == 3 and all(x is None for x in options.values())
    rows = q if q.ndim == 4 else q[:, None]
    fused = _fused_call(rows, layer, new_k, new_v, slots, seq, pos, lengths, options, scale)
    if fused is not None:
        out, written = fused
    else:
        if slots is None:
            written = kv_write(layer, new_k, new_v, seq=seq, pos=pos)
        else:
            written = kv_write(layer, new_k, new_v, slots)
        if plain:
            return decode_attention(q, written, lengths, scale=scale), written
        out = attention(rows, written, lengths, scale=scale, **options)
    return (out if q.ndim == 4 else out[:, 0]), written


def _fused_call(
    q: jax.Array,
    layer: KVLayer,
    new_k: Any,
    new_v: Any,
    slots: Any,
    seq: Any,
    pos: Any,
    lengths: Any,
    options: dict,
    scale: float | None,
) -> tuple[jax.Array, KVLayer] | None:
    """The one-call form over q ``(B, S, H_q, D)``, or None where it does not apply (then
    the caller runs the two calls, which check and report everything this does not)."""
    if not layer.is_arena or layer.id.sharded or layer.id.fp8:
        return None
    if layer_ops._targets != layer_ops._Targets():
        return None  # the testing layer's variants of the targets: keep them
    if not routes_to_cudnn(q.dtype, layer.id, default_knobs=True):
        return None
    if not any(isinstance(x, jax.core.Tracer) for x in (q, new_k, new_v, layer.token)):
        return None  # eager: the two calls, each waited for as kv_write's is
    layer = checked_arena_layer(layer, "kv_write_attention")
    layer = vmap_reads.fenced(layer, "kv_write_attention")
    lid = layer.id
    new_k, new_v = _as_array(new_k), _as_array(new_v)
    if slots is None:
        slots = seq_pos_slots(layer, new_k, _as_array(seq, jnp.int32), _as_array(pos, jnp.int32))
    spec = layer_ops._spec(lid)
    if _ops.check_write("kv_write_attention", spec, spec, new_k, new_v, slots, fp8=False) == 0:
        return None
    q, opts = checked_options(q, spec, options)  # as jax.Array's route to cuDNN checks them
    call = _cudnn._validate(
        q, spec, spec, lengths, opts["q_lengths"], opts["window"] or None,
        opts["softcap"] or None, scale, zero_rows=True,
    )  # fmt: skip
    if call.empty:
        return None
    read_lengths = _cudnn.clamped_read_lengths(call.requested, lid)
    attrs = dict(layer_ops._identity_attrs(lid), **call.attrs)
    operands = (new_k, new_v, slots, layer.token, call.q, read_lengths, call.q_lengths)
    token, out = write_token_and_read(_TARGET, operands, attrs, call.out_type, label=lid.describe())
    return out, KVLayer._arena(lid, token)
