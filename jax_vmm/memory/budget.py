"""MemoryBudget: one cap on the physical memory that several arenas of one device hold."""

from __future__ import annotations

from typing import Any, TypedDict

import jax

from ..base.args import as_int
from ..base.devices import DeviceTarget, resolve_device
from ..base.loader import core as _core

__all__ = ["MemoryBudget", "MemoryBudgetStats", "BudgetArenaStats"]


class BudgetArenaStats(TypedDict):
    """One arena of :meth:`MemoryBudget.stats`."""

    uid: int  # the arena's uid (``Arena.uid``)
    label: str
    held_bytes: int  # physical memory it holds now: backed + parked + retired
    peak_bytes: int


class MemoryBudgetStats(TypedDict):
    """:meth:`MemoryBudget.stats`."""

    cap_bytes: int
    used_bytes: int  # held by the budget's arenas together
    peak_bytes: int
    free_bytes: int  # cap_bytes - used_bytes
    device: str
    arenas: list[BudgetArenaStats]  # the open arenas in the budget, oldest first


class MemoryBudget:
    """A cap on the physical memory of several arenas on one device.

    ``MemoryBudget(bytes, device=None)``; pass it as ``Arena(..., budget=b)`` or
    ``kv_arena(..., budget=b)``. Every physical allocation of those arenas comes out of
    ``bytes``: commits, commits ahead, prefetches, wakes and restores. The budget counts
    what the arenas *hold* (``held_bytes``: backed, parked and released-but-not-yet-given-
    back memory), so it is a true cap on physical memory. A commit past it raises
    :class:`~jax_vmm.OutOfMemoryError` that names the budget, what each arena holds and
    what was asked, and changes nothing. Before raising, the commit takes back the memory
    that deferred releases of every arena in the budget still hold (waiting for the
    device). Arenas that are closed leave the budget, and so do arenas that are collected
    once no view of theirs is alive (a live view keeps its arena's memory, and its place in
    the budget). Thread-safe.
    """

    def __init__(self, bytes: int, device: jax.Device | None = None):  # noqa: A002
        cap = as_int(bytes, "MemoryBudget: bytes")
        if cap <= 0:
            raise ValueError(
                f"MemoryBudget: bytes must be > 0 (the physical memory its arenas may hold "
                f"together), got {cap}"
            )
        if cap >= 1 << 64:
            raise ValueError(f"MemoryBudget: bytes={cap} is too large: it must be below 2^64")
        self._target: DeviceTarget = resolve_device(device)
        self._handle = _core.create_memory_budget(
            cap, self._target.driver, self._target.ordinal, self._target.name
        )

    @property
    def bytes(self) -> int:
        """The cap."""
        return self._handle.cap_bytes

    @property
    def device(self) -> jax.Device:
        return self._target.device

    def stats(self) -> MemoryBudgetStats:
        """The cap, what the arenas hold together now (``used_bytes``) and at most
        (``peak_bytes``), and per open arena its ``held_bytes`` and ``peak_bytes``."""
        s = self._handle.stats()
        return {
            "cap_bytes": s["cap_bytes"],
            "used_bytes": s["used_bytes"],
            "peak_bytes": s["peak_bytes"],
            "free_bytes": max(0, s["cap_bytes"] - s["used_bytes"]),
            "device": str(self._target.device),
            "arenas": [dict(a) for a in s["arenas"]],  # type: ignore[misc]
        }

    def __repr__(self) -> str:
        s = self._handle.stats()
        return (
            f"MemoryBudget({s['cap_bytes']} bytes on {self._target.device}, "
            f"{s['used_bytes']} used by {len(s['arenas'])} arena(s))"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            f"jax_vmm.MemoryBudget cannot be pickled or copied: it is the one count of what "
            f"the arenas of this process hold on {self._target.device}. Share the object "
            "itself (it is thread-safe), or make a MemoryBudget(budget.bytes) in the other "
            "process"
        )

    def _check(self, target: DeviceTarget, chunk_bytes: int, what: str, buffers: int = 1) -> None:
        """ValueError unless an arena on ``target`` with chunks of ``chunk_bytes`` may join;
        ``buffers``: how many chunks its smallest commit takes (a KV arena's first token
        backs one chunk in each of its buffers)."""
        if target.device != self._target.device:
            raise ValueError(
                f"{what}: the budget is on {self._target.device} and the arena on "
                f"{target.device}; a budget caps one device: create one per device"
            )
        if chunk_bytes > self.bytes:
            raise ValueError(
                f"{what}: the budget of {self.bytes} bytes is smaller than one chunk of the "
                f"arena ({chunk_bytes} bytes), the least it can commit; create a larger "
                "budget or use a smaller chunk_bytes"
            )
        if buffers * chunk_bytes > self.bytes:
            raise ValueError(
                f"{what}: the budget of {self.bytes} bytes is smaller than one chunk of "
                f"{chunk_bytes} bytes in each of the arena's {buffers} buffers, the least "
                "that backing one token commits; create a larger budget or use a smaller "
                "chunk_bytes"
            )

    def _join(self, core_arena: Any, target: DeviceTarget, label: str) -> None:
        """Makes the new arena ``core_arena`` on ``target`` draw from this budget."""
        self._check(target, core_arena.chunk_bytes, label)
        _core.arena_join_budget(core_arena, self._handle, label)


def check_budget(budget: Any, what: str) -> MemoryBudget | None:
    """``budget`` if it is a :class:`MemoryBudget` or None, else a TypeError naming
    ``what``."""
    if budget is None or isinstance(budget, MemoryBudget):
        return budget
    raise TypeError(
        f"{what}: budget must be a jax_vmm.MemoryBudget or None, got {type(budget).__name__}"
    )
