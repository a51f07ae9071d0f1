"""Exceptions raised by jax_vmm.

Bad arguments raise the built-in ``ValueError`` / ``TypeError``. The classes below cover
the states that are specific to an arena; ``docs/errors.md`` lists every case.
"""

from __future__ import annotations

from .loader import core as _core

#: Use of an arena (or one of its buffers) after ``close()``. A ``RuntimeError``.
ArenaClosedError = _core.ArenaClosedError
#: Commit or release of an arena that ``sleep()`` emptied; call ``wake()`` first. A
#: ``RuntimeError``.
ArenaAsleepError = _core.ArenaAsleepError
#: The reservation has no free address range large enough for a new buffer.
ReservationFullError = _core.ReservationFullError
#: The OS or the CUDA driver failed (not for lack of memory), or a device lacks VMM.
DriverError = _core.DriverError
#: A call on an arena inherited through ``os.fork()``: the child shares the parent's
#: physical memory, so it may change nothing of it (create a new arena in the child). A
#: ``RuntimeError``.
ForkedProcessError = _core.ForkedProcessError
#: Physical memory could not be committed. Subclass of ``MemoryError`` with
#: ``requested_bytes`` and ``free_bytes`` attributes; the arena is left unchanged.
OutOfMemoryError = _core.OutOfMemoryError


class OutOfBoundsWrite(RuntimeError):
    """Writes into a KV arena were dropped because their slot was outside the buffer, on a
    page that was not committed, or past the tokens its sequence ensured. ``count`` is the
    number of dropped K/V row writes (a token's K and V rows count apiece);
    ``dropped_reads`` the reads clamped in the same period (see :class:`OutOfBoundsRead`)."""

    def __init__(self, message: str, count: int, dropped_reads: int = 0):
        super().__init__(message)
        self.count = count
        self.dropped_reads = dropped_reads


class OutOfBoundsRead(RuntimeError):
    """``decode_attention`` over a KV cache layer was asked to read more tokens of a
    sequence than the sequence ensured; the read was clamped to them. ``count`` is the
    number of such (sequence, call) pairs."""

    def __init__(self, message: str, count: int):
        super().__init__(message)
        self.count = count


class TransferError(RuntimeError):
    """An offload or restore of a KV sequence failed. A failed offload leaves the sequence
    in place; a failed restore leaves it offloaded (its host copy intact), so it can be
    restored again."""


__all__ = [
    "ArenaAsleepError",
    "TransferError",
    "ArenaClosedError",
    "ReservationFullError",
    "DriverError",
    "ForkedProcessError",
    "OutOfMemoryError",
    "OutOfBoundsWrite",
    "OutOfBoundsRead",
]
