"""Tells the CUDA driver which stream XLA runs a GPU's work on (ffi/src/drivers/cuda/
compute_streams.h).

An arena's device waits (before memory is unmapped, an offload, a sleep) wait for that
stream instead of the whole CUDA context: a context-wide wait would also wait on the
stream XLA captures a command buffer on, from another thread, and break that capture.

The stream belongs to the JAX client, which destroys it when it goes (``clear_backends``,
or at exit, possibly before the last arena is collected). The device's streams are
forgotten just before: a weak-reference finalizer on the client, which also runs at exit
before JAX's own clean-up. Waits there then wait for the whole context again.
"""

from __future__ import annotations

import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from . import ffi as _ffi
from .devices import DeviceTarget
from .loader import core as _core

_TARGET = "jax_vmm_register_compute_stream"
_lock = threading.RLock()  # a client may be collected (and forgotten) while it is held
_registered: set[tuple[int, int]] = set()  # (id of the JAX client, device id)
_finalizers: list[weakref.finalize] = []  # one per registration: forgets it with its client


def register_compute_stream(target: DeviceTarget) -> None:
    """Runs the registering handler once on ``target``'s device (a no-op off CUDA, and
    after the first call per device). Blocks until it ran. Thread-safe."""
    if target.driver != "cuda":
        return
    key = (id(target.device.client), target.device.id)
    with _lock:
        if key in _registered:
            return
        _ffi.register()
        call = jax.ffi.ffi_call(
            _TARGET,
            jax.ShapeDtypeStruct((), jnp.int32),
            input_output_aliases={0: 0},
            has_side_effect=True,
        )
        with jax.transfer_guard("allow"):  # one int32 of ours, whatever the user's guard
            operand = jax.device_put(np.int32(0), target.device)
            jax.block_until_ready(jax.jit(call)(operand))
        _registered.add(key)
        _finalizers.append(forget_when_gone(target.device.client, key, target.ordinal))


def forget_when_gone(client: object, key: tuple[int, int], ordinal: int) -> weakref.finalize:
    """Forget CUDA device ``ordinal``'s registered streams when ``client`` goes (or at
    exit, whichever comes first)."""
    return weakref.finalize(client, _forget, key, ordinal)


def _forget(key: tuple[int, int], ordinal: int) -> None:
    with _lock:
        _registered.discard(key)
        _core.forget_compute_streams(ordinal)
