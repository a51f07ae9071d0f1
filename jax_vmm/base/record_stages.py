"""XLA's FFI record stage for jax_vmm's CUDA targets (``ffi/src/common/ffi_record_stage.h``).

In a command buffer XLA traces a custom call without a record stage into a child graph,
which it re-records and updates at every command-buffer update (a step whose results are
new buffers has one per call). ``jax.ffi.register_ffi_target`` cannot pass a record stage,
so the compiled core registers its recorded targets from inside XLA: :func:`ensure` runs
the bootstrap custom call once on a GPU; a call traced after that carries
:func:`use_recorded`, and its CUDA lowering names the recorded variant
(``<name>_recorded``, :func:`target_for`). Where the bootstrap did not
register them (jaxlib without the record stage, XLA refusing, no GPU) the plain targets run,
as before; :func:`status` says why. ``JAX_VMM_RECORD_STAGES=off`` in the environment keeps
the plain targets (to compare the two).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .loader import core as _core

__all__ = ["RECORDED", "ensure", "status", "target_for", "use_recorded"]

_log = logging.getLogger("jax_vmm")

#: Targets with a recorded variant (the core registers ``<name>_recorded``).
RECORDED = frozenset({"jax_vmm_kv_cache_check_views"})

_BOOTSTRAP = "jax_vmm_register_record_stages"
_lock = threading.Lock()
_tried = False
# Cleared by jax_vmm.testing.record_stages_off(): the CUDA lowering then names the plain
# targets, to compare the two.
_use_recorded = True
_OFF = "off: JAX_VMM_RECORD_STAGES=off"


def _switched_off() -> bool:
    return os.environ.get("JAX_VMM_RECORD_STAGES", "").strip().lower() in ("0", "off", "false")


_unavailable = ""  # why ensure() found no record stage to use (set once, by ensure())


def status() -> str:
    """The record-stage status: ``"registered"``, ``"pending"`` (the bootstrap has not
    run), ``"off: ..."``, ``"unavailable: ..."`` or ``"failed: ..."``."""
    if _switched_off():
        return _OFF
    if not _core.built_with_cuda_kernels:
        return "unavailable: this jax_vmm build has no CUDA targets"
    return _unavailable or _core.record_stage_status()


def _run_eagerly(fn: Callable[[], Any], device: jax.Device) -> None:
    """Run ``jax.jit(fn)()`` to completion on ``device`` now, whatever the caller is
    tracing: in a helper thread, because JAX's trace and mesh state are per thread (under
    ``jax.set_mesh`` of several devices XLA's partitioner refuses a side-effecting call
    that is not sharded, and inside a jit trace the call would be staged instead)."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            with jax.default_device(device):
                jax.block_until_ready(jax.jit(fn)())
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            failure.append(e)

    worker = threading.Thread(target=run, name="jax_vmm-record-stages")
    worker.start()
    worker.join()
    if failure:
        raise failure[0]


def _bootstrap_call() -> jax.Array:
    """The bootstrap custom call (its s32 result carries no value)."""
    call = jax.ffi.ffi_call(_BOOTSTRAP, jax.ShapeDtypeStruct((), jnp.int32), has_side_effect=True)
    return call()


def ensure(has_cuda_backend: bool) -> str:
    """Run the bootstrap once per process on this process's first CUDA device, after the
    FFI registration (base/ffi.py) registered the bootstrap target. Returns :func:`status`.
    Never raises: a failure leaves the plain targets, and :func:`status` says why."""
    global _tried, _unavailable
    if _tried:
        return status()
    with _lock:
        if _tried:
            return status()
        _tried = True
        if _switched_off():
            return status()
        if not has_cuda_backend:
            _unavailable = "unavailable: no CUDA backend in this process"
            return status()
        try:
            _run_eagerly(_bootstrap_call, jax.local_devices(backend="cuda")[0])
        except Exception as e:  # noqa: BLE001 - any failure keeps the plain targets
            _unavailable = f"failed: the bootstrap call raised {type(e).__name__}: {e}"
        state = status()
        if state != "registered":
            _log.warning("jax_vmm: XLA's FFI record stage not used (%s)", state)
        return state


def use_recorded(name: str) -> bool:
    """Whether a call of target ``name`` traced now should lower to its recorded variant on
    a GPU. Decided when the call is traced, so that the choice is part of the traced
    computation (and of JAX's caches of it)."""
    return _use_recorded and name in RECORDED and status() == "registered"


def target_for(name: str, recorded: bool) -> str:
    """The target a CUDA lowering calls: ``name``'s recorded variant where the call was
    traced with ``recorded`` (:func:`use_recorded`), else ``name``."""
    return name + "_recorded" if recorded else name
