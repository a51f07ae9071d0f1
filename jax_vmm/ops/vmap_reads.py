"""A read of an arena layer in the same ``vmap`` as a batched ``kv_write`` of it: refused.

vmap turns a function of one cache into one of a batch of caches. An array cache is
copied per element, so each element reads its own write. An arena layer is one memory:
the batched write lands every element's tokens (one after another) before the read, so
every element would read every element's writes, a silent difference from the array
cache's result.

The check sits in the batching rules, so that it sees what vmap sees wherever the write
and the read were traced: directly in the vmapped function, or in a ``jit``,
``checkpoint``, ``cond`` branch, loop body or inner vmap nested in it (JAX batches those
bodies with the same rules and the vmap's own ``AxisData`` object). The write's rule
(ops/cache_write.py) notes its layer under the vmap's ``AxisData``; every cache read
passes the layer's token through :data:`read_fence_p`, an identity whose rule refuses a
layer noted under the same ``AxisData``. Each call of a vmapped function makes its own
``AxisData``, so a layer returned from one vmap (``out_axes=None``) and read in another,
or after it, is not refused: all its writes have landed by then.

Not seen: a write and a read in two separately jitted functions whose batched forms JAX
takes from its cache (``_batch_jaxpr2`` is keyed by the vmap's size, not by the vmap), and
a loop body that reads before it writes (it reads the previous iteration's batched
writes) unless JAX batches the body twice.
"""

from __future__ import annotations

import collections
from typing import Any

from jax._src import core as jax_core
from jax._src.interpreters import batching
from jax.extend.core import Primitive
from jax.interpreters import mlir

from ..cache.pytree import KVLayer

#: How many vmaps' notes are kept (each holds its AxisData alive, so its id stays unique).
_MAX_VMAPS = 64

#: id(AxisData) -> (the AxisData, {(cache_uid, layer) written by a batched kv_write}).
_batched_writes: collections.OrderedDict[int, tuple[Any, set]] = collections.OrderedDict()


def note_batched_write(axis_data: Any, layer_key: tuple[int, int]) -> None:
    """Called by the write's batching rule when the vmap of ``axis_data`` batches it."""
    entry = _batched_writes.get(id(axis_data))
    if entry is None or entry[0] is not axis_data:
        entry = (axis_data, set())
        _batched_writes[id(axis_data)] = entry
    _batched_writes.move_to_end(id(axis_data))
    entry[1].add(layer_key)
    while len(_batched_writes) > _MAX_VMAPS:
        _batched_writes.popitem(last=False)


def refuse_read(axis_data: Any, layer_key: tuple[int, int], op: str, label: str) -> None:
    """Raise if the vmap of ``axis_data`` batched a kv_write of ``layer_key``."""
    entry = _batched_writes.get(id(axis_data))
    if entry is None or entry[0] is not axis_data or layer_key not in entry[1]:
        return
    raise ValueError(
        f"{op}: {label} was written by a kv_write batched by this same vmap. The arena is "
        "one cache, not a copy per batch element as an array cache is, so every element's "
        "read would see every element's writes. Return the layer from the vmap "
        "(in_axes/out_axes None for the cache) and read it after, or write and read one "
        "element at a time in a loop (docs/kv_cache.md, vmap)"
    )


#: The token on its way into a cache read: the identity, seen by vmap's batching.
read_fence_p = Primitive("jax_vmm_read_fence")
read_fence_p.def_impl(lambda token, **_: token)
read_fence_p.def_abstract_eval(lambda token, **_: token)
mlir.register_lowering(read_fence_p, lambda ctx, token, **_: [token])


def _fence_batching_rule(axis_data: Any, args: tuple, dims: tuple, **params: Any):
    refuse_read(axis_data, params["layer_key"], params["op"], params["label"])
    # Bound again one level down, where an enclosing vmap checks it in turn.
    return read_fence_p.bind(args[0], **params), dims[0]


batching.fancy_primitive_batchers[read_fence_p] = _fence_batching_rule


def fenced(layer: KVLayer, op: str) -> KVLayer:
    """``layer`` (an arena layer) with its token passed through the read fence for ``op``;
    outside any transformation the layer itself."""
    if isinstance(jax_core.trace_ctx.trace, jax_core.EvalTrace):
        return layer
    lid = layer.id
    token = read_fence_p.bind(
        layer.token, layer_key=(lid.cache_uid, lid.layer), op=op, label=lid.describe()
    )
    return KVLayer._arena(lid, token, tuple(layer._leaves[1:]))
