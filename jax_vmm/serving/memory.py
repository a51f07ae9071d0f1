"""Honest memory measurements for the example and benchmarks.

GPU: XLA's allocator statistics (`Device.memory_stats()`), which do NOT include jax_vmm
arena memory (committed through the CUDA driver, outside XLA) -- add the arena's backed
bytes for a device total. CPU: the process's resident set (Linux /proc), which counts
arena pages only once the process touches them through its mapping, while the host
driver backs a commit at once (its memfd's pages, Shmem in /proc/meminfo): the arena's
backed bytes are the measure of its memory there too.
"""

from __future__ import annotations

import os
from typing import Any

import jax


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line (not Linux?)")


def rss_bytes() -> int:
    return 1024 * _status_kib("VmRSS")


def peak_rss_bytes() -> int:
    return 1024 * _status_kib("VmHWM")


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs).
    Returns False where that is not allowed; peaks then count from process start."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_memory_stats(device: jax.Device) -> dict[str, Any] | None:
    """XLA allocator stats (bytes_in_use, peak_bytes_in_use, bytes_limit, ...) or None
    (the CPU platform has none)."""
    try:
        stats = device.memory_stats()
    except Exception:  # some platforms raise instead of returning None
        return None
    return dict(stats) if stats else None
