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

Three hooks on JAX's batching keep this exact:

* JAX caches a batched body (``_batch_jaxpr2``, ``_batch_jaxpr_axes``) by the vmap's
  size, not by the vmap, and a cached body runs no rule: a body that holds a write or a
  read of ours is evicted before and after it is batched, under one lock (the caches
  are shared by threads), so its rules run in every vmap.
* A body's notes reach the eqns after it. Only one branch of a ``cond`` runs, so a
  branch does not see its sibling's notes, and a loop body batched twice (JAX's
  fixed point over the carry) does not see its first pass's.
* In a loop body a layer both read and written by the vmap is refused whatever the
  order: from the second iteration on, the read sees the batched writes of the last.

Notes live per thread (a trace runs on one thread) and per scope; a scope looks up its
enclosing scopes' notes, it does not copy them.

Not seen: a write of a sharded arena's layer under ``vmap(..., spmd_axis_name=...)``: its
``shard_map`` batches the write with an AxisData of its own, so the read after it outside
the ``shard_map`` does not find its note. On jax 0.10.2 JAX itself refused such a vmap in
every layout tried (the spmd axis the arena's, another axis of its mesh: "vmap
spmd_axis_name cannot appear in shard_map in_specs"; an axis outside its mesh: KeyError).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from typing import Any

from jax._src import core as jax_core
from jax._src.interpreters import batching
from jax.extend.core import Primitive
from jax.interpreters import mlir

from ..cache.pytree import KVLayer

try:  # where jax 0.10 and 0.11 keep them; without them _install warns of a weaker check
    from jax._src.lax.control_flow.conditionals import cond_p
    from jax._src.lax.control_flow.loops import scan_p, while_p
except ImportError:
    cond_p = scan_p = while_p = None

#: How many vmaps' notes one scope keeps.
_MAX_VMAPS = 4096

#: The primitives whose batching rules keep the notes: the arena write and the read fence.
_OURS = frozenset({"jax_vmm_kv_cache_write", "jax_vmm_read_fence"})


class _Scope:
    """The notes made at one level of batching: ``own`` maps id(AxisData) to the AxisData
    (kept alive, so the id stays its own) and the layers its vmap wrote here; a lookup
    also sees the enclosing scopes' (``parent``). ``pending`` holds what nested bodies
    wrote, merged at the next eqn; ``loop_reads`` (a loop body's scope and those inside
    it) the layers read there."""

    def __init__(self, parent: _Scope | None = None, loop_reads: set | None = None):
        self.parent = parent
        self.own: dict[int, tuple[Any, set]] = {}
        self.pending: list[dict[int, tuple[Any, set]]] = []
        self.loop_reads = loop_reads
        self.siblings = 0  # > 0 while a cond's branches (or a loop's passes) are batched

    def note(self, axis_data: Any, layers: set) -> None:
        key = id(axis_data)
        entry = self.own.pop(key, None)  # re-inserted last: the cap drops the oldest
        if entry is None or entry[0] is not axis_data:
            entry = (axis_data, set())
        entry[1].update(layers)
        self.own[key] = entry
        # Finished vmaps' notes are never looked up again; past this many the one written
        # longest ago goes (only so many writing vmaps nested in a live one could lose it).
        while len(self.own) > _MAX_VMAPS:
            del self.own[next(iter(self.own))]

    def settle(self) -> None:
        for delta in self.pending:
            for axis_data, layers in delta.values():
                self.note(axis_data, layers)
        self.pending.clear()

    def wrote(self, axis_data: Any, layer_key: tuple[int, int]) -> bool:
        scope: _Scope | None = self
        while scope is not None:
            entry = scope.own.get(id(axis_data))
            if entry is not None and entry[0] is axis_data and layer_key in entry[1]:
                return True
            scope = scope.parent
        return False


class _State(threading.local):
    def __init__(self) -> None:
        self.scopes = [_Scope()]
        self.loop_batcher = False  # a loop's batching rule is running: its bodies are loops
        self.loop_reads: set | None = None  # the layers read in that loop's bodies


_state = _State()


def _scope() -> _Scope:
    scope = _state.scopes[-1]
    if not scope.siblings:
        scope.settle()
    return scope


def note_batched_write(axis_data: Any, layer_key: tuple[int, int], label: str) -> None:
    """Called by the write's batching rule when the vmap of ``axis_data`` batches it."""
    scope = _scope()
    if scope.loop_reads is not None and (id(axis_data), layer_key) in scope.loop_reads:
        refuse_loop_write(label)
    scope.note(axis_data, {layer_key})


def refuse_loop_write(label: str) -> None:
    raise ValueError(
        f"kv_write: {label} is read and then written in a loop body batched by one vmap: "
        "from the second iteration on, every element's read would see every element's "
        "writes of the iteration before (the arena is one cache, not a copy per batch "
        "element). Loop over the batch elements instead, or move the loop out of the "
        "vmap (docs/kv_cache.md, vmap)"
    )


def refuse_read(axis_data: Any, layer_key: tuple[int, int], op: str, label: str) -> None:
    """Raise if the vmap of ``axis_data`` batched a kv_write of ``layer_key`` before."""
    scope = _scope()
    if scope.loop_reads is not None:
        scope.loop_reads.add((id(axis_data), layer_key))
    if not scope.wrote(axis_data, layer_key):
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


# -- the hooks on JAX's batching ------------------------------------------------------------


def _holds_ours(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` (a Jaxpr) or a body inside it binds a write or a read fence."""
    try:
        return _holds_ours_memo[jaxpr]
    except (KeyError, TypeError):
        pass
    found = any(e.primitive.name in _OURS for e in jaxpr.eqns) or any(
        _holds_ours(sub) for sub in jax_core.subjaxprs(jaxpr)
    )
    with contextlib.suppress(TypeError):
        _holds_ours_memo[jaxpr] = found
    return found


_holds_ours_memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


#: Held while a body of ours is batched: JAX's caches are shared by threads and keyed by
#: value (a same-size vmap elsewhere has an equal key), so no other thread may store or
#: find a batched body of ours between the eviction and the rules running.
_batching_lock = threading.RLock()


def _scoped_batching(cached: Any) -> Any:
    """``cached`` (one of JAX's cached jaxpr batchers), re-run for a body of ours (its
    rules must run in this vmap) in a scope of its own, and never left in the cache."""
    evict = getattr(cached, "evict_weakref", None)

    def forget(closed_jaxpr: Any) -> None:
        if evict is not None:
            evict(closed_jaxpr)
        else:
            cached.cache_clear()

    def batch(closed_jaxpr: Any, *args: Any) -> Any:
        if not _holds_ours(getattr(closed_jaxpr, "jaxpr", closed_jaxpr)):
            return cached(closed_jaxpr, *args)
        with _batching_lock:
            forget(closed_jaxpr)
            parent = _scope()
            child = _Scope(parent, _state.loop_reads if _state.loop_batcher else parent.loop_reads)
            loop_batcher, _state.loop_batcher = _state.loop_batcher, False
            _state.scopes.append(child)
            try:
                return cached(closed_jaxpr, *args)
            finally:
                _state.scopes.pop()
                _state.loop_batcher = loop_batcher
                child.settle()
                forget(closed_jaxpr)
                parent.pending.append(child.own)

    batch.__wrapped__ = cached
    return batch


def _sibling_bodies(rule: Any, loop: bool) -> Any:
    """A control-flow primitive's batching rule whose bodies (a cond's branches, a loop's
    fixed-point passes) do not see each other's notes; all reach the eqns after it."""

    def batch(*args: Any, **params: Any) -> Any:
        scope = _scope()
        scope.siblings += 1
        loop_batcher, _state.loop_batcher = _state.loop_batcher, loop
        # One set for the loop's bodies (a while's cond reads what its body wrote).
        loop_reads, _state.loop_reads = _state.loop_reads, set() if loop else _state.loop_reads
        try:
            return rule(*args, **params)
        finally:
            _state.loop_batcher = loop_batcher
            _state.loop_reads = loop_reads
            scope.siblings -= 1
            if not scope.siblings:
                scope.settle()

    batch.__wrapped__ = rule
    return batch


def _install() -> None:
    """The hooks, where this JAX has what they wrap (jax 0.10 and 0.11 do); without one,
    a warning says which check is weaker, and importing jax_vmm still works."""
    missing = []
    for name in ("_batch_jaxpr2", "_batch_jaxpr_axes"):
        cached = getattr(batching, name, None)
        if cached is None:
            missing.append(f"batching.{name}")
        elif not hasattr(cached, "__wrapped__"):
            setattr(batching, name, _scoped_batching(cached))
    if cond_p is None:
        missing.append("cond_p, scan_p, while_p")
    else:
        rules = batching.fancy_primitive_batchers
        for prim, loop in ((cond_p, False), (scan_p, True), (while_p, True)):
            if prim not in rules:
                missing.append(f"the batching rule of {prim}")
            elif not hasattr(rules[prim], "__wrapped__"):
                rules[prim] = _sibling_bodies(rules[prim], loop)
    if missing:
        warnings.warn(
            f"jax_vmm: this JAX lacks {', '.join(missing)}; the refusal of a cache read after "
            "a kv_write batched by the same vmap may miss reads in cached or sibling bodies "
            "(docs/kv_cache.md, vmap)",
            stacklevel=2,
        )


_install()
