"""The README's "Using it" block runs as written, in its order: the step writes, and
``kv.check()`` right after it reports a dropped write. (That check() waits for a step
still in flight is shown by tests/ops/test_kv_write.py::test_check_waits_for_the_writes_in_flight,
with a step slow enough to still be running.)"""

from __future__ import annotations

import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm

README = Path(__file__).resolve().parents[2] / "README.md"


def _using_it_block() -> str:
    text = README.read_text()
    section = text.split("## Using it", 1)[1]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


def _run(position: int) -> dict:
    """The block, with one new token of sequence 3 at ``position``."""
    scope = {
        "prompt_len": 5,
        "new_k": jnp.full((1, 8, 128), 2, jnp.bfloat16),
        "new_v": jnp.full((1, 8, 128), 3, jnp.bfloat16),
        "slots": jnp.array([3 * 8192 + position], jnp.int32),
        "print": lambda *a: None,
    }
    exec(compile(_using_it_block(), str(README), "exec"), scope)  # noqa: S102
    return scope


def test_the_readme_block_writes_the_arena(cpu_device):
    scope = _run(position=5)  # ensure(prompt_len + 1) backs it; check() passed
    kv = scope["kv"]
    try:
        assert float(np.asarray(scope["k0"][3, 5]).astype(np.float32).max()) == 2.0
        assert kv.stats()["commit_calls"] == 1
        assert kv.backed_tokens(3) == 0  # released at the end of the block
    finally:
        kv.close()


def test_the_readme_check_sees_the_step_it_follows(cpu_device):
    with pytest.raises(jax_vmm.OutOfBoundsWrite) as info:
        _run(position=8000)  # far past what ensure() backed: dropped
    assert info.value.count == 2  # the k and the v side
