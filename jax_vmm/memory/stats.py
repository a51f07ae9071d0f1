"""The type of :meth:`jax_vmm.Arena.stats`: a plain dict (the core makes it), typed here so
that its keys are checked and documented."""

from __future__ import annotations

from typing import TypedDict

__all__ = ["ArenaStats"]


class ArenaStats(TypedDict):
    """:meth:`jax_vmm.Arena.stats`; docs/memory.md explains each count."""

    driver: str
    device_ordinal: int
    granularity: int
    chunk_bytes: int
    handle_bytes: int
    zero_fill: bool
    reserved_bytes: int
    placed_bytes: int
    backed_bytes: int
    peak_backed_bytes: int
    held_bytes: int
    parked_bytes: int
    retired_bytes: int
    alias_bytes: int
    shared_bytes: int
    chunks_shared: int
    num_buffers: int
    commit_calls: int
    decommit_calls: int
    commit_seconds: float
    decommit_seconds: float
    chunks_created: int
    chunks_released: int
    chunks_revived: int
    handles_created: int
    handles_released: int
    set_access_calls: int
    failed_commits: int
    commit_drains: int
    commits_ahead: int
    deferred_releases: int
    reclaim_syncs: int
    live_views: int
    held_range_bytes: int
    views_exported: bool
    unbacked_reads_zero: bool
    asleep: bool
    sleep_image_bytes: int
    offloaded_bytes: int
    host_cached_bytes: int
    pending_transfers: int
    closed: bool
    device_free_bytes: int
    device_total_bytes: int
