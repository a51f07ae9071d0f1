"""The cache layer: the KV cache as a JAX pytree (:class:`KVCache` of :class:`KVLayer`),
the static identities its arena layers carry (:class:`LayerId`, and for a sharded arena
:class:`~jax_vmm.cache.sharding.ShardedLayerId` with the layout it describes), and the
registry through which an identity finds its live arena."""

from .ids import LayerId
from .pytree import ArenaNotWrittenWarning, KVCache, KVLayer, KVWriteResultUnusedWarning
from .sharding import ShardedLayerId

__all__ = [
    "KVCache",
    "KVLayer",
    "LayerId",
    "ShardedLayerId",
    "ArenaNotWrittenWarning",
    "KVWriteResultUnusedWarning",
]
