"""``jax_vmm.kv_write``: the one entry point of a KV-cache write. A :class:`~jax_vmm.KVLayer`
goes to the layer ops (``layer_ops``, or ``sharded_ops`` for a sharded arena's layer),
arrays to the array-level custom calls (``array_writes``)."""

from __future__ import annotations

from typing import Any

from ..cache.pytree import KVLayer
from . import layer_ops, sharded_ops
from .array_writes import KVDest, kv_write_arrays

__all__ = ["kv_write"]


def kv_write(cache: Any, *args: Any, dest: KVDest | None = None) -> Any:
    """Write ``n`` tokens into a KV cache. Two forms:

    ``kv_write(layer, new_k, new_v, slots) -> KVLayer`` (the cache API): ``layer`` is a
    :class:`~jax_vmm.KVLayer` (``cache[l]`` of ``kv.cache()``, or an array layer). For an
    arena layer the arena holds the tokens when the call returns (eager) or runs (inside
    ``jit``, donated or not, CPU or GPU, in any loop): one custom call finds the arena
    buffers by the layer's static identity, nothing is copied, and the returned layer's
    token orders every later read of it (``decode_attention(q, layer, lengths)``) after
    the write. An fp8 arena layer quantizes float tokens with its scales. For an array
    layer it is a checked functional scatter. Put the result back with
    ``cache.replace(l, layer)``.

    ``kv_write(k, v, new_k, new_v, slots, dest=None) -> (k, v)`` (array level, for power
    users): ``k``, ``v`` are arrays (or arena views ``kv.k[l]``, ``kv.v[l]``), seen as
    ``(num_slots, H, D)``; returns them updated. Inside ``jit`` the arena is written only
    with ``dest=kv.dest(l)`` (or with the cache donated on a GPU): without it, a call on
    arrays shaped like a live KV arena's layer warns (:class:`~jax_vmm.ArenaNotWrittenWarning`).

    Common arguments: ``new_k``, ``new_v``: ``(n, H, D)`` in the cache's dtype (fp8:
    float32/bfloat16/float16); ``slots``: int32 ``(n,)``, flat slot ``seq * max_tokens +
    position``; negative slots are skipped. A slot out of range, on a page not committed,
    or past the tokens its sequence ensured (``kv.ensure``) is not written and is counted:
    ``kv.check()`` raises :class:`~jax_vmm.OutOfBoundsWrite`.
    """
    if isinstance(cache, KVLayer):
        if dest is not None:
            raise TypeError(
                "kv_write(layer, ...): a KVLayer names its arena itself; dest= is for the "
                "array form kv_write(k, v, new_k, new_v, slots, dest=kv.dest(l))"
            )
        if len(args) != 3:
            raise TypeError(
                f"kv_write(layer, new_k, new_v, slots) takes 3 arguments after the layer, got "
                f"{len(args)}"
            )
        write = sharded_ops.write if cache.is_arena and cache.id.sharded else layer_ops.write
        return write(cache, *args)
    if len(args) != 4:
        raise TypeError(
            "kv_write takes (layer, new_k, new_v, slots) or (k, v, new_k, new_v, slots, "
            f"dest=...); got {1 + len(args)} positional arguments"
        )
    return kv_write_arrays(cache, *args, dest=dest)
