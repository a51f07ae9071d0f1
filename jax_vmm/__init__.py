"""jax_vmm: virtual-memory KV-cache buffers and graph-safe scratch for JAX.

Buffers live at fixed addresses in one reserved virtual range; physical memory is
committed and released page by page underneath (CUDA driver VMM on GPUs, mmap/memfd on
the CPU), so arrays never move, growth needs no copy, and CUDA graphs stay valid.
"""

from pkgutil import extend_path

# A development build keeps the compiled module in <build>/jax_vmm/; with that build
# directory on PYTHONPATH it joins this package.
__path__ = extend_path(__path__, __name__)

from .arena import Arena, Buffer  # noqa: E402
from .cache import ArenaNotWrittenWarning, KVCache, KVLayer, LayerId  # noqa: E402
from .errors import (  # noqa: E402
    ArenaAsleepError,
    ArenaClosedError,
    DriverError,
    ForkedProcessError,
    OutOfBoundsRead,
    OutOfBoundsWrite,
    OutOfMemoryError,
    ReservationFullError,
    TransferError,
)
from .kv import KVArena, Transfer, kv_arena  # noqa: E402
from .sharded import ShardedKVArena  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Arena",
    "Buffer",
    "KVArena",
    "ShardedKVArena",
    "Transfer",
    "kv_arena",
    "KVCache",
    "KVLayer",
    "LayerId",
    "ArenaNotWrittenWarning",
    "ArenaAsleepError",
    "ArenaClosedError",
    "DriverError",
    "ForkedProcessError",
    "OutOfBoundsWrite",
    "OutOfBoundsRead",
    "OutOfMemoryError",
    "ReservationFullError",
    "TransferError",
]

# Ops from feature modules (added by their owners; keep one import line each).
from .attention import decode_attention  # noqa: E402,F401
from .cache_ops import ordered_views  # noqa: E402,F401
from .ops import KVDest, kv_write, kv_write_fp8, kv_write_through  # noqa: E402,F401
from .scratch import scratch_stats  # noqa: E402,F401
