"""bench/_split_causal.py: the equal-work JAX baseline of bench/cudnn_attention.py for
several queries per sequence (a prefix call and a causal diagonal-block call, joined by
their log-sum-exps) equals bottom-right causal attention, here with JAX's XLA attention
in place of cuDNN's, against a float64 NumPy reference; ragged lengths, a sequence of
exactly S tokens (no prefix) and one of all T included, also with an attention that leaves
NaN and +inf in the rows of an empty prefix (as cuDNN may: rows it does not write). The
control: the top-left causal mask JAX's call has gives other values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scripts import load_script

SC = load_script("bench/_split_causal.py")
B, T, S, HQ, HKV, D = 4, 24, 6, 4, 2, 8


def _bottom_right_reference(q, k, v, lengths):
    out = np.zeros(q.shape, np.float64)
    for b in range(B):
        n = lengths[b]
        for i in range(S):
            for h in range(HQ):
                kh = k[b, : n - S + i + 1, h // (HQ // HKV)].astype(np.float64)
                vh = v[b, : n - S + i + 1, h // (HQ // HKV)].astype(np.float64)
                s = kh @ q[b, i, h].astype(np.float64) / np.sqrt(D)
                p = np.exp(s - s.max())
                out[b, i, h] = (p / p.sum()) @ vh
    return out


def _garbage_where_empty(q, k, v, kv_lengths, causal):
    """reference_attend, with NaN outputs and +inf log-sum-exps where no token is scored."""
    out, lse = SC.reference_attend(q, k, v, kv_lengths, causal)
    empty = (kv_lengths == 0)[:, None, None]
    return jnp.where(empty[..., None], jnp.nan, out), jnp.where(empty, jnp.inf, lse)


@pytest.mark.parametrize("attend", ["reference", "garbage_where_empty"])
def test_the_split_equals_bottom_right_causal_attention(attend, cpu_device):
    # On the CPU: a GPU's default float32 matmul precision is below this tolerance.
    with jax.default_device(cpu_device):
        _check_the_split(SC.reference_attend if attend == "reference" else _garbage_where_empty)


def _check_the_split(attend) -> None:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, S, HQ, D)).astype(np.float32)
    k = rng.standard_normal((B, T, HKV, D)).astype(np.float32)
    v = rng.standard_normal((B, T, HKV, D)).astype(np.float32)
    lengths = np.array([S, T, 11, 17], np.int32)
    got = SC.split_causal_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths), attend
    )
    want = _bottom_right_reference(q, k, v, lengths)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)

    # The control: one top-left causal call over the same tokens is another attention.
    top_left, _ = SC.reference_attend(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths), True
    )
    assert np.abs(np.asarray(top_left) - want).max() > 1e-2
