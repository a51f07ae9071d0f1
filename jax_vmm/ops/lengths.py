"""Per-sequence counts (``lengths``, ``q_lengths``) and write coordinates (``seq``,
``pos``) as the int32 arrays the custom calls take, whatever the user passed: a
jax.Array, a NumPy array, a list of Python or NumPy integers, or a list of traced scalars
(inside ``jit``). Integers wider than int32 are clamped before the cast, so ``2**32 + 1``
never becomes 1: host values before JAX sees them (without x64 JAX itself would truncate
an int64 array to int32), traced ones in the graph. Shapes and dtypes are the caller's to
check."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def clamped_counts(values: Any, upper: int | None) -> jax.Array:
    """``values`` as a jax.Array; integers of 32 bits or more clamped to [0, ``upper``]
    (no clamp when ``upper`` is None) and cast to int32. Narrower integers and
    non-integers are returned as they are, for the caller's checks."""
    return clamped_int32(values, 0, upper)


def clamped_int32(values: Any, lower: int, upper: int | None) -> jax.Array:
    """:func:`clamped_counts` with a lower bound of choice (``seq`` and ``pos`` of a
    write clamp to one past each end, so an out-of-range value stays out of range)."""
    if not isinstance(values, jax.Array):
        try:
            host = np.asarray(values)
        except Exception:  # noqa: BLE001 - e.g. a list of traced scalars: JAX stacks it
            values = jnp.asarray(values)
        else:
            if upper is not None and _is_wide_int(host.dtype):
                host = np.clip(host, _lower_of(host.dtype, lower), upper).astype(np.int32)
            return jnp.asarray(host)
    if upper is not None and _is_wide_int(values.dtype):
        values = jnp.clip(values, _lower_of(values.dtype, lower), upper).astype(jnp.int32)
    return values


def _lower_of(dtype: Any, lower: int) -> int:
    """The clamp's lower bound in ``dtype``: a negative bound of an unsigned type would
    wrap to its largest value and clamp everything to ``upper``."""
    return max(lower, 0) if np.issubdtype(dtype, np.unsignedinteger) else lower


def _is_wide_int(dtype: Any) -> bool:
    return bool(np.issubdtype(dtype, np.integer)) and np.dtype(dtype).itemsize >= 4
