"""The host driver's deferred unmapping: what a KV arena's ``release`` / ``shrink`` gives
back on the CPU is unmapped once the XLA:CPU work that was in flight at the call has
finished, on a background thread, so the dispatching thread never waits for it.

On a GPU the arena's reclaimer thread waits for the compute stream and then unmaps what
was retired before the wait began (``ffi/src/core/arena_release.cc``). XLA:CPU has no
stream; the only handle on its work is the arrays it has not computed yet
(``host_wait.py``). So the release takes those arrays, retires the allocations that lost
their last chunk (``decommit_ranges(defer_unmap=True)``), begins a host wait in the core
(``begin_host_wait``: what it retired is covered by that wait), and queues the arrays
here; this thread waits for them and then calls the follow-up (the core's
``reclaim_retired_before`` and the KV cache's ``forget_epochs_before``). A commit that
needs the memory again meanwhile takes the retired allocation back without a driver call,
as on a GPU.

Thread-safety: :func:`after` may be called from any thread. One daemon thread per
process serves the queue in order (a follow-up never runs before an earlier one).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable

import jax

from . import host_wait

log = logging.getLogger("jax_vmm")

_jobs: queue.SimpleQueue[tuple[list[jax.Array], Callable[[], None]]] = queue.SimpleQueue()
_thread: threading.Thread | None = None
_thread_pid = -1
_start_lock = threading.Lock()

#: Test hook (``jax_vmm.testing.host_reclaims_paused()``): while clear, the thread takes
#: no job.
serving = threading.Event()
serving.set()


def after(arrays: list[jax.Array], then: Callable[[], None]) -> None:
    """Call ``then()`` on the reclaim thread once every array of ``arrays`` is ready.
    ``then`` should hold its objects weakly: a job still queued at exit keeps them."""
    global _thread, _thread_pid
    with _start_lock:
        if _thread is None or _thread_pid != os.getpid():  # a forked child has no thread
            _thread = threading.Thread(target=_serve, name="jax_vmm-host-reclaim", daemon=True)
            _thread_pid = os.getpid()
            _thread.start()
    _jobs.put((arrays, then))


def _serve() -> None:
    while True:
        arrays, then = _jobs.get()
        serving.wait()
        try:
            host_wait.wait_for(arrays)
            then()
        except Exception:  # a closed arena, a forked child: nothing left to give back
            log.debug("jax_vmm: deferred host release skipped", exc_info=True)
        finally:
            del arrays, then  # hold nothing of a job while waiting for the next one


def drain(timeout: float | None = None) -> bool:
    """Wait until every job queued before the call has been served; False on timeout."""
    done = threading.Event()
    after([], done.set)
    return done.wait(timeout)
