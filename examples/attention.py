"""Decode attention for the example: a plain-JAX reference and the jax_vmm kernel.

Both take q (B, H_q, D), k/v (B, T, H_kv, D) and live lengths int32 (B,); positions
>= length are masked. The reference reads the whole (B, T) cache (masked), the jax_vmm
kernel reads only the live tokens of each sequence.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

ATTENTION_CHOICES = ("auto", "reference", "jax_vmm")


def reference_decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    current: tuple[jax.Array, jax.Array] | None = None,
    tail_may_be_garbage: bool = True,
) -> jax.Array:
    """Masked GQA attention over the whole cache, fp32 softmax and accumulation.

    current: (k_new, v_new), each (B, H_kv, D): one more token per sequence, attended to
    after the cache's first `lengths` tokens (for write-through caches, where the step
    may not read back the token it writes).
    tail_may_be_garbage: zero V past each length before use. Needed when the tail can
    hold non-finite bit patterns (freshly committed device pages of an arena, a token
    being written by a write-through call); a `jnp.zeros` cache written only by the
    model holds finite values there, so its baseline skips this extra pass over V."""
    b, hq, d = q.shape
    t, hk = k.shape[1], k.shape[2]
    qg = q.reshape(b, hk, hq // hk, d)
    s = jnp.einsum("bhgd,bthd->bhgt", qg, k, preferred_element_type=jnp.float32) / np.sqrt(d)
    live = jnp.arange(t, dtype=jnp.int32)[None, :] < lengths[:, None]  # (B, T)
    s = jnp.where(live[:, None, None, :], s, -jnp.inf)
    if current is not None:
        s_cur = jnp.einsum("bhgd,bhd->bhg", qg, current[0], preferred_element_type=jnp.float32)[
            ..., None
        ] / np.sqrt(d)
        s = jnp.concatenate([s, s_cur], axis=-1)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # length 0: all masked, output 0, no NaN
    w = jnp.exp(s - m)
    w = w / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), 1e-30)
    # 0 * NaN would poison the sum: zero what lies past each length when it may be junk.
    v_live = (
        jnp.where(live[:, :, None, None], v, jnp.zeros((), v.dtype)) if tail_may_be_garbage else v
    )
    out = jnp.einsum("bhgt,bthd->bhgd", w[..., :t], v_live, preferred_element_type=jnp.float32)
    if current is not None:
        out = out + w[..., t:] * current[1].astype(jnp.float32)[:, :, None, :]
    return out.reshape(b, hq, d).astype(q.dtype)


def vmm_kernel_available() -> bool:
    try:
        import jax_vmm
    except ImportError:
        return False
    return hasattr(jax_vmm, "decode_attention")


def choose_attention(
    choice: str,
    *,
    backend: str,
    platform: str,
    write_through: bool = False,
    tail_may_be_garbage: bool = True,
) -> tuple[str, Callable[..., jax.Array]]:
    """Resolves --attention. 'auto' uses jax_vmm.decode_attention for the jax_vmm backend
    on a GPU when the kernel exists, else the reference. Returns (name, fn).
    tail_may_be_garbage: see reference_decode_attention (the cache backend knows)."""
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got {choice!r}")
    if choice == "auto":
        use_kernel = (
            backend == "jax_vmm"
            and platform == "gpu"
            and not write_through
            and vmm_kernel_available()
        )
        choice = "jax_vmm" if use_kernel else "reference"
    if choice == "jax_vmm" and write_through:
        raise ValueError(
            "--attention jax_vmm reads the new token from the cache, which a write-through "
            "step may not do (XLA cannot order the read after the write); use --write "
            "kv_write (the cache donated, as on a GPU) or --attention reference"
        )
    if choice == "reference":
        return "reference", functools.partial(
            reference_decode_attention, tail_may_be_garbage=tail_may_be_garbage
        )
    if not vmm_kernel_available():
        raise RuntimeError(
            "--attention jax_vmm asks for jax_vmm.decode_attention, which this jax_vmm "
            "build does not provide; use --attention reference"
        )
    import jax_vmm

    return "jax_vmm", jax_vmm.decode_attention
