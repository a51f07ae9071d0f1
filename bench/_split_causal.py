"""An equal-work baseline for several queries per sequence (bench/cudnn_attention.py, S > 1).

jax_vmm.attention gives the S new queries of a sequence of n cached tokens the last S
positions: query i sees tokens [0, n - S + i] (a causal mask aligned bottom-right). JAX's
cuDNN call has no such mask: its causal mask is aligned top-left, and a padding-only mask
scores all S x n pairs. The same scores (S x (n - S) + S x (S + 1) / 2) come from two calls
it can express, joined by their log-sum-exps:

  * the prefix: every query over tokens [0, n - S), padding mask only;
  * the diagonal block: the queries over tokens [n - S, n), copied out per sequence (a
    ragged slice), causal (now aligned: S queries over S tokens).

The copy of the block is part of the baseline's cost (2 x S tokens of K and V per sequence).
``attend`` is the attention with log-sum-exp: cuDNN's on a GPU (:func:`cudnn_attend`), a
plain JAX reference in the tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# attend(q, k, v, kv_lengths, causal) -> (out (B, S, Hq, D) float32, lse (B, S, Hq) float32)
Attend = Callable[[Any, Any, Any, Any, bool], tuple[Any, Any]]


def split_causal_attention(q: Any, k: Any, v: Any, lengths: Any, attend: Attend) -> jax.Array:
    """Bottom-right causal attention of q (B, S, Hq, D) over the first ``lengths[b] >= S``
    tokens of k, v (B, T, Hkv, D), through two calls of ``attend``."""
    s = q.shape[1]
    prefix = lengths.astype(jnp.int32) - s
    out_a, lse_a = attend(q, k, v, prefix, False)

    def block(x):
        return jax.vmap(lambda xb, start: jax.lax.dynamic_slice_in_dim(xb, start, s, 0))(x, prefix)

    out_b, lse_b = attend(q, block(k), block(v), jnp.full_like(prefix, s), True)
    # A sequence of exactly S tokens has no prefix: its first call scored nothing.
    has_prefix = (prefix > 0)[:, None, None]
    lse_a = jnp.where(has_prefix, lse_a, -jnp.inf)
    out_a = jnp.where(has_prefix[..., None], out_a, 0.0)
    m = jnp.maximum(lse_a, lse_b)
    w_a, w_b = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
    out = (w_a[..., None] * out_a + w_b[..., None] * out_b) / (w_a + w_b)[..., None]
    return out.astype(q.dtype)


def cudnn_attend(q: Any, k: Any, v: Any, kv_lengths: Any, causal: bool) -> tuple[Any, Any]:
    """cuDNN's fused attention through JAX, with its softmax statistics (the rows'
    log-sum-exp of the scaled scores): the call jax.nn.dot_product_attention makes, taken
    directly because the public one casts the statistics to the output's dtype (bf16 here:
    too coarse to join two calls by)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa  # the call JAX's cuDNN path makes

    b, s, _, d = q.shape
    out, stats = fa.dot_product_attention(
        q,
        k,
        v,
        q_seqlen=jnp.full((b,), s, jnp.int32),
        kv_seqlen=kv_lengths.astype(jnp.int32),
        scale=1.0 / math.sqrt(d),
        mask_type=fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING,
        return_residual=True,
    )
    return out.astype(jnp.float32), jnp.transpose(stats, (0, 2, 1))  # (B, Hq, S) -> (B, S, Hq)


def reference_attend(q: Any, k: Any, v: Any, kv_lengths: Any, causal: bool) -> tuple[Any, Any]:
    """The same contract through JAX's XLA implementation, in float32: for the tests."""
    b, s = q.shape[:2]
    return jax.nn.dot_product_attention(
        q.astype(jnp.float32),
        k.astype(jnp.float32),
        v.astype(jnp.float32),
        is_causal=causal,
        query_seq_lengths=jnp.full((b,), s, jnp.int32),
        key_value_seq_lengths=kv_lengths.astype(jnp.int32),
        implementation="xla",
        return_residual=True,
    )
