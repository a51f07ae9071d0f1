"""Graph-safe scratch workspaces: statistics, mode selection and reservation.

Custom calls get a per (device, stream) workspace from the C++ API in
``ffi/include/jax_vmm/scratch.h``. Its address stays valid for every CUDA graph that
captured it: by default it grows in place (reserved virtual range, pages mapped at the
tail); in ``"retire"`` mode a larger block replaces it and the old block is kept for the
life of the process. A workspace never grows while its stream is capturing a graph: size
it before capture (the handler's kInitialize stage, or :func:`reserve`).

The test-only probe custom call and the free-on-growth emulation are in
:mod:`jax_vmm.testing`.
"""

from __future__ import annotations

import os
from typing import Literal

import jax

from ..base.args import as_int
from ..base.loader import core as _core
from .stats import ScratchStats

__all__ = [
    "scratch_stats",
    "set_scratch_mode",
    "get_scratch_mode",
    "reserve",
    "set_reserve_bytes",
    "get_reserve_bytes",
]

Mode = Literal["default", "grow", "retire"]

#: The user address space of x86-64 and AArch64 Linux (47 bits): no workspace is larger.
_ADDRESS_SPACE = 1 << 47

#: The default of set_reserve_bytes, read by the core when it first makes a workspace.
RESERVE_ENV = "JAX_VMM_SCRATCH_RESERVE_BYTES"


def _check_reserve_env() -> None:
    """Refuse a malformed ``JAX_VMM_SCRATCH_RESERVE_BYTES`` at import: the core would
    ignore it (or, for "-1", wrap it to 2**64 - 1) and nothing would say so."""
    text = os.environ.get(RESERVE_ENV, "")
    if not text:  # unset or empty: the 1 GiB default (so is 0)
        return
    if not (text.isascii() and text.isdigit() and 0 <= int(text) <= _ADDRESS_SPACE):
        raise ValueError(
            f"{RESERVE_ENV}={text!r}: expected a number of bytes (decimal digits only) of at "
            f"most 2**47, e.g. {1 << 30} for 1 GiB; unset it (or 0) for the 1 GiB default"
        )


_check_reserve_env()


def scratch_stats() -> list[ScratchStats]:
    """One dict per workspace ever created.

    Keys: ``device`` ("cpu" or "cuda:N"), ``stream`` (0: the device default workspace),
    ``generation``/``current`` (a mode change retires the current workspaces), ``mode``
    ("grow" or "retire"), ``address``, ``capacity``, ``reserved_bytes``, ``backed_bytes``
    (including retired blocks), ``retired_blocks``, ``retired_bytes``, ``growth_events``
    (every capacity increase, the first allocation included), ``freed_blocks`` (0 unless
    ``jax_vmm.testing.free_scratch_on_growth()`` emulates the bug), ``capture_refusals``
    and ``fallback_reason`` (why "default" chose "retire").
    """
    return list(_core.scratch_stats())


def set_scratch_mode(mode: Mode) -> None:
    """Select ``"grow"`` (grow in place; needs VMM), ``"retire"`` or ``"default"`` (grow
    where the device supports VMM, else retire) for workspaces created from now on.
    Changing the mode retires the current workspaces (they stay allocated, so graphs that
    captured them stay valid) and the next request creates a fresh one."""
    if mode not in ("default", "grow", "retire"):
        raise ValueError(f"scratch mode must be 'default', 'grow' or 'retire', got {mode!r}")
    _core.scratch_set_mode(mode)


def get_scratch_mode() -> str:
    return _core.scratch_get_mode()


def set_reserve_bytes(nbytes: int) -> None:
    """Virtual bytes reserved per grow-in-place workspace (default 1 GiB, or the
    ``JAX_VMM_SCRATCH_RESERVE_BYTES`` environment variable); 0 restores the default (the
    variable's value where it is set).
    Outgrowing it retires the range and reserves a larger one."""
    nbytes = as_int(nbytes, "scratch.set_reserve_bytes: nbytes")
    if not 0 <= nbytes <= _ADDRESS_SPACE:
        raise ValueError(
            f"scratch.set_reserve_bytes: nbytes must be >= 0 and at most 2**47 (the "
            f"process's address space), got {nbytes}"
        )
    _core.scratch_set_reserve_bytes(nbytes)


def get_reserve_bytes() -> int:
    return int(_core.scratch_get_reserve_bytes())


def _ordinal(device: jax.Device | None) -> int:
    if device is None:
        device = jax.devices()[0]
    if device.platform == "cpu":
        return -1
    hw = getattr(device, "local_hardware_id", None)
    return int(device.id if hw is None else hw)


def reserve(nbytes: int, device: jax.Device | None = None) -> None:
    """Grow ``device``'s default workspace to ``nbytes`` now, outside any capture.

    Custom calls recorded into a CUDA graph fall back to this workspace when their
    stream has none of its own (see scratch.h). ``device`` defaults to
    ``jax.devices()[0]``; a CPU device reserves the host default workspace."""
    if isinstance(nbytes, jax.core.Tracer):
        raise TypeError(
            "scratch.reserve is a host call that grows the workspace now: call it outside "
            "jit with a Python int (inside jit it would run once, at trace time, with no "
            "size to read)"
        )
    nbytes = as_int(nbytes, "scratch.reserve: nbytes")
    if not 0 < nbytes <= _ADDRESS_SPACE:
        raise ValueError(
            f"scratch.reserve: nbytes must be > 0 and at most 2**47 (the process's address "
            f"space), got {nbytes}"
        )
    if device is not None and not isinstance(device, jax.Device):
        raise TypeError(
            f"scratch.reserve: device must be a jax.Device (e.g. jax.devices()[0]), got "
            f"{type(device).__name__}"
        )
    _core.scratch_reserve(_ordinal(device), nbytes)
