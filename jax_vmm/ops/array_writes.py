"""KV-cache writes as XLA FFI custom calls: ``kv_write``, ``kv_write_through`` and
``kv_write_fp8``.

The cache API comes first: ``kv_write(layer, new_k, new_v, slots)`` on a
:class:`~jax_vmm.KVLayer` of ``kv.cache()`` writes the arena with nothing to remember
and nothing copied (jax_vmm/ops/layer_ops.py, docs/kv_cache.md); ``jax_vmm.kv_write``
(jax_vmm/ops/writes.py) dispatches. This module is the array level, for power users.

The array-level calls take KV-cache views (``kv.k[l]``, ``kv.v[l]``), ``n`` new tokens
and their flat slots (``slot = seq * max_tokens + position`` for a per-sequence layout;
the cache is seen as ``(num_slots, num_kv_heads, head_dim)``; a negative slot is padding
and is skipped).
Slots are validated on the device, so the checks hold when XLA replays a captured CUDA
graph: a slot past the buffer, or on a page that is not committed, is dropped, never
written, and counted in the buffer's drop counter (``kv.check()`` raises
:class:`jax_vmm.OutOfBoundsWrite`).

Where the tokens land. Inside ``jit`` the cache is a tracer, and what XLA hands the
custom call at run time is not always the arena: without donation XLA must keep the
argument intact and gives the call a copy; on CPU, PjRt copies a donated DLPack view
(measured, docs/kv_write.md). So the arena buffers are named statically: ``dest``, a
:class:`KVDest` from :meth:`jax_vmm.KVArena.dest`, is baked into the compiled call
(arena addresses never move, which is the point of the arena). With it the tokens
always land in the arena, donated or not, CPU or GPU. Called eagerly on arena views,
``dest`` is found from the arrays themselves. A dest names its buffers by uid: a step
traced with the dest of an arena closed or destroyed since refuses to run
(``JaxRuntimeError``), even when a newer arena now sits at the same addresses.

Both calls have a side effect (the arena), so XLA never removes one whose result is
unused, and ``jax.effects_barrier()`` (which ``kv.check()`` calls) waits for them.

``kv_write(k, v, new_k, new_v, slots, dest=None) -> (k, v)`` is functional too: the
returned arrays hold the tokens. With the cache donated on a GPU the outputs *are* the
arena (no copy of the cache; one write). Otherwise XLA's copy is written as well, and
``kv_write_stats()`` counts an alias miss. Without ``dest`` and without arena memory
handed over it is a plain checked scatter (``non_arena``).

``kv_write_through(k, v, new_k, new_v, slots, dest=None) -> status`` is for an arena that
*is* the state: it writes only the arena (no aliasing, so XLA never copies the cache: no
donation needed, zero copy cost in ``lax.scan``/``fori_loop`` too) and returns a
``(2, n)`` int32 status per token and side (0 padding, 1 written, 2 dropped: slot out of
range, 3 dropped: page not committed). XLA does not know that the cache changed, so order
later reads of it by data dependence on ``status`` (a custom call such as attention that
takes it as an operand), or read the arena after the step.

``kv_write_fp8(k, v, new_k, new_v, slots, k_scale, v_scale, dest=None) -> (k, v)`` is
``kv_write`` into a float8_e4m3fn cache, quantizing float tokens on the device with one
scale per KV head (the format: jax_vmm/fp8.py).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.interpreters import batching

from ..base.ffi import register
from ..base.fp8 import FP8_STORAGE, quantize_fp8
from ..base.loader import core as _core
from ..cache.pytree import ArenaNotWrittenWarning, check_scale
from ..cache.registry import live_arenas
from ..memory.lookup import describe_buffer, find_view_buffer
from .stats import KVWriteStats

__all__ = [
    "KVDest",
    "kv_write_arrays",
    "check_write",
    "kv_write_fp8",
    "quantize_fp8",
    "kv_write_through",
    "kv_write_stats",
    "reset_kv_write_stats",
    "PADDING",
    "WRITTEN",
    "DROPPED_OUT_OF_RANGE",
    "DROPPED_UNBACKED",
    "DROPPED_NOT_ENSURED",
    "DROPPED_SHARED",
]

#: Per-token status codes returned by :func:`kv_write_through`.
PADDING, WRITTEN, DROPPED_OUT_OF_RANGE, DROPPED_UNBACKED, DROPPED_NOT_ENSURED = 0, 1, 2, 3, 4
#: ... and for a token in its sequence's read-only shared prefix (``kv.share_prefix``).
DROPPED_SHARED = 5

_WRITE_FP8 = "jax_vmm_kv_write_fp8"
_FP8_SOURCES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class _Targets:
    write: str = "jax_vmm_kv_write"
    through: str = "jax_vmm_kv_write_through"


#: The FFI targets the wrappers call. ``jax_vmm.testing.unchecked_kv_writes()`` and
#: ``address_only_dests()`` swap in the testing layer's variants for the duration of their
#: with-block (the one seam for those test hooks); nothing else should.
_targets = _Targets()


def _shape_dtype(x: Any, name: str) -> tuple[tuple[int, ...], np.dtype]:
    try:
        return tuple(x.shape), np.dtype(x.dtype)
    except AttributeError:
        raise TypeError(f"kv_write: {name} must be an array, got {type(x).__name__}") from None


def check_write(
    op: str, k: Any, v: Any, new_k: Any, new_v: Any, slots: Any, fp8: bool = False
) -> int:
    """Trace-time validation; returns the number of tokens n. fp8: the cache holds
    float8_e4m3fn (or uint8) and the new tokens a float type."""
    ks, kd = _shape_dtype(k, "k")
    vs, vd = _shape_dtype(v, "v")
    nks, nkd = _shape_dtype(new_k, "new_k")
    nvs, nvd = _shape_dtype(new_v, "new_v")
    ss, sd = _shape_dtype(slots, "slots")
    if len(ks) < 3:
        raise ValueError(
            f"{op}: k must be a KV-cache view of shape (..., num_kv_heads, head_dim) "
            f"with rank >= 3, e.g. kv.k[layer]; got shape {ks}"
        )
    if (ks, kd) != (vs, vd):
        raise ValueError(
            f"{op}: k and v must have the same shape and dtype; got k {ks} {kd} and v {vs} {vd}"
        )
    heads = ks[-2:]
    for name, s, d in (("new_k", nks, nkd), ("new_v", nvs, nvd)):
        if len(s) != 3 or s[1:] != heads:
            raise ValueError(
                f"{op}: {name} must have shape (n, {heads[0]}, {heads[1]}) to match "
                f"the cache {ks}; got {s}"
            )
        if fp8:
            if kd not in FP8_STORAGE:
                raise TypeError(
                    f"{op}: the cache must be float8_e4m3fn (or uint8 bits), got {kd}; "
                    f"use kv_write for other dtypes"
                )
            if d not in _FP8_SOURCES:
                raise TypeError(f"{op}: {name} must be float32, bfloat16 or float16, got {d}")
        elif d != kd and kd in FP8_STORAGE:
            # A cast would store unscaled values: fp8 caches quantize with their scales.
            raise TypeError(
                f"{op}: {name} has dtype {d} but the cache is fp8 ({kd}); write it with "
                "jax_vmm.kv_write(kv.cache()[layer], ...) (the arena's scales) or "
                "jax_vmm.kv_write_fp8(..., k_scale, v_scale), which quantize it"
            )
        elif d != kd:
            raise TypeError(
                f"{op}: {name} has dtype {d} but the cache holds {kd}; cast it with "
                f"{name}.astype({kd.name!r})"
            )
    if nks != nvs or nkd != nvd:
        raise ValueError(
            f"{op}: new_k {nks} {nkd} and new_v {nvs} {nvd} must have the same shape and dtype"
        )
    n = nks[0]
    if ss != (n,):
        raise ValueError(
            f"{op}: slots must have shape ({n},), one flat slot per new token; got {ss}"
        )
    if sd != np.dtype(np.int32):
        raise TypeError(
            f"{op}: slots must be int32 (flat slot = seq * max_tokens + position); got "
            f"{sd}; use slots.astype(jnp.int32)"
        )
    return n


@dataclasses.dataclass(frozen=True)
class KVDest:
    """Where a kv_write lands: one layer's K and V arena buffers, by uid (the identity,
    never reused) and address (checked to match).

    Static and hashable (it becomes attributes of the compiled custom call, and may be a
    ``static_argnums`` argument; dests of two arenas differ, so a step jitted over one is
    never reused for the other). Get it from :meth:`jax_vmm.KVArena.dest`. The handlers
    check at every host call that both uids still name buffers of an open arena, at these
    addresses; otherwise the call fails and writes nothing.
    """

    k_address: int
    v_address: int
    nbytes: int  # bytes of each of the two buffers
    k_uid: int
    v_uid: int


def _check_views_match_dest(op: str, k: Any, v: Any, dest: KVDest) -> None:
    """An eager call's concrete arena views must be the dest's own buffers."""
    for side, x, uid in (("k", k, dest.k_uid), ("v", v, dest.v_uid)):
        found = find_view_buffer(x, dest.nbytes)
        if found is not None and found["buffer_uid"] != uid:
            raise ValueError(
                f"{op}: {side} is a view of {describe_buffer(found['buffer_uid'])} but dest names "
                f"{describe_buffer(uid)}; pass dest=kv.dest(layer) of the layer whose views you "
                "write, or leave dest out in eager calls (it is found from the views)"
            )


#: Checks an eager call's views against its dest. The seam for
#: ``jax_vmm.testing.address_only_dests()``, which removes the check for its with-block;
#: nothing else should.
_verify_views = _check_views_match_dest


def _dest_attrs(op: str, k: Any, v: Any, dest: KVDest | None) -> dict:
    nbytes = int(np.prod(k.shape)) * np.dtype(k.dtype).itemsize
    if dest is None:
        kb, vb = find_view_buffer(k, nbytes), find_view_buffer(v, nbytes)
        if kb is None or vb is None:
            return _attrs(0, 0, 0, 0)
        return _attrs(kb["buffer_base"], vb["buffer_base"], kb["buffer_uid"], vb["buffer_uid"])
    if not isinstance(dest, KVDest):
        raise TypeError(
            f"{op}: dest must be a jax_vmm.KVDest from kv.dest(layer), got {type(dest).__name__}"
        )
    if dest.nbytes != nbytes:
        raise ValueError(
            f"{op}: dest names buffers of {dest.nbytes} bytes but the cache "
            f"{tuple(k.shape)} {np.dtype(k.dtype)} has {nbytes}; pass the dest of "
            f"the KV arena (and layer) whose views you write"
        )
    _verify_views(op, k, v, dest)
    return _attrs(dest.k_address, dest.v_address, dest.k_uid, dest.v_uid)


def _vmap_method(op: str, attrs: dict, operands: tuple) -> str | None:
    """Under vmap, a write into plain arrays is a pure function of them: one call per
    batch element ("sequential") is its meaning. A write into named arena buffers is a
    side effect on one cache, which a batch of calls cannot mean: refused here where the
    vmap is seen (an operand batched by it), else by JAX."""
    if not attrs["dest_k"] and not attrs["dest_v"]:
        return "sequential"
    if any(isinstance(x, batching.BatchTracer) for x in operands):
        raise ValueError(
            f"{op}: a write into a KV arena's buffers (dest=, or its views) under jax.vmap: "
            "the arena is one cache, not one per batch element. Write the batch's rows in "
            "one call (stack them into new_k/new_v and slots), or write through the cache "
            "API, jax_vmm.kv_write(kv.cache()[layer], ...), which vmap batches into one "
            "write"
        )
    return None


def _attrs(k_address: int, v_address: int, k_uid: int, v_uid: int) -> dict:
    return {
        "dest_k": np.uint64(k_address),
        "dest_v": np.uint64(v_address),
        "dest_k_uid": np.uint64(k_uid),
        "dest_v_uid": np.uint64(v_uid),
    }


def _warn_if_arena_not_written(op: str, k: Any, dest: KVDest | None) -> None:
    """Inside jit, an array-level write without dest on arrays shaped like a live KV
    arena's layer writes XLA's copy, not the arena (unless donated on a GPU): say so."""
    if dest is not None or not isinstance(k, jax.core.Tracer):
        return
    shape, dtype = tuple(k.shape), np.dtype(k.dtype)
    for kv in live_arenas():
        if kv.layer_shape == shape and kv.dtype == dtype:
            warnings.warn(
                ArenaNotWrittenWarning(
                    f"{op} inside jit on a cache shaped like a layer of a live KV arena "
                    f"({shape} {dtype}) without dest=: XLA hands the call its own copy "
                    "(always on the CPU, on a GPU unless the cache is donated), so the arena "
                    "is NOT written and a later read of it misses these tokens. Use the "
                    "cache API: cache = kv.cache(); layer = jax_vmm.kv_write(cache[l], new_k, "
                    "new_v, slots); or pass dest=kv.dest(l)"
                ),
                stacklevel=4,
            )
            return


def kv_write_arrays(
    k: jax.Array,
    v: jax.Array,
    new_k: jax.Array,
    new_v: jax.Array,
    slots: jax.Array,
    *,
    dest: KVDest | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The array form of :func:`kv_write`.

    Returns ``(k, v)`` with the tokens written (dropped slots excepted); use them in place
    of the inputs. With ``dest`` (``kv.dest(l)``) the arena buffers are written whatever
    XLA hands the call; found automatically when ``k``/``v`` are concrete arena views.
    Donate the cache on a GPU for an in-place update without any copy.
    """
    n = check_write("kv_write", k, v, new_k, new_v, slots)
    attrs = _dest_attrs("kv_write", k, v, dest)
    _warn_if_arena_not_written("kv_write", k, dest)
    if n == 0:
        return k, v
    register()
    out = jax.ffi.ffi_call(
        _targets.write,
        (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        input_output_aliases={0: 0, 1: 1},
        has_side_effect=True,
        vmap_method=_vmap_method("kv_write", attrs, (k, v, new_k, new_v, slots)),
    )(k, v, new_k, new_v, slots, **attrs)
    return out[0], out[1]


def kv_write_fp8(
    k: jax.Array,
    v: jax.Array,
    new_k: jax.Array,
    new_v: jax.Array,
    slots: jax.Array,
    k_scale: jax.Array,
    v_scale: jax.Array,
    *,
    dest: KVDest | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`kv_write` into an fp8 cache: quantizes on the device.

    Args:
      k, v: the fp8 cache ``(..., H, D)``: float8_e4m3fn (``kv_arena(...,
        dtype=jnp.float8_e4m3fn)`` views), or uint8 holding its bits.
      new_k, new_v: ``(n, H, D)`` float32, bfloat16 or float16 tokens (one dtype).
      slots, dest: as for :func:`kv_write`.
      k_scale, v_scale: float32 ``(H,)``: the cache holds ``fp8(x * (1 / scale[h]))``
        (round to nearest even, saturated to +-448, NaN kept: :func:`quantize_fp8`), and
        ``decode_attention(q, k, v, lengths, k_scale=..., v_scale=...)`` reads
        ``fp8 * scale[h]``. Device arrays, so they may change between steps without a
        recompile. Into a KV arena's buffers they are yours to keep: the arena's cache
        API (``kv.cache()``) reads with the arena's own scales, ``kv.scales(layer)``, so
        pass those where it reads the tokens. A scale must be finite and at least
        float32's smallest normal (checked when concrete).

    Returns the updated ``(k, v)``, like :func:`kv_write` (validation, status and drop
    counting identical; the CUDA handler needs head_dim a multiple of 8).
    """
    n = check_write("kv_write_fp8", k, v, new_k, new_v, slots, fp8=True)
    ks, vs = jnp.asarray(k_scale), jnp.asarray(v_scale)
    H = k.shape[-2]
    for name, x in (("k_scale", ks), ("v_scale", vs)):
        check_scale(x, H, f"kv_write_fp8: {name}")
    attrs = _dest_attrs("kv_write_fp8", k, v, dest)
    _warn_if_arena_not_written("kv_write_fp8", k, dest)
    if n == 0:
        return k, v
    register()
    out = jax.ffi.ffi_call(
        _WRITE_FP8,
        (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        input_output_aliases={0: 0, 1: 1},
        has_side_effect=True,  # as kv_write: an unused result must still write the arena
        vmap_method=_vmap_method("kv_write_fp8", attrs, (k, v, new_k, new_v, slots, ks, vs)),
    )(k, v, new_k, new_v, slots, ks, vs, **attrs)
    return out[0], out[1]


def kv_write_through(
    k: jax.Array,
    v: jax.Array,
    new_k: jax.Array,
    new_v: jax.Array,
    slots: jax.Array,
    *,
    dest: KVDest | None = None,
) -> jax.Array:
    """Write ``n`` tokens straight into the arena buffers of ``k``/``v``.

    Same arguments as :func:`kv_write`. Without ``dest``, ``k``/``v`` must be arena memory
    when the program runs (jit arguments that no other op updates; on CPU not donated),
    otherwise the call fails with an error saying so. Returns the ``(2, n)`` int32 status
    (see :data:`WRITTEN` and friends). The call runs even when the status is unused (it
    has a side effect); feed the status to the op that reads the cache next to order that
    read after the write.
    """
    n = check_write("kv_write_through", k, v, new_k, new_v, slots)
    attrs = _dest_attrs("kv_write_through", k, v, dest)
    if n == 0:
        return jnp.zeros((2, 0), jnp.int32)
    register()
    return jax.ffi.ffi_call(
        _targets.through, jax.ShapeDtypeStruct((2, n), jnp.int32), has_side_effect=True
    )(k, v, new_k, new_v, slots, require_arena=True, **attrs)


def kv_write_stats() -> KVWriteStats:
    """Counters of the kv_write handlers.

    ``{"kv_write_through": {...}, "kv_write": {...}, "kv_cache_write": {...},
    "dropped_writes": int}`` (``kv_cache_write``: kv_write on KVCache layers); each
    handler has ``calls`` and ``captured_calls`` (host invocations, and those made while
    XLA captured a CUDA graph; graph replays run no host code and are not counted),
    ``alias_misses`` (kv_write's output was not arena memory: the tokens went into an XLA
    copy) and ``non_arena`` (the write-through operand was not arena memory).
    ``dropped_writes`` counts dropped token writes per buffer side on the host and the
    devices (reading it waits for the devices).
    """
    return _core.kv_write_stats()


def reset_kv_write_stats() -> None:
    """Zero every kv_write counter (waits for the devices)."""
    _core.kv_write_reset_stats()
