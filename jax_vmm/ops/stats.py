"""The types of the ops' counters: :func:`jax_vmm.scratch_stats`,
:func:`jax_vmm.kv_write_stats` and :func:`jax_vmm.attention_stats` (plain dicts, typed)."""

from __future__ import annotations

from typing import TypedDict

__all__ = ["ScratchStats", "HandlerStats", "KVWriteStats", "AttentionStats"]


class ScratchStats(TypedDict):
    """One graph-safe scratch workspace (:func:`jax_vmm.scratch_stats`)."""

    device: str
    stream: int
    generation: int
    current: bool
    mode: str
    vmm: bool
    address: int
    capacity: int
    reserved_bytes: int
    backed_bytes: int
    retired_blocks: int
    retired_bytes: int
    growth_events: int
    freed_blocks: int
    capture_refusals: int
    fallback_reason: str


class HandlerStats(TypedDict):
    """The counters of one kv_write handler."""

    calls: int
    captured_calls: int
    alias_misses: int
    non_arena: int


class KVWriteStats(TypedDict):
    kv_write_through: HandlerStats
    kv_write: HandlerStats
    kv_cache_write: HandlerStats
    dropped_writes: int


KVWriteStats.__doc__ = ":func:`jax_vmm.kv_write_stats`."


class AttentionStats(TypedDict):
    """:func:`jax_vmm.attention_stats`: process-wide decode-attention handler counters."""

    cpu_calls: int
    cuda_initialize_calls: int
    cuda_execute_calls: int
    cuda_captured_calls: int
    cuda_tensor_core_launches: int
    cuda_simple_launches: int
