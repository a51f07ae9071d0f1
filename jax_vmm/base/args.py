"""Argument checks shared by every layer: integers, flags, shapes and layer indices as the
public API accepts them, with errors that name the argument; and the refusal to pickle an
object that owns a reservation."""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

import jax
import numpy as np

__all__ = [
    "is_int",
    "as_int",
    "as_float32",
    "as_index",
    "as_flag",
    "as_shape",
    "layer_index",
    "refuse_copy",
]


def is_int(value: Any) -> bool:
    """Whether ``value`` is a Python or NumPy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def as_int(value: Any, what: str) -> int:
    """``value`` as an int: anything ``operator.index`` accepts (numpy and concrete JAX
    integer scalars too), except bools (True is not a size or an index)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be an integer, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {type(value).__name__}") from None


def as_float32(value: Any, what: str) -> float:
    """``value`` as a float that float32 holds finite (the kernels compute in float32):
    a Python, NumPy or concrete JAX real scalar, not a bool; ValueError when float32 would
    make it inf."""
    if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer):
        value = value.item() if value.ndim == 0 else value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{what} must be a real number (static: a Python, NumPy or concrete JAX scalar), "
            f"got {type(value).__name__}"
        )
    try:
        out = float(value)
    except OverflowError:  # an int past float64's range
        out = math.inf
    with np.errstate(over="ignore"):
        if not np.isfinite(np.float32(out)):
            raise ValueError(
                f"{what} must be finite in float32 (|x| < 3.4e38; the kernels compute in "
                f"float32), got {value}"
            )
    return out


def as_softcap(softcap: Any, op: str) -> float:
    """A logit soft-cap for ``op``'s error messages: 0.0 for None (no cap), else a normal
    float32 > 0 (one that float32 rounds to 0, or a subnormal the kernels flush to 0,
    would silently mean no cap)."""
    if softcap is None:
        return 0.0
    value = as_float32(softcap, f"{op}: softcap (None for no cap)")
    if np.float32(value) < np.finfo(np.float32).tiny:
        raise ValueError(
            f"{op}: softcap must be > 0 in float32, and at least its smallest normal "
            f"1.18e-38 (the kernels flush smaller ones to 0: no cap), or None for no cap; "
            f"got {softcap}"
        )
    return value


def as_window(window: Any, op: str) -> int:
    """A sliding window for ``op``'s error messages: 0 for None (no window), else a static
    int >= 1, capped at int32's largest (a window past every position is no window)."""
    if window is None:
        return 0
    try:
        window = as_int(window, "window")
    except TypeError:
        raise TypeError(
            f"{op}: window must be None or an int >= 1 (positions a query sees, itself "
            f"included; static, not traced), got {type(window).__name__} {window!r}"
        ) from None
    if window < 1:
        raise ValueError(f"{op}: window must be >= 1 (or None for no window), got {window}")
    return int(min(window, np.iinfo(np.int32).max))


def as_index(value: Any, what: str, minimum: int = 0) -> int:
    """``value`` as an int >= ``minimum`` (0 or 1), see :func:`as_int`."""
    i = as_int(value, what)
    if i < minimum:
        raise ValueError(f"{what} must be {'> 0' if minimum == 1 else '>= 0'}, got {i}")
    return i


def as_flag(value: Any, what: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be True or False, got {value!r}")
    return bool(value)


def refuse_copy(what: str, device: Any, copy_out: str) -> TypeError:
    return TypeError(
        f"jax_vmm.{what} cannot be pickled or copied: it owns a reservation of virtual memory "
        f"on {device}. Share the object itself (it is thread-safe), or copy data out with "
        f"{copy_out}"
    )


def as_shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, (bool, np.bool_)):
        shape = (shape,)
    try:
        if any(isinstance(d, (bool, np.bool_)) for d in shape):
            raise TypeError
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise TypeError(f"shape must be a tuple of ints, got {shape!r}") from None
    if not dims or any(d <= 0 for d in dims):
        raise ValueError(f"shape must have at least one dimension and all sizes > 0, got {dims}")
    return dims


def layer_index(layer: Any, num_layers: int, op: str) -> int:
    """A layer index in [-num_layers, num_layers) as a non-negative int. It must be static:
    a layer picks buffers on the host, when a step is traced."""
    if isinstance(layer, jax.core.Tracer):
        raise TypeError(
            f"{op}: the layer must be static (a Python int), got a traced value (a layer "
            "picks its buffers when the step is traced): pass the layer as a static argument "
            "(static_argnums) or loop over layers in Python"
        )
    if isinstance(layer, (bool, np.bool_)):
        raise TypeError(f"{op}: layer must be an integer, got bool")
    try:
        i = operator.index(layer)
    except TypeError:
        raise TypeError(f"{op}: layer must be an integer, got {type(layer).__name__}") from None
    if not -num_layers <= i < num_layers:
        raise IndexError(f"{op}: layer {i} is out of range for {num_layers} layers")
    return i % num_layers
