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
from jax._src.array import ArrayImpl

from .ids import LayerId

__all__ = [
    "RegisteredArena",
    "register_arena",
    "live_arenas",
    "arena_of",
    "note_token",
    "latest_tokens",
    "forget_tokens",
]


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
            "collected; a cache does not keep its KVArena alive: hold a reference to it while "
            "the cache is used); build the cache of an open KV arena (kv.cache())"
        )
    kv.check_open(op)
    return kv


# The last concrete token seen per (arena uid, layer): a jitted step's returned cache
# passes here when JAX rebuilds it (also on its C++ fast path, which runs no other Python),
# and the tokens of a layer chain its writes, so waiting for the last one waits for every
# write before it. Strong references to int32 scalars; dropped with the arena.
_tokens: dict[tuple[int, int], Any] = {}


def note_token(lid: LayerId, token: Any) -> None:
    """Remember ``token`` as layer ``lid``'s latest (tracers and placeholders ignored).
    Called as ``registry.note_token``: ``jax_vmm.testing.tokens_unnoted()`` swaps it out
    for its with-block (the one seam for that hook); nothing else should."""
    if type(token) is ArrayImpl:
        _tokens[(lid.cache_uid, lid.layer)] = token


def latest_tokens(uid: int) -> list[Any]:
    """The latest live tokens of arena ``uid``'s layers (donated ones skipped: the step
    that consumed them made newer ones)."""
    out = []
    for (cache_uid, _), token in list(_tokens.items()):
        if cache_uid == uid and not token.is_deleted():
            out.append(token)
    return out


def forget_tokens(uid: int) -> None:
    """Drop arena ``uid``'s tokens (it was closed)."""
    for key in [k for k in list(_tokens) if k[0] == uid]:
        _tokens.pop(key, None)
