"""jax_vmm: virtual-memory KV-cache buffers and graph-safe scratch for JAX.

Buffers live at fixed addresses in one reserved virtual range; physical memory is
committed and released page by page underneath (CUDA driver VMM on GPUs, mmap/memfd on
the CPU), so arrays never move, growth needs no copy, and CUDA graphs stay valid.

The package is layered; each subpackage imports only from those before it: ``base``
(the compiled core, FFI registration, devices, errors, fp8, argument checks),
``memory`` (Arena, Buffer, Transfer), ``cache`` (the KVCache pytree), ``ops`` (array ops,
attention, scratch, the cache-layer and sharded ops), ``kv`` (KVArena, ShardedKVArena).
This module, ``errors``, ``info`` and ``__main__`` are the public face; ``testing``
(test hooks) is never imported by them.
"""

from pkgutil import extend_path

# A development build keeps the compiled module in <build>/jax_vmm/; with that build
# directory on PYTHONPATH it joins this package.
__path__ = extend_path(__path__, __name__)

from .base.fp8 import dequantize_fp8, quantize_fp8  # noqa: E402
from .cache import (  # noqa: E402
    ArenaNotWrittenWarning,
    KVCache,
    KVLayer,
    KVWriteResultUnusedWarning,
    LayerId,
)
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
from .kv import (  # noqa: E402
    KV_LAYOUTS,
    KVArena,
    KVArenaStats,
    ShardedKVArena,
    ShardedKVArenaStats,
    kv_arena,
)
from .memory import Arena, Buffer, MemoryBudget, Transfer  # noqa: E402
from .memory.stats import ArenaStats  # noqa: E402
from .ops import (  # noqa: E402
    KVDest,
    decode_attention,
    kv_write,
    kv_write_fp8,
    kv_write_stats,
    kv_write_through,
    ordered_views,
    reset_kv_write_stats,
    scratch_stats,
)
from .ops.array_attention import attention_stats  # noqa: E402
from .ops.general_attention import attention, reference_attention  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    # arenas and the KV cache
    "Arena",
    "Buffer",
    "Transfer",
    "MemoryBudget",
    "kv_arena",
    "KV_LAYOUTS",
    "KVArena",
    "ShardedKVArena",
    "KVCache",
    "KVLayer",
    "LayerId",
    "KVDest",
    # ops
    "kv_write",
    "kv_write_fp8",
    "kv_write_through",
    "decode_attention",
    "attention",
    "reference_attention",
    "ordered_views",
    "quantize_fp8",
    "dequantize_fp8",
    # counters and stats
    "scratch_stats",
    "kv_write_stats",
    "reset_kv_write_stats",
    "attention_stats",
    "ArenaStats",
    "KVArenaStats",
    "ShardedKVArenaStats",
    # warnings and errors
    "ArenaNotWrittenWarning",
    "KVWriteResultUnusedWarning",
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
