"""The ops on :class:`~jax_vmm.KVLayer` s: what ``jax_vmm.kv_write(layer, ...)``,
``jax_vmm.decode_attention(q, layer, lengths)`` and :func:`ordered_views` do.

Arena layer: each op is one custom call that takes the layer's token and names the layer
by its static identity (``cache_uid``, ``layer`` attributes); its handler finds the
arena buffers through the KV cache registry on the device it runs on. The write is a
primitive of its own (ops/cache_write.py): a custom call with a side effect for XLA, so
XLA never removes it, but no JAX effect, so a step with writes keeps JAX's fast dispatch
path; ``kv.check()`` waits for the tokens of the returned cache. It returns the token,
which orders every later op on the layer after it (read after write). A read is not
ordered before a *later* write of the same layer in the same computation (write after
read): a decode step never overwrites what it read in that step, and two steps are
ordered by the token they pass on.

Array layer: a checked functional scatter (``.at[slots].set(mode="drop")``, negative
slots skipped, slots past the cache dropped) and the array form of decode attention.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.interpreters.partial_eval import DynamicJaxprTracer

from ..base.ffi import register
from ..base.fp8 import FP8_DTYPE, dequantized_for_split_k, quantize_fp8
from ..cache.ids import LayerId
from ..cache.pytree import KVLayer
from ..cache.registry import arena_of
from ..memory.lookup import find_view_buffer
from . import array_writes as _ops
from .array_attention import decode_attention_arrays
from .attention_call import _clamped_lengths, prepare, run_split_k
from .cache_write import write_token
from .views_check import check_views

__all__ = ["write", "attention", "rows_attention", "ordered_views"]


@dataclasses.dataclass(frozen=True)
class _Targets:
    write: str = "jax_vmm_kv_cache_write"
    write_fp8: str = "jax_vmm_kv_cache_write_fp8"
    attention: str = "jax_vmm_decode_attention_cache"
    attention_stream: str = "jax_vmm_decode_attention_v2_cache"
    check_views: str = "jax_vmm_kv_cache_check_views"
    copy_tokens: str = "jax_vmm_kv_cache_copy_tokens"
    read_lengths: str = "jax_vmm_kv_cache_read_lengths"


_log = logging.getLogger("jax_vmm")

#: The FFI targets of the arena-layer ops. ``jax_vmm.testing.limits_ignored()`` swaps in
#: the testing layer's variants for its with-block (the one seam for that hook); nothing
#: else should.
_targets = _Targets()


def _identity_attrs(lid: LayerId) -> dict:
    return {"cache_uid": np.uint64(lid.cache_uid), "layer": np.int64(lid.layer)}


def _spec(lid: LayerId) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(lid.shape, np.dtype(lid.dtype))


# -- kv_write ----------------------------------------------------------------------------


def write(
    layer: KVLayer, new_k: Any, new_v: Any, slots: Any, *, effectful: bool = False
) -> KVLayer:
    """``jax_vmm.kv_write(layer, new_k, new_v, slots)``: see its docstring. ``effectful``:
    give the write a JAX effect (a sharded arena's, inside its ``shard_map``)."""
    if not isinstance(layer, KVLayer):
        raise TypeError(f"kv_write: expected a KVLayer, got {type(layer).__name__}")
    if not layer.is_arena:
        return _write_arrays(layer, new_k, new_v, slots)
    lid = layer.id
    spec = _spec(lid)
    n = _ops.check_write("kv_write", spec, spec, new_k, new_v, slots, fp8=lid.fp8)
    if n == 0:
        return layer
    register()
    operands: tuple = (new_k, new_v, slots, layer.token)
    target = _targets.write
    scales: tuple = ()
    if lid.fp8:
        scales = (layer.k_scale, layer.v_scale)
        operands += scales
        target = _targets.write_fp8
    token = write_token(
        target, operands, _identity_attrs(lid), effectful=effectful, label=lid.describe()
    )
    return KVLayer._arena(lid, token, scales)


def _write_arrays(layer: KVLayer, new_k: Any, new_v: Any, slots: Any) -> KVLayer:
    """The checked functional scatter of an array layer: negative slots are padding, slots
    past the cache are dropped (``mode="drop"``), the rest written; fp8 tokens quantized
    as kv_write_fp8 does."""
    k, v = layer.k, layer.v
    n = _ops.check_write("kv_write", k, v, new_k, new_v, slots, fp8=layer.fp8)
    if n == 0:
        return layer
    h, d = k.shape[-2:]
    num_slots = int(np.prod(k.shape[:-2]))
    idx = jnp.where(slots < 0, num_slots, slots)  # negative would wrap: send it past the end

    def scatter(cache: Any, new: Any, scale: Any) -> Any:
        if layer.fp8:
            new = quantize_fp8(new, scale)
            if np.dtype(cache.dtype) != FP8_DTYPE:  # uint8 holding the bits
                new = jax.lax.bitcast_convert_type(new, cache.dtype)
        flat = cache.reshape(num_slots, h, d).at[idx].set(new, mode="drop")
        return flat.reshape(cache.shape)

    leaves = (scatter(k, new_k, layer.k_scale), scatter(v, new_v, layer.v_scale))
    if layer.fp8:
        leaves += (layer.k_scale, layer.v_scale)
    return KVLayer(layer._id, leaves)


# -- decode attention ----------------------------------------------------------------------


def attention(q: Any, layer: KVLayer, lengths: Any, *, scale: float | None = None, **knobs: Any):
    """``jax_vmm.decode_attention(q, layer, lengths)``; ``knobs``: the private plan knobs of
    ``jax_vmm.ops.attention.decode_attention_tuned`` (impl, chunk, splits, ctas, ...)."""
    if not layer.is_arena:
        return decode_attention_arrays(
            q,
            layer.k,
            layer.v,
            lengths,
            scale=scale,
            k_scale=layer.k_scale,
            v_scale=layer.v_scale,
            **knobs,
        )
    lid = layer.id
    if len(lid.shape) != 4:
        raise ValueError(
            f"decode_attention: {lid.describe()} has shape {lid.shape}; attention needs one "
            "buffer row per sequence (kv_arena(..., max_seqs=batch))"
        )
    if knobs.get("workspace", "scratch") != "scratch":
        raise ValueError("decode_attention over an arena layer keeps its partials in scratch")
    knobs.pop("workspace", None)
    spec = _spec(lid)
    call = prepare(
        q,
        spec,
        spec,
        lengths,
        scale=scale,
        k_scale=layer.k_scale,
        v_scale=layer.v_scale,
        workspace="scratch",
        **knobs,
    )
    if call is None:
        return jnp.zeros(jnp.shape(q), jnp.asarray(q).dtype)
    q, lengths = call.operands[0], call.operands[3]
    batch = jax.ShapeDtypeStruct((q.shape[0],), jnp.int32)  # read_lengths: discarded
    target = _targets.attention_stream if call.stream else _targets.attention
    out, _ = jax.ffi.ffi_call(target, (call.out_type, batch), vmap_method="sequential")(
        q, lengths, layer.token, *call.operands[4:], **_identity_attrs(lid), **call.attrs
    )
    return out


def rows_attention(
    q: jax.Array, layer: KVLayer, lengths: Any, options: dict, *, scale: Any, knobs: dict
) -> jax.Array:
    """``jax_vmm.attention(q, layer, lengths, **options)`` with S query rows on jax_vmm's
    split-K kernels over a single-device arena layer: the cache target
    with q ``(B, S, H_q, D)`` and the options (``q_lengths`` int32 ``(B,)`` or None,
    ``window``, ``softcap``: 0 = none) as checked by ``general_attention.checked_options``.
    Its lengths are clamped to the tokens ensured, counted. An fp8 layer: the kernels read
    a dequantized copy of its live tokens (:func:`_live_copy`)."""
    spec = _spec(layer.id)
    if layer.fp8:
        # Every check first, on the shapes of the copy to come: a refused call copies
        # (and counts) nothing.
        like = jax.ShapeDtypeStruct(spec.shape, q.dtype)
        if (
            prepare(q, like, like, lengths, scale=scale, workspace="scratch", **knobs, **options)
            is None
        ):
            return jnp.zeros(q.shape, q.dtype)
        k, v, n = _live_copy(layer, lengths)
        q32, k, v, out_dtype = dequantized_for_split_k(q, k, v, layer.k_scale, layer.v_scale)
        call = prepare(q32, k, v, n, scale=scale, workspace="scratch", **knobs, **options)
        return (
            jnp.zeros(q.shape, out_dtype) if call is None else run_split_k(call).astype(out_dtype)
        )
    call = prepare(q, spec, spec, lengths, scale=scale, workspace="scratch", **knobs, **options)
    if call is None:
        return jnp.zeros(q.shape, q.dtype)
    q, lengths = call.operands[0], call.operands[3]
    batch = jax.ShapeDtypeStruct((q.shape[0],), jnp.int32)  # read_lengths: discarded
    ffi = jax.ffi.ffi_call(_targets.attention, (call.out_type, batch), vmap_method="sequential")
    out, _ = ffi(q, lengths, layer.token, *call.tail, **_identity_attrs(layer.id), **call.attrs)
    return out


@functools.cache
def _note_the_copy_path() -> None:
    """Once per process: the fp8 copy path is slow by design; say so where users look."""
    _log.warning(
        "jax_vmm.attention over an fp8 arena layer with several query rows or a window/"
        "softcap reads a dequantized copy of the layer per call (correct, not fast; "
        "docs/attention.md); decode (one query row, no option) reads fp8 in place"
    )


def _live_copy(layer: KVLayer, lengths: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(k, v, read_lengths): the arena layer's tokens [0, read_lengths[b]) of every
    sequence copied by one custom call (ordered after the layer's writes by its token),
    zeros past them, in the layer's shape and dtype; read_lengths = lengths clamped to
    [0, T] and to the tokens each sequence ensured (counted for ``kv.check()``). For the
    split-K kernels, which read 16-bit or float32 caches only: fp8 layers with several
    query rows (correct, not fast: a copy of the layer per call)."""
    lid = layer.id
    spec = _spec(lid)
    B = lid.shape[0]
    n = _clamped_lengths(lengths, spec)
    if tuple(n.shape) != (B,) or not jnp.issubdtype(n.dtype, jnp.integer):
        raise ValueError(
            f"attention: lengths must be ({B},) integers, one per sequence of "
            f"{lid.describe()}; got {n.dtype}{tuple(n.shape)}"
        )
    _note_the_copy_path()
    register()
    read = jax.ShapeDtypeStruct((B,), jnp.int32)
    ffi = jax.ffi.ffi_call(_targets.copy_tokens, (spec, spec, read), vmap_method="sequential")
    return ffi(n.astype(jnp.int32), layer.token, **_identity_attrs(lid))


# -- ordered views ---------------------------------------------------------------------------


def ordered_views(layer: KVLayer, k: Any, v: Any) -> tuple[Any, Any]:
    """Read an arena layer with plain XLA ops (cuDNN or XLA attention) after its writes.

    Inside ``jit`` an arena layer has no arrays (the arena is not an XLA value). Pass
    ``kv.k[l]`` and ``kv.v[l]`` into the jitted function as arguments (neither donated nor
    returned nor updated there) with the layer, and write
    ``k, v = jax_vmm.ordered_views(layer, k, v)``: the same buffers, no copy.

    Ordering: ``layer`` must come into the computation (a jit argument, or a loop carry),
    not from a ``kv_write`` earlier in the same function. XLA starts a computation (and a
    loop iteration) once its inputs are ready, so reads there follow the writes that
    produced the layer; the returned views pass through a barrier with the layer's token,
    so that in a loop XLA cannot hoist reads of them out of the loop, before the writes of
    the iterations before. Within one computation nothing orders a plain read of the
    views after a ``kv_write``: as far as XLA knows the views never change, and it may
    read them whenever it likes (it may, say, copy them into another layout first); a
    layer written in the same function, or returned by a jitted helper it calls, is
    refused here (``ValueError``). Not seen: a jitted helper that calls ordered_views on
    a layer its caller wrote (the helper is traced apart; XLA inlines it). Read such a
    layer with ``jax_vmm.attention`` / ``jax_vmm.decode_attention``, which take the token
    as an operand. Nor is a read of the views ordered before a later ``kv_write`` of the
    layer in the same computation (or loop iteration): read only tokens that it does not
    write (a decode step reads each sequence's first ``length`` tokens, writes at
    ``length``).

    A small custom call checks at run time that the buffers XLA hands over ARE the
    layer's arena buffers, and fails the step otherwise (a donated view on the CPU, for
    instance, reaches the step as XLA's copy, which the writes never touch). Outside
    ``jit`` it checks the views and waits for the layer's writes.
    """
    if not isinstance(layer, KVLayer) or not layer.is_arena:
        raise TypeError(
            "ordered_views takes an arena layer (kv.cache()[l]); an array layer's arrays are "
            "layer.k and layer.v, ordered by data dependence already"
        )
    lid = layer.id
    if lid.sharded:
        raise TypeError(
            f"ordered_views: {lid.describe()} is sharded; read it with "
            "jax_vmm.decode_attention(q, layer, lengths) (plain XLA reads of a sharded arena "
            "are not ordered or checked per device)"
        )
    if layer._written_in_trace or _computed_here(layer.token):
        raise ValueError(
            f"ordered_views: {lid.describe()} was written by a kv_write in this same "
            "computation, and XLA cannot order plain reads of the arena views after it (the "
            "views never change as far as XLA knows). Read it with "
            "jax_vmm.decode_attention(q, layer, lengths), or read the views in the next "
            "step (pass the layer in as a jit argument)"
        )
    for name, x in (("k", k), ("v", v)):
        if tuple(getattr(x, "shape", ())) != lid.shape or np.dtype(x.dtype) != np.dtype(lid.dtype):
            raise ValueError(
                f"ordered_views: {name} must be the layer's view {lid.shape} {lid.dtype} "
                f"(kv.{name}[{lid.layer}]), got {getattr(x, 'shape', type(x).__name__)}"
            )
    if not any(isinstance(x, jax.core.Tracer) for x in (k, v, layer.token)):
        _check_concrete_views(lid, k, v)
        jax.block_until_ready(layer.token)
        return k, v
    register()
    # Kept although nothing uses its result, with no JAX effect: the step keeps JAX's fast
    # dispatch path (ops/views_check.py).
    check_views(_targets.check_views, k, v, layer.token, _identity_attrs(lid))
    return _loop_variant_views(k, v, layer.token)


def _computed_here(token: Any) -> bool:
    """Whether a traced token is the result of an equation of the computation being traced
    (a kv_write in a nested jit, a cond), not handed to it (a jit argument, a loop carry):
    XLA inlines nested computations, so their writes are this computation's."""
    return isinstance(token, DynamicJaxprTracer) and getattr(token, "parent", None) is not None


def _loop_variant_views(k: Any, v: Any, token: Any) -> tuple[Any, Any]:
    """In a loop body the views are loop-invariant for XLA, which hoists its reads of them
    out of the loop, before every iteration's write (a scan writing one token per step
    read zeros at every step). Passed through a barrier with the layer's token, which the
    loop carries, they depend on the iteration: the reads stay in it, after the writes of
    the iterations before (no copy: the barrier's outputs are its operands). Outside a
    loop it changes nothing. The seam of ``jax_vmm.testing.loop_views_unbarriered()``."""
    k, v, _ = jax.lax.optimization_barrier((k, v, token))
    return k, v


def _check_concrete_views(lid: LayerId, k: Any, v: Any) -> None:
    kv = arena_of(lid, "ordered_views")
    for name, x, buf in (
        ("k", k, kv.k_buffers[lid.layer]),
        ("v", v, kv.v_buffers[lid.layer]),
    ):
        found = find_view_buffer(x, buf.nbytes)
        if found is None or found["buffer_uid"] != buf.uid:
            raise ValueError(
                f"ordered_views: {name} is not a view of {lid.describe()}'s {name} buffer; "
                f"pass kv.{name}[{lid.layer}]"
            )
