"""Where the dispatching thread's time goes in the main job, measured on the device.

    python bench/dispatch_costs.py [--batch 64] [--json OUT.json]

Runs examples/decode.py's main job (gpu preset, `--batch` slots, 3 requests per slot)
once, with the calls the dispatching thread makes into jax_vmm's core (the KV cache's
device-table copies, the arena's decommits and statistics), its waits for the KV arena's
lock and the Python steps of ensure_all timed on that thread only. Prints, next to the
engine's own time per cache call, what of it is core work and what is Python around it;
then the CPU seconds each thread of the process used while serving (/proc/self/task; the
OS names every Python and C++ thread after the process, so the Python ones are named
from `threading`): which threads compete with the dispatching one.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from jax_vmm.serving import cache as C  # noqa: E402
from jax_vmm.serving import engine as E  # noqa: E402
from jax_vmm.serving.cli import decode as D  # noqa: E402


class CallTimes:
    """name -> [calls, seconds, longest] of calls made on one thread (others ignored)."""

    def __init__(self, thread_id: int) -> None:
        self.thread_id = thread_id
        self.rows: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, 0.0])

    def wrap(self, label: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if threading.get_ident() == self.thread_id:
                    dt = time.perf_counter() - t0
                    row = self.rows[label]
                    row[0] += 1
                    row[1] += dt
                    row[2] = max(row[2], dt)

        return timed

    def table(self) -> list[dict]:
        rows = sorted(self.rows.items(), key=lambda kv: -kv[1][1])
        return [
            {"call": k, "calls": n, "mean_us": 1e6 * t / n, "longest_ms": 1e3 * m}
            for k, (n, t, m) in rows
        ]


class TimedCalls:
    """A core handle whose method calls are timed (attributes pass through)."""

    def __init__(self, inner: object, prefix: str, times: CallTimes) -> None:
        self._inner, self._prefix, self._times = inner, prefix, times

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        return self._times.wrap(self._prefix + name, attr) if callable(attr) else attr


class TimedLock:
    """A lock whose acquisitions (the wait to take it) are timed."""

    def __init__(self, inner, label: str, times: CallTimes) -> None:
        self._inner = inner
        self.acquire = times.wrap(label, inner.acquire)

    def release(self) -> None:
        self._inner.release()

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self._inner.release()


def instrument(kv, times: CallTimes) -> None:
    kv._core_cache = TimedCalls(kv._core_cache, "core kv_cache.", times)
    kv.arena._handle = TimedCalls(kv.arena._handle, "core arena.", times)
    kv._lock = TimedLock(kv._lock, "wait for kv._lock", times)
    kv._ahead.schedule = times.wrap("py commit-ahead schedule", kv._ahead.schedule)
    for name in ("_token_array", "_backed_already"):
        setattr(kv, name, times.wrap(f"py {name}", getattr(kv, name)))
    kv.ensure_all = times.wrap("kv.ensure_all (all of it)", kv.ensure_all)


def thread_cpu() -> dict[int, tuple[str, float]]:
    """tid -> (OS thread name, user + system CPU seconds) of every thread of this process."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def measure(batch: int, preset: str = "gpu", device: str = "auto") -> dict:
    times = CallTimes(threading.get_ident())
    seen: dict = {}
    make_cache, run = C.make_cache, E.Generator.run

    def instrumented_cache(*args, **kwargs):
        cache = make_cache(*args, **kwargs)
        if isinstance(cache, C.VmmCache):
            instrument(cache.kv, times)
        return cache

    def measured_run(self, requests, **kwargs):
        self.precompile(requests)
        before, t0 = thread_cpu(), time.perf_counter()
        try:
            report = run(self, requests, **kwargs)
        finally:
            seen.update(wall=time.perf_counter() - t0, before=before, after=thread_cpu())
            seen["names"] = {t.native_id: t.name for t in threading.enumerate()}
        seen["report"] = report
        return report

    D.make_cache, E.Generator.run = instrumented_cache, measured_run
    try:
        summary = D.main(
            ["--preset", preset, "--device", device, "--batch", str(batch)]
            + ["--requests", str(3 * batch)]
            + ["--no-progress", "--no-plot", "--out", "/tmp/dispatch_costs"]
        )
    finally:
        D.make_cache, E.Generator.run = make_cache, run
    cpu: dict[str, float] = {}
    for tid, (name, seconds) in seen["after"].items():
        if tid == os.getpid():
            name = f"{name} (main: dispatching)"
        elif tid in seen["names"]:
            name = f"{name} (Python thread {seen['names'][tid]})"
        cpu[name] = cpu.get(name, 0.0) + seconds - seen["before"].get(tid, (name, 0.0))[1]
    engine = {
        k: {"calls": n, "mean_us": 1e6 * t / n, "longest_ms": 1e3 * m}
        for k, (n, t, m) in seen["report"].host_calls.items()
    }
    return {
        "tokens_per_second": summary["tokens_per_second"],
        "host_memory_share": summary["host_memory_share"],
        "engine_calls": engine,
        "inside_calls": times.table(),
        "wall_seconds": seen["wall"],
        "cpu_seconds_by_thread": dict(sorted(cpu.items(), key=lambda kv: -kv[1])),
        "cpus_in_affinity": len(os.sched_getaffinity(0)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--preset", default="gpu", help=argparse.SUPPRESS)  # cpu: a quick try
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    r = measure(args.batch, args.preset)
    print(f"-- the engine's cache calls (batch {args.batch}; {100 * r['host_memory_share']:.2f}%)")
    for k, v in r["engine_calls"].items():
        print(
            f"  {k:34s} {v['calls']:6d} x {v['mean_us']:8.1f} us  longest {v['longest_ms']:6.2f} ms"
        )
    print("-- inside them, on the dispatching thread")
    for v in r["inside_calls"]:
        print(
            f"  {v['call']:34s} {v['calls']:6d} x {v['mean_us']:8.1f} us  "
            f"longest {v['longest_ms']:6.2f} ms"
        )
    print(
        f"-- CPU seconds per thread while serving ({r['wall_seconds']:.2f} s wall, "
        f"{r['cpus_in_affinity']} CPUs)"
    )
    for name, seconds in list(r["cpu_seconds_by_thread"].items())[:12]:
        print(f"  {seconds:7.2f} s  {name}")
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
