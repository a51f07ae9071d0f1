"""The kv layer: KV-cache buffers on arenas. :class:`KVArena` (one device) and
:class:`ShardedKVArena` (one KVArena per device of a mesh) share one interface,
:class:`~jax_vmm.kv.base.KVArenaBase`; :func:`kv_arena` makes either."""

from .arena import DEFAULT_KV_HANDLE_BYTES, KV_LAYOUTS, KVArena
from .base import KVArenaBase
from .factory import kv_arena
from .sharded import ShardedKVArena
from .stats import KVArenaStats, ShardedKVArenaStats

__all__ = [
    "KVArena",
    "ShardedKVArena",
    "KVArenaBase",
    "kv_arena",
    "KVArenaStats",
    "ShardedKVArenaStats",
    "DEFAULT_KV_HANDLE_BYTES",
    "KV_LAYOUTS",
]
