"""Graph-safe scratch workspaces: statistics, mode selection and a test probe.

Custom calls get a per (device, stream) workspace from the C++ API in
``ffi/include/jax_vmm/scratch.h``. Its address stays valid for every CUDA graph that
captured it: by default it grows in place (reserved virtual range, pages mapped at the
tail); in ``"retire"`` mode a larger block replaces it and the old block is kept for the
life of the process. A workspace never grows while its stream is capturing a graph: size
it before capture (the handler's kInitialize stage, or :func:`reserve`).

``scratch_probe`` is a test-only custom call that copies its input through a workspace,
so the graph hazard can be tested without a real consumer.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from ._ffi import register
from ._loader import core as _core

__all__ = ["scratch_stats", "set_scratch_mode", "get_scratch_mode", "reserve",
           "set_reserve_bytes", "get_reserve_bytes", "set_debug_free_on_growth",
           "debug_free_on_growth", "scratch_probe", "scratch_probe_stats", "address_of"]

Mode = Literal["default", "grow", "retire"]

_PROBE = "jax_vmm_scratch_probe"


def scratch_stats() -> list[dict]:
    """One dict per workspace ever created.

    Keys: ``device`` ("cpu" or "cuda:N"), ``stream`` (0: the device default workspace),
    ``generation``/``current`` (a mode change retires the current workspaces), ``mode``
    ("grow" or "retire"), ``address``, ``capacity``, ``reserved_bytes``, ``backed_bytes``
    (including retired blocks), ``retired_blocks``, ``retired_bytes``, ``growth_events``
    (every capacity increase, the first allocation included), ``freed_blocks`` (debug
    switch only), ``capture_refusals`` and ``fallback_reason`` (why "default" chose
    "retire").
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
    ``JAX_VMM_SCRATCH_RESERVE_BYTES`` environment variable); 0 restores the default.
    Outgrowing it retires the range and reserves a larger one."""
    if int(nbytes) < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    _core.scratch_set_reserve_bytes(int(nbytes))


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
    if int(nbytes) <= 0:
        raise ValueError(f"nbytes must be > 0, got {nbytes}")
    _core.scratch_reserve(_ordinal(device), int(nbytes))


def set_debug_free_on_growth(enabled: bool) -> None:
    """TEST ONLY. When on, growth moves the workspace and frees the outgrown block at
    once (the bug graph-safe scratch exists to prevent): a graph captured before the
    growth then replays into freed memory. Tests use it to show they can see that."""
    _core.scratch_set_debug_free_on_growth(bool(enabled))


def debug_free_on_growth() -> bool:
    return bool(_core.scratch_debug_free_on_growth())


def scratch_probe(x: jax.Array, workspace_bytes: int | None = None, *,
                  reserve_at: Literal["initialize", "trace"] = "initialize",
                  device: jax.Device | None = None) -> tuple[jax.Array, jax.Array]:
    """TEST ONLY: ``y = x`` copied through a scratch workspace of ``workspace_bytes``
    (default ``x.nbytes``). Returns ``(y, address)``: ``address`` is the int32 ``(lo, hi)``
    pair of the workspace pointer the call used (see :func:`address_of`).

    ``reserve_at`` says where the workspace is sized before any capture: "initialize"
    (the CUDA handler's kInitialize stage reserves it on its stream) or "trace" (this
    function calls :func:`reserve` for ``device`` now, at trace time)."""
    nbytes = int(x.size) * jnp.dtype(x.dtype).itemsize
    ws = nbytes if workspace_bytes is None else int(workspace_bytes)
    if ws < nbytes:
        raise ValueError(f"workspace_bytes={ws} is smaller than the input ({nbytes} bytes)")
    if reserve_at not in ("initialize", "trace"):
        raise ValueError(f"reserve_at must be 'initialize' or 'trace', got {reserve_at!r}")
    register()
    if reserve_at == "trace":
        reserve(ws, device)
    y, addr = jax.ffi.ffi_call(
        _PROBE, (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((2,), jnp.int32)),
    )(x, workspace_bytes=ws, reserve_at_initialize=reserve_at == "initialize")
    return y, addr


def scratch_probe_stats() -> dict:
    """TEST ONLY: host invocations of the probe: ``calls``, ``captured_calls`` (made while
    a CUDA graph was captured) and ``initialize_calls`` (CUDA kInitialize stage)."""
    return dict(_core.scratch_probe_stats())


def address_of(addr: jax.Array) -> int:
    """The pointer from a :func:`scratch_probe` ``address`` result."""
    lo, hi = (int(a) & 0xFFFFFFFF for a in jax.device_get(addr))
    return (hi << 32) | lo
