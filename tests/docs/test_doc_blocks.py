"""Every ```python block of README.md and docs/*.md runs as written, as a new user would
run it: alone, in a fresh interpreter, in an empty folder, on the CPU. A block that cannot
run alone is marked ``# fragment: <why>`` on its first line and is skipped by name, with
that reason (doc_blocks.py has the rules)."""

from __future__ import annotations

import subprocess
import textwrap
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from doc_blocks import Block, failure_report, python_blocks, run_block  # this folder, by pytest

HERE = Path(__file__).resolve().parent

REPO = HERE.parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _params() -> list:
    params = []
    for path in DOCS:
        for block in python_blocks(path.read_text(), str(path.relative_to(REPO))):
            why = f"{block.id} is a fragment: {block.fragment}"
            marks = [pytest.mark.skip(reason=why)] * bool(block.fragment)
            params.append(pytest.param(block, id=block.id, marks=marks))
    return params


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The selected blocks' runs, started together two at a time: each child spends most
    of its time importing JAX, and CI has 2 cores."""
    blocks = [
        item.callspec.params["block"]
        for item in request.session.items
        if item.originalname == "test_doc_block_runs_as_written"
        and not item.get_closest_marker("skip")
    ]
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {b.id: pool.submit(run_block, b, tmp_path_factory.mktemp("block")) for b in blocks}


@pytest.mark.parametrize("block", _params())
def test_doc_block_runs_as_written(block: Block, runs: dict[str, Future]):
    proc: subprocess.CompletedProcess = runs[block.id].result()
    if proc.returncode != 0:
        pytest.fail(failure_report(block, proc), pytrace=False)


def test_the_readme_blocks_are_found():
    # An empty parameter list would skip the test above silently.
    assert python_blocks((REPO / "README.md").read_text(), "README.md")


# The finder and the runner themselves, on a synthetic page: a broken block must fail.

PAGE = textwrap.dedent(
    """\
    # Title

    ```bash
    exit 1
    ```

    ```python
    x = 2
    assert x == 2
    ```

    ````python
    import missing_name_on_purpose_xyz
    ````

    ```python
    # fragment: uses `kv` from the block above
    kv.check()
    ```

    ```
    plain text
    ```
    """
)


def test_the_finder_takes_only_python_blocks_with_their_lines():
    blocks = python_blocks(PAGE, "page.md")
    assert [(b.id, b.fragment) for b in blocks] == [
        ("page.md:7", None),
        ("page.md:12", None),
        ("page.md:16", "uses `kv` from the block above"),
    ]
    assert blocks[0].code == "x = 2\nassert x == 2\n"


def test_a_broken_block_is_reported(tmp_path: Path):
    good, broken, _ = python_blocks(PAGE, "page.md")
    assert run_block(good, tmp_path, timeout=60).returncode == 0
    proc = run_block(broken, tmp_path, timeout=60)
    assert proc.returncode != 0
    report = failure_report(broken, proc)
    assert "page.md:12" in report and "ModuleNotFoundError" in report


@pytest.mark.parametrize(
    "text, message",
    [
        ("```python\nx = 1\n", "never closed"),
        ("```python\n# fragment:\nx\n```\n", "needs the reason"),
    ],
    ids=["unclosed-fence", "fragment-without-reason"],
)
def test_a_page_that_would_hide_a_block_is_an_error(text: str, message: str):
    with pytest.raises(ValueError, match=message):
        python_blocks(text, "page.md")
