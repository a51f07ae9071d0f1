"""Which arena buffer an array views: the lookups that let the cache and the ops refuse,
or name, arena memory handed to them as a plain array."""

from __future__ import annotations

from typing import Any

import jax

from ..base.loader import core as _core

__all__ = ["find_view_buffer", "describe_buffer"]


def find_view_buffer(x: Any, nbytes: int) -> dict | None:
    """The open arena buffer that concrete array ``x`` views (starting at its base), or
    None: a tracer, not arena memory, or not a single-device buffer."""
    if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
        return None
    try:
        address = int(x.unsafe_buffer_pointer())
    except Exception:  # noqa: BLE001 - sharded, deleted, or not a single-device buffer
        return None
    found = _core.find_arena_buffer(address, nbytes)
    return found if found is not None and found["buffer_base"] == address else None


def describe_buffer(uid: int) -> str:
    """How an error names arena buffer ``uid``: its name and uid."""
    found = _core.find_arena_buffer_by_uid(uid)
    name = "?" if found is None else found["name"]
    return f"buffer '{name}' (uid {uid})"
