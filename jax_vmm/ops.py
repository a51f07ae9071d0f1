"""KV-cache writes as XLA FFI custom calls: ``kv_write`` and ``kv_write_through``.

Both take KV-cache views (``kv.k[l]``, ``kv.v[l]``), ``n`` new tokens and their flat
slots (``slot = seq * max_tokens + position`` for a per-sequence layout; the cache is seen
as ``(num_slots, num_kv_heads, head_dim)``; a negative slot is padding and is skipped).
Slots are validated on the device, so the checks hold when XLA replays a captured CUDA
graph: a slot past the buffer, or on a page that is not committed, is dropped, never
written, and counted in the buffer's drop counter (``kv.check()`` raises
:class:`jax_vmm.OutOfBoundsWrite`).

Where the tokens land depends on what XLA hands the custom call, which these two ops
split differently (measured with jax 0.10.2 on CPU, see docs/kv_write.md):

``kv_write(k, v, new_k, new_v, slots) -> (k, v)`` is functional: the returned arrays
always hold the new tokens. It is two custom calls. ``jax_vmm_kv_write_through`` writes
the tokens into its cache operand in place when that operand is arena memory;
``jax_vmm_kv_write`` (cache aliased to its output) has nothing left to do when its output
is that arena buffer, and otherwise ("alias miss") writes the tokens into the output.
With the cache donated on a GPU, XLA updates it in place: the output *is* the arena, no
copy of the cache happens, and the arena holds the tokens. Without donation XLA must not
modify the argument, so it copies the cache once at the start of the program and hands
*both* calls the copy: the returned arrays are right, but the arena is not written
(``kv_write_stats()`` counts an alias miss). On CPU, donating an arena view makes PjRt
copy it before the program runs, with the same effect.

``kv_write_through(k, v, new_k, new_v, slots) -> status`` is for an arena that *is* the
state: it only writes into the arena (no aliasing, so XLA never copies the cache: it
works without donation, in ``lax.scan``/``fori_loop`` too, at zero copy cost) and
returns a ``(2, n)`` int32 status per token and side (0 padding, 1 written, 2 dropped:
slot out of range, 3 dropped: page not committed). XLA does not know that the cache
changed, so order later reads of it by data dependence on ``status`` (a custom call such
as attention that takes it as an operand), or read the arena after the step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._ffi import ensure_registered
from ._loader import core as _core

__all__ = ["kv_write", "kv_write_through", "kv_write_stats", "reset_kv_write_stats",
           "PADDING", "WRITTEN", "DROPPED_OUT_OF_RANGE", "DROPPED_UNBACKED"]

#: Per-token status codes returned by :func:`kv_write_through`.
PADDING, WRITTEN, DROPPED_OUT_OF_RANGE, DROPPED_UNBACKED = 0, 1, 2, 3

_THROUGH = "jax_vmm_kv_write_through"
_WRITE = "jax_vmm_kv_write"


def _shape_dtype(x: Any, name: str) -> tuple[tuple[int, ...], np.dtype]:
    try:
        return tuple(x.shape), np.dtype(x.dtype)
    except AttributeError:
        raise TypeError(f"kv_write: {name} must be an array, got {type(x).__name__}") from None


def _check(op: str, k: Any, v: Any, new_k: Any, new_v: Any, slots: Any) -> int:
    """Trace-time validation; returns the number of tokens n."""
    ks, kd = _shape_dtype(k, "k")
    vs, vd = _shape_dtype(v, "v")
    nks, nkd = _shape_dtype(new_k, "new_k")
    nvs, nvd = _shape_dtype(new_v, "new_v")
    ss, sd = _shape_dtype(slots, "slots")
    if len(ks) < 3:
        raise ValueError(f"{op}: k must be a KV-cache view of shape (..., num_kv_heads, head_dim) "
                         f"with rank >= 3, e.g. kv.k[layer]; got shape {ks}")
    if (ks, kd) != (vs, vd):
        raise ValueError(f"{op}: k and v must have the same shape and dtype; got k {ks} {kd} "
                         f"and v {vs} {vd}")
    heads = ks[-2:]
    for name, s, d in (("new_k", nks, nkd), ("new_v", nvs, nvd)):
        if len(s) != 3 or s[1:] != heads:
            raise ValueError(f"{op}: {name} must have shape (n, {heads[0]}, {heads[1]}) to match "
                             f"the cache {ks}; got {s}")
        if d != kd:
            raise TypeError(f"{op}: {name} has dtype {d} but the cache holds {kd}; cast it with "
                            f"{name}.astype({kd.name!r})")
    if nks != nvs:
        raise ValueError(f"{op}: new_k {nks} and new_v {nvs} must have the same shape")
    n = nks[0]
    if ss != (n,):
        raise ValueError(f"{op}: slots must have shape ({n},), one flat slot per new token; got {ss}")
    if sd != np.dtype(np.int32):
        raise TypeError(f"{op}: slots must be int32 (flat slot = seq * max_tokens + position); got "
                        f"{sd}; use slots.astype(jnp.int32)")
    return n


def kv_write(k: jax.Array, v: jax.Array, new_k: jax.Array, new_v: jax.Array,
             slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Write ``n`` tokens into a KV cache; returns the updated ``(k, v)``.

    Args:
      k, v: the cache, shape ``(..., num_kv_heads, head_dim)`` (a KV-arena view
        ``kv.k[l]``/``kv.v[l]``, or any array), seen as ``(num_slots, H, D)``.
      new_k, new_v: ``(n, H, D)`` in the cache's dtype.
      slots: int32 ``(n,)``, the flat slot of each token; negative slots are skipped.

    Returns:
      ``(k, v)`` with the tokens written (dropped slots excepted). Use them in place of
      the inputs. Donate the cache (``jax.jit(..., donate_argnums=...)``) on a GPU for an
      in-place update of the arena without any copy; see the module docstring for what
      happens without donation. Works in ``jit``, ``lax.scan`` and ``fori_loop``.
    """
    n = _check("kv_write", k, v, new_k, new_v, slots)
    if n == 0:
        return k, v
    ensure_registered()
    status = jax.ffi.ffi_call(_THROUGH, jax.ShapeDtypeStruct((2, n), jnp.int32))(
        k, v, new_k, new_v, slots, require_arena=False)
    # The status operand orders the aliased call after the write-through one, and lets it
    # write exactly the tokens the first call validated.
    out = jax.ffi.ffi_call(
        _WRITE,
        (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        input_output_aliases={0: 0, 1: 1})(k, v, new_k, new_v, slots, status)
    return out[0], out[1]


def kv_write_through(k: jax.Array, v: jax.Array, new_k: jax.Array, new_v: jax.Array,
                     slots: jax.Array) -> jax.Array:
    """Write ``n`` tokens straight into the arena buffers that ``k``/``v`` view.

    Same arguments as :func:`kv_write`; ``k``/``v`` must be arena memory when the program
    runs (jit arguments that no other op updates; on CPU not donated), otherwise the call
    fails with an error saying so. Returns the ``(2, n)`` int32 status (see
    :data:`WRITTEN` and friends); keep it alive (return it, or feed it to the op that
    reads the cache next), since XLA removes calls whose result is unused.
    """
    n = _check("kv_write_through", k, v, new_k, new_v, slots)
    if n == 0:
        return jnp.zeros((2, 0), jnp.int32)
    ensure_registered()
    return jax.ffi.ffi_call(_THROUGH, jax.ShapeDtypeStruct((2, n), jnp.int32))(
        k, v, new_k, new_v, slots, require_arena=True)


def kv_write_stats() -> dict:
    """Counters of the kv_write handlers.

    ``{"kv_write_through": {...}, "kv_write": {...}, "dropped_writes": int}``; each
    handler has ``calls`` and ``captured_calls`` (host invocations, and those made while
    XLA captured a CUDA graph; graph replays run no host code and are not counted),
    ``alias_misses`` (kv_write's output was not arena memory: the tokens went into an XLA
    copy) and ``non_arena`` (the write-through operand was not arena memory).
    ``dropped_writes`` counts dropped token writes per buffer side on the host and the
    devices (reading it waits for the devices).
    """
    return _core.kv_write_stats()


def reset_kv_write_stats() -> None:
    """Zero every kv_write counter (waits for the devices)."""
    _core.kv_write_reset_stats()


def set_debug_unchecked_writes(enabled: bool) -> None:
    """TEST ONLY. When on, the write-through handler skips the slot range and page checks
    and writes wherever a slot points: out-of-range slots corrupt neighbouring memory and
    unbacked pages fault. Tests use it to show that their checks notice."""
    _core.kv_write_set_debug_unchecked(bool(enabled))
