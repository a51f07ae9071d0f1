"""``jax_vmm.kv_arena``: makes a :class:`~jax_vmm.KVArena`, or with ``sharding=`` a
:class:`~jax_vmm.ShardedKVArena`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .arena import KVArena
from .sharded import ShardedKVArena

__all__ = ["kv_arena"]


def kv_arena(
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    max_tokens: int,
    dtype: Any = jnp.bfloat16,
    device: jax.Device | None = None,
    initial_tokens: int = 0,
    max_seqs: int | None = None,
    chunk_bytes: int | None = None,
    handle_bytes: int | None = None,
    zero_fill: bool = False,
    commit_ahead_tokens: int | None = None,
    k_scales: Any = None,
    v_scales: Any = None,
    sharding: Any = None,
    budget: Any = None,
    name: str | None = None,
    layout: str = "per_layer",
) -> KVArena | ShardedKVArena:
    """Create a :class:`KVArena`: K/V buffers for every layer in one reserved range.

    ``sharding=jax.sharding.NamedSharding(mesh, spec)`` (``spec`` over the layer shape
    ``(max_seqs, max_tokens, num_kv_heads, head_dim)``, splitting the sequences and/or the
    KV heads): a :class:`~jax_vmm.ShardedKVArena`, one arena per device of the
    mesh (see docs/sharding.md); ``device`` must then be None.

    An fp8 arena (``dtype=jnp.float8_e4m3fn``) holds ``k_scales``, ``v_scales``: float32
    ``(num_layers, num_kv_heads)``, the per-layer, per-KV-head scales its tokens are
    quantized with (default 1.0; see docs/kv_cache.md for choosing them). Its cache
    layers carry them: ``kv_write(layer, ...)`` quantizes float tokens, and
    ``decode_attention(q, layer, lengths)`` dequantizes.

    ``budget``: a :class:`~jax_vmm.MemoryBudget` on the arena's device, shared with other
    arenas (docs/sharing.md); with ``sharding``, a sequence of budgets, one per device of
    the mesh, in any order. ``name``: how the budget's stats and errors call the arena
    (``KV arena 7 (policy)``).

    ``layout``: ``"per_layer"`` (default; one K and one V buffer per layer, each viewable
    as a zero-copy ``jax.Array``, ``kv.k[l]``) or ``"interleaved"`` (one buffer holding
    every layer's K and V token by token: a sequence's partial last chunk is paid once
    instead of once per layer buffer, so short sequences and shared prefixes take little
    more memory than their tokens; no views, the cache API only; see :class:`KVArena`)."""
    kw = dict(locals())  # the arguments above, as given: the same keywords as KVArena's
    del kw["sharding"]
    if sharding is not None:
        return ShardedKVArena(sharding=sharding, **kw)
    return KVArena(**kw)
