"""Raw-driver baselines for the benchmarks: the bare CUDA VMM calls through cuda-python
(GPU) and the host driver's system calls through ctypes (CPU), plus the pinned host <->
device copy bandwidth. Imported as ``_raw`` by bench/commit.py, growth.py and sleep.py."""

from __future__ import annotations

import ctypes
import os
import statistics
import time
from collections.abc import Callable


def seconds_per_call(fn: Callable[[], object], n: int = 2000) -> float:
    """Mean wall time of n calls: the Python overhead of a call that does no work."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


class RawCuda:
    """Raw VMM calls through cuda-python on one device (its primary context, pushed on the
    calling thread for the run)."""

    def __init__(self, ordinal: int):
        from cuda.bindings import driver as cu

        self.cu = cu
        self._ok(cu.cuInit(0))
        self.dev = self._ok(cu.cuDeviceGet(ordinal))
        self.ctx = self._ok(cu.cuDevicePrimaryCtxRetain(self.dev))
        self._ok(cu.cuCtxPushCurrent(self.ctx))
        self.prop = cu.CUmemAllocationProp()
        self.prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = ordinal
        self.rw = [self._access(ordinal, cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)]
        self.stream = self._ok(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))

    def _access(self, ordinal, flags):
        d = self.cu.CUmemAccessDesc()
        d.location.type = self.cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        d.location.id = ordinal
        d.flags = flags
        return d

    def _ok(self, out):
        err, *rest = out
        if err != self.cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver call failed: {self.cu.cuGetErrorName(err)[1]}")
        return rest[0] if len(rest) == 1 else (tuple(rest) or None)

    def call_overhead(self) -> float:
        """Seconds per cuda-python call, measured on a driver call that does no work."""
        return seconds_per_call(self.cu.cuCtxGetCurrent)

    def reserve(self, size: int, align: int) -> int:
        return int(self._ok(self.cu.cuMemAddressReserve(size, align, 0, 0)))

    def free(self, va: int, size: int) -> None:
        self._ok(self.cu.cuMemAddressFree(va, size))

    def runs_ops(self, runs: list[tuple[int, int]], handle: int):
        """(commit, decommit, calls per commit, calls per decommit) of the raw sequence for
        runs of (va, bytes): per handle of `handle` bytes cuMemCreate + cuMemMap, one
        cuMemSetAccess per run; decommit: cuMemUnmap + cuMemRelease per handle. No zero
        chunk, no fill: the least any VMM allocator does."""
        cu, ok = self.cu, self._ok
        pieces = [
            (va + off, min(handle, size - off))
            for va, size in runs
            for off in range(0, size, handle)
        ]
        held: list = []

        def commit():
            for va, n in pieces:
                h = ok(cu.cuMemCreate(n, self.prop, 0))
                ok(cu.cuMemMap(va, n, 0, h, 0))
                held.append(h)
            for va, size in runs:
                ok(cu.cuMemSetAccess(va, size, self.rw, 1))

        def decommit():
            for (va, n), h in zip(pieces, held):
                ok(cu.cuMemUnmap(va, n))
                ok(cu.cuMemRelease(h))
            held.clear()

        return commit, decommit, 2 * len(pieces) + len(runs), 2 * len(pieces)

    def free_bytes(self) -> int:
        return int(self._ok(self.cu.cuMemGetInfo())[0])

    def pinned_device_cost(self, nbytes: int) -> int:
        """Device memory (cuMemGetInfo) that `nbytes` of page-locked host memory takes while
        it is allocated: the device-side mapping of host pages is not free."""
        cu, ok = self.cu, self._ok
        before = self.free_bytes()
        host = ok(cu.cuMemHostAlloc(nbytes, 0))
        try:
            return before - self.free_bytes()
        finally:
            ok(cu.cuMemFreeHost(host))

    def pinned_copy_bandwidth(self, nbytes: int, repeats: int = 5) -> tuple[float, float]:
        """(device -> host, host -> device) bytes per second of one large copy between
        page-locked host memory and device memory, median of `repeats`."""
        cu, ok = self.cu, self._ok
        host = ok(cu.cuMemHostAlloc(nbytes, 0))
        dev = ok(cu.cuMemAlloc(nbytes))
        try:
            out = []
            for to_host in (True, False):
                samples = []
                for i in range(repeats + 1):
                    t0 = time.perf_counter()
                    if to_host:
                        ok(cu.cuMemcpyDtoHAsync(host, dev, nbytes, self.stream))
                    else:
                        ok(cu.cuMemcpyHtoDAsync(dev, host, nbytes, self.stream))
                    ok(cu.cuStreamSynchronize(self.stream))
                    if i:
                        samples.append(time.perf_counter() - t0)
                out.append(nbytes / statistics.median(samples))
            return out[0], out[1]
        finally:
            ok(cu.cuMemFree(dev))
            ok(cu.cuMemFreeHost(host))


class RawHost:
    """The host driver's system calls through ctypes (x86-64/aarch64 Linux constants)."""

    PROT_READ, PROT_WRITE = 1, 2
    MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 1, 2, 0x10, 0x20, 0x4000
    FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2

    def __init__(self):
        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap = libc.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        self.munmap = libc.munmap
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.mprotect = libc.mprotect
        self.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.fallocate = libc.fallocate
        self.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        self.fd = os.memfd_create("jax_vmm_bench_raw")

    def _check(self, rc, what):
        if rc == -1 or rc == ctypes.c_void_p(-1).value:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")
        return rc

    def call_overhead(self) -> float:
        return seconds_per_call(lambda: self.mprotect(None, 0, 0))

    def reserve(self, size: int) -> int:
        flags = self.MAP_PRIVATE | self.MAP_ANONYMOUS | self.MAP_NORESERVE
        return self._check(self.mmap(None, size, self.PROT_READ, flags, -1, 0), "mmap")

    def unreserve(self, va: int, size: int) -> None:
        self._check(self.munmap(va, size), "munmap")

    def runs_ops(self, runs: list[tuple[int, int]], handle: int, base: int):
        """The host driver's syscalls for runs of (va, bytes), allocations of `handle`
        bytes at file offset va - base."""
        fd = self.fd
        end = max(va - base + size for va, size in runs)
        os.ftruncate(fd, max(os.fstat(fd).st_size, end))
        zero_flags = self.MAP_PRIVATE | self.MAP_ANONYMOUS | self.MAP_FIXED | self.MAP_NORESERVE
        pieces = [
            (va + off, min(handle, size - off))
            for va, size in runs
            for off in range(0, size, handle)
        ]

        def commit():
            for va, n in pieces:
                self._check(self.fallocate(fd, 0, va - base, n), "fallocate")
                self._check(
                    self.mmap(
                        va, n, self.PROT_READ, self.MAP_SHARED | self.MAP_FIXED, fd, va - base
                    ),
                    "mmap",
                )
            for va, size in runs:
                self._check(self.mprotect(va, size, self.PROT_READ | self.PROT_WRITE), "mprotect")

        def decommit():
            for va, n in pieces:
                self._check(self.mmap(va, n, self.PROT_READ, zero_flags, -1, 0), "mmap(zero)")
                self._check(
                    self.fallocate(
                        fd, self.FALLOC_FL_PUNCH_HOLE | self.FALLOC_FL_KEEP_SIZE, va - base, n
                    ),
                    "fallocate(punch)",
                )

        return commit, decommit, 2 * len(pieces) + len(runs), 2 * len(pieces)


def raw_for(device):
    """The raw baseline of a JAX device: RawCuda on a GPU (None without cuda-python), RawHost
    on the CPU."""
    if device.platform == "cpu":
        return RawHost()
    try:
        ordinal = getattr(device, "local_hardware_id", None)
        return RawCuda(device.id if ordinal is None else int(ordinal))
    except ImportError:
        return None
