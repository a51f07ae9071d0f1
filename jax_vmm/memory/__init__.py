"""The memory layer: :class:`Arena` (one reserved virtual range, committed page by page)
with its :class:`Buffer` s, and the host transfers of a sleep or offload
(:class:`Transfer`)."""

from .arena import Arena, Buffer
from .transfer import Transfer

__all__ = ["Arena", "Buffer", "Transfer"]
