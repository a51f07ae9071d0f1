"""Registers jax_vmm's XLA FFI handlers with JAX, once, on first use."""

from __future__ import annotations

import threading

import jax

from ._loader import core as _core

_lock = threading.Lock()
_registered: set[str] = set()


def ensure_registered() -> None:
    """Register every handler compiled into ``_core`` for its platform.

    Called lazily by the op wrappers (kv_write, decode_attention) rather than at import:
    the CPU backend must have started before FFI targets are registered on it, and a
    CUDA handler is only registered when JAX has a CUDA backend.
    """
    if _registered:
        return
    with _lock:
        if _registered:
            return
        platforms = {d.platform for d in jax.devices()} | {"cpu"}
        for name, platform, capsule in _core.registrations():
            if platform == "CUDA" and not ({"gpu", "cuda"} & platforms):
                continue
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
            _registered.add(f"{platform}:{name}")
        _registered.add("done")


def registered_targets() -> list[str]:
    return sorted(t for t in _registered if t != "done")
