"""Which attention serves an arena layer when the caller leaves the choice to jax_vmm
(jax_vmm/ops/attention_backend.py): the decision table, with cuDNN's availability faked
(the GPU test of the routed call is in test_cudnn_attention.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
from jax_vmm.cache.ids import LayerId
from jax_vmm.ops import attention_backend as ab

GPU_LAYER = LayerId(
    cache_uid=1, layer=0, num_layers=1, shape=(4, 256, 2, 128), dtype="bfloat16", platform="gpu"
)


@pytest.fixture
def cudnn_here(monkeypatch):
    monkeypatch.setattr(ab, "cudnn_available", lambda: True)
    monkeypatch.delenv("JAX_VMM_ATTENTION", raising=False)


def routes(q_dtype=jnp.bfloat16, layer=GPU_LAYER, default_knobs=True) -> bool:
    return ab.routes_to_cudnn(q_dtype, layer, default_knobs=default_knobs)


def test_a_16_bit_gpu_layer_with_default_knobs_runs_cudnn(cudnn_here):
    assert routes()
    assert routes(jnp.float16, dataclasses.replace(GPU_LAYER, dtype="float16"))


@pytest.mark.parametrize(
    "case",
    ["knobs", "cpu", "fp8", "float32", "mixed", "head_dim", "flat", "env"],
)
def test_what_stays_with_jax_vmm_kernels(cudnn_here, monkeypatch, case):
    kw = {}
    if case == "knobs":
        kw["default_knobs"] = False  # an explicit impl or plan is the kernels'
    elif case == "cpu":
        kw["layer"] = dataclasses.replace(GPU_LAYER, platform="cpu")
    elif case == "fp8":
        kw["layer"] = dataclasses.replace(GPU_LAYER, dtype="float8_e4m3fn")
    elif case == "float32":
        kw = dict(q_dtype=jnp.float32, layer=dataclasses.replace(GPU_LAYER, dtype="float32"))
    elif case == "mixed":
        kw["q_dtype"] = jnp.float16  # over a bf16 cache
    elif case == "head_dim":
        kw["layer"] = dataclasses.replace(GPU_LAYER, shape=(4, 256, 2, 260))
    elif case == "flat":
        kw["layer"] = dataclasses.replace(GPU_LAYER, shape=(256, 2, 128))
    else:
        monkeypatch.setenv("JAX_VMM_ATTENTION", "kernels")
    assert not routes(**kw)


def test_without_the_backend_nothing_routes(monkeypatch):
    monkeypatch.setattr(ab, "cudnn_available", lambda: False)
    assert not routes()


def test_a_misspelt_mode_is_refused_by_the_natural_call(monkeypatch):
    """The env var is checked by the call a user makes, with what is accepted."""
    monkeypatch.setenv("JAX_VMM_ATTENTION", "cuddn")
    # zero_fill: the unwritten tokens read as zeros, so the output is finite.
    kv = jax_vmm.kv_arena(
        num_layers=1, num_kv_heads=2, head_dim=16, max_tokens=64, dtype=jnp.float32,
        device=jax.devices("cpu")[0], max_seqs=2, initial_tokens=8, zero_fill=True,
    )  # fmt: skip
    try:
        q = jnp.ones((2, 4, 16), jnp.float32)
        with pytest.raises(ValueError, match="JAX_VMM_ATTENTION='cuddn'.*'kernels'"):
            jax_vmm.decode_attention(q, kv.cache()[0], jnp.array([4, 8]))
        monkeypatch.setenv("JAX_VMM_ATTENTION", "kernels")
        out = jax_vmm.decode_attention(q, kv.cache()[0], jnp.array([4, 8]))
        assert np.isfinite(np.asarray(out)).all()
    finally:
        kv.close()
