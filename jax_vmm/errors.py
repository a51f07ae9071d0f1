"""Exceptions raised by jax_vmm (defined in the base layer, ``jax_vmm/base/errors.py``).

Bad arguments raise the built-in ``ValueError`` / ``TypeError``. The classes below cover
the states that are specific to an arena; ``docs/errors.md`` lists every case.
"""

from .base.errors import (
    ArenaAsleepError,
    ArenaClosedError,
    DriverError,
    ForkedProcessError,
    OutOfBoundsRead,
    OutOfBoundsWrite,
    OutOfMemoryError,
    ReservationFullError,
    TransferError,
)

__all__ = [
    "ArenaAsleepError",
    "ArenaClosedError",
    "DriverError",
    "ForkedProcessError",
    "OutOfBoundsRead",
    "OutOfBoundsWrite",
    "OutOfMemoryError",
    "ReservationFullError",
    "TransferError",
]
