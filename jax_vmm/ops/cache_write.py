"""The arena-layer write as its own JAX primitive: a custom call XLA never removes that
leaves JAX's fast dispatch path open.

Why not ``jax.ffi.ffi_call(..., has_side_effect=True)``: that gives the call a JAX effect,
and JAX dispatches any computation with an effect (ordered or not) through its slow
Python path. jax 0.10.2, ``_src/pjit.py`` ``_get_fastpath_data`` refuses the C++ fast
path when ``executable.unsafe_call.ordered_effects or .has_unordered_effects``, and
``_src/interpreters/pxla.py`` (``_cached_lowering_to_hlo``) counts every effect of the
jaxpr not in ``effects.ordered_effects`` as unordered; there is no effect the fast path
allows (RefEffect is refused separately). A decode step with a write cost ~25x the
dispatch of the same step without it.

So the write primitive here has no JAX effect, and the other two jobs of the effect are
done otherwise:

* XLA must not remove it: the custom call is lowered with ``has_side_effect=True`` (an
  HLO attribute; the HLO is the one ``ffi_call`` made), and JAX's own dead-code
  elimination keeps it through a DCE rule that never drops it.
* ``kv.check()`` must wait for it: the step returns the cache, whose tokens chain every
  write after the previous one; the cache pytree notes each concrete token it is rebuilt
  with (cache/pytree.py), and ``kv.check()`` waits for those.

A write whose token is not used (the step does not return the cache: the forgotten
argument) would escape both: the DCE rule sees it and gives that one write the JAX effect
back (``jax.effects_barrier()``, hence ``kv.check()``, waits for it; that step takes the
slow path) and warns (:class:`~jax_vmm.KVWriteResultUnusedWarning`): nothing orders a
later read after such a write.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import core as _jcore
from jax._src import dispatch as _dispatch
from jax._src.ffi import _FfiEffect  # the effect ffi_call(has_side_effect=True) carries
from jax._src.interpreters import batching
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.interpreters import partial_eval as pe

from ..cache.pytree import KVWriteResultUnusedWarning
from . import vmap_reads

__all__ = ["write_token"]

#: How a batching rule marks an operand or result vmap does not map.
_NOT_MAPPED = None

#: The operand the returned token aliases: (new_k, new_v, index, token, *scales).
_TOKEN_OPERAND = 3

kv_cache_write_p = Primitive("jax_vmm_kv_cache_write")


def write_token(
    target: str, operands: tuple, attrs: dict, *, effectful: bool = False, label: str = ""
) -> Any:
    """Bind the write: ``target`` (an FFI target), ``operands`` ``(new_k, new_v, index,
    token, *scales)``, ``attrs`` its static attributes; returns the new int32 token.
    ``effectful``: carry the JAX effect anyway (a sharded arena's write, whose
    ``shard_map`` JAX would drop whole if its token went unused); ``label`` names the
    layer in the warning."""
    return kv_cache_write_p.bind(
        *operands,
        target=target,
        attrs=tuple(sorted(attrs.items())),
        effectful=bool(effectful),
        label=label,
    )


def _abstract_eval(*avals: Any, effectful: bool, **_: Any):
    _jcore.standard_vma_rule("jax_vmm_kv_cache_write", *avals)  # as ffi_call checks
    out = _jcore.ShapedArray((), jnp.dtype(jnp.int32))
    out = out.update(sharding=_jcore.get_cur_mesh_sharding())
    return out, ({_FfiEffect} if effectful else _jcore.no_effects)


kv_cache_write_p.def_effectful_abstract_eval(_abstract_eval)


# Eager: compiled once per parameters and cached, as JAX runs any primitive.
kv_cache_write_p.def_impl(functools.partial(_dispatch.apply_primitive, kv_cache_write_p))


def _lowering(ctx: Any, *operands: Any, target: str, attrs: tuple, **_: Any):
    rule = jax.ffi.ffi_lowering(
        target, operand_output_aliases={_TOKEN_OPERAND: 0}, has_side_effect=True
    )
    return rule(ctx, *operands, **dict(attrs))


mlir.register_lowering(kv_cache_write_p, _lowering)


def _dce_rule(used_outputs: list[bool], eqn: Any):
    """Never drop the write. Its token unused: carry the effect (see the module docstring)."""
    keep = [True] * len(eqn.invars)
    if used_outputs[0] or eqn.params["effectful"]:
        return keep, eqn
    warnings.warn(
        KVWriteResultUnusedWarning(
            f"a jax_vmm.kv_write on {eqn.params['label'] or 'an arena layer'} inside jit "
            "returns a layer that nothing uses (the step does not return the cache?). The "
            "write still runs and kv.check() waits for it, but nothing orders a later read "
            "after it, and this step leaves JAX's fast dispatch path. Put the layer back "
            "(cache = cache.replace(l, layer)) and return the cache from the step"
        ),
        stacklevel=2,
    )
    params = dict(eqn.params, effectful=True)
    return keep, eqn.replace(params=params, effects={_FfiEffect})


pe.dce_rules[kv_cache_write_p] = _dce_rule


def _batching_rule(axis_data: Any, args: tuple, dims: tuple, **params: Any):
    """vmap over the new tokens: the writes run one after another, each ordered after the
    last by the token (which stays unbatched: one layer). The layer is noted as written by
    this vmap, whose reads of it are refused (ops/vmap_reads.py)."""
    if all(d is _NOT_MAPPED for d in dims):  # an unbatched write inside the vmap: one write
        return kv_cache_write_p.bind(*args, **params), _NOT_MAPPED
    if dims[_TOKEN_OPERAND] is not _NOT_MAPPED:
        raise NotImplementedError(
            "jax_vmm.kv_write: the layer's token is batched: either the cache itself was "
            "vmapped (not supported: vmap over the new tokens with the cache unbatched, "
            "in_axes=None), or the write sits in a lax.cond/switch/while_loop whose "
            "predicate is batched (vmap runs every branch and batches all their operands, "
            "the token too): write outside such a branch"
        )
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not _NOT_MAPPED)
    moved = [None if d is _NOT_MAPPED else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]

    def body(token: Any, xs: tuple) -> tuple:
        ops = [a if x is None else x for a, x in zip(args, xs)]
        ops[_TOKEN_OPERAND] = token
        return kv_cache_write_p.bind(*ops, **params), None

    token, _ = jax.lax.scan(body, args[_TOKEN_OPERAND], tuple(moved), length=size)
    attrs = dict(params["attrs"])
    vmap_reads.note_batched_write(
        axis_data, (int(attrs["cache_uid"]), int(attrs["layer"])), params["label"] or "a layer"
    )
    return token, _NOT_MAPPED


batching.fancy_primitive_batchers[kv_cache_write_p] = _batching_rule
