"""The memory layer: :class:`Arena` (one reserved virtual range, committed page by page)
with its :class:`Buffer` s, and the host transfers of a sleep or offload
(:class:`Transfer`), and the :class:`MemoryBudget` that caps several arenas."""

from .arena import Arena, Buffer
from .budget import MemoryBudget
from .transfer import Transfer

__all__ = ["Arena", "Buffer", "MemoryBudget", "Transfer"]
