"""Loading Hugging Face checkpoints (jax_vmm.serving.hf: config,
weights, tokenizer): both config spellings, the defaults of each architecture, and a clear
CheckpointError naming the file and the tensor for everything that does not fit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hf_fixtures import FIXTURE_DIR, NAMES, expected

from jax_vmm.serving import model as M
from jax_vmm.serving.hf.checkpoint import CheckpointError, load_checkpoint
from jax_vmm.serving.hf.config import parse_config, read_config
from jax_vmm.serving.hf.weights import expected_tensors, weight_files

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def config(**changes) -> M.ModelConfig:
    raw = {k: v for k, v in {**BASE, **changes}.items() if v is not ...}
    return parse_config(raw).config


def _to_other_spelling(raw: dict) -> dict:
    """config.json with its RoPE keys in the other spelling."""
    raw = dict(raw)
    if "rope_parameters" in raw:
        rope = dict(raw.pop("rope_parameters"))
        raw["rope_theta"] = rope.pop("rope_theta")
        raw["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    else:
        rope = dict(raw.pop("rope_scaling") or {"rope_type": "default"})
        rope["rope_theta"] = raw.pop("rope_theta")
        raw["rope_parameters"] = rope
    return raw


@pytest.mark.parametrize("name", NAMES)
def test_both_rope_spellings_give_the_same_model(name: str) -> None:
    raw = json.loads((FIXTURE_DIR / name / "config.json").read_text())
    other = _to_other_spelling(raw)
    assert ("rope_parameters" in raw) != ("rope_parameters" in other)
    assert parse_config(raw) == parse_config(other)


def test_rope_spellings_and_defaults() -> None:
    llama31 = config(rope_theta=500000.0, rope_scaling=LLAMA31_ROPE)
    assert llama31.rope_theta == 500000.0
    assert llama31.rope_scaling == M.RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert config(rope_parameters={**LLAMA31_ROPE, "rope_theta": 500000.0}) == llama31
    # The older "type" key; the dict's rope_theta wins over the top-level one.
    linear = config(
        rope_theta=1.0e9, rope_scaling={"type": "linear", "factor": 2.0, "rope_theta": 20000.0}
    )
    assert (linear.rope_theta, linear.rope_scaling) == (20000.0, M.RopeScaling("linear", 2.0))
    assert config().rope_theta == 10000.0 and config().rope_scaling is None
    assert config(rope_scaling=None, rope_theta=1e6).rope_scaling is None
    no_original = {k: v for k, v in LLAMA31_ROPE.items() if k != "original_max_position_embeddings"}
    assert config(rope_scaling=no_original).rope_scaling.original_max_position == 256
    # Both spellings present and agreeing (some exports write both) is fine.
    assert (
        config(
            rope_theta=500000.0,
            rope_scaling=LLAMA31_ROPE,
            rope_parameters={**LLAMA31_ROPE, "rope_theta": 500000.0},
        )
        == llama31
    )


def test_architecture_defaults_and_shapes() -> None:
    assert config(num_key_value_heads=...).num_kv_heads == 4  # Llama: as many as q heads
    assert config().head_dim == 16 and config(head_dim=24).head_dim == 24
    assert config(head_dim=None).head_dim == 16
    assert config().norm_eps == 1e-6 and config(rms_norm_eps=1e-5).norm_eps == 1e-5
    assert not config().tie_embeddings and config(tie_word_embeddings=True).tie_embeddings
    assert not config().qkv_bias
    assert parse_config({**BASE, "architectures": ["Qwen2ForCausalLM"]}).config.qkv_bias
    spec = parse_config({**BASE, "architectures": ["MistralForCausalLM"]})
    assert spec.sliding_window == 4096  # Mistral's default, on every layer
    assert spec.sliding_layers == (4096, 4096) and spec.config.layer_windows is None
    # Applied (as ModelConfig.layer_windows) only for contexts that can outgrow it.
    assert spec.config_for(4096) is spec.config
    assert spec.config_for(4097).layer_windows == (4096, 4096)
    assert (
        parse_config(
            {**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": None}
        ).sliding_window
        is None
    )
    qwen = {**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 512}
    assert parse_config(qwen).sliding_window is None  # use_sliding_window is off
    assert (
        parse_config({**qwen, "use_sliding_window": True, "max_window_layers": 1}).sliding_window
        == 512
    )
    # transformers: the layers from max_window_layers on slide.
    assert parse_config(
        {**qwen, "use_sliding_window": True, "max_window_layers": 1}
    ).sliding_layers == (None, 512)
    assert parse_config({**qwen, "use_sliding_window": True}).sliding_window is None
    assert parse_config({**qwen, "use_sliding_window": True}).sliding_layers is None
    assert (
        parse_config(
            {
                **qwen,
                "use_sliding_window": True,
                "layer_types": ["full_attention", "sliding_attention"],
            }
        ).sliding_window
        == 512
    )
    # Without "architectures", model_type decides.
    assert (
        parse_config({**BASE, "architectures": None, "model_type": "qwen2"}).architecture
        == "Qwen2ForCausalLM"
    )


def test_eos_ids_come_from_generation_config_first(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "eos_token_id": 2}))
    assert read_config(tmp_path).eos_token_ids == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9, 7]}))
    assert read_config(tmp_path).eos_token_ids == (7, 9)


@pytest.mark.parametrize(
    "changes, match",
    [
        (
            dict(architectures=["GPT2LMHeadModel"]),
            r"architecture \['GPT2LMHeadModel'\] is not supported; the example loads "
            r"LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM",
        ),
        (dict(architectures=None), "no 'architectures' list"),
        (dict(hidden_size=...), "no 'hidden_size'; the config must give it"),
        (dict(num_hidden_layers=0), "num_hidden_layers must be an integer >= 1, got 0"),
        (dict(num_attention_heads=4.0), "num_attention_heads must be an integer"),
        (
            dict(num_key_value_heads=3),
            r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)$",
        ),
        (
            dict(architectures=["MistralForCausalLM"], num_key_value_heads=...),
            r"num_key_value_heads \(8, transformers' default for MistralForCausalLM: "
            r"config.json has none\)",
        ),
        (dict(architectures=[], model_type="gpt2"), "names none of the supported ones"),
        (dict(head_dim=15), "head_dim must be even"),
        (dict(hidden_act="gelu"), "hidden_act is 'gelu'"),
        (dict(attention_bias=True), "attention_bias is true"),
        (dict(mlp_bias=True), "mlp_bias is true"),
        (dict(tie_word_embeddings="yes"), "tie_word_embeddings must be true or false"),
        (
            dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
            "RoPE type 'yarn' is not supported; the example implements 'default', 'linear', "
            "'llama3'",
        ),
        (
            dict(rope_scaling={"rope_type": "linear"}),
            "RoPE type 'linear' needs a finite number 'factor'",
        ),
        (
            dict(rope_scaling={"factor": 4.0}),
            r"the RoPE parameters set 'factor' but no 'rope_type' \(or 'type'\), so it is "
            r"unknown how to apply them; add the type: 'default', 'linear', 'llama3'",
        ),
        (
            dict(rope_parameters={"rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0}),
            "the RoPE parameters set 'factor', 'low_freq_factor' but no 'rope_type'",
        ),
        (
            dict(rope_scaling={**LLAMA31_ROPE, "low_freq_factor": 5.0}),
            "low_freq_factor < high_freq_factor",
        ),
        (
            dict(
                rope_scaling={"rope_type": "linear", "factor": 2.0},
                rope_parameters={"rope_type": "linear", "factor": 4.0},
            ),
            "disagree; keep one",
        ),
        (dict(rope_theta="big"), "rope_theta must be a finite number > 1"),
        (dict(rope_theta=float("nan")), "rope_theta must be a finite number > 1"),
        (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a finite number > 0"),
        (dict(rms_norm_eps=float("inf")), "rms_norm_eps must be a finite number > 0"),
        (
            dict(rope_scaling={"rope_type": "linear", "factor": float("inf")}),
            "needs a finite number 'factor'",
        ),
        (dict(rope_scaling={"rope_type": None, "factor": 2.0}), "set 'factor' but no 'rope_type'"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5 is not supported"),
        (
            dict(rope_parameters={"full_attention": {"rope_type": "default"}}),
            "RoPE parameters per layer type",
        ),
        (dict(eos_token_id=[1, -1]), "eos_token_id must be a token id or a list of them"),
    ],
)
def test_config_errors_name_the_file_and_key(tmp_path: Path, changes: dict, match: str) -> None:
    raw = {k: v for k, v in {**BASE, **changes}.items() if v is not ...}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=match) as info:
        read_config(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)


# -- weights ----------------------------------------------------------------------------


def _copy(name: str, tmp_path: Path) -> Path:
    dest = tmp_path / name
    shutil.copytree(FIXTURE_DIR / name, dest)
    return dest


def _rewrite_weights(path: Path, edit) -> None:
    """Rewrites one safetensors file through `edit(dict of arrays) -> dict`."""
    from safetensors.numpy import load_file, save_file

    save_file(edit(load_file(str(path))), str(path))


def test_missing_and_broken_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such directory"):
        load_checkpoint(tmp_path / "nowhere")
    d = _copy("qwen2_bias_bf16", tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: no such file"):
        load_checkpoint(d)
    d = _copy("mistral", tmp_path)
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(
        CheckpointError,
        match=r"neither model\.safetensors nor model\."
        r"safetensors\.index\.json exists \(found "
        r"pytorch_model\.bin: PyTorch pickles",
    ):
        load_checkpoint(d)
    (d / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: not a readable "
        r"safetensors file",
    ):
        load_checkpoint(d)
    d = _copy("llama3_tied", tmp_path)
    (d / "tokenizer.json").write_text("{broken")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: not a readable"):
        load_checkpoint(d)


def test_sharded_checkpoint_loads_like_the_index_says(tmp_path: Path) -> None:
    d = FIXTURE_DIR / "llama_linear_sharded"
    files = weight_files(d)
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert {n: p.name for n, p in files.items()} == index and len(set(index.values())) > 1
    cfg = read_config(d).config
    assert {s.name for s in expected_tensors(cfg).values()} == set(index)


def test_missing_shard_is_named_with_the_index(tmp_path: Path) -> None:
    d = _copy("llama_linear_sharded", tmp_path)
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    shard = sorted(set(index.values()))[2]
    (d / shard).unlink()
    with pytest.raises(
        CheckpointError,
        match=rf"index\.json: tensor \S+ is in {shard}, "
        rf"but .*{shard} does not exist",
    ):
        load_checkpoint(d)


def test_a_tensor_the_index_does_not_map_is_named_with_the_index(tmp_path: Path) -> None:
    """A tensor missing from a sharded checkpoint: the message says the index does not map
    it (not that the shards were searched), and names the shard that holds it if one does
    (an incomplete index)."""
    d = _copy("llama_linear_sharded", tmp_path)
    path = d / "model.safetensors.index.json"
    raw = json.loads(path.read_text())
    shards = list(raw["weight_map"].values())
    name, shard = next((n, f) for n, f in raw["weight_map"].items() if shards.count(f) > 1)
    del raw["weight_map"][name]
    path.write_text(json.dumps(raw))
    with pytest.raises(
        CheckpointError,
        match=rf"index\.json: tensor {name} is not in its weight_map, but {shard} holds it: "
        "the index is incomplete",
    ):
        load_checkpoint(d)
    _rewrite_weights(d / shard, lambda t: {k: v for k, v in t.items() if k != name})
    n = len(set(raw["weight_map"].values()))
    with pytest.raises(
        CheckpointError,
        match=rf"tensor {name} is missing: .*index\.json does not map it, and none of the "
        rf"{n} shards it lists \(.*\) holds it",
    ):
        load_checkpoint(d)


def test_index_pointing_at_the_wrong_shard_is_named(tmp_path: Path) -> None:
    d = _copy("llama_linear_sharded", tmp_path)
    path = d / "model.safetensors.index.json"
    raw = json.loads(path.read_text())
    shards = sorted(set(raw["weight_map"].values()))
    name = next(n for n, f in raw["weight_map"].items() if f == shards[0])
    raw["weight_map"][name] = shards[1]
    path.write_text(json.dumps(raw))
    with pytest.raises(
        CheckpointError,
        match=rf"tensor {name} is said to be in "
        rf".*{shards[1]}, which has no such tensor",
    ):
        load_checkpoint(d)


_GONE = "model.layers.1.self_attn.k_proj.bias"
_SQUARE = "model.layers.0.mlp.up_proj.weight"


@pytest.mark.parametrize(
    "name, edit, match",
    [
        (
            "qwen2_bias_bf16",
            lambda t: {k: v for k, v in t.items() if k != _GONE},
            rf"tensor {_GONE} is missing: it is in none of .*model\.safetensors",
        ),
        (
            "mistral",
            lambda t: {**t, _SQUARE: np.ascontiguousarray(t[_SQUARE].T)},
            rf"model\.safetensors: tensor {_SQUARE} has shape \(64, 128\), the config "
            rf"\(config\.json\) needs \(128, 64\)",
        ),
        (
            "mistral",
            lambda t: {**t, _SQUARE: t[_SQUARE].astype(np.int32)},
            rf"model\.safetensors: tensor {_SQUARE} is I32; expected one of",
        ),
    ],
    ids=["missing tensor", "shape mismatch", "integer dtype"],
)
def test_tensor_errors_name_the_file_and_tensor(
    tmp_path: Path, name: str, edit, match: str
) -> None:
    d = _copy(name, tmp_path)
    _rewrite_weights(d / "model.safetensors", edit)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(d)


def test_config_that_does_not_describe_the_weights_is_refused(tmp_path: Path) -> None:
    """Weights the config would leave unused mean another model: refuse, never load the
    rest silently. A Llama config on Qwen2 weights leaves the biases unused; a config
    with one layer fewer leaves a whole layer."""
    d = _copy("qwen2_bias_bf16", tmp_path)
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(
        CheckpointError,
        match=r"tensors the config does not account for: "
        r"model\.layers\.0\.self_attn\.k_proj\.bias",
    ):
        load_checkpoint(d)
    (d / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 1}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.\S+ \(model\.safetensors\)"):
        load_checkpoint(d)


def test_dtype_cast_and_tied_lm_head(tmp_path: Path) -> None:
    """Weights stored bf16 load exactly into float32 and round into bfloat16; a tied
    checkpoint's extra lm_head.weight is ignored, as transformers ties it."""
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    d = _copy("qwen2_bias_bf16", tmp_path)
    stored = load_file(str(d / "model.safetensors"))
    wq = stored["model.layers.0.self_attn.q_proj.weight"]
    f32 = load_checkpoint(d, dtype="float32")
    bf16 = load_checkpoint(d, dtype="bfloat16")
    assert f32.params.layers[0].wq.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(f32.params.layers[0].wq), wq.astype(np.float32).T)
    assert bf16.params.layers[0].wq.dtype == jnp.bfloat16
    assert f32.params.unembed is None and f32.config.tie_embeddings
    _rewrite_weights(
        d / "model.safetensors", lambda t: {**t, "lm_head.weight": t["model.embed_tokens.weight"]}
    )
    assert load_checkpoint(d).params.unembed is None
    with pytest.raises(CheckpointError, match="dtype must be one of"):
        load_checkpoint(d, dtype="float16")


def test_tokenizer_matches_transformers_and_is_optional(tmp_path: Path) -> None:
    """tokenizer.json's post-processor decides BOS (Llama: added; Qwen2: none), as in
    transformers; without tokenizer.json the checkpoint still loads."""
    for name in NAMES:
        tok = load_checkpoint(FIXTURE_DIR / name).tokenizer
        for req in expected(name)["requests"]:
            assert tok.encode(req["prompt"]) == req["prompt_ids"]
            assert tok.decode(req["generated_ids"]) == req["text"]
    assert expected("llama3_tied")["requests"][0]["prompt_ids"][0] == 0  # BOS
    assert expected("qwen2_bias_bf16")["requests"][0]["prompt_ids"][0] != 0
    d = _copy("mistral", tmp_path)
    (d / "tokenizer.json").unlink()
    assert load_checkpoint(d).tokenizer is None


def test_gemma2_config_as_transformers_reads_it() -> None:
    """Gemma 2's keys and transformers' defaults for the ones left out: alternate
    sliding layers from the first, softcaps 50 / 30, query scale 256^-1/2, (1 + w) norms,
    scaled embeddings, post norms, gelu-tanh; null softcaps and window mean none; what
    the example cannot run is refused."""
    gemma = {"architectures": ["Gemma2ForCausalLM"], "head_dim": 16}
    cfg = config(**gemma, num_hidden_layers=4)
    assert cfg.layer_windows == (4096, None, 4096, None)
    assert (cfg.attn_softcap, cfg.final_softcap) == (50.0, 30.0)
    assert cfg.attn_scale == 256**-0.5 and cfg.tie_embeddings
    assert cfg.norm_plus_one and cfg.embed_scale and cfg.post_norms and cfg.mlp_act == "gelu_tanh"
    assert M.attention_options(cfg, 1) == {"softcap": 50.0, "scale": 256**-0.5}
    nulls = config(
        **gemma,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        sliding_window=None,
        layer_types=["full_attention", "sliding_attention"],
    )
    assert nulls.attn_softcap is nulls.final_softcap is None
    assert nulls.layer_windows == (None, None)
    assert M.attention_options(nulls, 0) == {"scale": 256**-0.5}
    assert parse_config({**BASE, **gemma}).sliding_window is None  # applied, not refused
    bad = [
        (dict(layer_types=["sliding_attention"]), "layer_types must list"),
        (dict(layer_types=["local", "global"]), "layer_types must list"),
        (dict(attention_bias=True), "attention_bias is true"),
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention is true"),
        (dict(hidden_activation="gelu"), "gelu_pytorch_tanh only"),
        (dict(query_pre_attn_scalar=0), "query_pre_attn_scalar must be a finite number > 0"),
        (dict(attn_logit_softcapping="big"), "attn_logit_softcapping must be a finite number > 0"),
    ]
    for changes, match in bad:
        with pytest.raises(CheckpointError, match=match):
            config(**gemma, **changes)
    names = {s.name for s in expected_tensors(cfg).values()}
    assert "model.layers.3.pre_feedforward_layernorm.weight" in names
    assert "model.layers.3.post_feedforward_layernorm.weight" in names
    assert "lm_head.weight" not in names  # tied by default


def test_architectures_as_one_string_is_read(tmp_path: Path) -> None:
    """ "architectures": "LlamaForCausalLM" (the list left out) reads as the list would;
    an empty list falls back to model_type (both were refused, the first naming a
    model_type it did not look at)."""
    want = read_config_of(tmp_path, BASE).config
    assert read_config_of(tmp_path, {**BASE, "architectures": "LlamaForCausalLM"}).config == want
    raw = {**BASE, "architectures": [], "model_type": "llama"}
    assert read_config_of(tmp_path, raw).architecture == "LlamaForCausalLM"


def read_config_of(tmp_path: Path, raw: dict):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return read_config(tmp_path)


def test_both_rope_spellings_take_theta_from_the_newer_dict():
    """rope_parameters holds rope_theta; an older rope_scaling beside it with the same
    settings but no theta won, and theta fell back to the default 10000 (wrong tokens)."""
    raw = {k: v for k, v in BASE.items() if k != "rope_theta"}
    scaling = {"rope_type": "linear", "factor": 2.0}
    cfg = parse_config(
        {**raw, "rope_scaling": scaling, "rope_parameters": {**scaling, "rope_theta": 500000.0}}
    ).config
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling.factor == 2.0
