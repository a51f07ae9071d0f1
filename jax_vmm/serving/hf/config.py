"""Hugging Face `config.json` -> the example's `ModelConfig`, for Llama, Mistral, Qwen2 and
Gemma 2.

Keys a config leaves out take the default of that architecture's transformers config
class, so a sparse config means what transformers makes of it. Both RoPE spellings are
read: the older top-level `rope_theta` + `rope_scaling` (whose type key is `rope_type` or
`type`), and the newer `rope_parameters` dict that holds `rope_theta` itself. Anything
the example cannot reproduce exactly (another architecture, another RoPE type, biases on
the output or MLP projections, ...) is refused with a `CheckpointError` naming the file
and the key, never approximated.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

from .. import model as M

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

_log = logging.getLogger("jax_vmm")


class CheckpointError(ValueError):
    """A checkpoint directory the example cannot load as asked. The message names the
    file (and the key or tensor) that is wrong and what was expected."""


# transformers' defaults for the keys a config may omit, per architecture.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": dict(
        num_key_value_heads=None,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        head_dim=None,
        hidden_act="silu",
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "MistralForCausalLM": dict(
        num_key_value_heads=8,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        head_dim=None,
        hidden_act="silu",
        max_position_embeddings=4096 * 32,
        bos_token_id=1,
        eos_token_id=2,
        sliding_window=4096,
    ),
    "Qwen2ForCausalLM": dict(
        num_key_value_heads=32,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        head_dim=None,
        hidden_act="silu",
        max_position_embeddings=32768,
        bos_token_id=None,
        eos_token_id=None,
        use_sliding_window=False,
        sliding_window=4096,
        max_window_layers=28,
    ),
    "Gemma2ForCausalLM": dict(
        num_key_value_heads=4,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        head_dim=256,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=8192,
        bos_token_id=2,
        eos_token_id=1,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
    ),
}
SUPPORTED_ARCHITECTURES = tuple(_DEFAULTS)
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
}
_LAYER_TYPES = ("full_attention", "sliding_attention")
_DEFAULT_ROPE_THETA = 10_000.0


@dataclasses.dataclass(frozen=True)
class HFModelSpec:
    """What a checkpoint's config says, in the example's terms."""

    architecture: str
    config: M.ModelConfig
    # Attention window of the sliding-window layers that `config` leaves off (Mistral,
    # Qwen2), None if every layer sees the whole context or `config` applies the windows
    # itself (Gemma 2: ModelConfig.layer_windows); and per layer, that window or None (a
    # layer that sees the whole context). The whole context is the same thing while a
    # sequence is at most this long, so generate applies them (as layer_windows) only
    # when a context can be longer, keeping the plain attention otherwise.
    sliding_window: int | None
    sliding_layers: tuple[int | None, ...] | None
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # generation_config.json's, else config.json's

    def config_for(self, context: int) -> M.ModelConfig:
        """`config` for sequences of up to `context` tokens: with the sliding layers'
        windows (ModelConfig.layer_windows) once a sequence can outgrow them."""
        if self.sliding_layers is None or context <= self.sliding_window:
            return self.config
        return dataclasses.replace(self.config, layer_windows=self.sliding_layers)


def read_config(model_dir: str | Path, *, dtype: str = "float32") -> HFModelSpec:
    """Parses `model_dir/config.json` (and `generation_config.json` for the EOS ids)."""
    path = Path(model_dir) / CONFIG_FILE
    raw = _read_json(path, what="the model's configuration")
    spec = parse_config(raw, dtype=dtype, where=str(path))
    gen_path = Path(model_dir) / GENERATION_CONFIG_FILE
    if gen_path.exists():
        gen = _read_json(gen_path, what="the generation defaults")
        if not isinstance(gen, dict):
            raise CheckpointError(f"{gen_path}: expected a JSON object, got {type(gen).__name__}")
        if gen.get("eos_token_id") is not None:
            eos = _token_ids(gen, "eos_token_id", str(gen_path))
            spec = dataclasses.replace(spec, eos_token_ids=eos)
    vocab = spec.config.vocab
    never = [t for t in spec.eos_token_ids if t >= vocab]
    if never:  # a config shared across model sizes may list ids past a small vocabulary
        _log.warning(
            "%s: eos_token_id %s lies past the vocabulary [0, %d): the model never "
            "generates it, so it is left out of the stop tokens",
            gen_path if gen_path.exists() else path, never, vocab,
        )  # fmt: skip
        spec = dataclasses.replace(
            spec, eos_token_ids=tuple(t for t in spec.eos_token_ids if t < vocab)
        )
    return spec


def parse_config(
    raw: dict[str, Any], *, dtype: str = "float32", where: str = CONFIG_FILE
) -> HFModelSpec:
    """`raw`: config.json's content; `where` names it in errors."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    arch = _architecture(raw, where)
    get = _Getter(raw, _DEFAULTS[arch], where)
    gemma = arch == "Gemma2ForCausalLM"

    if not gemma and get.str_("hidden_act") != "silu":
        raise CheckpointError(
            f"{where}: hidden_act is {raw.get('hidden_act')!r}; the "
            f"example's MLP is SwiGLU with silu only"
        )
    if arch == "LlamaForCausalLM":
        for key in ("attention_bias", "mlp_bias"):
            if raw.get(key):
                raise CheckpointError(
                    f"{where}: {key} is true; the example supports Llama checkpoints "
                    "without biases on the attention and MLP projections only"
                )
    heads = get.int_("num_attention_heads")
    hidden = get.int_("hidden_size")
    max_position = get.int_("max_position_embeddings")
    theta, scaling = parse_rope(raw, where=where, max_position=max_position)
    fields = dict(
        vocab=get.int_("vocab_size"),
        d_model=hidden,
        num_layers=get.int_("num_hidden_layers"),
        num_q_heads=heads,
        num_kv_heads=get.int_("num_key_value_heads", optional=True) or heads,
        head_dim=get.int_("head_dim", optional=True) or hidden // heads,
        ffn_dim=get.int_("intermediate_size"),
        rope_theta=theta,
        norm_eps=get.float_("rms_norm_eps"),
        dtype=dtype,
        rope_scaling=scaling,
        qkv_bias=arch == "Qwen2ForCausalLM",
        tie_embeddings=get.bool_("tie_word_embeddings"),
    )
    if gemma:
        fields.update(_gemma2_fields(get, fields["num_layers"]))
    if heads % fields["num_kv_heads"]:
        kv = "num_key_value_heads" in raw
        raise CheckpointError(
            f"{where}: num_attention_heads ({heads}) must be a multiple of "
            f"num_key_value_heads ({fields['num_kv_heads']}"
            + ("" if kv else f", transformers' default for {arch}: config.json has none")
            + ")"
        )
    try:
        cfg = M.ModelConfig(**fields)
    except ValueError as e:  # an odd head_dim
        raise CheckpointError(f"{where}: {e}") from None
    sliding = None if gemma else _sliding_layers(arch, get, cfg)
    return HFModelSpec(
        architecture=arch,
        config=cfg,
        sliding_window=None if sliding is None else next(w for w in sliding if w),
        sliding_layers=sliding,
        max_position_embeddings=max_position,
        bos_token_id=get.int_("bos_token_id", optional=True, minimum=0),
        eos_token_ids=_token_ids(
            raw, "eos_token_id", where, default=_DEFAULTS[arch]["eos_token_id"]
        ),
    )


#: What a RoPE dict may hold without a type: it then means default RoPE.
_UNTYPED_ROPE_KEYS = frozenset({"rope_theta", "partial_rotary_factor"})


def parse_rope(
    raw: dict[str, Any], *, where: str, max_position: int
) -> tuple[float, M.RopeScaling | None]:
    """(rope_theta, scaling) from either spelling. As in transformers, a value inside
    the RoPE dict wins over the top-level `rope_theta`, and llama3's
    original_max_position_embeddings defaults to max_position_embeddings."""
    new, old = raw.get("rope_parameters"), raw.get("rope_scaling")
    for key, value in (("rope_parameters", new), ("rope_scaling", old)):
        if value is not None and not isinstance(value, dict):
            raise CheckpointError(f"{where}: {key} must be an object or null, got {value!r}")
    if new and old and _without_theta(new) != _without_theta(old):
        raise CheckpointError(
            f"{where}: rope_parameters {new} and rope_scaling {old} disagree; keep one "
            "(rope_parameters is the newer spelling)"
        )
    # The newer dict holds rope_theta; the older one may carry the same settings without it.
    params = {**(old or {}), **(new or {})}
    if any(isinstance(v, dict) for v in params.values()):
        raise CheckpointError(
            f"{where}: RoPE parameters per layer type ({sorted(params)}) "
            "are not supported; the example uses one RoPE for all layers"
        )
    theta = params.get("rope_theta", raw.get("rope_theta", _DEFAULT_ROPE_THETA))
    if not _finite_number(theta) or theta <= 1:
        raise CheckpointError(f"{where}: rope_theta must be a finite number > 1, got {theta!r}")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise CheckpointError(
            f"{where}: partial_rotary_factor {partial} is not supported "
            "(the example rotates the whole head)"
        )
    kind = params.get("rope_type")
    kind = params.get("type") if kind is None else kind
    if kind is None:
        settings = sorted({k for k, v in params.items() if v is not None} - _UNTYPED_ROPE_KEYS)
        if settings:
            # A factor without a type would silently load as default RoPE.
            raise CheckpointError(
                f"{where}: the RoPE parameters set {', '.join(repr(k) for k in settings)} "
                "but no 'rope_type' (or 'type'), so it is unknown how to apply them; add "
                f"the type: 'default', {', '.join(repr(k) for k in M.ROPE_SCALING_KINDS)}"
            )
        kind = "default"
    if kind == "default":
        return float(theta), None

    def number(key: str, default: float | None = None) -> float:
        value = params.get(key, default)
        if not _finite_number(value):
            raise CheckpointError(
                f"{where}: RoPE type {kind!r} needs a finite number {key!r}, got {value!r}"
            )
        return value

    if kind == "linear":
        fields = dict(factor=float(number("factor")))
    elif kind == "llama3":
        fields = dict(
            factor=float(number("factor")),
            low_freq_factor=float(number("low_freq_factor")),
            high_freq_factor=float(number("high_freq_factor")),
            original_max_position=int(number("original_max_position_embeddings", max_position)),
        )
    else:
        fields = None
    if fields is not None:
        try:
            return float(theta), M.RopeScaling(kind, **fields)
        except ValueError as e:  # a factor <= 0, low >= high
            raise CheckpointError(f"{where}: {e}") from None
    raise CheckpointError(
        f"{where}: RoPE type {kind!r} is not supported; the example implements "
        f"'default', {', '.join(repr(k) for k in M.ROPE_SCALING_KINDS)}"
    )


def _finite_number(value: Any) -> bool:
    """A real JSON number that is not NaN or infinite (JSON's NaN/Infinity extensions
    parse in Python and would pass every `<=` check)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _without_theta(d: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in d.items() if k != "rope_theta"}
    if "type" in out:  # the older alias of rope_type
        out.setdefault("rope_type", out.pop("type"))
    return out


def _architecture(raw: dict[str, Any], where: str) -> str:
    archs = raw.get("architectures")
    if isinstance(archs, str):  # one name written without its list
        archs = [archs]
    if not archs and raw.get("model_type") in _MODEL_TYPES:
        return _MODEL_TYPES[raw["model_type"]]
    if not isinstance(archs, list) or not archs:
        raise CheckpointError(
            f"{where}: no 'architectures' list, and model_type {raw.get('model_type')!r} "
            f"names none of the supported ones {list(_MODEL_TYPES)}"
        )
    if len(archs) != 1 or archs[0] not in _DEFAULTS:
        raise CheckpointError(
            f"{where}: architecture {archs} is not supported; the example loads "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return archs[0]


def _gemma2_fields(get: _Getter, num_layers: int) -> dict[str, Any]:
    """What Gemma 2 adds to the Llama architecture, as transformers' Gemma2 model does
    it: (1 + w) RMSNorm, embeddings scaled by sqrt(hidden), norms after the attention and
    the MLP, a gelu-tanh gated MLP, softmax scale query_pre_attn_scalar^-1/2, soft-capped
    attention and final logits, and the sliding window on the layers that layer_types
    names (default: every other layer, from the first)."""
    where, raw = get.where, get.raw
    act = get.str_("hidden_activation")
    if act != "gelu_pytorch_tanh":
        raise CheckpointError(
            f"{where}: hidden_activation is {act!r}; the example's Gemma 2 MLP uses "
            "gelu_pytorch_tanh only"
        )
    for key in ("attention_bias", "use_bidirectional_attention"):
        if raw.get(key):
            raise CheckpointError(
                f"{where}: {key} is true; the example supports causal Gemma 2 without "
                "biases on the attention projections only"
            )
    types = raw.get("layer_types")
    if types is None:
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if not (
        isinstance(types, list) and len(types) == num_layers and set(types) <= set(_LAYER_TYPES)
    ):
        raise CheckpointError(
            f"{where}: layer_types must list one of {_LAYER_TYPES} per layer "
            f"({num_layers}), got {types!r}"
        )
    window = get.int_("sliding_window", optional=True)  # null: no window anywhere
    return dict(
        norm_plus_one=True,
        embed_scale=True,
        post_norms=True,
        mlp_act="gelu_tanh",
        attn_scale=get.float_("query_pre_attn_scalar") ** -0.5,
        attn_softcap=get.float_("attn_logit_softcapping", optional=True),
        final_softcap=get.float_("final_logit_softcapping", optional=True),
        layer_windows=tuple(window if t == "sliding_attention" else None for t in types),
    )


def _sliding_layers(arch: str, get: _Getter, cfg: M.ModelConfig) -> tuple[int | None, ...] | None:
    """Per layer, the window of a Mistral or Qwen2 config (None: the whole context); None
    when no layer slides."""
    if arch == "MistralForCausalLM":  # every layer
        window = get.int_("sliding_window", optional=True)
        return None if window is None else (window,) * cfg.num_layers
    if arch != "Qwen2ForCausalLM" or not get.bool_("use_sliding_window"):
        return None
    window = get.int_("sliding_window", optional=True)
    types = get.raw.get("layer_types")
    if types is None:  # transformers: the layers from max_window_layers on slide
        first = get.int_("max_window_layers", minimum=0)
        types = [
            "sliding_attention" if i >= first else "full_attention" for i in range(cfg.num_layers)
        ]
    elif not (
        isinstance(types, list) and len(types) == cfg.num_layers and set(types) <= set(_LAYER_TYPES)
    ):
        raise CheckpointError(
            f"{get.where}: layer_types must list one of {set(_LAYER_TYPES)} "
            f"per layer ({cfg.num_layers}), got {types!r}"
        )
    layers = tuple(window if t == "sliding_attention" else None for t in types)
    return layers if window is not None and any(layers) else None


def _token_ids(
    raw: dict[str, Any], key: str, where: str, default: int | None = None
) -> tuple[int, ...]:
    value = raw.get(key, default)
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise CheckpointError(f"{where}: {key} must be a token id or a list of them, got {value!r}")
    return tuple(dict.fromkeys(values))


class _Getter:
    """Typed access to config keys, with the architecture's defaults and errors that
    name the file and the key."""

    def __init__(self, raw: dict[str, Any], defaults: dict[str, Any], where: str):
        self.raw, self.defaults, self.where = raw, defaults, where

    def _value(self, key: str, optional: bool) -> Any:
        # An explicit null means None, as in transformers (Mistral's "sliding_window":
        # null turns the window off); only an absent key takes the default.
        value = self.raw[key] if key in self.raw else self.defaults.get(key)
        if value is None and not optional:
            raise CheckpointError(f"{self.where}: no {key!r}; the config must give it")
        return value

    def int_(self, key: str, *, optional: bool = False, minimum: int = 1) -> int | None:
        value = self._value(key, optional)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise CheckpointError(
                f"{self.where}: {key} must be an integer >= {minimum}, got {value!r}"
            )
        return value

    def float_(self, key: str, *, optional: bool = False) -> float | None:
        value = self._value(key, optional)
        if value is None:
            return None
        if not _finite_number(value) or value <= 0:
            raise CheckpointError(f"{self.where}: {key} must be a finite number > 0, got {value!r}")
        return float(value)

    def bool_(self, key: str) -> bool:
        value = self._value(key, False)
        if not isinstance(value, bool):
            raise CheckpointError(f"{self.where}: {key} must be true or false, got {value!r}")
        return value

    def str_(self, key: str) -> str:
        return self._value(key, False)


def _read_json(path: Path, *, what: str) -> Any:
    if not path.is_file():
        raise CheckpointError(
            f"{path}: no such file ({what}); a Hugging Face checkpoint "
            f"directory has config.json, model*.safetensors and "
            f"tokenizer.json"
        )
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read {what}: {e}") from None
