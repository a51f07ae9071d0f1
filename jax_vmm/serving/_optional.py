"""The serving extra's optional dependencies, imported only where they are used, so that
`import jax_vmm` (and most of `jax_vmm.serving`) works without them."""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL_HINT = "pip install 'jax_vmm[serving]'"


def require(module: str, purpose: str) -> ModuleType:
    """`module`, imported; if it is not installed, an ImportError that says what needs it
    and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{purpose} needs the {module!r} package, which is not installed: {INSTALL_HINT}"
        ) from e
