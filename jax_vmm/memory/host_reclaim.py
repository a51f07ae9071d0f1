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

The core never gives such memory back on its own (not when a commit runs out of memory or
a budget is full: the work that may still read it is Python's to wait for); a commit that
failed for want of it waits here (:func:`drain`) and tries once more
(``jax_vmm.Arena._commit``).

Thread-safety: :func:`after`, :func:`pending` and :func:`drain` may be called from any
thread. One daemon thread per process serves the queue in order (a follow-up never runs
before an earlier one).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from collections.abc import Callable

import jax

from . import host_wait

log = logging.getLogger("jax_vmm")

_jobs: queue.SimpleQueue[tuple[list[jax.Array], Callable[[], None]] | None] = queue.SimpleQueue()
_thread: threading.Thread | None = None
_thread_pid = -1
_start_lock = threading.Lock()
_pending = 0  # jobs queued and not yet served (under _start_lock)

#: Test hook (``jax_vmm.testing.host_reclaims_paused()``): while clear, the thread takes
#: no job.
serving = threading.Event()
serving.set()


@atexit.register
def _stop_at_exit() -> None:
    """Serves the queued jobs and stops the thread at interpreter exit, before daemon
    threads are killed: one killed inside a core call aborts the process (SIGABRT; see
    jax_vmm/kv/prefetch.py). A release right before exit queues exactly such a job."""
    thread = _thread
    if thread is None or _thread_pid != os.getpid() or not thread.is_alive():
        return
    serving.set()
    _jobs.put(None)
    thread.join()


def after(arrays: list[jax.Array], then: Callable[[], None]) -> None:
    """Call ``then()`` on the reclaim thread once every array of ``arrays`` is ready.
    ``then`` should hold its objects weakly: a job still queued at exit keeps them."""
    global _thread, _thread_pid, _pending
    with _start_lock:
        if _thread is None or _thread_pid != os.getpid():  # a forked child has no thread
            _thread = threading.Thread(target=_serve, name="jax_vmm-host-reclaim", daemon=True)
            _thread_pid = os.getpid()
            _thread.start()
        _pending += 1
    _jobs.put((arrays, then))


def pending() -> int:
    """Jobs queued and not yet served: memory released on the CPU that work in flight may
    still read, not given back yet."""
    return _pending


def _serve() -> None:
    global _pending
    while True:
        job = _jobs.get()
        if job is None:  # _stop_at_exit
            return
        arrays, then = job
        serving.wait()
        try:
            host_wait.wait_for(arrays)
            then()
        except Exception:  # a closed arena, a forked child: nothing left to give back
            log.debug("jax_vmm: deferred host release skipped", exc_info=True)
        finally:
            del arrays, then  # hold nothing of a job while waiting for the next one
            with _start_lock:
                _pending -= 1


def drain(timeout: float | None = None) -> bool:
    """Wait until every job queued before the call has been served; False on timeout."""
    done = threading.Event()
    after([], done.set)
    return done.wait(timeout)
