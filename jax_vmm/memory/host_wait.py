"""The host driver's device wait: XLA:CPU work that may read or write arena memory is
finished before that memory is unmapped, copied out or punched.

On a GPU the arena waits for XLA's compute stream (the driver's ``Synchronize``). XLA:CPU
has no stream the extension can wait on: it runs a computation on its own threads after
the dispatching call returned, and the only handle on that work is the computation's
results, ``jax.Array`` objects that are not ready until it has finished. So before
memory goes, every live array on the arena's CPU device that is not ready yet is waited
for. A computation whose results the caller has already dropped is not waited for: what
it reads can no longer be observed (unbacked host pages read zeros, so nothing faults).

Called by the Python methods that give memory back (``Arena.close/sleep/reclaim``,
``Buffer.decommit/free``, ``KVArena.offload``, ...) right before they call into the core:
the host driver unmaps inline, so nothing is unmapped later without it. A KV arena's
``release`` and ``shrink`` do not wait: they take the arrays in flight (:func:`in_flight`)
and leave the unmapping to ``host_reclaim.py``, which waits for them on its own thread.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax

#: Test hook (``jax_vmm.testing.host_device_waits_skipped()``): when True the wait does
#: nothing and nothing is found in flight, as the host driver's ``Synchronize`` did:
#: memory goes under running work.
skip = False


def wait_for_host_work(device: jax.Device) -> None:
    """Block until no XLA:CPU computation dispatched so far on ``device`` is running, as far
    as anything can observe it (see the module docstring). No-op for other platforms."""
    if skip or device.platform != "cpu":
        return
    wait_for_live_arrays({device})


def live_arrays_on(devices: set) -> Iterator[jax.Array]:
    """The live arrays of the backends of ``devices``. ``jax.live_arrays()`` alone lists
    the default backend's: on a machine with a GPU a CPU arena saw none of its work in
    flight, and gave memory back under it."""
    for platform in sorted({d.platform for d in devices}):
        yield from jax.live_arrays(platform)


def wait_for_live_arrays(devices: set) -> None:
    """Block until every live array on any of ``devices`` that is not ready yet is (or is
    gone), whatever the platform."""
    for a in live_arrays_on(devices):
        try:
            if a.is_deleted() or a.is_ready() or not devices & set(a.devices()):
                continue
            a.block_until_ready()
        except RuntimeError:  # deleted or donated meanwhile by another thread: not ours
            continue


def in_flight(device: jax.Device) -> list[jax.Array]:
    """The live arrays on ``device`` (a CPU device) that are not ready yet: what
    :func:`wait_for_host_work` would wait for now, without waiting. Empty for other
    platforms."""
    if skip or device.platform != "cpu":
        return []
    out = []
    for a in live_arrays_on({device}):
        try:
            if not a.is_deleted() and not a.is_ready() and device in a.devices():
                out.append(a)
        except RuntimeError:  # deleted or donated meanwhile by another thread: not ours
            continue
    return out


def wait_for(arrays: list[jax.Array]) -> None:
    """Block until every array of ``arrays`` is ready (or gone: deleted or donated, so
    the computation that made it has finished or failed)."""
    for a in arrays:
        try:
            a.block_until_ready()
        except Exception:  # deleted, donated, or its computation failed: it has ended
            continue
