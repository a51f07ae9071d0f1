"""Imports the compiled core, with an error that says what to do when it is missing."""

from __future__ import annotations

try:
    from .. import _core  # noqa: F401  (the nanobind extension)
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        "jax_vmm: the compiled extension jax_vmm._core could not be imported "
        f"({exc}). Install the package with `pip install .` (it builds the C++ core), "
        "or for a development build put its build directory on PYTHONPATH."
    ) from exc

core = _core
