"""Commit ahead of need: a background thread backs a KV sequence's next chunk before the
decode loop reaches it, so that ``kv.ensure()`` on the thread that dispatches device work
finds it backed and makes no driver call (cuMemCreate/cuMemMap/cuMemSetAccess cost ~50 us
per buffer; a sequence crossing a chunk boundary touches every layer's K and V buffer).

The commit runs through ``Arena.commit_ahead``, which skips once the arena handed out a
raw view (a reader dispatched meanwhile could run over the zero mappings being swapped),
so with views the decode thread commits itself, waiting for the device as before.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Any

_log = logging.getLogger("jax_vmm")

# Every worker is stopped (and joined) at interpreter exit, before daemon threads are
# killed: a daemon thread inside a core call (which releases the GIL) is ended by
# pthread_exit when it takes the GIL back during finalization, and that forced unwind
# through the binding's GIL guard (a noexcept destructor) is std::terminate: SIGABRT,
# "terminate called without an active exception". An ensure() just before exit (say,
# after an out-of-memory left the sequence short) schedules exactly such a commit.
_live: weakref.WeakSet[CommitAhead] = weakref.WeakSet()


@atexit.register
def _stop_all_at_exit() -> None:
    for worker in list(_live):
        worker.stop()


class CommitAhead:
    """One worker thread per KV arena, started on first use; it holds only a weak
    reference to the arena, so an arena that is dropped without ``close()`` still goes.

    Sequences are served in the order they were first scheduled, so the one the dispatching
    thread needs first (an admission's prompt, ``KVArena.prefetch``) is backed first.

    Thread-safety: every method may be called from any thread."""

    def __init__(self, kv: Any):
        self._kv = weakref.ref(kv)
        self._cv = threading.Condition()
        self._pending: dict[int, tuple[int, int]] = {}  # seq -> (tokens to back, epoch)
        self._busy: int | None = None  # the sequence being committed now
        self._stop = False
        self._thread: threading.Thread | None = None
        _live.add(self)

    def schedule(self, seq: int, tokens: int, epoch: int) -> None:
        """Back tokens [0, tokens) of ``seq`` for its life that began at ``epoch`` (the
        arena's release count of the sequence: a commit for an older life is void)."""
        with self._cv:
            old = self._pending.get(seq)
            if self._stop or (old is not None and old[1] == epoch and old[0] >= tokens):
                return
            self._pending[seq] = (tokens, epoch)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="jax_vmm-commit-ahead", daemon=True
                )
                self._thread.start()
            self._cv.notify()

    def cancel(self, seq: int | None = None) -> None:
        """Forget what is scheduled for ``seq`` (None: for every sequence); a commit
        already running is not stopped (the arena's epoch check handles that one)."""
        with self._cv:
            if seq is None:
                dropped = bool(self._pending)
                self._pending.clear()
            else:
                dropped = self._pending.pop(seq, None) is not None
            if dropped:  # for wait_for(); waking the worker for nothing costs a GIL hand-off
                self._cv.notify_all()

    def idle(self) -> bool:
        """Nothing scheduled and nothing running."""
        with self._cv:
            return not self._pending and self._busy is None

    def wait_idle(self, timeout: float = 60.0) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: not self._pending and self._busy is None, timeout)

    def wait_for(self, seq: int, timeout: float) -> bool:
        """Waits until nothing is scheduled or running for ``seq``; False on timeout."""
        with self._cv:
            return self._cv.wait_for(
                lambda: seq not in self._pending and self._busy != seq, timeout
            )

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._pending.clear()
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._stop:
                    self._cv.wait(timeout=1.0)
                    if self._kv() is None:
                        return
                if self._stop:
                    return
                seq = next(iter(self._pending))  # the oldest request first
                tokens, epoch = self._pending.pop(seq)
                self._busy = seq
            try:
                kv = self._kv()
                if kv is None:
                    return
                kv._commit_ahead(seq, tokens, epoch)
                del kv
            except Exception:  # the worker must live on: the ensure that follows commits itself
                _log.exception("jax_vmm: commit ahead of sequence %d failed", seq)
            finally:
                with self._cv:
                    self._busy = None
                    self._cv.notify_all()
