"""Loads a repository script (bench/, tools/) as a module by its path, for the tests that
check a measurement script against the engine: no sys.path edit, so its folder's module
names cannot shadow others."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_script(relpath: str) -> ModuleType:
    """The module of REPO/relpath (loaded once per process). The script must import no
    sibling module by bare name."""
    path = REPO / relpath
    name = "_script_" + relpath.replace("/", "_").removesuffix(".py")
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not a Python file to load")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
