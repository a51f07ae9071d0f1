"""Sleep/wake of a KV cache: many cycles of a large cache, throughput against the measured
page-locked host <-> device copy bandwidth, leaks by the driver's own count, contents
checked bit for bit after every wake.

    python bench/sleep.py                          # GPU: a 20 GiB cache, 100 cycles
    python bench/sleep.py --gib 0.25 --cycles 10   # a quick run (also on the CPU)

The cache: 8 layers, 8 KV heads x 128, bfloat16, one sequence (the gpu preset of
bench/growth.py), --gib in all; every word holds a function of its position and buffer,
so a wake that restored anything else (a block moved, a stale chunk, zeros) fails the
check. Goals (issue #15): 0 bytes leaked over the cycles, contents bit-exact, sleep and
wake throughput >= 80% of the pinned copy bandwidth (device -> host for sleep, host ->
device for wake). The first cycle pins the host staging memory (kept for the next cycles);
steady-state numbers are the median of the later cycles.

Leaks are read from the driver (cuMemGetInfo), with cupy's pool emptied before every
reading and its kernels loaded before the first: before the first sleep against after the
last wake, and before the arena against after its close. Pinned host memory costs device
memory too (the GPU's mapping of the host pages), so the bench also measures what a raw
cuMemHostAlloc of the staging size takes: that is what the kept staging memory holds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_vmm  # noqa: E402
from _common import GiB, pick_device, write_json  # noqa: E402
from _raw import RawCuda, raw_for  # noqa: E402

GOLDEN = 2654435761  # Knuth's multiplicative hash constant: word i of buffer b holds i*G + b


class DeviceWords:
    """Fills and checks arena buffers in place: cupy on a GPU (no JAX view, no copy to
    the host), NumPy over the host address on the CPU."""

    def __init__(self, device):
        self.gpu = device.platform != "cpu"
        if self.gpu:
            import cupy

            self.cp = cupy

    def _array(self, buf):
        n = buf.nbytes // 4
        if self.gpu:
            cp = self.cp
            mem = cp.cuda.UnownedMemory(buf.address, buf.nbytes, buf)
            return cp.ndarray((n,), cp.uint32, cp.cuda.MemoryPointer(mem, 0))
        import ctypes

        return np.ctypeslib.as_array((ctypes.c_uint32 * n).from_address(buf.address))

    def _pattern(self, n: int, seed: int):
        xp = self.cp if self.gpu else np
        return xp.arange(n, dtype=xp.uint32) * xp.uint32(GOLDEN) + xp.uint32(seed)

    def fill(self, buf, seed: int) -> None:
        a = self._array(buf)
        a[...] = self._pattern(a.size, seed)
        if self.gpu:
            self.cp.cuda.runtime.deviceSynchronize()

    def check(self, buf, seed: int) -> bool:
        a = self._array(buf)
        return bool((a == self._pattern(a.size, seed)).all())

    def empty_pool(self) -> None:
        """Give cupy's cached blocks back, so that cuMemGetInfo sees only the arena."""
        if self.gpu:
            self.cp.get_default_memory_pool().free_all_blocks()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    p.add_argument(
        "--gib", type=float, default=None, help="cache size (default 20 on a GPU, 0.25 on the CPU)"
    )
    p.add_argument("--cycles", type=int, default=None, help="default 100 on a GPU, 10 on the CPU")
    p.add_argument("--keep", choices=["host", "discard"], default="host")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = pick_device(args.device)
    on_gpu = device.platform != "cpu"
    gib = args.gib if args.gib is not None else (20.0 if on_gpu else 0.25)
    cycles = args.cycles or (100 if on_gpu else 10)

    raw = raw_for(device)
    if isinstance(raw, RawCuda):
        d2h, h2d = raw.pinned_copy_bandwidth(1 << 30)
        mem_free = raw.free_bytes
    else:
        a = np.ones(1 << 28, np.uint8)
        b = np.ones_like(a)  # touched: the copy is timed, not the page faults
        t0 = time.perf_counter()
        np.copyto(b, a)
        d2h = h2d = a.nbytes / (time.perf_counter() - t0)
        mem_free = None
    print(
        f"sleep/wake benchmark on {device}; jax {jax.__version__}; {gib:g} GiB cache, "
        f"{cycles} cycles, keep={args.keep}"
    )
    print(
        f"  pinned copy bandwidth: device->host {d2h / 1e9:.1f} GB/s, host->device "
        f"{h2d / 1e9:.1f} GB/s (1 GiB, cuda-python)"
        if on_gpu
        else f"  host memcpy bandwidth {d2h / 1e9:.1f} GB/s"
    )

    words = DeviceWords(device)
    if mem_free:
        inner_free = mem_free

        def mem_free() -> int:
            words.empty_pool()
            return inner_free()

    free_before_arena = mem_free() if mem_free else None
    L, H, D = 8, 8, 128
    token_bytes = 2 * L * H * D * 2
    tokens = int(gib * GiB) // token_bytes
    kv = jax_vmm.kv_arena(
        num_layers=L,
        num_kv_heads=H,
        head_dim=D,
        max_tokens=tokens,
        dtype=jnp.bfloat16,
        device=device,
    )
    kv.ensure(tokens)
    for i, b in enumerate(kv.buffers):
        words.fill(b, i)
    bad = sum(not words.check(b, i) for i, b in enumerate(kv.buffers))  # loads the kernels
    backed = kv.arena.backed_bytes
    free0 = mem_free() if mem_free else None
    sleeps, wakes, freed = [], [], []
    free1 = None  # after the first cycle
    for cycle in range(cycles):
        t0 = time.perf_counter()
        kv.sleep(args.keep)
        t1 = time.perf_counter()
        if mem_free:
            freed.append(mem_free() - free0)
        kv.wake()
        t2 = time.perf_counter()
        sleeps.append(t1 - t0)
        wakes.append(t2 - t1)
        if args.keep == "host":
            bad += sum(not words.check(b, i) for i, b in enumerate(kv.buffers))
        if cycle == 0 and mem_free:
            free1 = mem_free()
    free_end = mem_free() if mem_free else None
    leaked = (free0 - free_end) if mem_free else None
    leaked_steady = (free1 - free_end) if free1 is not None and cycles > 1 else None
    s = kv.stats()
    kv.close()
    free_after_close = mem_free() if mem_free else None
    staging_cost = (
        raw.pinned_device_cost(s["host_cached_bytes"])
        if mem_free and s["host_cached_bytes"]
        else None
    )

    steady = slice(1, None) if cycles > 1 else slice(None)
    sleep_s, wake_s = float(np.median(sleeps[steady])), float(np.median(wakes[steady]))
    result = dict(
        device=str(device),
        gib=gib,
        cycles=cycles,
        keep=args.keep,
        backed=backed,
        d2h_bandwidth=d2h,
        h2d_bandwidth=h2d,
        sleep_s=sleeps,
        wake_s=wakes,
        freed_while_asleep_min=min(freed) if freed else None,
        leaked_bytes=leaked,
        leaked_after_first_cycle_bytes=leaked_steady,
        leaked_after_close_bytes=(free_before_arena - free_after_close if mem_free else None),
        staging_device_cost_bytes=staging_cost,
        bad_buffers=bad,
        host_cached_bytes=s["host_cached_bytes"],
    )
    print(
        f"  first cycle: sleep {sleeps[0] * 1e3:.1f} ms, wake {wakes[0] * 1e3:.1f} ms "
        "(includes pinning the host staging memory)"
    )
    print(
        f"  steady state (median of {len(sleeps[steady])}): sleep {sleep_s * 1e3:.1f} ms = "
        f"{backed / sleep_s / 1e9:.1f} GB/s = {100 * backed / sleep_s / d2h:.0f}% of device->host; "
        f"wake {wake_s * 1e3:.1f} ms = {backed / wake_s / 1e9:.1f} GB/s = "
        f"{100 * backed / wake_s / h2d:.0f}% of host->device (goal >= 80%)"
    )
    if freed:
        mib = 1 << 20
        print(
            f"  device memory free while asleep: +{min(freed) / mib:.0f} MiB at least "
            f"(backed {backed / mib:.0f} MiB)"
        )
        print(
            f"  less free after {cycles} cycles (cuMemGetInfo, goal 0): {leaked / mib:+.1f} MiB "
            f"since before the first sleep, {(leaked_steady or 0) / mib:+.1f} MiB since the end "
            f"of the first cycle; {result['leaked_after_close_bytes'] / mib:+.1f} MiB after "
            "close against before the arena"
        )
        if staging_cost is not None:
            print(
                f"  a raw cuMemHostAlloc of the staging size "
                f"({s['host_cached_bytes'] / GiB:.2f} GiB) takes {staging_cost / mib:.1f} MiB "
                "of device memory while it is held (the GPU's mapping of the host pages)"
            )
    print(
        f"  contents: {'bit-exact after every wake' if not bad else f'{bad} BAD buffer checks'}"
        + ("" if args.keep == "host" else " (not checked: discard)")
    )
    print(f"  host staging memory kept: {s['host_cached_bytes'] / GiB:.2f} GiB")
    if args.json:
        write_json(args.json, result)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
