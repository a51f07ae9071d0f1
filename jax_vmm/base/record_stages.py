"""XLA's FFI record stage for jax_vmm's CUDA targets (``ffi/src/common/ffi_record_stage.h``).

In a command buffer XLA traces a custom call without a record stage into a child graph,
which it re-records and updates at every command-buffer update (a step whose results are
new buffers has one per call). ``jax.ffi.register_ffi_target`` cannot pass a record stage,
so the compiled core registers its recorded targets from inside XLA: :func:`ensure` runs
the bootstrap custom call once on a GPU, and :func:`target_for` then names the recorded
variant of a target (``<name>_recorded``) to the CUDA lowering. Where the bootstrap did not
register them (jaxlib without the record stage, XLA refusing, no GPU) the plain targets run,
as before; :func:`status` says why. ``JAX_VMM_RECORD_STAGES=off`` in the environment keeps
the plain targets (to compare the two).
"""

from __future__ import annotations

import logging
import os
import threading

import jax
import jax.numpy as jnp

from .loader import core as _core

__all__ = ["RECORDED", "ensure", "status", "target_for"]

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


_no_backend = ""  # set by ensure() where the process has no CUDA backend


def status() -> str:
    """The record-stage status: ``"registered"``, ``"pending"`` (the bootstrap has not
    run), ``"off: ..."``, ``"unavailable: ..."`` or ``"failed: ..."``."""
    if _switched_off():
        return _OFF
    if not _core.built_with_cuda_kernels:
        return "unavailable: this jax_vmm build has no CUDA targets"
    return _no_backend or _core.record_stage_status()


def ensure(has_cuda_backend: bool) -> str:
    """Run the bootstrap once per process on the first CUDA device, eagerly (also while a
    jit traces), after the FFI registration (base/ffi.py) registered the bootstrap target.
    Returns :func:`status`. Never raises: a failure leaves the plain targets."""
    global _tried, _no_backend
    if _tried:
        return status()
    with _lock:
        if _tried:
            return status()
        _tried = True
        if _switched_off():
            return status()
        if not has_cuda_backend:
            _no_backend = "unavailable: no CUDA backend in this process"
            return status()
        gpus = jax.devices("cuda")
        call = jax.ffi.ffi_call(
            _BOOTSTRAP, jax.ShapeDtypeStruct((), jnp.int32), has_side_effect=True
        )
        try:
            with jax.ensure_compile_time_eval(), jax.default_device(gpus[0]):
                jax.block_until_ready(jax.jit(call)())
        except Exception as e:  # noqa: BLE001 - any failure keeps the plain targets
            _log.warning("jax_vmm: XLA's FFI record stage not used (%s: %s)", type(e).__name__, e)
            return status()
        state = status()
        if state != "registered":
            _log.info("jax_vmm: XLA's FFI record stage not used (%s)", state)
        return state


def target_for(name: str) -> str:
    """The target the CUDA lowering of ``name`` should call: its recorded variant once
    registered, else ``name``."""
    if _use_recorded and name in RECORDED and status() == "registered":
        return name + "_recorded"
    return name
