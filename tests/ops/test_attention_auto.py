"""Which kernel ``impl="auto"`` picks for a 16-bit cache: the streaming kernel on a GPU
from STREAM_MIN_CACHE_TOKENS cache tokens, split-K below that, on the CPU and whenever a
split-K knob (chunk, splits, workspace="xla") is given. On a GPU, the pick is checked
against the reference."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_vmm import _attention_call as call
from jax_vmm.attention import _decode_attention, reference_decode_attention

GPU = types.SimpleNamespace(platform="gpu")
BIG_T = call.STREAM_MIN_CACHE_TOKENS // 8  # with B = 8: exactly the threshold


def _shapes(B=8, T=BIG_T, D=128, dtype=jnp.bfloat16, k_dtype=None):
    q = jax.ShapeDtypeStruct((B, 32, D), dtype)
    k = jax.ShapeDtypeStruct((B, T, 8, D), k_dtype or dtype)
    return q, k


@pytest.fixture
def on_a_gpu(monkeypatch):
    monkeypatch.setattr(call, "_target", lambda *a: (GPU, 132))


@pytest.mark.parametrize(
    "change, streams",
    [
        ({}, True),
        ({"T": BIG_T - 1}, False),
        ({"dtype": jnp.float16}, True),
        ({"dtype": jnp.float32}, False),
        ({"D": 96}, False),
        ({"k_dtype": jnp.float16}, False),
    ],
    ids=["at_threshold", "below", "fp16", "float32", "head_dim_96", "mixed_dtypes"],
)
def test_auto_streams_large_16_bit_caches_on_a_gpu(on_a_gpu, change, streams):
    q, k = _shapes(**change)
    assert call._streams_by_default(q, k, "scratch", 0, 0) is streams


@pytest.mark.parametrize(
    "workspace, chunk, splits",
    [("xla", 0, 0), ("scratch", 256, 0), ("scratch", 0, 4)],
    ids=["xla_workspace", "chunk", "splits"],
)
def test_a_split_k_knob_keeps_split_k(on_a_gpu, workspace, chunk, splits):
    q, k = _shapes()
    assert not call._streams_by_default(q, k, workspace, chunk, splits)


def test_the_cpu_keeps_split_k(cpu_device):
    q = jax.device_put(jnp.zeros((8, 32, 128), jnp.bfloat16), cpu_device)
    k = jax.ShapeDtypeStruct((8, BIG_T, 8, 128), jnp.bfloat16)
    assert not call._streams_by_default(q, k, "scratch", 0, 0)


@pytest.mark.gpu
def test_auto_at_a_large_shape_matches_the_reference(gpu_device):
    B, T, Hq, Hkv, D = 8, BIG_T, 32, 8, 128
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, T + 1, size=B).astype(np.int32)

    def put(shape):
        x = rng.standard_normal(shape, dtype=np.float32)
        return jax.device_put(jnp.asarray(x, jnp.bfloat16), gpu_device)

    q, k, v = put((B, Hq, D)), put((B, T, Hkv, D)), put((B, T, Hkv, D))
    lens = jax.device_put(jnp.asarray(lengths), gpu_device)
    assert call._streams_by_default(q, k, "scratch", 0, 0)
    got = np.asarray(_decode_attention(q, k, v, lens), np.float32)
    ref = np.asarray(
        reference_decode_attention(
            *(jax.device_put(x, jax.devices("cpu")[0]).astype(jnp.float32) for x in (q, k, v)),
            jax.device_put(lens, jax.devices("cpu")[0]),
        )
    )
    np.testing.assert_allclose(got, ref, atol=2e-2, rtol=2e-2)
