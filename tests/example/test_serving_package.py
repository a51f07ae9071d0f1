"""jax_vmm.serving as a package: `import jax_vmm` pulls in none of it nor its optional
dependencies, a missing one is named with the extra that installs it, and the serving
code reaches jax_vmm through its public top-level names only."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import jax_vmm
from conftest import child_env
from jax_vmm.serving._optional import INSTALL_HINT, require

SERVING = Path(jax_vmm.__file__).resolve().parent / "serving"
OPTIONAL = ("tqdm", "safetensors", "tokenizers", "matplotlib")


def test_import_jax_vmm_leaves_serving_and_its_dependencies_out() -> None:
    code = (
        "import sys, jax_vmm\n"
        "print(sorted(m for m in sys.modules if m.startswith('jax_vmm.serving')"
        f" or m.split('.')[0] in {OPTIONAL!r}))"
    )
    env = child_env()
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("module", ["tokenizers", "safetensors", "tqdm"])
def test_a_missing_optional_dependency_names_the_extra(monkeypatch, module: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # `import module` fails
    want = rf"'{module}' package.*{re.escape(INSTALL_HINT)}"
    with pytest.raises(ImportError, match=want) as info:
        require(module, "this feature")
    assert "this feature" in str(info.value)


def test_text_prompts_without_tokenizers_say_how_to_install(monkeypatch, tmp_path) -> None:
    from jax_vmm.serving.hf.tokenizer import TextTokenizer

    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r"jax_vmm\[serving\]"):
        TextTokenizer(tmp_path / "tokenizer.json")


def _jax_vmm_uses(tree: ast.AST) -> list[str]:
    """What a module takes from jax_vmm outside jax_vmm.serving: `import jax_vmm.x`,
    `from jax_vmm.x import ...` (as "jax_vmm.x"), and each `jax_vmm.NAME` attribute."""
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            uses += [a.name for a in node.names if a.name.startswith("jax_vmm.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "jax_vmm":
                uses += [f"jax_vmm.{a.name}" for a in node.names]
            elif node.module.startswith("jax_vmm."):
                uses.append(node.module)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "jax_vmm"
        ):
            uses.append(f"jax_vmm.{node.attr}")
    return [u for u in uses if not u.startswith("jax_vmm.serving")]


def test_serving_uses_only_the_public_api() -> None:
    files = sorted(SERVING.rglob("*.py"))
    assert len(files) > 10, f"no serving modules under {SERVING}"
    bad = {}
    for path in files:
        for use in _jax_vmm_uses(ast.parse(path.read_text(), str(path))):
            name = use.removeprefix("jax_vmm.")
            if "." in name or name.startswith("_") or not hasattr(jax_vmm, name):
                bad.setdefault(str(path.relative_to(SERVING)), []).append(use)
    assert not bad, f"serving reaches jax_vmm past its top-level public names: {bad}"


def test_the_public_api_check_catches_a_private_import() -> None:
    tree = ast.parse(
        "import jax_vmm\nfrom jax_vmm.attention import _decode_attention\n"
        "jax_vmm._loader.core\njax_vmm.kv_write\n"
    )
    want = ["jax_vmm._loader", "jax_vmm.attention", "jax_vmm.kv_write"]
    assert sorted(_jax_vmm_uses(tree)) == want


@pytest.mark.parametrize("script", ["decode", "generate", "sleep_wake", "tensor_parallel"])
def test_example_scripts_run_from_outside_the_repo(script: str, tmp_path: Path) -> None:
    """The thin scripts of examples/ reach jax_vmm.serving as an installed package would
    (the PYTHONPATH this test runs with), from any working directory."""
    path = Path(__file__).resolve().parents[2] / "examples" / f"{script}.py"
    env = child_env()
    out = subprocess.run(
        [sys.executable, str(path), "--help"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout and "--backend" in out.stdout
