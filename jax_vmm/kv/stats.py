"""The types of :meth:`jax_vmm.KVArena.stats` and :meth:`jax_vmm.ShardedKVArena.stats`
(plain dicts, typed)."""

from __future__ import annotations

from typing import TypedDict

from ..memory.stats import ArenaStats

__all__ = ["KVArenaStats", "SharedPrefix", "ShardStats", "ShardedKVArenaStats"]


class SharedPrefix(TypedDict):
    """One :meth:`jax_vmm.KVArena.share_prefix` still in place (its ``dst`` not released)."""

    src: int | None  # None once the source was released (its slot may hold another request)
    dst: int
    tokens: int
    mapped_bytes: int
    copied_bytes: int


class KVArenaStats(ArenaStats):
    """:meth:`jax_vmm.KVArena.stats`: its arena's stats and the cache's own."""

    num_layers: int
    max_tokens: int
    max_seqs: int | None
    token_bytes_all_layers: int
    backed_tokens: list[int]
    offloaded_seqs: list[int]
    commit_ahead_tokens: int
    commits_ahead_skipped: int
    commits_ahead_failed: int
    preallocated_equivalent_bytes: int
    shared_prefixes: list[SharedPrefix]
    sharing_seqs: list[int]


class ShardStats(KVArenaStats):
    """One shard's stats in :meth:`jax_vmm.ShardedKVArena.stats` (``devices``)."""

    device: str


class ShardedKVArenaStats(TypedDict):
    """:meth:`jax_vmm.ShardedKVArena.stats`: totals over the devices, and each shard's."""

    reserved_bytes: int
    backed_bytes: int
    peak_backed_bytes: int
    held_bytes: int
    shared_bytes: int
    chunks_shared: int
    commit_calls: int
    commit_seconds: float
    decommit_calls: int
    decommit_seconds: float
    num_layers: int
    max_tokens: int
    max_seqs: int | None
    num_devices: int
    sharding: str
    backed_tokens: list[int]
    devices: list[ShardStats]
