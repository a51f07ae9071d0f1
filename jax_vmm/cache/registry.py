"""The live KV arenas by uid: how an arena layer, which names its arena only by uid (its
static identity), finds it for a concrete read, and how the ops find the arenas a call
may have meant. The kv layer registers each arena it creates; this layer never imports
it, and sees an arena only through :class:`RegisteredArena`."""

from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol

import jax
import numpy as np

from .ids import LayerId

__all__ = ["RegisteredArena", "register_arena", "live_arenas", "arena_of"]


class RegisteredArena(Protocol):
    """What the cache and the ops need of a KV arena (single-device or sharded)."""

    @property
    def uid(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    @property
    def layer_shape(self) -> tuple[int, ...]: ...

    dtype: np.dtype

    def check_open(self, op: str) -> None: ...

    def fresh_view(self, side: int, layer: int) -> jax.Array: ...


# Weak: the static identity kept in jit caches must not keep an arena alive.
_arenas: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_arenas_lock = threading.Lock()


def register_arena(kv: RegisteredArena) -> None:
    """Make ``kv`` findable by its uid (for as long as it lives)."""
    with _arenas_lock:
        _arenas[kv.uid] = kv


def live_arenas() -> list[RegisteredArena]:
    """The registered arenas that are still open."""
    with _arenas_lock:
        return [kv for kv in _arenas.values() if not kv.closed]


def arena_of(lid: LayerId, op: str) -> Any:
    """The open arena that ``lid`` names; raises for ``op`` if it is gone or closed. Typed
    ``Any``: the caller knows which kind of arena its layer belongs to."""
    with _arenas_lock:
        kv = _arenas.get(lid.cache_uid)
    if kv is None:
        raise ValueError(
            f"{op}: {lid.describe()} no longer exists (the KVArena was closed and "
            "collected); build the cache of an open KV arena (kv.cache())"
        )
    kv.check_open(op)
    return kv
