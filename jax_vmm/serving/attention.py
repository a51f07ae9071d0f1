"""Decode attention for the example: a plain-JAX reference, cuDNN and the jax_vmm kernel.

All are `attend(q, layer, lengths, **options)`: q (B, H_q, D), a `jax_vmm.KVLayer` whose
k/v are (B, T, H_kv, D), and live lengths int32 (B,); positions >= length are masked;
options: the layer's window, softcap and scale (`model.attention_options`, Gemma 2).
A prompt chunk prefilled over the cache attends with `chunk_attention(name)`:
`jax_vmm.attention` itself (with bf16 queries for an fp8 cache of a float32 model, as in
decode), or `jax_vmm.reference_attention` over an array layer (for the reference and
cuDNN choices: cuDNN serves decode only). The
reference reads the whole (B, T) cache (masked) with plain XLA ops, so it needs the
layer's arrays: an array layer (the preallocated backend); so does cuDNN
(`jax.nn.dot_product_attention(..., implementation="cudnn")`, GPU, bf16/fp16: the
preallocated backend's default there). The jax_vmm kernel reads only
the live tokens of each sequence, of either kind of layer: an arena layer in place,
after the step's writes (the layer's token orders it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jax_vmm

ATTENTION_CHOICES = ("auto", "reference", "jax_vmm", "cudnn")
CUDNN_DTYPES = ("bfloat16", "float16")
FP8_HEAD_DIMS = (64, 128, 256)  # jax_vmm's streaming kernel (the one that reads fp8)
FP8_BF16_QUERIES = "jax_vmm (fp8, bf16 queries)"  # an fp8 cache under a float32 model


def reference_decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    tail_may_be_garbage: bool = True,
) -> jax.Array:
    """Masked GQA attention over the whole cache, fp32 softmax and accumulation.

    tail_may_be_garbage: zero V past each length before use. Needed when the tail can
    hold non-finite bit patterns (freshly committed device pages); a `jnp.zeros` cache
    written only by the model holds finite values there, so its baseline skips this extra
    pass over V."""
    b, hq, d = q.shape
    t, hk = k.shape[1], k.shape[2]
    qg = q.reshape(b, hk, hq // hk, d)
    s = jnp.einsum("bhgd,bthd->bhgt", qg, k, preferred_element_type=jnp.float32) / np.sqrt(d)
    live = jnp.arange(t, dtype=jnp.int32)[None, :] < lengths[:, None]  # (B, T)
    s = jnp.where(live[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # length 0: all masked, output 0, no NaN
    w = jnp.exp(s - m)
    w = w / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), 1e-30)
    # 0 * NaN would poison the sum: zero what lies past each length when it may be junk.
    v_live = (
        jnp.where(live[:, :, None, None], v, jnp.zeros((), v.dtype)) if tail_may_be_garbage else v
    )
    out = jnp.einsum("bhgt,bthd->bhgd", w, v_live, preferred_element_type=jnp.float32)
    return out.reshape(b, hq, d).astype(q.dtype)


def reference_over_layer(
    q: jax.Array, layer, lengths: jax.Array, *, tail_may_be_garbage: bool = True, **options
) -> jax.Array:
    """The reference over an array layer's K/V; with options (window, softcap, scale)
    jax_vmm's general reference (which reads the tail: the preallocated backend's is
    finite)."""
    if options:
        return reference_chunk_over_layer(q[:, None], layer, lengths, **options)[:, 0]
    return reference_decode_attention(
        q, layer.k, layer.v, lengths, tail_may_be_garbage=tail_may_be_garbage
    )


def reference_chunk_over_layer(q: jax.Array, layer, lengths: jax.Array, **options) -> jax.Array:
    """`jax_vmm.reference_attention` (plain XLA, the semantics of `jax_vmm.attention`)
    over an array layer's K/V: q (B, S, H_q, D)."""
    return jax_vmm.reference_attention(q, layer.k, layer.v, lengths, **options)


def cudnn_decode_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *, implementation="cudnn"
) -> jax.Array:
    """What a JAX user picks for decode over a preallocated cache: cuDNN's fused attention
    through `jax.nn.dot_product_attention`, reading each sequence's first `lengths`
    tokens (GQA: H_q a multiple of H_kv). q (B, H_q, D); k, v (B, T, H_kv, D), bf16/fp16.
    An idle slot (length 0) reads one token instead: its output is ignored.
    implementation: "xla" runs the same call anywhere (what the CPU tests check)."""
    out = jax.nn.dot_product_attention(
        q[:, None],
        k,
        v,
        key_value_seq_lengths=jnp.maximum(lengths, 1),
        implementation=implementation,
    )
    return out[:, 0]


def cudnn_over_layer(q: jax.Array, layer, lengths: jax.Array, **options) -> jax.Array:
    """cuDNN attention over an array layer's K/V (a softmax scale, but no window or
    soft-capping: refused)."""
    unsupported = sorted(set(options) - {"scale"})
    if unsupported:
        raise ValueError(
            f"--attention cudnn: the model's attention needs {unsupported}, which "
            "jax.nn.dot_product_attention does not do; use --attention reference or jax_vmm"
        )
    if "scale" in options:
        out = jax.nn.dot_product_attention(
            q[:, None],
            layer.k,
            layer.v,
            key_value_seq_lengths=jnp.maximum(lengths, 1),
            scale=options["scale"],
            implementation="cudnn",
        )
        return out[:, 0]
    return cudnn_decode_attention(q, layer.k, layer.v, lengths)


def vmm_over_layer(q: jax.Array, layer, lengths: jax.Array, **options) -> jax.Array:
    """jax_vmm's kernel: `decode_attention` (the plain case), else `jax_vmm.attention`
    with one query per sequence and the layer's options."""
    if not options:
        return jax_vmm.decode_attention(q, layer, lengths)
    return jax_vmm.attention(q[:, None], layer, lengths, **options)[:, 0]


def chunk_attention(name: str) -> Callable[..., jax.Array]:
    """The multi-query attention (`model.ChunkAttendFn`) that goes with the decode
    attention `name` (as `choose_attention` returned it), for prompt chunks prefilled
    over the cache."""
    if name == "jax_vmm":
        return jax_vmm.attention
    if name == FP8_BF16_QUERIES:
        return _bf16_queries(jax_vmm.attention)
    if name in ("reference", "cudnn"):
        return reference_chunk_over_layer
    raise ValueError(
        f"chunk_attention: unknown attention {name!r}; expected a name choose_attention "
        f"returns: 'jax_vmm', {FP8_BF16_QUERIES!r}, 'reference' or 'cudnn'"
    )


def cudnn_unavailable(platform: str, dtype: str) -> str | None:
    """Why cuDNN attention cannot run here (None: it can)."""
    if platform != "gpu":
        return f"cuDNN attention needs an NVIDIA GPU (this device is {platform})"
    if dtype not in CUDNN_DTYPES:
        return f"cuDNN attention takes {' or '.join(CUDNN_DTYPES)}, not {dtype}"
    return None


def vmm_kernel_available() -> bool:
    return hasattr(jax_vmm, "decode_attention")


def choose_attention(
    choice: str,
    *,
    backend: str,
    platform: str,
    tail_may_be_garbage: bool = True,
    dtype: str = "float32",
    kv_dtype: str = "model",
) -> tuple[str, Callable[..., jax.Array]]:
    """Resolves --attention. 'auto' uses jax_vmm.decode_attention for the jax_vmm backend
    (any platform); for the preallocated one cuDNN where it runs (a GPU, bf16/fp16: what
    a JAX user would pick), else the plain-XLA reference. Returns (name, attend).
    tail_may_be_garbage: see reference_decode_attention (the cache backend knows);
    dtype: the model's; kv_dtype: "model" or "fp8" (then only the jax_vmm kernel, which
    dequantizes)."""
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got {choice!r}")
    if kv_dtype == "fp8":
        if choice not in ("auto", "jax_vmm"):
            raise ValueError(
                f"--attention {choice} reads the cache's values as they are; an fp8 cache "
                "holds fp8(x / scale): use --attention jax_vmm (it dequantizes)"
            )
        choice = "jax_vmm"
    if choice == "auto" and backend == "jax_vmm":
        choice = "jax_vmm" if vmm_kernel_available() else "reference"
    elif choice == "auto":
        choice = "reference" if cudnn_unavailable(platform, dtype) else "cudnn"
    if choice == "cudnn":
        if backend == "jax_vmm":
            raise ValueError(
                "--attention cudnn reads the cache with XLA's cuDNN call, which nothing orders "
                "after the step's own kv_write into the arena; use --attention jax_vmm, or "
                "--backend prealloc (bench/decode.py measures cuDNN over the arena, reading "
                "before writing)"
            )
        why = cudnn_unavailable(platform, dtype)
        if why:
            raise ValueError(f"--attention cudnn: {why}; use --attention reference or jax_vmm")
        return "cudnn", cudnn_over_layer
    if choice == "reference" and backend == "jax_vmm":
        raise ValueError(
            "--attention reference reads the cache with plain XLA ops; over the jax_vmm arena "
            "nothing orders such reads after the step's own kv_write (the arena is not an XLA "
            "value: that is why it is never copied). Use --attention jax_vmm (it reads the "
            "arena after the writes), or --backend prealloc"
        )
    if choice == "reference":
        return "reference", functools.partial(
            reference_over_layer, tail_may_be_garbage=tail_may_be_garbage
        )
    if not vmm_kernel_available():
        raise RuntimeError(
            "--attention jax_vmm asks for jax_vmm.decode_attention, which this jax_vmm "
            "build does not provide; use --attention reference"
        )
    if kv_dtype == "fp8" and dtype not in CUDNN_DTYPES:
        return FP8_BF16_QUERIES, _bf16_queries(vmm_over_layer)
    return "jax_vmm", vmm_over_layer


def _bf16_queries(attend: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """The fp8 kernel takes bf16/fp16 queries: a float32 model's are rounded to bf16 for
    it, and its output cast back (chunks too, so that a prompt prefilled in chunks sees
    what decode sees)."""

    def call(q: jax.Array, layer, lengths: jax.Array, **options) -> jax.Array:
        return attend(q.astype(jnp.bfloat16), layer, lengths, **options).astype(q.dtype)

    return call
