#!/usr/bin/env python3
"""Writes the tiny Hugging Face checkpoints under tests/fixtures/hf/ and transformers'
greedy outputs next to each; or (--preset 1b) a Llama-3.2-1B-shaped random checkpoint
for throughput runs.

Needs torch + transformers + tokenizers + safetensors (a separate venv; the tests and
examples/generate.py need neither torch nor transformers):

    python tools/make_hf_fixtures.py                          # all fixtures
    python tools/make_hf_fixtures.py --only qwen2_bias_bf16   # one
    python tools/make_hf_fixtures.py --preset 1b --out /tmp/llama1b

Each fixture directory holds what a real checkpoint has (config.json,
generation_config.json, model.safetensors or shards + model.safetensors.index.json,
tokenizer.json, tokenizer_config.json) and expected.json: the prompts, their ids from
transformers' tokenizer, and for each prompt the ids that transformers'
`model.generate(do_sample=False)` produced from the checkpoint as written to disk
(reloaded with from_pretrained, float32, eager attention), the decoded text, per step
the top-1 logit and its margin over the top-2, and transformers' own bfloat16 error on
those top-1 logits (bf16_top1_error).

The weights are random but large (unit-scale embeddings, projections of 1/sqrt(fan_in)
times the gains in _GAINS, norm weights and biases away from 1 and 0, so that a mapping
that drops one shows), and the logits spread over several units (logit_std in
expected.json), so greedy decoding has a clear winner. Every step must
beat the runner-up by MIN_MARGIN; seeds are tried in order until one does, and the seed
is recorded. The tokenizer is a byte-level BPE trained here on TRAINING_TEXT.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "tests" / "fixtures" / "hf"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
TOKENIZER_VOCAB = 384
MAX_NEW_TOKENS = 24
# float32 JAX and torch agree to ~1e-5 on these logits; a clear winner leads by far more.
MIN_MARGIN = 0.02
MAX_SEEDS = 50

TRAINING_TEXT = """\
A cache holds the keys and values of every token a sequence has seen, so that the next
token costs one step instead of a pass over the whole text. Memory is reserved once and
backed page by page as sequences grow; when a sequence ends its pages go back.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Numbers like 1, 2, 3, 10, 42 and 2048 appear in text too, with commas, dots; colons:
and "quotes". Small models read small prompts and write short answers, one token at a
time, while a scheduler keeps every slot of the batch busy with the next request.
"""

# Token lengths differ (3, 14, 33 and 53 with BOS); all fit one 64-token prefill.
PROMPTS = (
    "Hi",
    "The quick brown fox jumps.",
    "A cache holds the keys and values of every token, so the next token costs one step.",
    "Memory is reserved once and backed page by page as sequences grow; when a sequence "
    "ends, its pages go back.",
)

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=0,
    eos_token_id=1,
)

# name -> how to build it. "spelling": "legacy" rewrites config.json to top-level
# rope_theta + rope_scaling (transformers 5 writes rope_parameters, the "new" spelling).
FIXTURES: dict[str, dict[str, Any]] = {
    "llama3_tied": dict(
        arch="LlamaForCausalLM",
        spelling="legacy",
        derive_head_dim=True,
        bos=True,
        features="Llama 3.x: llama3 RoPE scaling, tied embeddings, head_dim derived, "
        "legacy rope_theta + rope_scaling spelling",
        config=dict(
            _COMMON,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "llama_linear_sharded": dict(
        arch="LlamaForCausalLM",
        spelling="new",
        bos=True,
        shard="120KB",
        features="Llama: linear RoPE scaling, untied embeddings, explicit head_dim 24 "
        "(hidden 64 / 4 heads would give 16), rope_parameters spelling, "
        "sharded (model.safetensors.index.json)",
        config=dict(
            _COMMON,
            tie_word_embeddings=False,
            head_dim=24,
            rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
        ),
    ),
    "qwen2_bias_bf16": dict(
        arch="Qwen2ForCausalLM",
        spelling="legacy",
        bos=False,
        store_dtype="bfloat16",
        features="Qwen2: q/k/v biases, tied embeddings, no BOS, weights stored bfloat16 "
        "(outputs computed in float32 from them), legacy spelling",
        config=dict(
            _COMMON,
            tie_word_embeddings=True,
            bos_token_id=None,
            use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
    "mistral": dict(
        arch="MistralForCausalLM",
        spelling="new",
        bos=True,
        features="Mistral: sliding_window 4096 (longer than any fixture sequence), "
        "untied embeddings, rope_parameters spelling",
        config=dict(
            _COMMON,
            tie_word_embeddings=False,
            sliding_window=4096,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
    "gemma2": dict(
        arch="Gemma2ForCausalLM",
        spelling="new",
        bos=True,
        features="Gemma 2: sliding window 8 on alternate layers (shorter than every "
        "prompt + generation), attention and final logit soft-capping, query scale "
        "1/sqrt(24) with head_dim 16, (1 + w) RMSNorm, embeddings scaled by "
        "sqrt(hidden), post-attention and post-feed-forward norms, gelu_pytorch_tanh MLP, "
        "untied embeddings (tied ones this small give near-ties)",
        config=dict(
            _COMMON,
            head_dim=16,
            tie_word_embeddings=False,
            pad_token_id=None,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=24,
            sliding_window=8,
            attn_logit_softcapping=10.0,
            final_logit_softcapping=30.0,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
}

# Llama 3.2 1B's shape (vocab 128256, 16 layers, 2048 wide, 32 q / 8 kv heads of 64).
PRESET_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=True,
    rope_parameters=dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
)


def build_tokenizer(add_bos: bool) -> Tokenizer:
    """Byte-level BPE trained on TRAINING_TEXT (deterministic); BOS via the post-processor
    when `add_bos`, as Llama's tokenizer.json does (Qwen2's adds none)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT.splitlines(), trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A",
            pair=f"{BOS} $A {BOS} $B",
            special_tokens=[(BOS, tok.token_to_id(BOS))],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def save_tokenizer(tok: Tokenizer, out: Path, add_bos: bool) -> None:
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS if add_bos else None, eos_token=EOS
    )
    fast.save_pretrained(out)


# Gains over 1/sqrt(fan_in) per projection. q, k: sharper attention, so positions and
# RoPE matter more. o, down: the blocks outweigh the token's own embedding in the
# residual stream; otherwise a random model (tied ones above all) repeats its input token.
_GAINS = {"q_proj": 2.0, "k_proj": 2.0, "o_proj": 10.0, "down_proj": 10.0}


def reinit_(
    model: torch.nn.Module, seed: int, logit_gain: float = 1.0, embed_std: float = 1.0
) -> None:
    """Large random weights (see the module doc). Tied lm_head shares embed_tokens and
    is not listed separately by named_parameters. embed_std: Gemma scales embeddings by
    sqrt(hidden) and normalizes each block's output, so unit embeddings would drown the
    blocks (the model would repeat its input token); it takes 1/sqrt(hidden)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.6, 1.4, generator=g)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.3, generator=g)
            elif "embed_tokens" in name:
                p.normal_(0.0, embed_std, generator=g)
            elif p.ndim == 2:
                fan_in = p.shape[1]
                gain = _GAINS.get(name.split(".")[-2], 1.0)
                if "lm_head" in name:  # unit-scale entries, like a tied lm_head
                    gain = logit_gain * math.sqrt(fan_in)
                p.normal_(0.0, gain / math.sqrt(fan_in), generator=g)
            else:
                raise AssertionError(f"no init rule for {name} {tuple(p.shape)}")


def make_model(arch: str, config: dict[str, Any], seed: int) -> torch.nn.Module:
    config_cls = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Gemma2ForCausalLM": transformers.Gemma2Config,
    }[arch]
    cfg = config_cls(**config)
    cfg.architectures = [arch]
    model = getattr(transformers, arch)(cfg)
    # Gemma 2 multiplies embeddings by sqrt(hidden): unit-scale after that.
    embed_std = config["hidden_size"] ** -0.5 if arch == "Gemma2ForCausalLM" else 1.0
    reinit_(model, seed, embed_std=embed_std)
    return model.eval()


def rewrite_config(path: Path, spec: dict[str, Any]) -> None:
    raw = json.loads(path.read_text())
    if spec.get("derive_head_dim"):
        raw.pop("head_dim", None)
    if spec["spelling"] == "legacy":
        rope = dict(raw.pop("rope_parameters"))
        raw["rope_theta"] = rope.pop("rope_theta")
        raw["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def check_reloaded(model: torch.nn.Module, spec: dict[str, Any]) -> None:
    """The rewritten config means to transformers what the fixture says."""
    cfg, want = model.config, spec["config"]
    assert cfg.rope_parameters["rope_type"] == want["rope_parameters"]["rope_type"]
    assert cfg.rope_parameters["rope_theta"] == want["rope_parameters"]["rope_theta"]
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == want["tie_word_embeddings"], (tied, want["tie_word_embeddings"])
    head_dim = want.get("head_dim") or want["hidden_size"] // want["num_attention_heads"]
    assert model.model.layers[0].self_attn.head_dim == head_dim


def reference_outputs(
    model_dir: Path,
    prompts: tuple[str, ...],
    max_new_tokens: int,
    spec: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """transformers' float32 greedy generation per prompt (ids, text, per-step top-1
    logit and margin). spec: a FIXTURES entry, to check transformers read the written
    config as meant."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    if spec is not None:
        check_reloaded(model, spec)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model.generation_config.eos_token_id = None  # exactly max_new_tokens, no early stop
    out = []
    for text in prompts:
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=0,
                pad_token_id=tok.convert_tokens_to_ids(EOS),
                output_logits=True,
                return_dict_in_generate=True,
            )
        new = gen.sequences[0, len(ids) :].tolist()
        assert len(new) == max_new_tokens, (text, len(new))
        margins, top, stds = [], [], []
        for step, logits in enumerate(gen.logits):
            top2 = torch.topk(logits[0].float(), 2)
            assert int(top2.indices[0]) == new[step]
            margins.append(float(top2.values[0] - top2.values[1]))
            top.append(float(top2.values[0]))
            stds.append(float(logits[0].float().std()))
        out.append(
            dict(
                prompt=text,
                prompt_ids=ids,
                generated_ids=new,
                text=tok.decode(new, skip_special_tokens=True),
                margins=[round(m, 4) for m in margins],
                top1_logits=[round(v, 5) for v in top],
                logit_std=round(sum(stds) / len(stds), 3),
            )
        )
    return out


def add_bf16_errors(model_dir: Path, outputs: list[dict[str, Any]]) -> None:
    """transformers' own bfloat16 error: the same checkpoint in bfloat16, teacher-forced
    with the float32 greedy ids, against the float32 top-1 logit of every step. The
    tests allow a bfloat16 run of the example a small multiple of it."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    for o in outputs:
        seq = o["prompt_ids"] + o["generated_ids"][:-1]
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0].float()
        first = len(o["prompt_ids"]) - 1
        errs = [
            abs(float(logits[first + s, tok]) - o["top1_logits"][s])
            for s, tok in enumerate(o["generated_ids"])
        ]
        o["bf16_top1_error"] = round(max(errs), 5)


def write_checkpoint(out: Path, spec: dict[str, Any], seed: int, tokenizer: Tokenizer) -> None:
    config = dict(spec["config"], vocab_size=tokenizer.get_vocab_size())
    model = make_model(spec["arch"], config, seed)
    if spec.get("store_dtype") == "bfloat16":
        model = model.to(torch.bfloat16)
    kwargs = {"max_shard_size": spec["shard"]} if spec.get("shard") else {}
    model.save_pretrained(out, **kwargs)
    rewrite_config(out / "config.json", spec)
    save_tokenizer(tokenizer, out, spec["bos"])


def make_fixture(name: str, out_root: Path) -> dict[str, Any]:
    spec = FIXTURES[name]
    tokenizer = build_tokenizer(spec["bos"])
    for seed in range(MAX_SEEDS):
        with tempfile.TemporaryDirectory() as tmp:
            tmp_dir = Path(tmp) / name
            write_checkpoint(tmp_dir, spec, seed, tokenizer)
            outputs = reference_outputs(tmp_dir, PROMPTS, MAX_NEW_TOKENS, spec)
            lowest = min(m for o in outputs for m in o["margins"])
            if lowest < MIN_MARGIN:
                print(
                    f"{name}: seed {seed}: smallest margin {lowest:.4f} < {MIN_MARGIN}; next seed"
                )
                continue
            add_bf16_errors(tmp_dir, outputs)
            lengths = [len(o["prompt_ids"]) for o in outputs]
            assert len(set(lengths)) == len(lengths) and max(lengths) <= 64, lengths
            expected = dict(
                fixture=name,
                architecture=spec["arch"],
                features=spec["features"],
                made_by="tools/make_hf_fixtures.py",
                torch=torch.__version__,
                transformers=transformers.__version__,
                seed=seed,
                stored_dtype=spec.get("store_dtype", "float32"),
                max_new_tokens=MAX_NEW_TOKENS,
                min_margin_required=MIN_MARGIN,
                min_margin=lowest,
                requests=outputs,
            )
            (tmp_dir / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
            dest = out_root / name
            if dest.exists():
                shutil.rmtree(dest)
            shutil.copytree(tmp_dir, dest)
            size = sum(p.stat().st_size for p in dest.iterdir())
            print(
                f"{name}: seed {seed}, prompt lengths {lengths}, smallest margin "
                f"{lowest:.4f}, {size / 1024:.0f} KiB -> {dest}"
            )
            return expected
    raise SystemExit(f"{name}: no seed in 0..{MAX_SEEDS - 1} gives margins >= {MIN_MARGIN}")


def make_1b(out: Path, dtype: str) -> None:
    """Random weights (seed 0) of the 1B shape, sharded, with the fixtures' tokenizer
    (its ids are a subset of the model's vocabulary)."""
    tokenizer = build_tokenizer(True)
    torch.set_default_dtype(getattr(torch, dtype))  # build in the stored dtype: half the RAM
    model = make_model("LlamaForCausalLM", PRESET_1B, seed=0)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out, max_shard_size="1GB")
    save_tokenizer(tokenizer, out, True)
    print(f"1b: {n / 1e9:.2f}B parameters, {dtype} -> {out}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", type=Path, help=f"default {DEFAULT_OUT} (fixtures); required with --preset 1b"
    )
    p.add_argument("--only", nargs="+", choices=sorted(FIXTURES))
    p.add_argument("--preset", choices=("fixtures", "1b"), default="fixtures")
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="stored dtype of the 1b checkpoint",
    )
    args = p.parse_args(argv)
    if args.preset == "1b":
        if args.out is None:
            p.error("--preset 1b needs --out DIR")
        make_1b(args.out, args.dtype)
        return
    out = args.out or DEFAULT_OUT
    out.mkdir(parents=True, exist_ok=True)
    for name in args.only or FIXTURES:
        make_fixture(name, out)


if __name__ == "__main__":
    sys.exit(main())
