"""A read of an arena layer in the same ``vmap`` as a batched ``kv_write`` of it: refused.

vmap turns a function of one cache into one of a batch of caches. An array cache is
copied per element, so each element reads its own write. An arena layer is one memory:
the batched write lands every element's tokens (one after another) before the read, so
every element would read every element's writes, a silent difference from the array
cache's result. ``kv_write`` marks the layer it returns with the vmap that batched it;
the cache reads (``checked_arena_layer``) refuse such a layer while that vmap is still
tracing. A layer returned from the vmap and read after it is not refused: all writes
have landed by then, as an array cache with ``out_axes=None`` would say.

Not seen: a read inside a ``jit``, ``checkpoint``, ``cond``, loop body or inner vmap
nested in the vmap: such a body is traced on its own (its trace is not the vmap's, and
the layer crosses into it as a fresh object); docs/kv_cache.md says so.
"""

from __future__ import annotations

import weakref
from typing import Any

from jax._src import core as jax_core
from jax._src.interpreters import batching

from ..cache.pytree import KVLayer


def note_write(layer: KVLayer, operands: tuple) -> KVLayer:
    """Mark ``layer`` (what a kv_write returned) when the current vmap batches one of the
    write's operands."""
    trace = jax_core.trace_ctx.trace
    if isinstance(trace, batching.BatchTrace) and any(
        isinstance(x, batching.BatchTracer) and x._trace is trace for x in operands
    ):
        layer._vmap_writer = weakref.ref(trace)
    return layer


def refuse_read(layer: KVLayer, op: str) -> None:
    """Raise if ``layer`` was written by a kv_write batched by the vmap now tracing."""
    writer: Any = layer._vmap_writer
    if writer is None or writer() is not jax_core.trace_ctx.trace:
        return
    raise ValueError(
        f"{op}: {layer.id.describe()} was written by a kv_write batched by this same vmap. "
        "The arena is one cache, not a copy per batch element as an array cache is, so "
        "every element's read would see every element's writes. Return the layer from the "
        "vmap (in_axes/out_axes None for the cache) and read it after, or write and read "
        "one element at a time in a loop (docs/kv_cache.md, vmap)"
    )
