"""Finds the fenced ```python blocks of a Markdown file and runs one as a new user would.

A block that cannot run alone says so on its first line, visibly in the rendered page:
``# fragment: <why it cannot run alone>``. Every other ```python block must run as
written in a fresh interpreter (``python -c``), in an empty folder, on the CPU.
Blocks of other languages (bash, text, tables) are never run.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
FRAGMENT = re.compile(r"^#\s*fragment:\s*(?P<why>.*?)\s*$")


@dataclass(frozen=True)
class Block:
    source: str  # the file's name as the test id shows it
    line: int  # 1-based line of the opening fence
    code: str
    fragment: str | None  # why it cannot run alone, or None: it must run

    @property
    def id(self) -> str:
        return f"{self.source}:{self.line}"


def python_blocks(text: str, source: str) -> list[Block]:
    """The ```python blocks of ``text``, in order. Raises ValueError for a fence never
    closed or a fragment marker without a reason (both would hide a block)."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, fence = i, m["fence"]
        lang = (m["info"].split() or [""])[0].lower()
        close = re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        i += 1
        while i < len(lines) and not close.match(lines[i]):
            i += 1
        if i == len(lines):
            raise ValueError(
                f"{source}:{start + 1}: the fence {fence!r} is never closed; close it so "
                "the blocks after it are found"
            )
        body = lines[start + 1 : i]
        i += 1
        if lang != "python":
            continue
        fragment = None
        first = FRAGMENT.match(body[0]) if body else None
        if first:
            fragment = first["why"]
            if not fragment:
                raise ValueError(
                    f"{source}:{start + 1}: '# fragment:' needs the reason the block cannot "
                    "run alone, e.g. '# fragment: needs a 4-GPU host'"
                )
        blocks.append(Block(source, start + 1, "\n".join(body) + "\n", fragment))
    return blocks


def child_env() -> dict[str, str]:
    """The environment of a new user on the CPU, who has this package importable the way
    the running tests do (a development build's path included)."""
    from conftest import child_env

    env = child_env(JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # a block that needs several host devices asks for them
    return env


def run_block(block: Block, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs the block as written with ``python -c`` in ``cwd``."""
    return subprocess.run(
        [sys.executable, "-c", block.code],
        cwd=cwd,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def failure_report(block: Block, proc: subprocess.CompletedProcess) -> str:
    """What the test shows when a block fails: where it is, its exit code and its stderr."""
    return (
        f"the ```python block at {block.id} failed (exit {proc.returncode}) when run as "
        f"written (its line n, '<string>' below, is line {block.line} + n of the file); fix "
        "the block, or mark it '# fragment: <why>' on its first line.\n"
        f"--- stderr ---\n{proc.stderr[-4000:]}"
    )
