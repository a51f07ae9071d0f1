"""The static identity of one layer of a KV arena (:class:`LayerId`): the pytree aux data
of an arena :class:`~jax_vmm.KVLayer`."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..base.fp8 import FP8_DTYPE

__all__ = ["LayerId"]


@dataclasses.dataclass(frozen=True)
class LayerId:
    """The static identity of one layer of a KV arena: the pytree aux data of an arena
    :class:`KVLayer`. Hashable and compared by value, so equal ids share compiled code.

    ``cache_uid`` is the KV arena's uid (never reused; addresses are); the handlers find
    the layer's buffers through it on the device the step runs on. The rest is the
    geometry every check needs at trace time."""

    cache_uid: int
    layer: int
    num_layers: int
    shape: tuple[int, ...]  # of each of K and V: (max_seqs, max_tokens, H, D) or (T, H, D)
    dtype: str
    platform: str  # "cpu" or "gpu"

    @property
    def fp8(self) -> bool:
        """A float8_e4m3fn arena: its layers carry scales (a uint8 arena is plain bytes)."""
        return np.dtype(self.dtype) == FP8_DTYPE

    @property
    def num_kv_heads(self) -> int:
        return self.shape[-2]

    @property
    def sharded(self) -> bool:
        """A layer of a sharded KV arena (jax_vmm/cache/sharding.py: ShardedLayerId)."""
        return False

    def describe(self) -> str:
        return f"layer {self.layer} of KV arena {self.cache_uid}"
