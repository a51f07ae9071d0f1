"""Tells the CUDA driver which stream XLA runs a GPU's work on (ffi/src/drivers/cuda/
compute_streams.h).

An arena's device waits (before memory is unmapped, an offload, a sleep) wait for that
stream instead of the whole CUDA context: a context-wide wait would also wait on the
stream XLA captures a command buffer on, from another thread, and break that capture.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi
from ._device import DeviceTarget

_TARGET = "jax_vmm_register_compute_stream"
_lock = threading.Lock()
_registered: set[tuple[int, int]] = set()  # (id of the JAX client, device id)


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
