"""
Test-only hooks of jax_vmm's C++ core; use them through jax_vmm.testing.
"""

from collections.abc import Sequence
from typing import Annotated

import numpy
from numpy.typing import NDArray

import jax_vmm._core


def registrations(platform: str) -> dict:
    """
    {target name: capsule, or {stage: capsule}} of every XLA FFI handler of this module on `platform` ('cpu' or 'CUDA'), for jax.ffi.register_ffi_target.
    """

class InjectedFault(RuntimeError):
    pass

def create_fault_injecting_arena(driver: str, device: int, reserve_bytes: int, chunk_bytes: int = ..., handle_bytes: int = ..., zero_fill: bool = ...) -> jax_vmm._core.Arena:
    """create_arena() with its driver wrapped in a fault-injecting driver."""

def arm_fault(arena: jax_vmm._core.Arena, op: str, nth: int, out_of_memory: bool = ...) -> None:
    """Fail the nth (1-based) future driver call of op."""

def disarm_faults(arena: jax_vmm._core.Arena) -> None:
    """
    Disarm every op, repair release, lift every switch and the device hold.
    """

def break_release(arena: jax_vmm._core.Arena, broken: bool) -> None:
    """
    While broken, the driver's release and unmap calls do nothing (rollbacks leak).
    """

def skip_device_waits(arena: jax_vmm._core.Arena, skip: bool) -> None:
    """
    While set, device waits do nothing and releases unmap at once (no drain, no deferral).
    """

def defer_reclaim(arena: jax_vmm._core.Arena, defer: bool) -> None:
    """
    While set, unmapping claims to need a device wait (the host driver defers like CUDA).
    """

def kv_cache_tables(cache: jax_vmm._core.KvCache) -> tuple[list[int], list[int], list[int]]:
    """
    (writers' table, readers' table, floors) of a host KV cache, as the kernels see them.
    """

def unorder_table_writes(arena: jax_vmm._core.Arena, unordered: bool) -> None:
    """While set, table changes land at once instead of in dispatch order."""

def hold_device(arena: jax_vmm._core.Arena, hold: bool) -> None:
    """While held, device waits block (a device that is still busy)."""

def device_syncs(arena: jax_vmm._core.Arena) -> int:
    """
    Device waits (Synchronize calls) made through this arena's driver so far.
    """

def injected_faults(arena: jax_vmm._core.Arena) -> int:
    """Faults thrown into this arena's driver so far."""

def set_host_map_limit(limit: int) -> None:
    """
    The mapping limit host arenas check against instead of vm.max_map_count (0: the real one).
    """

def set_budget_check_bypassed(bypassed: bool) -> None:
    """While set, memory budgets never refuse a commit (they still count)."""

def set_host_available_bytes(bytes: int) -> None:
    """
    The host driver takes `bytes` (0: /proc/meminfo's) as the memory available and checks every commit against it.
    """

def set_host_fresh_memory_poisoned(poisoned: bool) -> None:
    """
    While set, memory the host driver commits holds 0xFF bytes (NaN), not zeros.
    """

class ZeroLayout:
    def __init__(self, base: int, bytes: int, max_piece: int, unit: int) -> None: ...

    def tile(self, arg0: int, arg1: int, /) -> list: ...

    def plan_clear(self, arg0: int, arg1: int, /) -> tuple: ...

    def add(self, arg: Sequence[tuple[int, int]], /) -> None: ...

    def remove(self, arg: Sequence[tuple[int, int]], /) -> None: ...

    def pieces(self) -> list: ...

    def covered(self, arg0: int, arg1: int, /) -> int: ...

def zero_piece_bytes(total_bytes: int, granularity: int, ceiling: int = ...) -> int: ...

def zero_piece_ceiling_from_env() -> int: ...

def compute_streams(ordinal: int, emulated: bool = ...) -> list[int]:
    """The XLA compute streams registered for CUDA device `ordinal`."""

def forget_compute_streams(ordinal: int, emulated: bool = ...) -> list[int]:
    """
    Removes and returns them: device waits fall back to cuCtxSynchronize meanwhile.
    """

def register_compute_streams(ordinal: int, streams: Sequence[int], emulated: bool = ...) -> None:
    """Puts forgotten streams back."""

def set_host_gate(open: bool) -> None:
    """
    Open or close the gate of jax_vmm_testing_host_gate (host_gate_cpu.cc).
    """

def host_gate_held() -> int:
    """Calls of jax_vmm_testing_host_gate waiting now."""

def scratch_get(device: int, stream: int, nbytes: int, capturing: bool) -> int:
    """
    scratch Get() with the capture state given; returns the workspace address.
    """

def scratch_set_free_on_growth(enabled: bool) -> None: ...

def scratch_free_on_growth() -> bool: ...

def scratch_probe_stats() -> dict: ...

def legacy_view(arena: object, buffer_id: int, shape: Sequence[int], code: int, bits: int, device_type: int, device_id: int) -> NDArray:
    """
    Arena.view as it was before view leases (GIL-taking deleter, no lease).
    """

def attention_stream_partition(lengths: Sequence[int], max_tokens: int, unit_groups: int, ctas: int, min_tiles: int, tile_tokens: int = ...) -> list:
    """
    Per CTA, the pieces (b, hg, first_tile, tiles, slot or -1 for a whole unit, first_owner, last_owner) of the streaming kernel's partition.
    """

def fast_div(divisor: int, dividends: Annotated[NDArray[numpy.uint32], dict(shape=(None,), order='C', writable=False)]) -> list[int]:
    """
    FastDivmod(divisor).Div(n) for each n (uint32, C-contiguous, each < 2^31).
    """

def fake_cuda_results() -> dict: ...

def fake_cuda_granularity() -> int: ...

def fake_cuda_total_bytes() -> int: ...

def fake_cuda_stats() -> dict:
    """
    Counters of the fake CUDA driver (calls per entry point, live objects, refusals).
    """

def fake_cuda_mappings() -> list: ...

def fake_cuda_allocations() -> list: ...

def fake_cuda_map_log(clear: bool = ...) -> list:
    """
    (va, bytes, offset, handle, allocation_bytes, result) of every cuMemMap call.
    """

def fake_cuda_fail_nth(entry: str, nth: int, result: int) -> None:
    """
    The nth (1-based) future call of entry returns result; nth=0 disarms it.
    """

def fake_cuda_disarm() -> None: ...

def fake_cuda_access(va: int) -> tuple[int, int]:
    """(result, flags) of cuMemGetAccess at va."""

def fake_cuda_read(va: int, nbytes: int) -> tuple:
    """
    (result, bytes) of fake-device memory, read under the copy rules (READ needed).
    """

def fake_cuda_write(va: int, data: bytes) -> int:
    """Writes under the copy rules (READWRITE needed)."""

def fake_cuda_reserve(bytes: int, alignment: int = ...) -> tuple[int, int]: ...

def fake_cuda_address_free(arg0: int, arg1: int, /) -> int: ...

def fake_cuda_create(arg: int, /) -> tuple[int, int]: ...

def fake_cuda_release(arg: int, /) -> int: ...

def fake_cuda_map(va: int, bytes: int, offset: int, handle: int) -> int: ...

def fake_cuda_unmap(arg0: int, arg1: int, /) -> int: ...

def fake_cuda_set_access(va: int, bytes: int, flags: int) -> int: ...

def fake_cuda_stream_create() -> tuple[int, int]: ...

def fake_cuda_stream_destroy(arg: int, /) -> int: ...

def fake_cuda_memset(va: int, value: int, bytes: int) -> int: ...

def create_fake_cuda_arena(reserve_bytes: int, chunk_bytes: int = ..., handle_bytes: int = ..., zero_fill: bool = ..., defer_zero_reads: bool | None = ...) -> jax_vmm._core.Arena:
    """
    A core Arena over the real CUDA driver code running on the fake CUDA driver. defer_zero_reads=None: as a production arena, from JAX_VMM_DEFER_ZERO_READS.
    """
