"""An independent oracle for GPU tests: asks the CUDA driver itself (through cuda-python,
``cuda.bindings.driver``) what backs an address, so tests never trust jax_vmm's own
counters.

What the driver tells us about an address inside an arena's reservation:

* ``access(addr)``: the access flags of the mapping there. jax_vmm maps one shared
  zero chunk read-only (``READ`` = 1) under every unbacked chunk and real memory
  read-write (``READWRITE`` = 3) under every committed chunk. ``None``: nothing mapped
  (a hole: reading it would fault the GPU).
* ``allocation_handle(addr)``: the physical allocation mapped there
  (``cuMemRetainAllocationHandle``, released again at once). All unbacked chunks of a
  reservation share the zero chunk's allocation.
* ``address_range(addr)``: ``cuMemGetAddressRange`` of the mapping.
* ``mem_free()``: ``cuMemGetInfo`` free bytes, to see physical memory come and go.

Also ``probe_driver_facts()``: raw VMM experiments whose answers shape the driver (can
one ``cuMemUnmap`` span several mappings; is read-only access supported; is a re-created
allocation zeroed). Needs a current primary context, so every call pushes the device's
primary context (the one JAX uses) for its duration. Thread-safe (no shared state).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Collection, Iterator

from cuda.bindings import driver as cu

READ = int(cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ)
READWRITE = int(cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)


class CudaCallError(RuntimeError):
    def __init__(self, call: str, result: cu.CUresult):
        _, name = cu.cuGetErrorName(result)
        name = name.decode() if isinstance(name, bytes) else str(name)
        super().__init__(f"{call} failed with {name}")
        self.result = result


def _ok(call: str, out: tuple):
    """Unpacks a cuda-python result tuple, raising on an error code."""
    err, *rest = out
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaCallError(call, err)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


@dataclasses.dataclass(frozen=True)
class ChunkState:
    access: int | None  # READ, READWRITE or None (unmapped)
    handle: int | None  # allocation handle value (None when unmapped)

    @property
    def kind(self) -> str:
        return {READ: "ro", READWRITE: "rw", None: "hole"}.get(self.access, f"?{self.access}")


class CudaOracle:
    """Driver-side view of one CUDA device (``ordinal`` as CUDA numbers it, i.e. a JAX
    device's ``local_hardware_id``)."""

    def __init__(self, ordinal: int = 0):
        _ok("cuInit", cu.cuInit(0))
        self.ordinal = ordinal
        self.device = _ok("cuDeviceGet", cu.cuDeviceGet(ordinal))
        self._location = cu.CUmemLocation()
        self._location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._location.id = ordinal

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        ctx = _ok("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(self.device))
        try:
            _ok("cuCtxPushCurrent", cu.cuCtxPushCurrent(ctx))
            try:
                yield
            finally:
                _ok("cuCtxPopCurrent", cu.cuCtxPopCurrent())
        finally:
            _ok("cuDevicePrimaryCtxRelease", cu.cuDevicePrimaryCtxRelease(self.device))

    # -- single addresses ---------------------------------------------------------------
    def access(self, addr: int) -> int | None:
        with self.context():
            err, flags = cu.cuMemGetAccess(self._location, addr)
        if err != cu.CUresult.CUDA_SUCCESS:
            return None
        return int(flags)

    def allocation_handle(self, addr: int) -> int | None:
        with self.context():
            err, handle = cu.cuMemRetainAllocationHandle(addr)
            if err != cu.CUresult.CUDA_SUCCESS:
                return None
            _ok("cuMemRelease(retained)", cu.cuMemRelease(handle))
        return int(handle)

    def address_range(self, addr: int) -> tuple[int, int] | None:
        with self.context():
            err, base, size = cu.cuMemGetAddressRange(addr)
        if err != cu.CUresult.CUDA_SUCCESS:
            return None
        return int(base), int(size)

    def state(self, addr: int) -> ChunkState:
        return ChunkState(self.access(addr), self.allocation_handle(addr))

    def mem_free(self) -> int:
        with self.context():
            free, _total = _ok("cuMemGetInfo", cu.cuMemGetInfo())
        return int(free)

    def mem_total(self) -> int:
        with self.context():
            _free, total = _ok("cuMemGetInfo", cu.cuMemGetInfo())
        return int(total)

    # -- ranges -------------------------------------------------------------------------
    def chunk_states(self, base: int, nbytes: int, chunk: int) -> list[ChunkState]:
        """The state of every chunk of ``[base, base + nbytes)`` (base chunk-aligned)."""
        return [self.state(base + off) for off in range(0, nbytes, chunk)]

    def kinds(
        self, base: int, nbytes: int, chunk: int, zero_handles: Collection[int] | None = None
    ) -> list[str]:
        """Per chunk: 'rw' (own writable memory), 'zero' (read-only; when ``zero_handles``
        is given, also one of the shared zero allocations), 'ro' (read-only, other
        memory), 'hole'."""
        out = []
        for s in self.chunk_states(base, nbytes, chunk):
            if s.access == READ and (zero_handles is None or s.handle in zero_handles):
                out.append("zero")
            else:
                out.append(s.kind)
        return out


# -- raw-driver experiments ------------------------------------------------------------
def _prop(ordinal: int) -> cu.CUmemAllocationProp:
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    return prop


def _access(ordinal: int, flags: int) -> cu.CUmemAccessDesc:
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = ordinal
    desc.flags = cu.CUmemAccess_flags(flags)
    return desc


def granularity(ordinal: int = 0) -> int:
    oracle = CudaOracle(ordinal)
    with oracle.context():
        return int(
            _ok(
                "cuMemGetAllocationGranularity",
                cu.cuMemGetAllocationGranularity(
                    _prop(ordinal),
                    cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                ),
            )
        )


def probe_driver_facts(ordinal: int = 0) -> dict:
    """Facts about this driver that jax_vmm's CUDA driver relies on or could exploit.
    Cleans up after itself. Returns a dict of findings."""
    import numpy as np

    oracle = CudaOracle(ordinal)
    g = granularity(ordinal)
    facts: dict = {"granularity": g}
    ok = cu.CUresult.CUDA_SUCCESS
    with oracle.context():
        va = int(_ok("cuMemAddressReserve", cu.cuMemAddressReserve(4 * g, 0, 0, 0)))
        handles = [_ok("cuMemCreate", cu.cuMemCreate(g, _prop(ordinal), 0)) for _ in range(2)]
        try:
            for i, h in enumerate(handles):
                _ok("cuMemMap", cu.cuMemMap(va + i * g, g, 0, h, 0))
            # 1. Does a sub-range of one mapping unmap? (documented: no)
            facts["unmap_partial_mapping_ok"] = cu.cuMemUnmap(va, g // 2)[0] == ok
            # 2. Does one cuMemUnmap span two adjacent whole mappings? (jax_vmm tries this
            #    once per reservation teardown and falls back to one call per chunk)
            spans = cu.cuMemUnmap(va, 2 * g)[0] == ok
            facts["unmap_spans_mappings"] = spans
            if not spans:
                for i in range(2):
                    _ok("cuMemUnmap", cu.cuMemUnmap(va + i * g, g))
            # 3. The zero-chunk layout: one allocation mapped at two addresses, read-only
            #    access set by one call over both.
            for i in range(2):
                _ok("cuMemMap", cu.cuMemMap(va + i * g, g, 0, handles[0], 0))
            facts["read_only_access_ok"] = (
                cu.cuMemSetAccess(va, 2 * g, [_access(ordinal, READ)], 1)[0] == ok
            )
            facts["access_flags_seen"] = oracle.access(va + g)
            h0, h1 = oracle.allocation_handle(va), oracle.allocation_handle(va + g)
            facts["retained_handle_is_original"] = h0 == h1 == int(handles[0])
            facts["address_range"] = oracle.address_range(va + g)
            facts["address_range_if_per_mapping"] = (va + g, g)
            for i in range(2):
                _ok("cuMemUnmap", cu.cuMemUnmap(va + i * g, g))
            # 3b. The zero layout maps whole zero allocations of different sizes side by
            #     side and makes them read-only with one call. (Informational: whether part
            #     of an allocation maps at all; the H200 refuses it.)
            big = _ok("cuMemCreate", cu.cuMemCreate(2 * g, _prop(ordinal), 0))
            try:
                part = cu.cuMemMap(va, g, 0, big, 0)[0] == ok
                facts["partial_allocation_map_ok"] = part
                if part:
                    cu.cuMemUnmap(va, g)
                _ok("cuMemMap", cu.cuMemMap(va, g, 0, handles[0], 0))
                _ok("cuMemMap", cu.cuMemMap(va + g, 2 * g, 0, big, 0))
                facts["read_only_over_pieces_ok"] = (
                    cu.cuMemSetAccess(va, 3 * g, [_access(ordinal, READ)], 1)[0] == ok
                )
                cu.cuMemUnmap(va, g)
                cu.cuMemUnmap(va + g, 2 * g)
            finally:
                _ok("cuMemRelease", cu.cuMemRelease(big))
            # 4. Is a fresh cuMemCreate zeroed after this process released dirty memory?
            #    (informational: jax_vmm gives committed chunks no zero guarantee)
            _ok("cuMemMap", cu.cuMemMap(va, g, 0, handles[1], 0))
            _ok("cuMemSetAccess", cu.cuMemSetAccess(va, g, [_access(ordinal, READWRITE)], 1))
            _ok("cuMemsetD8", cu.cuMemsetD8(va, 0xAB, g))
            _ok("cuCtxSynchronize", cu.cuCtxSynchronize())
            _ok("cuMemUnmap", cu.cuMemUnmap(va, g))
            _ok("cuMemRelease", cu.cuMemRelease(handles[1]))
            handles[1] = _ok("cuMemCreate", cu.cuMemCreate(g, _prop(ordinal), 0))
            _ok("cuMemMap", cu.cuMemMap(va, g, 0, handles[1], 0))
            _ok("cuMemSetAccess", cu.cuMemSetAccess(va, g, [_access(ordinal, READWRITE)], 1))
            host = np.ones(1 << 16, np.uint8)
            _ok("cuMemcpyDtoH", cu.cuMemcpyDtoH(host.ctypes.data, va, host.nbytes))
            facts["recreated_chunk_reads_zero"] = not host.any()
            _ok("cuMemUnmap", cu.cuMemUnmap(va, g))
        finally:
            for i in range(4):  # whatever is still mapped (errors ignored)
                cu.cuMemUnmap(va + i * g, g)
            for h in handles:
                cu.cuMemRelease(h)
            cu.cuMemAddressFree(va, 4 * g)
    return facts


if __name__ == "__main__":
    import json

    print(json.dumps(probe_driver_facts(), indent=1, default=str))
