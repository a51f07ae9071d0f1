"""The README's "Using it" block runs as written, in its order: the step writes the arena
and attends over it, and ``kv.check()`` right after it reports a dropped write. (That
check() waits for a step still in flight is shown by
tests/ops/test_kv_write.py::test_check_waits_for_the_writes_in_flight, with a step slow
enough to still be running.)"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import jax_vmm

README = Path(__file__).resolve().parents[2] / "README.md"


def _using_it_block() -> str:
    text = README.read_text()
    section = text.split("## Using it", 1)[1]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


SLOT = "seq, pos = jnp.array([3]), jnp.array([prompt_len])"


def _run(slot: str = SLOT) -> dict:
    """The block as written (one new token of sequence 3 at position prompt_len = 5), or
    with its ``seq, pos`` line replaced by ``slot``."""
    block = _using_it_block()
    assert SLOT in block, "the README block's seq, pos line changed: update SLOT here"
    scope: dict = {"print": lambda *a: None}
    exec(compile(block.replace(SLOT, slot), str(README), "exec"), scope)  # noqa: S102
    return scope


def test_the_readme_block_writes_the_arena(cpu_device):
    scope = _run()  # ensure(prompt_len + 1) backs it; check() passed
    kv = scope["kv"]
    try:
        # Attention in the step read the token the step wrote into the arena: its key
        # (all 1s) scores ~11 above the zero keys before it, so sequence 3 gets its V (1).
        out = np.asarray(scope["out"]).astype(np.float32)
        np.testing.assert_allclose(out[3], 1.0, atol=0.05)
        assert not out[:3].any()  # length 0: zeros
        assert kv.stats()["commit_calls"] == 1
        assert kv.backed_tokens(3) == 0  # released at the end of the block
    finally:
        kv.close()


def test_the_readme_check_sees_the_step_it_follows(cpu_device):
    with pytest.raises(jax_vmm.OutOfBoundsWrite) as info:
        _run(SLOT.replace("prompt_len", "8000"))  # far past what ensure() backed: dropped
    assert info.value.count == 2  # the k and the v side


def test_the_readme_check_sees_a_position_past_the_sequence(cpu_device):
    """pos = max_tokens of sequence 3 is not sequence 4's first token: dropped, counted."""
    with pytest.raises(jax_vmm.OutOfBoundsWrite) as info:
        _run(SLOT.replace("prompt_len", "8192"))
    assert info.value.count == 2
