"""The run-time check of ``jax_vmm.ordered_views`` as its own JAX primitive: a custom call
XLA never removes and JAX never drops, with no JAX effect, so that a step reading arena
views with plain XLA ops (cuDNN attention, say) keeps JAX's fast dispatch path.

Why not ``jax.ffi.ffi_call(..., has_side_effect=True)``: that gives the call a JAX effect,
and any computation with an effect is dispatched through JAX's slow Python path (see
ops/cache_write.py for the JAX source lines). The check's two needs are met otherwise:

* XLA must not remove it although nothing uses its result: the custom call is lowered
  with ``has_side_effect=True`` (an HLO attribute, not a JAX effect).
* JAX's dead-code elimination must not drop it: its DCE rule keeps it always.

Unlike a write, nothing has to wait for the check: it runs on the host when XLA runs (or,
on a GPU, records) the call, and a failure fails that execution of the step. Its s32
result carries no value (the CUDA handler enqueues no device work for it) and is never
read. On a GPU it lowers to the check's recorded variant where XLA's FFI record stage is
registered (``base/record_stages.py``): no node in the step's command buffer.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import core as _jcore
from jax._src import dispatch as _dispatch
from jax._src.interpreters import batching
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.interpreters import partial_eval as pe

from ..base import record_stages

__all__ = ["check_views"]

check_views_p = Primitive("jax_vmm_kv_cache_check_views")


def check_views(target: str, k: Any, v: Any, token: Any, attrs: dict) -> None:
    """Bind the check of the views ``k``, ``v`` of the layer that ``attrs`` names
    (``cache_uid``, ``layer``), ordered after the writes behind ``token``."""
    check_views_p.bind(
        k,
        v,
        token,
        target=target,
        recorded=record_stages.use_recorded(target),
        attrs=tuple(sorted(attrs.items())),
    )


def _abstract_eval(*avals: Any, **_: Any):
    _jcore.standard_vma_rule("jax_vmm_kv_cache_check_views", *avals)  # as ffi_call checks
    out = _jcore.ShapedArray((), jnp.dtype(jnp.int32))
    return out.update(sharding=_jcore.get_cur_mesh_sharding())


check_views_p.def_abstract_eval(_abstract_eval)
check_views_p.def_impl(functools.partial(_dispatch.apply_primitive, check_views_p))


def _lowering(ctx: Any, *operands: Any, target: str, recorded: bool, attrs: tuple):
    del recorded  # the CPU has no record stage
    rule = jax.ffi.ffi_lowering(target, has_side_effect=True)
    return rule(ctx, *operands, **dict(attrs))


def _cuda_lowering(ctx: Any, *operands: Any, target: str, recorded: bool, attrs: tuple):
    """On a GPU the check's recorded variant where the call was traced with it: in a
    command buffer it adds no node and re-traces nothing at an update
    (base/record_stages.py)."""
    name = record_stages.target_for(target, recorded)
    return _lowering(ctx, *operands, target=name, recorded=False, attrs=attrs)


mlir.register_lowering(check_views_p, _lowering)
mlir.register_lowering(check_views_p, _cuda_lowering, platform="cuda")


def _dce_rule(used_outputs: list[bool], eqn: Any):
    """Never drop the check: its result is never used, the reads it guards are."""
    del used_outputs
    return [True] * len(eqn.invars), eqn


pe.dce_rules[check_views_p] = _dce_rule


def _batching_rule(args: tuple, dims: tuple, **params: Any):
    """Called only when vmap maps the views or the token: one layer has one pair of views."""
    raise NotImplementedError(
        "jax_vmm.ordered_views: vmap over the layer or its views is not supported; pass "
        "the layer and kv.k[l], kv.v[l] unbatched (in_axes=None)"
    )


batching.primitive_batchers[check_views_p] = _batching_rule
