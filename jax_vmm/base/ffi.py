"""Registers jax_vmm's XLA FFI targets with JAX: one ``register()`` for every op wrapper.

The compiled modules hand their targets over as ``registrations(platform)`` dicts
(``{name: capsule | {stage: capsule}}``, platform ``"cpu"`` or ``"CUDA"``). The production
targets come from ``_core.registrations``; ``jax_vmm.testing`` adds the test-only ones of
``_core_testing`` with :func:`add_source`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import jax

from . import record_stages
from .loader import core as _core

Registrations = Callable[[str], dict]

_lock = threading.Lock()
_sources: list[Registrations] = [_core.registrations]
_done: set[tuple[int, str]] = set()  # (index into _sources, platform) already registered
_registered: list[str] = []  # "platform:name", for registered_targets()
_complete = False  # every source registered on every platform: the fast path


def _has_cuda_backend() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:  # no CUDA backend in this process
        return False


def _platforms() -> list[str]:
    # jax.devices() starts the backends: on the CPU platform FFI targets must be
    # registered only after the backend started.
    jax.devices()
    return ["cpu", "CUDA"] if _has_cuda_backend() else ["cpu"]


def register() -> None:
    """Register every FFI target of every source with JAX, once per target and platform:
    the CPU always, CUDA when JAX has a CUDA backend.

    Op wrappers call it right before ``jax.ffi.ffi_call`` rather than at import, because
    the CPU backend must have started before targets are registered on it. Thread-safe.
    """
    global _complete
    if _complete:
        return
    with _lock:
        if _complete:
            return
        platforms = _platforms()
        for i, source in enumerate(_sources):
            for platform in platforms:
                if (i, platform) in _done:
                    continue
                for name, handler in source(platform).items():
                    target = dict(handler) if isinstance(handler, dict) else handler
                    jax.ffi.register_ffi_target(name, target, platform=platform)
                    _registered.append(f"{platform}:{name}")
                _done.add((i, platform))
        record_stages.ensure("CUDA" in platforms)  # after its bootstrap target, above
        _complete = True


def add_source(registrations: Registrations) -> None:
    """Make :func:`register` also register the targets of ``registrations(platform)``
    (used by ``jax_vmm.testing`` for ``_core_testing.registrations``). Idempotent."""
    global _complete
    with _lock:
        if registrations not in _sources:
            _sources.append(registrations)
            _complete = False


def registered_targets() -> list[str]:
    """``"platform:name"`` of every target registered so far."""
    with _lock:
        return sorted(_registered)
