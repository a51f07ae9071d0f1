"""The ops layer, bottom to top: the attention call's checks and plans
(``attention_call``, over graph-safe ``scratch``), the array ops (``array_writes``:
``kv_write_through``, ``kv_write_fp8``, the array form of ``kv_write``;
``array_attention``), the ops on a cache layer (``layer_ops``), the same per device of a
sharded arena (``sharded_ops``), and the entry points that dispatch between them
(``writes``: ``kv_write``; ``attention``: ``decode_attention``)."""

from ..base.fp8 import quantize_fp8
from .array_writes import (
    DROPPED_NOT_ENSURED,
    DROPPED_OUT_OF_RANGE,
    DROPPED_SHARED,
    DROPPED_UNBACKED,
    PADDING,
    WRITTEN,
    KVDest,
    kv_write_fp8,
    kv_write_stats,
    kv_write_through,
    reset_kv_write_stats,
)
from .attention import decode_attention
from .layer_ops import ordered_views
from .scratch import scratch_stats
from .writes import kv_write

__all__ = [
    "kv_write",
    "kv_write_through",
    "kv_write_fp8",
    "quantize_fp8",
    "kv_write_stats",
    "reset_kv_write_stats",
    "KVDest",
    "decode_attention",
    "ordered_views",
    "scratch_stats",
    "PADDING",
    "WRITTEN",
    "DROPPED_OUT_OF_RANGE",
    "DROPPED_UNBACKED",
    "DROPPED_NOT_ENSURED",
    "DROPPED_SHARED",
]
