"""Commit/decommit throughput of a jax_vmm arena next to the raw driver calls.

For each chunk size (handle size) and range size it times, in one process:
  arena     Buffer.commit() / Buffer.decommit() of the whole range
  raw       the plain driver sequence for the same bytes and handle size, no zero chunk
            GPU (cuda-python): commit = cuMemCreate + cuMemMap per handle, one
            cuMemSetAccess for the run; decommit = cuMemUnmap + cuMemRelease per handle.
            CPU (ctypes): the host driver's syscalls (fallocate + mmap(MAP_FIXED) per chunk,
            one mprotect; decommit = mmap of the zero mapping + punch hole per chunk).
  design    GPU only: the raw sequence plus the least jax_vmm's semantics must add:
            commit unmaps the run's zero mappings first (one call where the driver
            allows) and zero-fills the new run (one memset + stream sync); decommit maps
            the zero chunk back per chunk with one read-only cuMemSetAccess per run.
            What a run-level driver API (run-api.patch) can reach.
ratio = arena time / raw time (goal: <= 1.25); "(adj)" subtracts the raw loops' Python
per-call overhead (cuda-python / ctypes, measured and printed) from the raw time.
Also times arena creation for a 64 GiB reservation against the raw reserve calls.

  python bench/commit.py                    # GPU if JAX has one, else CPU
  python bench/commit.py --device cpu --sizes 2M,64M --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

import jax_vmm
from _common import (
    GiB,
    MiB,
    Table,
    fmt,
    fmt_size,
    median_time,
    parse_list,
    parse_size,
    pick_device,
    ratio,
    write_json,
)


def time_pair(
    commit: Callable[[], None], decommit: Callable[[], None], repeats: int
) -> tuple[float, float]:
    """Median seconds of commit and of decommit, alternating them (warm-up first)."""
    commit()
    decommit()
    tc, td = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        commit()
        t1 = time.perf_counter()
        decommit()
        t2 = time.perf_counter()
        tc.append(t1 - t0)
        td.append(t2 - t1)
    return statistics.median(tc), statistics.median(td)


def seconds_per_call(fn: Callable[[], object], n: int = 2000) -> float:
    """Mean wall time of n calls: the Python overhead of a call that does no work."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


# -- raw baselines ------------------------------------------------------------------------
class RawCuda:
    """Raw VMM calls through cuda-python on one device (its primary context)."""

    def __init__(self, ordinal: int):
        from cuda.bindings import driver as cu

        self.cu = cu
        self._ok(cu.cuInit(0))
        self.dev = self._ok(cu.cuDeviceGet(ordinal))
        self.ctx = self._ok(cu.cuDevicePrimaryCtxRetain(self.dev))
        self._ok(cu.cuCtxPushCurrent(self.ctx))  # for this (main) thread, for the run
        self.prop = cu.CUmemAllocationProp()
        self.prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = ordinal
        self.rw = [self._access(ordinal, cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)]
        self.ro = [self._access(ordinal, cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ)]
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

    def create(self, chunk: int):
        return self._ok(self.cu.cuMemCreate(chunk, self.prop, 0))

    def span_unmap_ok(self, chunk: int) -> bool:
        """Whether one cuMemUnmap may cover several adjacent mappings (probed once)."""
        if not hasattr(self, "_span"):
            va = self.reserve(2 * chunk, chunk & -chunk)
            h = self.create(chunk)
            for i in range(2):
                self._ok(self.cu.cuMemMap(va + i * chunk, chunk, 0, h, 0))
            self._span = self.cu.cuMemUnmap(va, 2 * chunk)[0] == self.cu.CUresult.CUDA_SUCCESS
            if not self._span:
                self.unmap_each(va, 2 * chunk, chunk)
            self._ok(self.cu.cuMemRelease(h))
            self.free(va, 2 * chunk)
        return self._span

    def ops(self, va: int, size: int, chunk: int, zero=None):
        """(commit, decommit, driver calls per commit, per decommit) over [va, va+size).
        With `zero` (a handle) jax_vmm's semantics at their cheapest: the range starts
        zero-mapped; commit unmaps the zero run (one call where the driver allows) before
        mapping and zero-fills the new run; decommit maps the zero chunk back and sets the
        run read-only once."""
        cu, ok, n = self.cu, self._ok, size // chunk
        span = zero is not None and n > 1 and self.span_unmap_ok(chunk)
        handles: list = []

        def unmap_run():
            if span:
                ok(cu.cuMemUnmap(va, size))
            else:
                for i in range(n):
                    ok(cu.cuMemUnmap(va + i * chunk, chunk))

        def commit():
            if zero is not None:
                unmap_run()
            for i in range(n):
                h = ok(cu.cuMemCreate(chunk, self.prop, 0))
                ok(cu.cuMemMap(va + i * chunk, chunk, 0, h, 0))
                handles.append(h)
            ok(cu.cuMemSetAccess(va, size, self.rw, 1))
            if zero is not None:
                ok(cu.cuMemsetD8Async(va, 0, size, self.stream))
                ok(cu.cuStreamSynchronize(self.stream))

        def decommit():
            if zero is None:
                for i, h in enumerate(handles):
                    ok(cu.cuMemUnmap(va + i * chunk, chunk))
                    ok(cu.cuMemRelease(h))
            else:
                unmap_run()
                for i in range(n):
                    ok(cu.cuMemMap(va + i * chunk, chunk, 0, zero, 0))
                ok(cu.cuMemSetAccess(va, size, self.ro, 1))
                for h in handles:
                    ok(cu.cuMemRelease(h))
            handles.clear()

        unmaps = 0 if zero is None else (1 if span else n)
        if zero is None:
            return commit, decommit, 2 * n + 1, 2 * n
        return commit, decommit, unmaps + 2 * n + 3, unmaps + 2 * n + 1

    def zero_map(self, va: int, size: int, chunk: int, zero) -> None:
        for off in range(0, size, chunk):
            self._ok(self.cu.cuMemMap(va + off, chunk, 0, zero, 0))
        self._ok(self.cu.cuMemSetAccess(va, size, self.ro, 1))

    def unmap_each(self, va: int, size: int, chunk: int) -> None:
        for off in range(0, size, chunk):
            self._ok(self.cu.cuMemUnmap(va + off, chunk))


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
        """Seconds per ctypes call, measured on a system call that does no work."""
        return seconds_per_call(lambda: self.mprotect(None, 0, 0))

    def reserve(self, size: int) -> int:
        flags = self.MAP_PRIVATE | self.MAP_ANONYMOUS | self.MAP_NORESERVE
        return self._check(self.mmap(None, size, self.PROT_READ, flags, -1, 0), "mmap")

    def unreserve(self, va: int, size: int) -> None:
        self._check(self.munmap(va, size), "munmap")

    def ops(self, va: int, size: int, chunk: int):
        n, fd = size // chunk, self.fd
        os.ftruncate(fd, max(os.fstat(fd).st_size, size))
        zero_flags = self.MAP_PRIVATE | self.MAP_ANONYMOUS | self.MAP_FIXED | self.MAP_NORESERVE

        def commit():
            for i in range(n):
                self._check(self.fallocate(fd, 0, i * chunk, chunk), "fallocate")
                self._check(
                    self.mmap(
                        va + i * chunk,
                        chunk,
                        self.PROT_READ,
                        self.MAP_SHARED | self.MAP_FIXED,
                        fd,
                        i * chunk,
                    ),
                    "mmap",
                )
            self._check(self.mprotect(va, size, self.PROT_READ | self.PROT_WRITE), "mprotect")

        def decommit():
            for i in range(n):
                self._check(
                    self.mmap(va + i * chunk, chunk, self.PROT_READ, zero_flags, -1, 0),
                    "mmap(zero)",
                )
                self._check(
                    self.fallocate(
                        fd, self.FALLOC_FL_PUNCH_HOLE | self.FALLOC_FL_KEEP_SIZE, i * chunk, chunk
                    ),
                    "fallocate(punch)",
                )

        return commit, decommit, 2 * n + 1, 2 * n


# -- the benchmark ------------------------------------------------------------------------
def bench_ranges(device, sizes, chunks, repeats, raw) -> list[dict]:
    rows = []
    on_gpu = device.platform != "cpu"
    overhead = raw.call_overhead() if raw is not None else 0.0
    for chunk_arg in chunks:
        for size in sizes:
            arena = jax_vmm.Arena(
                size + 4 * max(chunk_arg, 2 * MiB), device=device, chunk_bytes=chunk_arg or None
            )
            chunk = arena.chunk_bytes
            if size % chunk:
                arena.close()
                continue
            buf = arena.allocate((size,), jnp.uint8)
            a_c, a_d = time_pair(buf.commit, buf.decommit, repeats)
            arena.close()
            row = dict(chunk=chunk, size=size, arena_commit_s=a_c, arena_decommit_s=a_d)
            if raw is not None:
                if on_gpu:
                    va = raw.reserve(size, chunk & -chunk)
                    c, d, nc, nd = raw.ops(va, size, chunk)
                    row["raw_commit_s"], row["raw_decommit_s"] = time_pair(c, d, repeats)
                    zero = raw.create(chunk)
                    raw.zero_map(va, size, chunk, zero)
                    zc, zd, _, _ = raw.ops(va, size, chunk, zero=zero)
                    row["design_commit_s"], row["design_decommit_s"] = time_pair(zc, zd, repeats)
                    raw.unmap_each(va, size, chunk)
                    raw._ok(raw.cu.cuMemRelease(zero))
                    raw.free(va, size)
                else:
                    va = raw.reserve(size)
                    c, d, nc, nd = raw.ops(va, size, chunk)
                    row["raw_commit_s"], row["raw_decommit_s"] = time_pair(c, d, repeats)
                    raw.unreserve(va, size)
                row["raw_commit_adj_s"] = max(row["raw_commit_s"] - nc * overhead, 1e-9)
                row["raw_decommit_adj_s"] = max(row["raw_decommit_s"] - nd * overhead, 1e-9)
            rows.append(row)
            print_row(row)
    return rows


def gibs(n: int, s: float | None) -> str:
    return fmt(n / GiB / s if s else None, "{:.1f}", "-")


def fmt_ratio(a: float, b: float | None) -> str:
    return fmt(ratio(a, b), "{:.2f}x", "-")


TABLE = Table(
    ("chunk", 8),
    ("range", 8),
    ("|", 1),
    ("commit GiB/s: arena", 19),
    ("raw", 9),
    ("design", 9),
    ("arena/raw", 9),
    ("(adj)", 7),
    ("|", 1),
    ("decommit GiB/s: arena", 21),
    ("raw", 9),
    ("design", 9),
    ("arena/raw", 9),
    ("(adj)", 7),
)


def print_row(r: dict) -> None:
    n = r["size"]
    cells = [fmt_size(r["chunk"]), fmt_size(n)]
    for op in ("commit", "decommit"):
        arena = r[f"arena_{op}_s"]
        cells += [
            "|",
            gibs(n, arena),
            gibs(n, r.get(f"raw_{op}_s")),
            gibs(n, r.get(f"design_{op}_s")),
            fmt_ratio(arena, r.get(f"raw_{op}_s")),
            fmt_ratio(arena, r.get(f"raw_{op}_adj_s")),
        ]
    print(TABLE.row(*cells), flush=True)


def bench_creation(device, reserve: int, chunks, repeats, raw) -> list[dict]:
    rows = []
    on_gpu = device.platform != "cpu"
    for chunk_arg in chunks:
        holder: list = []

        def create():
            holder.append(jax_vmm.Arena(reserve, device=device, chunk_bytes=chunk_arg or None))

        def destroy():
            holder.pop().close()  # close, then the last reference goes: unreserve

        t_create, t_destroy = time_pair(create, destroy, repeats)
        probe = jax_vmm.Arena(1, device=device, chunk_bytes=chunk_arg or None)
        chunk = probe.chunk_bytes  # what chunk_arg resolves to on this device
        probe.close()
        del probe
        row = dict(reserve=reserve, chunk=chunk, arena_create_s=t_create, arena_destroy_s=t_destroy)
        if raw is not None and on_gpu:

            def reserve_only():
                raw.free(raw.reserve(reserve, chunk & -chunk), reserve)

            row["raw_reserve_s"] = median_time(reserve_only, repeats, warmups=1)
            zero = raw.create(chunk)
            state: list = []

            def zero_reserve():
                va = raw.reserve(reserve, chunk & -chunk)
                raw.zero_map(va, reserve, chunk, zero)
                state.append(va)

            def zero_release():
                va = state.pop()
                raw.unmap_each(va, reserve, chunk)
                raw.free(va, reserve)

            row["raw_zero_reserve_s"], row["raw_zero_release_s"] = time_pair(
                zero_reserve, zero_release, max(1, repeats // 2)
            )
            raw._ok(raw.cu.cuMemRelease(zero))
        elif raw is not None:
            row["raw_reserve_s"] = median_time(
                lambda: raw.unreserve(raw.reserve(reserve), reserve), repeats, warmups=1
            )
        rows.append(row)
        ms = lambda k: f"{row[k] * 1e3:8.2f} ms" if k in row else "       -"  # noqa: E731
        print(
            f"{fmt_size(reserve):>8} chunk {fmt_size(chunk):>7}: "
            f"arena create {ms('arena_create_s')}"
            f", close+destroy {ms('arena_destroy_s')} | raw reserve {ms('raw_reserve_s')}"
            f", raw zero-mapped reserve {ms('raw_zero_reserve_s')}"
            f", its teardown {ms('raw_zero_release_s')}",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    p.add_argument(
        "--sizes", type=parse_list(parse_size), default=None, help="range sizes, e.g. 2M,64M,1G,4G"
    )
    p.add_argument(
        "--chunks",
        type=parse_list(parse_size),
        default="0,64M",
        help="chunk sizes; 0 = the driver default",
    )
    p.add_argument("--reserve", default="64G", help="reservation for the creation benchmark")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-raw", action="store_true", help="arena only")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    device = pick_device(args.device)
    on_gpu = device.platform != "cpu"
    sizes = args.sizes or parse_list(parse_size)("2M,64M,1G,4G" if on_gpu else "2M,64M,256M")
    raw = None
    if not args.no_raw:
        if on_gpu:
            ordinal = getattr(device, "local_hardware_id", None)
            raw = RawCuda(device.id if ordinal is None else int(ordinal))
        else:
            raw = RawHost()
    print(
        f"jax_vmm commit benchmark on {device} ({device.platform}); jax {jax.__version__}; "
        f"median of {args.repeats}; raw = {'cuda-python' if on_gpu else 'ctypes syscalls'}"
    )
    for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        print(f"  {k}={os.environ.get(k, '<unset>')}")
    if raw is not None:
        print(
            f"  raw per-call Python overhead ~{raw.call_overhead() * 1e6:.2f} us "
            "('adj' columns subtract it per raw call)"
        )
    print(TABLE.header())
    ranges = bench_ranges(device, sizes, args.chunks, args.repeats, raw)
    print()
    creation = bench_creation(device, parse_size(args.reserve), args.chunks, args.repeats, raw)
    if args.json:
        write_json(
            args.json,
            dict(
                device=str(device),
                platform=device.platform,
                jax=jax.__version__,
                ranges=ranges,
                creation=creation,
            ),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
