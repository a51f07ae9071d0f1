"""A small decoder-only transformer in plain JAX (RMSNorm, rotary embeddings, GQA, SwiGLU).

The architecture of Llama, Mistral, Qwen2 and Gemma 2: `ModelConfig` carries what differs
between them (RoPE theta and scaling, q/k/v biases, tied embeddings, head_dim, RMSNorm eps;
Gemma 2's (1 + w) norms, scaled embeddings, post-block norms, gelu-tanh MLP, query scale,
logit soft-capping and sliding-window layers), and
`jax_vmm.serving.hf.checkpoint` builds a config and `Params` from a Hugging Face checkpoint.
The random presets (`PRESETS`, `init_params`) need none of that.

The model knows nothing about where its KV cache lives: the cache is a
`jax_vmm.KVCache` (one `KVLayer` per layer: a jax_vmm arena layer or a plain array
layer), every function that touches it takes a `write` callable (new K/V into a layer
at flat token slots, returning the layer: `jax_vmm.kv_write`) and an `attend` callable
(decode attention of a query over a layer's per-sequence live lengths); a prompt chunk
prefilled over the cache (`prefill_chunk`) takes an `attend_chunk` callable with
`jax_vmm.attention`'s signature. The steps return the updated cache, which the caller
donates. `jax_vmm.serving.cache` provides the two cache
backends and `jax_vmm.serving.attention` the attention implementations.

Cache layout, per layer: k, v of shape (max_seqs, max_tokens, num_kv_heads, head_dim);
flat slot of (seq, position) = seq * max_tokens + position; a negative slot is padding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# write(layer, new_k, new_v, slots) -> layer; new_*: (n, H_kv, D), slots: int32 (n,).
WriteFn = Callable[[Any, jax.Array, jax.Array, jax.Array], Any]
# attend(q, layer, lengths, **options) -> out; q: (B, H_q, D), the layer's k/v
# (B, T, H_kv, D), lengths: int32 (B,); options (window, softcap, scale: see
# `attention_options`) only for a config that sets them, so a plain decode attention
# (jax_vmm.decode_attention) serves the Llama-family models.
AttendFn = Callable[..., jax.Array]
# attend_chunk(q, layer, lengths, *, q_lengths, window=None, softcap=None, scale=None)
# -> out (B, S, H_q, D): q (B, S, H_q, D) are the last q_lengths[b] of the lengths[b]
# cached tokens of sequence b, causal over the cache: jax_vmm.attention's signature.
ChunkAttendFn = Callable[..., jax.Array]

MLP_ACTIVATIONS = ("silu", "gelu_tanh")


ROPE_SCALING_KINDS = ("linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rescaled rotary frequencies, as Hugging Face's `rope_type` "linear" and "llama3".

    linear: every inverse frequency divided by `factor`.
    llama3: wavelengths below original_max_position / high_freq_factor kept, above
    original_max_position / low_freq_factor divided by `factor`, and in between a linear
    blend of the two, weighted by how many turns the wavelength makes over the original
    context."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position: int = 8192  # llama3 only

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALING_KINDS:
            raise ValueError(
                f"RoPE scaling kind must be one of {ROPE_SCALING_KINDS}, got {self.kind!r}"
            )
        if not self.factor > 0:
            raise ValueError(f"RoPE scaling factor must be > 0, got {self.factor}")
        if self.kind == "llama3" and not (
            0 < self.low_freq_factor < self.high_freq_factor and self.original_max_position > 0
        ):
            raise ValueError(
                "llama3 RoPE scaling needs 0 < low_freq_factor < high_freq_factor and "
                f"original_max_position > 0, got {self.low_freq_factor}, "
                f"{self.high_freq_factor}, {self.original_max_position}"
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 512
    d_model: int = 128
    num_layers: int = 2
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    ffn_dim: int = 384
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    dtype: str = "float32"  # activations, weights and KV cache
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    tie_embeddings: bool = False  # logits use the embedding table (no separate unembed)
    # Gemma 2 (the defaults are Llama's):
    norm_plus_one: bool = False  # RMSNorm scales by (1 + w)
    embed_scale: bool = False  # embeddings times sqrt(d_model) (in the model dtype)
    post_norms: bool = False  # RMSNorm of the attention and MLP outputs before each residual add
    mlp_act: str = "silu"  # gated MLP activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    attn_scale: float | None = None  # softmax scale; None: 1 / sqrt(head_dim)
    attn_softcap: float | None = None  # attention logits -> c * tanh(logits / c)
    final_softcap: float | None = None  # output logits -> c * tanh(logits / c)
    # Per layer: the sliding window (a query sees the `w` most recent positions, itself
    # included) or None for full attention; None: every layer attends to everything.
    layer_windows: tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.mlp_act not in MLP_ACTIVATIONS:
            raise ValueError(f"mlp_act must be one of {MLP_ACTIVATIONS}, got {self.mlp_act!r}")
        for name in ("attn_scale", "attn_softcap", "final_softcap"):
            value = getattr(self, name)
            if value is not None and not (np.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be None or a finite number > 0, got {value!r}")
        windows = self.layer_windows
        if windows is not None and (
            len(windows) != self.num_layers
            or any(w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1)
                   for w in windows)
        ):  # fmt: skip
            raise ValueError(
                f"layer_windows must give one window (an int >= 1) or None per layer "
                f"({self.num_layers}), got {windows!r}"
            )

    def window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, None if it attends to everything."""
        return None if self.layer_windows is None else self.layer_windows[layer]

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token occupies in the KV cache over all layers (K and V)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.jnp_dtype.itemsize

    def num_params(self) -> int:
        d, hq, hk, hd, f = (
            self.d_model,
            self.num_q_heads,
            self.num_kv_heads,
            self.head_dim,
            self.ffn_dim,
        )
        norms = 4 if self.post_norms else 2
        per_layer = norms * d + d * hq * hd * 2 + d * hk * hd * 2 + 3 * d * f
        if self.qkv_bias:
            per_layer += (hq + 2 * hk) * hd
        tables = 1 if self.tie_embeddings else 2
        return tables * self.vocab * d + d + self.num_layers * per_layer


PRESETS: dict[str, ModelConfig] = {
    # Runs on a 2-core CPU in seconds.
    "cpu": ModelConfig(),
    # The cpu preset with heads of 64 (the fp8 kernel takes head_dim 64/128/256): what
    # `--kv-dtype fp8` serves on a CPU.
    "cpu_fp8": ModelConfig(d_model=256, num_q_heads=4, num_kv_heads=2, head_dim=64, ffn_dim=512),
    # A realistic decode shape: 8 layers, 32 query / 8 KV heads of 128, bf16 (~1.4B params).
    "gpu": ModelConfig(
        vocab=32_000,
        d_model=4096,
        num_layers=8,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        ffn_dim=8192,
        dtype="bfloat16",
    ),
}


class LayerParams(NamedTuple):
    attn_norm: jax.Array
    wq: jax.Array
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array
    mlp_norm: jax.Array
    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array
    # q/k/v projection biases (cfg.qkv_bias), else None (an empty pytree node).
    bq: jax.Array | None = None
    bk: jax.Array | None = None
    bv: jax.Array | None = None
    # Norms of the attention and MLP outputs (cfg.post_norms, Gemma 2), else None.
    post_attn_norm: jax.Array | None = None
    post_mlp_norm: jax.Array | None = None


class Params(NamedTuple):
    embed: jax.Array  # (vocab, d_model)
    layers: tuple[LayerParams, ...]
    final_norm: jax.Array
    unembed: jax.Array | None = None  # (d_model, vocab); None: tied, logits use embed


def unembedding(params: Params) -> jax.Array:
    """(d_model, vocab): the separate unembedding, or the embedding table's transpose."""
    return params.embed.T if params.unembed is None else params.unembed


def init_params(cfg: ModelConfig, seed: int = 0) -> Params:
    """Seeded random weights, scaled 1/sqrt(fan_in) so activations stay O(1). Biases
    (cfg.qkv_bias) come from a stream of their own, so the other weights do not depend
    on whether the config has them."""
    dt = cfg.jnp_dtype
    root = jax.random.key(seed)
    keys = iter(jax.random.split(root, 2 + 7 * cfg.num_layers))
    bias_keys = iter(jax.random.split(jax.random.fold_in(root, 1), 3 * cfg.num_layers))

    def dense(shape: tuple[int, int]) -> jax.Array:
        w = jax.random.normal(next(keys), shape, jnp.float32) / np.sqrt(shape[0])
        return w.astype(dt)

    def bias(width: int) -> jax.Array | None:
        if not cfg.qkv_bias:
            return None
        return (0.1 * jax.random.normal(next(bias_keys), (width,), jnp.float32)).astype(dt)

    d, hd = cfg.d_model, cfg.head_dim
    layers = tuple(
        LayerParams(
            attn_norm=jnp.ones((d,), dt),
            wq=dense((d, cfg.num_q_heads * hd)),
            wk=dense((d, cfg.num_kv_heads * hd)),
            wv=dense((d, cfg.num_kv_heads * hd)),
            wo=dense((cfg.num_q_heads * hd, d)),
            mlp_norm=jnp.ones((d,), dt),
            w_gate=dense((d, cfg.ffn_dim)),
            w_up=dense((d, cfg.ffn_dim)),
            w_down=dense((cfg.ffn_dim, d)),
            bq=bias(cfg.num_q_heads * hd),
            bk=bias(cfg.num_kv_heads * hd),
            bv=bias(cfg.num_kv_heads * hd),
            post_attn_norm=jnp.ones((d,), dt) if cfg.post_norms else None,
            post_mlp_norm=jnp.ones((d,), dt) if cfg.post_norms else None,
        )
        for _ in range(cfg.num_layers)
    )
    embed = jax.random.normal(next(keys), (cfg.vocab, d), jnp.float32).astype(dt)
    return Params(
        embed=embed,
        layers=layers,
        final_norm=jnp.ones((d,), dt),
        unembed=None if cfg.tie_embeddings else dense((d, cfg.vocab)),
    )


# ----------------------------------------------------------------------------- blocks


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, plus_one: bool = False) -> jax.Array:
    """RMSNorm in float32, scaled by `weight` (Gemma: by 1 + weight)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    w = weight.astype(jnp.float32)
    return (xf * (1.0 + w if plus_one else w)).astype(x.dtype)


def norm(x: jax.Array, weight: jax.Array, cfg: ModelConfig) -> jax.Array:
    return rms_norm(x, weight, cfg.norm_eps, cfg.norm_plus_one)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap) (Gemma 2's logit soft-capping); x unchanged for None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def embed(params: Params, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Token embeddings (N, d_model); Gemma scales them by sqrt(d_model), rounded to the
    model dtype first as transformers does."""
    x = params.embed[tokens]
    if cfg.embed_scale:
        x = x * jnp.asarray(np.sqrt(cfg.d_model), x.dtype)
    return x


def attention_options(cfg: ModelConfig, layer: int) -> dict[str, Any]:
    """The options of layer `layer`'s attention that the config sets (window, softcap,
    scale), as keywords of `jax_vmm.attention`; empty for the Llama family."""
    options = dict(window=cfg.window(layer), softcap=cfg.attn_softcap, scale=cfg.attn_scale)
    return {k: v for k, v in options.items() if v is not None}


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """Inverse frequencies (head_dim // 2,) float32: theta^(-2i/head_dim), rescaled."""
    half = head_dim // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if scaling is None:
        return freqs
    if scaling.kind == "linear":
        return freqs / scaling.factor
    # llama3: by wavelength against the original context length.
    wavelength = 2 * np.pi / freqs
    turns = scaling.original_max_position / wavelength  # over the original context
    short = wavelength < scaling.original_max_position / scaling.high_freq_factor
    long = wavelength > scaling.original_max_position / scaling.low_freq_factor
    blend = (turns - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    between = (1 - blend) * freqs / scaling.factor + blend * freqs
    return jnp.where(short, freqs, jnp.where(long, freqs / scaling.factor, between))


def rope(
    x: jax.Array, positions: jax.Array, theta: float, scaling: RopeScaling | None = None
) -> jax.Array:
    """Rotary embedding (rotate-half form: dimension i pairs with i + D/2, as in Hugging
    Face's Llama). x: (N, H, D); positions: int (N,)."""
    half = x.shape[-1] // 2
    freqs = rope_frequencies(x.shape[-1], theta, scaling)
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]  # (N, half)
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _matmul(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """x @ w (+ b), accumulated in float32 and rounded once to x's dtype."""
    y = jnp.matmul(x, w, preferred_element_type=jnp.float32)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


def qkv_projection(
    lp: LayerParams, h: jax.Array, positions: jax.Array, cfg: ModelConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """h: (N, d_model) normed -> q (N, H_q, D), k and v (N, H_kv, D); q and k rotated."""
    n = h.shape[0]
    q = _matmul(h, lp.wq, lp.bq).reshape(n, cfg.num_q_heads, cfg.head_dim)
    k = _matmul(h, lp.wk, lp.bk).reshape(n, cfg.num_kv_heads, cfg.head_dim)
    v = _matmul(h, lp.wv, lp.bv).reshape(n, cfg.num_kv_heads, cfg.head_dim)
    theta, scaling = cfg.rope_theta, cfg.rope_scaling
    return rope(q, positions, theta, scaling), rope(k, positions, theta, scaling), v


def _activation(x: jax.Array, kind: str) -> jax.Array:
    if kind == "gelu_tanh":  # transformers' gelu_pytorch_tanh
        return jax.nn.gelu(x, approximate=True)
    return jax.nn.silu(x)


def mlp(lp: LayerParams, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The MLP block's contribution to the residual stream (post-normed for Gemma 2)."""
    h = norm(x, lp.mlp_norm, cfg)
    gate = _activation(_matmul(h, lp.w_gate), cfg.mlp_act)
    out = _matmul(gate * _matmul(h, lp.w_up), lp.w_down)
    return out if lp.post_mlp_norm is None else norm(out, lp.post_mlp_norm, cfg)


def attention_output(lp: LayerParams, o: jax.Array, cfg: ModelConfig) -> jax.Array:
    """o (N, H_q, D) -> the attention block's contribution to the residual stream."""
    out = _matmul(o.reshape(o.shape[0], -1), lp.wo)
    return out if lp.post_attn_norm is None else norm(out, lp.post_attn_norm, cfg)


def logits_from_hidden(params: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    h = norm(x, params.final_norm, cfg)
    # fp32 logits: greedy argmax then compares well across cache backends.
    logits = jnp.matmul(h, unembedding(params), preferred_element_type=jnp.float32)
    return soft_cap(logits, cfg.final_softcap)


def causal_prompt_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    length: jax.Array,
    *,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Causal GQA attention within one prompt. q: (P, H_q, D); k, v: (P, H_kv, D).
    Keys at positions >= length are padding and never attended to; window, softcap,
    scale: as `jax_vmm.attention`."""
    p, hq, d = q.shape
    hk = k.shape[1]
    qg = q.reshape(p, hk, hq // hk, d)
    s = jnp.einsum("ihgd,jhd->hgij", qg, k, preferred_element_type=jnp.float32)
    s = s / np.sqrt(d) if scale is None else s * scale
    s = soft_cap(s, softcap)
    pos = jnp.arange(p)
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] < length)
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    s = jnp.where(mask[None, None], s, -jnp.inf)
    # A padding row past length + window - 1 sees no key: zeros, not NaN (its V would
    # poison every row of the next layer through 0 * NaN).
    m = jnp.max(s, axis=-1, keepdims=True)
    w = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    w = w / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), 1e-30)
    out = jnp.einsum("hgij,jhd->ihgd", w, v.astype(jnp.float32))
    return out.reshape(p, hq, d).astype(q.dtype)


# ----------------------------------------------------------------------------- steps


def prefill(
    params: Params,
    cache: Any,
    tokens: jax.Array,
    length: jax.Array,
    seq: jax.Array,
    *,
    cfg: ModelConfig,
    write: WriteFn,
) -> tuple[jax.Array, Any]:
    """Runs one prompt (tokens: int32 (P,), first `length` real, rest padding) for
    sequence `seq` of the cache (a jax_vmm.KVCache), writes its K/V at positions
    [0, length) and returns the logits of the last real token (vocab,) and the updated
    cache. The prompt attends to its own K/V, never to the cache."""
    max_tokens = cache[0].shape[1]
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    slots = jnp.where(positions < length, seq * max_tokens + positions, -1).astype(jnp.int32)
    x = embed(params, tokens, cfg)
    for i, lp in enumerate(params.layers):
        q, k, v = qkv_projection(lp, norm(x, lp.attn_norm, cfg), positions, cfg)
        cache = cache.replace(i, write(cache[i], k, v, slots))
        o = causal_prompt_attention(q, k, v, length, **attention_options(cfg, i))
        x = x + attention_output(lp, o, cfg)
        x = x + mlp(lp, x, cfg)
    last = jax.lax.dynamic_index_in_dim(x, length - 1, axis=0, keepdims=False)
    return logits_from_hidden(params, last, cfg), cache


def prefill_chunk(
    params: Params,
    cache: Any,
    tokens: jax.Array,
    start: jax.Array,
    length: jax.Array,
    seq: jax.Array,
    *,
    cfg: ModelConfig,
    write: WriteFn,
    attend_chunk: ChunkAttendFn,
) -> tuple[jax.Array, Any]:
    """Appends `length` tokens (tokens: int32 (S,), the rest padding) to sequence `seq`,
    which holds `start` tokens already: writes their K/V at positions [start, start +
    length), attends each over the sequence's cached tokens up to itself (the earlier
    chunks, an earlier turn of a conversation, or a prefix shared into the sequence by
    kv.share_prefix), and returns the logits of the last real token (vocab,) and the
    updated cache. Prefilling a prompt chunk by chunk gives the logits of `prefill` over
    the whole prompt."""
    batch, max_tokens = cache[0].shape[0], cache[0].shape[1]
    offsets = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    positions = start + offsets
    slots = jnp.where(offsets < length, seq * max_tokens + positions, -1).astype(jnp.int32)
    # The attention runs over every sequence row of the layer: only `seq` is live.
    mine = jnp.arange(batch, dtype=jnp.int32) == seq
    lengths = jnp.where(mine, start + length, 0).astype(jnp.int32)
    q_lengths = jnp.where(mine, length, 0).astype(jnp.int32)
    x = embed(params, tokens, cfg)
    for i, lp in enumerate(params.layers):
        q, k, v = qkv_projection(lp, norm(x, lp.attn_norm, cfg), positions, cfg)
        layer = write(cache[i], k, v, slots)
        rows = jnp.zeros((batch, *q.shape), q.dtype).at[seq].set(q)  # (B, S, H_q, D)
        o = attend_chunk(rows, layer, lengths, q_lengths=q_lengths, **attention_options(cfg, i))
        cache = cache.replace(i, layer)  # after the attention: the layer carries the order
        x = x + attention_output(lp, o[seq], cfg)
        x = x + mlp(lp, x, cfg)
    last = jax.lax.dynamic_index_in_dim(x, length - 1, axis=0, keepdims=False)
    return logits_from_hidden(params, last, cfg), cache


def decode_step(
    params: Params,
    cache: Any,
    tokens: jax.Array,
    positions: jax.Array,
    *,
    cfg: ModelConfig,
    write: WriteFn,
    attend: AttendFn,
) -> tuple[jax.Array, jax.Array, Any]:
    """One token for every sequence slot. tokens: int32 (B,); positions: int32 (B,), the
    position of that token (= tokens already cached), -1 for an idle slot (its write is
    dropped and its output ignored). Writes each layer's new K/V, then attends over the
    layer including them. Returns (logits (B, vocab) fp32, greedy next tokens int32 (B,),
    the updated cache)."""
    batch, max_tokens = cache[0].shape[0], cache[0].shape[1]
    active = positions >= 0
    pos = jnp.maximum(positions, 0)
    slots = jnp.where(active, jnp.arange(batch, dtype=jnp.int32) * max_tokens + pos, -1).astype(
        jnp.int32
    )
    lengths = jnp.where(active, pos + 1, 0).astype(jnp.int32)
    x = embed(params, tokens, cfg)
    for i, lp in enumerate(params.layers):
        q, k, v = qkv_projection(lp, norm(x, lp.attn_norm, cfg), pos, cfg)
        layer = write(cache[i], k, v, slots)
        # After the write: the layer carries the order.
        o = attend(q, layer, lengths, **attention_options(cfg, i))
        cache = cache.replace(i, layer)
        x = x + attention_output(lp, o, cfg)
        x = x + mlp(lp, x, cfg)
    logits = logits_from_hidden(params, x, cfg)
    return logits, jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


def forward_no_cache(params: Params, tokens: jax.Array, *, cfg: ModelConfig) -> jax.Array:
    """Logits (S, vocab) of every position of one sequence, recomputed without a cache:
    the independent reference the cached paths are checked against."""
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    x = embed(params, tokens, cfg)
    for i, lp in enumerate(params.layers):
        q, k, v = qkv_projection(lp, norm(x, lp.attn_norm, cfg), positions, cfg)
        o = causal_prompt_attention(
            q, k, v, jnp.int32(tokens.shape[0]), **attention_options(cfg, i)
        )
        x = x + attention_output(lp, o, cfg)
        x = x + mlp(lp, x, cfg)
    return logits_from_hidden(params, x, cfg)


def config_summary(cfg: ModelConfig) -> str:
    extras = [
        f"rope {cfg.rope_scaling.kind} x{cfg.rope_scaling.factor:g}" if cfg.rope_scaling else "",
        "qkv bias" if cfg.qkv_bias else "",
        "tied embeddings" if cfg.tie_embeddings else "",
        "gemma norms" if cfg.norm_plus_one else "",
        f"attention softcap {cfg.attn_softcap:g}" if cfg.attn_softcap else "",
        f"final softcap {cfg.final_softcap:g}" if cfg.final_softcap else "",
        f"windows {sorted({w for w in cfg.layer_windows if w})}"
        if cfg.layer_windows and any(cfg.layer_windows)
        else "",
    ]
    extra = "".join(f", {e}" for e in extras if e)
    return (
        f"{cfg.num_layers} layers, d_model {cfg.d_model}, {cfg.num_q_heads} q / "
        f"{cfg.num_kv_heads} kv heads x {cfg.head_dim}, ffn {cfg.ffn_dim}, "
        f"vocab {cfg.vocab}{extra}, {cfg.dtype} "
        f"({cfg.num_params() / 1e6:.1f}M params)"
    )


__all__: Sequence[str] = [
    "ModelConfig",
    "RopeScaling",
    "PRESETS",
    "Params",
    "LayerParams",
    "init_params",
    "prefill",
    "prefill_chunk",
    "decode_step",
    "forward_no_cache",
    "config_summary",
    "rms_norm",
    "attention_options",
    "rope",
    "rope_frequencies",
    "unembedding",
]
