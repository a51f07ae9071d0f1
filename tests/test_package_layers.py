"""The package's import structure, checked from source (ast, no tool): no import circle
between modules, subpackages that import only the layers below them, no private name
imported from another subpackage, no import inside a function but of an optional
dependency, and ``import jax_vmm`` loading no test code.

The checker runs on jax_vmm and, to show that each rule can fail, on small synthetic
packages that break it.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "jax_vmm"

#: jax_vmm's layers, bottom first: a module may import only from its own layer and the
#: layers before it (within a layer, the module graph must still be acyclic). Keys are
#: module-name prefixes below ``jax_vmm``; "" is the package itself.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "base",
        "_core",
        "_core_testing",
    ),  # the compiled core (and its test hooks), FFI registration, devices, errors, fp8, args
    ("memory",),  # Arena, Buffer, Transfer
    ("cache",),  # the KVCache pytree, layer identities, the arena registry
    ("ops",),  # array ops, attention, scratch, cache-layer and sharded ops
    ("kv",),  # KVArena, ShardedKVArena, kv_arena
    ("", "errors", "info", "__main__"),  # the public face
    ("serving",),  # the engine, models and checkpoint loader, on the public face only
    ("testing",),  # test hooks: above everything, imported by nothing of the package
)

#: Third-party modules that may be imported inside a function (optional dependencies).
OPTIONAL_IMPORTS = frozenset({"cupy", "matplotlib", "tqdm"})

#: Private names that may cross subpackages: the compiled extensions.
PRIVATE_ALLOWED = frozenset({"_core", "_core_testing"})


@dataclasses.dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (inside the package)
    name: str | None  # for ``from target import name`` where name is not a module
    in_function: bool
    line: int


def _modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package under ``root``: dotted name -> file."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join([package, *parts])] = path
    return out


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _imports(root: Path, package: str) -> tuple[dict[str, Path], list[Import], list[str]]:
    """All imports of every module (module level, ``if TYPE_CHECKING``, inside functions),
    relative and absolute, as (modules, imports inside the package, function-level imports
    of outside modules as "module:line: name")."""
    modules = _modules(root, package)
    internal: list[Import] = []
    outside_in_functions: list[str] = []
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        here = mod if _is_package(path) else mod.rpartition(".")[0]

        def visit(node: ast.AST, in_function: bool, mod: str = mod, here: str = here) -> None:
            for child in ast.iter_child_nodes(node):
                func = in_function or isinstance(
                    child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
                )
                if isinstance(child, ast.Import):
                    for alias in child.names:
                        _record(mod, alias.name, None, func, child.lineno)
                elif isinstance(child, ast.ImportFrom):
                    if child.level:
                        base = here.split(".")
                        base = base[: len(base) - (child.level - 1)]
                        target = ".".join(base + ([child.module] if child.module else []))
                    else:
                        target = child.module or ""
                    for alias in child.names:
                        sub = f"{target}.{alias.name}"
                        if sub in modules or (target == package and alias.name in PRIVATE_ALLOWED):
                            _record(mod, sub, None, func, child.lineno)
                        else:
                            _record(mod, target, alias.name, func, child.lineno)
                visit(child, func)

        def _record(mod: str, target: str, name: str | None, func: bool, line: int) -> None:
            if target == package or target.startswith(package + "."):
                internal.append(Import(mod, target, name, func, line))
            elif func and target.split(".")[0] not in OPTIONAL_IMPORTS:
                outside_in_functions.append(f"{mod}:{line}: import {target}")

        visit(tree, False)
    return modules, internal, outside_in_functions


def _edges(modules: dict[str, Path], imports: list[Import], package: str) -> dict[str, set[str]]:
    """Module -> modules its import runs: the target and the packages on the way to it
    that are not the importer's own (their ``__init__`` runs too)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for imp in imports:
        parts = imp.target.split(".")
        for i in range(2, len(parts) + 1):
            step = ".".join(parts[:i])
            own = imp.source == step or imp.source.startswith(step + ".")
            if step in modules and not own:
                graph[imp.source].add(step)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules in order, the first repeated), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := dfs(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := dfs(node)):
            return found
    return None


def layer_of(module: str, package: str, layers: tuple[tuple[str, ...], ...]) -> tuple[int, str]:
    """(layer index, subpackage key) of a module, by the longest matching prefix."""
    rest = module[len(package) + 1 :] if module != package else ""
    best = None
    for index, keys in enumerate(layers):
        for key in keys:
            if rest == key or (key and rest.startswith(key + ".")):
                if best is None or len(key) > len(best[1]):
                    best = (index, key)
    if best is None:
        raise AssertionError(f"{module} is in no layer; add it to LAYERS")
    return best


def check(root: Path, package: str, layers: tuple[tuple[str, ...], ...]) -> dict[str, list[str]]:
    """Every rule's violations (empty lists: all rules hold)."""
    modules, imports, outside_in_functions = _imports(root, package)
    graph = _edges(modules, imports, package)
    cycle = find_cycle(graph)
    upward, private, in_functions = [], [], list(outside_in_functions)
    for imp in imports:
        src_layer, src_key = layer_of(imp.source, package, layers)
        dst_layer, dst_key = layer_of(imp.target, package, layers)
        where = f"{imp.source}:{imp.line}: {imp.target}" + (f".{imp.name}" if imp.name else "")
        if dst_layer > src_layer:
            upward.append(where)
        leaf = imp.name if imp.name is not None else imp.target.rpartition(".")[2]
        if (
            src_key != dst_key
            and leaf.startswith("_")
            and not leaf.startswith("__")
            and leaf not in PRIVATE_ALLOWED
        ):
            private.append(where)
        if imp.in_function:
            in_functions.append(where)
    return {
        "cycle": [" -> ".join(cycle)] if cycle else [],
        "upward": upward,
        "private": private,
        "in_function": in_functions,
    }


# -- jax_vmm ------------------------------------------------------------------------------

RESULT = check(PACKAGE, "jax_vmm", LAYERS)


@pytest.mark.parametrize("rule", ["cycle", "upward", "private", "in_function"])
def test_jax_vmm_obeys(rule: str) -> None:
    assert RESULT[rule] == [], f"jax_vmm breaks the {rule!r} rule:\n" + "\n".join(RESULT[rule])


def test_every_module_has_a_layer() -> None:
    for module in _modules(PACKAGE, "jax_vmm"):
        layer_of(module, "jax_vmm", LAYERS)


def test_attention_name_is_free() -> None:
    # jax_vmm.attention is kept for a function: no module may take the name.
    assert not (PACKAGE / "attention.py").exists()
    assert not (PACKAGE / "attention").exists()


def test_py_typed_ships() -> None:
    assert (PACKAGE / "py.typed").is_file()


def test_import_loads_no_test_code() -> None:
    code = "import sys, jax_vmm; print('\\n'.join(sorted(sys.modules)))"
    env = dict(os.environ)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    ).stdout.split()
    ours = [m for m in out if m == "jax_vmm" or m.startswith("jax_vmm.")]
    assert "jax_vmm.kv" in ours  # the import did load the package
    assert [m for m in ours if m.startswith("jax_vmm.testing")] == []
    extensions = [m for m in ours if "testing" in m.split(".")[1:] or "_testing" in m]
    assert extensions == []


def test_public_names_are_complete() -> None:
    import jax_vmm

    assert sorted(set(jax_vmm.__all__)) == sorted(jax_vmm.__all__)
    for name in jax_vmm.__all__:
        assert hasattr(jax_vmm, name), name
    for name in ("kv_write", "decode_attention", "ordered_views", "KVDest", "scratch_stats"):
        assert name in jax_vmm.__all__
    assert not isinstance(getattr(jax_vmm, "attention", None), type(sys))


# -- the checker fails where it should ------------------------------------------------------

SYNTHETIC_LAYERS = (("low",), ("high",), ("",))


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in {
        "__init__.py": "",
        "low/__init__.py": "",
        "high/__init__.py": "",
        **files,
    }.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_checker_passes_a_clean_package(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "low/a.py": "X = 1\n",
            "high/b.py": "from ..low.a import X\nfrom . import c\n",
            "high/c.py": "import pkg.low.a\n",
        },
    )
    assert check(root, "pkg", SYNTHETIC_LAYERS) == {
        "cycle": [],
        "upward": [],
        "private": [],
        "in_function": [],
    }


def test_checker_finds_a_cycle(tmp_path: Path) -> None:
    # The old tree's kind of circle: one side imports at module level, the other in a
    # function.
    root = _package(
        tmp_path,
        {
            "low/a.py": "from . import b\n",
            "low/b.py": "def f():\n    from .a import X\n",
        },
    )
    result = check(root, "pkg", SYNTHETIC_LAYERS)
    assert result["cycle"] == ["pkg.low.a -> pkg.low.b -> pkg.low.a"]
    assert result["in_function"] == ["pkg.low.b:2: pkg.low.a.X"]


def test_checker_finds_a_cycle_through_a_package_init(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "low/__init__.py": "from .a import X\n",
            "low/a.py": "X = 1\nimport pkg.high.b\n",
            "high/b.py": "from pkg.low import a\n",
        },
    )
    result = check(root, "pkg", SYNTHETIC_LAYERS)
    assert result["cycle"]
    assert result["upward"] == ["pkg.low.a:2: pkg.high.b"]


def test_checker_finds_private_names_across_subpackages(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "low/a.py": "_HIDDEN = 1\n",
            "low/c.py": "from .a import _HIDDEN\n",  # within a subpackage: allowed
            "high/b.py": "from ..low.a import _HIDDEN\nfrom ..low import _d\n",
            "low/_d.py": "",
        },
    )
    assert check(root, "pkg", SYNTHETIC_LAYERS)["private"] == [
        "pkg.high.b:1: pkg.low.a._HIDDEN",
        "pkg.high.b:2: pkg.low._d",
    ]


def test_checker_allows_only_optional_imports_in_functions(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {"low/a.py": "def f():\n    import tqdm\n    import json\n    return lambda: __import__\n"},
    )
    assert check(root, "pkg", SYNTHETIC_LAYERS)["in_function"] == ["pkg.low.a:3: import json"]
