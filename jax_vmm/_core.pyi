"""jax_vmm C++ core: virtual-memory arenas, drivers and XLA FFI handlers"""

from collections.abc import Sequence
from typing import Annotated

import numpy
from numpy.typing import NDArray


class ArenaClosedError(RuntimeError):
    pass

class ArenaAsleepError(RuntimeError):
    pass

class ReservationFullError(RuntimeError):
    pass

class DriverError(RuntimeError):
    pass

class ForkedProcessError(RuntimeError):
    pass

class OutOfMemoryError(MemoryError):
    """
    Physical memory could not be committed. Attributes: requested_bytes, free_bytes.
    """

def registrations(platform: str) -> dict:
    """
    {target name: capsule, or {stage: capsule}} of every XLA FFI handler of this module on `platform` ('cpu' or 'CUDA'), for jax.ffi.register_ffi_target.
    """

def record_stage_status() -> str:
    """
    'registered' once the bootstrap target registered jax_vmm's targets with XLA's FFI record stage; 'pending' before; 'unavailable: ...' or 'failed: ...' otherwise.
    """

built_with_cuda_kernels: bool = ...

built_with_cudnn: bool = ...

def forget_compute_streams(ordinal: int) -> int:
    """
    Forget the XLA compute streams registered for CUDA device `ordinal` (their JAX client is going); device waits there wait for the whole context until one is registered again. Returns how many were forgotten.
    """

class Arena:
    """
    A reserved virtual range with buffers committed chunk by chunk. Thread-safe. Use jax_vmm.Arena (Python) rather than this class.
    """

    @property
    def uid(self) -> int: ...

    @property
    def base(self) -> int: ...

    @property
    def reserved_bytes(self) -> int: ...

    @property
    def chunk_bytes(self) -> int: ...

    @property
    def handle_bytes(self) -> int: ...

    @property
    def zero_fill(self) -> bool: ...

    @property
    def asleep(self) -> bool: ...

    @property
    def granularity(self) -> int: ...

    @property
    def driver_kind(self) -> str: ...

    @property
    def device_ordinal(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    def backed_prefix(self, arg0: int, arg1: int, arg2: int, /) -> int: ...

    def buffer(self, arg: int, /) -> dict: ...

    def buffers(self) -> list: ...

    def stats(self) -> dict: ...

    def drop_count(self, arg: int, /) -> int: ...

    def transfer_state(self, arg: int, /) -> tuple:
        """
        (state, error) of a transfer: 0 offloading, 1 offloaded, 2 restoring, 3 restored, 4 failed.
        """

    def live_views(self) -> int:
        """View leases alive, of every buffer (freed ones included)."""

    def buffer_live_views(self, buffer_id: int) -> int: ...

    def view(self, arg0: int, arg1: Sequence[int], arg2: int, arg3: int, arg4: int, arg5: int, /) -> object:
        """
        A DLPack capsule over a buffer (pass to jax.dlpack.from_dlpack); its deleter releases a view lease and needs no GIL.
        """

    def allocate(self, nbytes: int, name: str = ...) -> dict: ...

    def commit_ranges(self, arg: Sequence[tuple[int, int, int]], /) -> int:
        """All-or-nothing commit of (buffer_id, start, stop) ranges."""

    def commit_ahead(self, arg: Sequence[tuple[int, int, int]], /) -> int:
        """
        commit_ranges from a background thread; -1 (skipped) once raw views were handed out.
        """

    def share_spans(self, arg: Sequence[tuple[int, int, int, int, int]], /) -> tuple[int, list[tuple[int, int, int]]]:
        """
        Map (src_id, src_start, dst_id, dst_start, bytes) spans' memory at their dst too; returns (bytes mapped, [(dst_id, start, stop) left out: the caller copies]).
        """

    def copy_spans(self, arg: Sequence[tuple[int, int, int, int, int]], /) -> None:
        """
        Copy (src_id, src_start, dst_id, dst_start, bytes) spans after the device's work.
        """

    def zero_ranges(self, arg: Sequence[tuple[int, int, int]], /) -> int:
        """
        Zero the backed, unshared bytes of (buffer_id, start, stop) ranges after the device's work; returns the bytes zeroed.
        """

    def shared_bytes(self, arg: Sequence[tuple[int, int, int]], /) -> int:
        """
        Bytes of the chunks in (buffer_id, start, stop) ranges still mapped elsewhere too.
        """

    def free(self, arg: int, /) -> None: ...

    def commit(self, arg0: int, arg1: int, arg2: int, /) -> int: ...

    def decommit(self, buffer_id: int, start: int, stop: int, wait: bool = ...) -> int: ...

    def decommit_ranges(self, ranges: Sequence[tuple[int, int, int]], wait: bool = ..., defer_unmap: bool = ...) -> int:
        """
        Decommit of (buffer_id, start, stop) ranges in one call; defer_unmap (host): retire what goes, for reclaim_retired_before.
        """

    def reclaim(self) -> int: ...

    @property
    def views_exported(self) -> bool: ...

    @property
    def unbacked_reads_zero(self) -> bool: ...

    def begin_host_wait(self) -> int:
        """Host driver: a wait for the work in flight begins; returns its number."""

    def reclaim_retired_before(self, sync: int) -> int:
        """
        Gives back what was retired before host wait `sync` began; returns its bytes.
        """

    def sleep(self, keep_contents: bool) -> None: ...

    def wake(self) -> None: ...

    def offload(self, arg: Sequence[tuple[int, int, int]], /) -> int:
        """
        Offload of (buffer_id, start, stop) ranges; returns the transfer's ticket.
        """

    def restore(self, ticket: int, wait: bool) -> None: ...

    def wait_transfer(self, arg: int, /) -> tuple:
        """Blocks while the transfer is in flight; returns (state, error)."""

    def drop_transfer(self, arg: int, /) -> None: ...

    def free_host_cache(self) -> None: ...

    def copy_in(self, buffer_id: int, offset: int, src: int, nbytes: int) -> None:
        """
        Copy nbytes from address src (host or device memory) into a backed buffer range.
        """

    def close(self) -> None: ...

    def pin_metadata_for_graphs(self) -> None:
        """
        Keep the page table and drop counters allocated after destruction: compiled code holds this arena's addresses (kv_write's static dest).
        """

    def reset_drop_count(self, arg: int, /) -> None: ...

def create_arena(driver: str, device: int, reserve_bytes: int, chunk_bytes: int = ..., handle_bytes: int = ..., zero_fill: bool = ...) -> Arena: ...

def find_arena_buffer(address: int, nbytes: int) -> object:
    """
    The live (open) arena buffer holding [address, address + nbytes), or None.
    """

def find_arena_buffer_by_uid(uid: int) -> object:
    """
    The buffer with this uid (with its name and whether its arena is closed), or None when no live arena has it.
    """

def resolve_chunk_bytes(arg0: str, arg1: int, arg2: int, /) -> int:
    """
    The chunk size an arena with these arguments would use (0 = the driver default).
    """

def query_cuda_devices() -> tuple:
    """
    ([device dicts], error): what the CUDA driver offers; error says why the list is empty.
    """

class MemoryBudget:
    """
    A cap on the physical memory of several arenas of one device. Thread-safe. Use jax_vmm.MemoryBudget (Python) rather than this class.
    """

    @property
    def cap_bytes(self) -> int: ...

    @property
    def driver_kind(self) -> str: ...

    @property
    def device_ordinal(self) -> int: ...

    def stats(self) -> dict: ...

def create_memory_budget(cap_bytes: int, driver: str, device: int, device_name: str = ...) -> MemoryBudget: ...

def arena_join_budget(arena: Arena, budget: MemoryBudget, label: str) -> None:
    """Every later physical allocation of the arena comes from the budget."""

def scratch_stats() -> list:
    """
    One dict per workspace: device, stream, mode, address, capacity, backed and retired bytes, growth events, capture refusals.
    """

def scratch_set_mode(arg: str, /) -> None: ...

def scratch_get_mode() -> str: ...

def scratch_set_reserve_bytes(arg: int, /) -> None: ...

def scratch_get_reserve_bytes() -> int: ...

def scratch_reserve(device: int, nbytes: int, stream: int = ...) -> None:
    """
    Grow the workspace of (device, stream) to nbytes; device -1 is the host.
    """

def kv_write_stats() -> dict:
    """
    Host counters of the kv_write handlers (calls, captured calls, alias misses, non-arena operands) and the dropped token writes counted on the host and devices (reading the device counter synchronises the devices).
    """

def kv_write_reset_stats() -> None: ...

def attention_plan(batch: int, max_tokens: int, q_heads: int, kv_heads: int, head_dim: int, parallel_units: int, chunk: int = ..., splits: int = ..., q_len: int = ...) -> dict:
    """
    Split-K plan of decode_attention (q_len: query rows per sequence, jax_vmm attention) for static shapes (see ffi/src/ops/attention/attention_plan.h).
    """

def attention_stream_plan(batch: int, max_tokens: int, q_heads: int, kv_heads: int, head_dim: int, storage_bytes: int, sm_count: int, ctas: int = ..., min_tiles: int = ...) -> dict:
    """
    Plan of the streaming decode attention for static shapes (see ffi/src/ops/attention/stream_plan.h); sm_count 0 plans for the CPU model.
    """

def attention_stats() -> dict:
    """Counters of the decode-attention handlers (process-wide)."""

class KvCache:
    """
    The C++ side of a KV arena: the identity the KVCache pytree carries, the table of ensured tokens the kernels check, the read-clamp counter. Thread-safe. Use jax_vmm.KVArena rather than this class.
    """

    @property
    def uid(self) -> int: ...

    @property
    def device_ordinal(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    def set_limit(self, seq: int, tokens: int) -> None:
        """
        Tokens ensured for a sequence: the writers' table before it returns, the readers' in dispatch order (CUDA).
        """

    def set_limits(self, tokens: Sequence[int]) -> None:
        """Every sequence's ensured tokens at once: one copy to the device."""

    def raise_limits(self, tokens: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu', writable=False)]) -> bool:
        """
        Raises each sequence's entry to tokens[seq] (an int64 array, one per sequence) where that is higher: one copy to the device if any changed. Returns whether one did.
        """

    def limits(self) -> list[int]: ...

    def begin_epoch(self) -> int:
        """
        Keeps the table for readers of the current epoch and advances it (host driver: a release that does not wait for the work in flight). Returns the new epoch.
        """

    def forget_epochs_before(self, epoch: int) -> None:
        """
        Drops the tables kept for epochs before `epoch` (their work has finished).
        """

    @property
    def epoch(self) -> int: ...

    def set_floor(self, seq: int, tokens: int) -> None:
        """
        Tokens of a sequence below which writes are dropped (its shared prefix).
        """

    def floors(self) -> list[int]: ...

    def read_clamps(self) -> int: ...

    def reset_read_clamps(self) -> None: ...

    def close(self) -> None: ...

def create_kv_cache(arena: Arena, k_ids: Sequence[int], v_ids: Sequence[int], max_seqs: int, per_sequence: bool, max_tokens: int, kv_heads: int, head_dim: int, dtype: str, itemsize: int, device_ordinal: int, shared_uid: int = ..., interleaved: bool = ...) -> KvCache:
    """
    A KV cache over layer buffers of `arena`, registered under a new uid, or (shared_uid) a shard joining the live cache of that uid on another device ordinal. interleaved: k_ids and v_ids name one buffer holding every layer (kvcache::Geometry).
    """

def find_kv_cache(uid: int, device_ordinal: int) -> str:
    """
    What a handler on this device ordinal finds under the uid: 'found', 'closed', 'gone' or 'other_device'.
    """

def token_range(tokens: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu', writable=False)]) -> tuple[int, int]:
    """(min, max) of an int64 array ((0, 0) when empty)."""

def ensure_need(tokens: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu', writable=False)], covered: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu', writable=False)], valid_gen: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu', writable=False)], gen: int) -> list[int]:
    """Sequences that ask for tokens beyond their chunks known backed."""

def ahead_due(tokens: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu', writable=False)], covered: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu', writable=False)], ahead_blocked: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu', writable=False)], ahead_tokens: int, max_tokens: int) -> list[int]:
    """Sequences within ahead_tokens of the end of their backed chunks."""
