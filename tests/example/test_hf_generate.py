"""jax_vmm.serving.generate (and examples/generate.py's CLI) on real checkpoint formats:
token for token what transformers generates (float32), on both cache backends, with
continuous batching; bfloat16 within a measured tolerance; sampling, stop-at-EOS and the CLI.

The expected outputs were made once by tools/make_hf_fixtures.py with torch and
transformers; nothing here needs either.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_fixtures import F32_LOGIT_TOL, FIXTURE_DIR, NAMES, checkpoint, expected, mixed_prompts

from jax_vmm.serving import engine as E
from jax_vmm.serving import generate as G
from jax_vmm.serving import model as M
from jax_vmm.serving.cache import BACKENDS
from jax_vmm.serving.cli import generate as GC
from jax_vmm.serving.hf.config import read_config
from jax_vmm.serving.hf.tokenizer import load_tokenizer
from jax_vmm.serving.sampling import SamplingConfig

SLOTS = 2  # fewer than the 4 prompts: slots are reused (continuous batching)


def test_fixtures_cover_the_supported_variants() -> None:
    """The committed checkpoints exercise every variant the loader claims."""
    configs = {n: json.loads((FIXTURE_DIR / n / "config.json").read_text()) for n in NAMES}

    def has(pred) -> bool:
        return any(pred(c, FIXTURE_DIR / n) for n, c in configs.items())

    rope = lambda c: c.get("rope_parameters") or c.get("rope_scaling") or {}  # noqa: E731
    assert has(lambda c, _: rope(c).get("rope_type") == "llama3" and c["tie_word_embeddings"])
    assert has(
        lambda c, _: (
            rope(c).get("rope_type") == "linear"
            and not c["tie_word_embeddings"]
            and c["head_dim"] != c["hidden_size"] // c["num_attention_heads"]
        )
    )
    assert has(lambda c, _: c["architectures"] == ["Qwen2ForCausalLM"])
    assert has(lambda c, _: c["architectures"] == ["MistralForCausalLM"])
    assert has(lambda c, d: (d / "model.safetensors.index.json").is_file())
    assert has(lambda c, _: "rope_parameters" in c and "rope_theta" not in c)
    assert has(lambda c, _: "rope_scaling" in c and "rope_parameters" not in c)
    assert has(lambda c, _: "head_dim" not in c)
    # Gemma 2: the window shorter than every prompt + generation, so that it matters.
    assert has(
        lambda c, _: (
            c["architectures"] == ["Gemma2ForCausalLM"]
            and "sliding_attention" in c["layer_types"]
            and "full_attention" in c["layer_types"]
            and c["attn_logit_softcapping"]
            and c["final_logit_softcapping"]
            and c["query_pre_attn_scalar"] != c["head_dim"]
        )
    )
    gemma = expected("gemma2")
    window = json.loads((FIXTURE_DIR / "gemma2" / "config.json").read_text())["sliding_window"]
    assert window < min(len(r["prompt_ids"]) for r in gemma["requests"]) + gemma["max_new_tokens"]
    for n in NAMES:
        exp = expected(n)
        margins = [m for r in exp["requests"] for m in r["margins"]]
        assert min(margins) >= exp["min_margin_required"] >= 20 * F32_LOGIT_TOL, n
        assert len({len(r["prompt_ids"]) for r in exp["requests"]}) == len(exp["requests"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_generates_what_transformers_generates(name: str, backend: str, device: jax.Device) -> None:
    """Four prompts of different lengths (one given as ids) on two slots, float32:
    the prompt ids, every generated id and the text equal transformers', and every
    step's winning logit is within F32_LOGIT_TOL of transformers' value."""
    exp = expected(name)
    n = exp["max_new_tokens"]
    out = G.generate(
        checkpoint(name, "float32", device),
        mixed_prompts(exp),
        max_new_tokens=n,
        opts=G.ServeOptions(backend=backend, batch=SLOTS),
        device=device,
        record_logits=True,
    )
    assert out["slots"] == SLOTS < len(exp["requests"])
    assert out["generated_tokens"] == n * len(exp["requests"])
    worst = 0.0
    for i, (got, want) in enumerate(zip(out["requests"], exp["requests"], strict=True)):
        assert got["prompt"] == (None if i == 2 else want["prompt"])
        assert got["prompt_ids"] == want["prompt_ids"], f"prompt {i}: tokenizer differs"
        assert got["generated_ids"] == want["generated_ids"], (
            f"{name}/{backend} prompt {i}: generated ids differ from transformers'"
        )
        assert got["text"] == want["text"]
        top1 = got["logits"][np.arange(n), want["generated_ids"]]
        err = np.abs(top1 - np.asarray(want["top1_logits"]))
        worst = max(worst, float(err.max()))
    assert worst <= F32_LOGIT_TOL, f"top-1 logits differ by up to {worst:.3g}"


def _rope_interleaved(x, positions, theta, scaling=None):
    """RoPE with pairs (2i, 2i+1), the other common convention: the wrong one here."""
    freqs = M.rope_frequencies(x.shape[-1], theta, scaling)
    ang = positions.astype(jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    x1, x2 = x[..., 0::2].astype(jnp.float32), x[..., 1::2].astype(jnp.float32)
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def _layers(params: M.Params, **fields) -> M.Params:
    return params._replace(
        layers=tuple(lp._replace(**{k: f(lp) for k, f in fields.items()}) for lp in params.layers)
    )


# Ways to get the model subtly wrong; each must change the greedy tokens.
MUTATIONS = {
    "llama3_tied": {
        "RoPE scaling ignored": lambda c, p: (dataclasses.replace(c, rope_scaling=None), p),
        "q_proj not transposed": lambda c, p: (c, _layers(p, wq=lambda lp: lp.wq.T)),
        "interleaved RoPE pairs": "interleaved",
    },
    "llama_linear_sharded": {
        "RoPE scaling ignored": lambda c, p: (dataclasses.replace(c, rope_scaling=None), p),
    },
    "qwen2_bias_bf16": {
        "q/k/v biases dropped": lambda c, p: (
            c,
            _layers(p, bq=lambda lp: None, bk=lambda lp: None, bv=lambda lp: None),
        ),
    },
    "gemma2": {
        "sliding window ignored": lambda c, p: (dataclasses.replace(c, layer_windows=None), p),
        "attention soft-capping ignored": lambda c, p: (
            dataclasses.replace(c, attn_softcap=None),
            p,
        ),
        "query scale 1/sqrt(head_dim)": lambda c, p: (dataclasses.replace(c, attn_scale=None), p),
        "RMSNorm by w, not 1 + w": lambda c, p: (dataclasses.replace(c, norm_plus_one=False), p),
        "embeddings not scaled": lambda c, p: (dataclasses.replace(c, embed_scale=False), p),
        "silu MLP": lambda c, p: (dataclasses.replace(c, mlp_act="silu"), p),
        "post-block norms dropped": lambda c, p: (
            c,
            _layers(p, post_attn_norm=lambda lp: None, post_mlp_norm=lambda lp: None),
        ),
    },
    "mistral": {
        "norm weights ignored": lambda c, p: (
            c,
            _layers(
                p,
                attn_norm=lambda lp: jnp.ones_like(lp.attn_norm),
                mlp_norm=lambda lp: jnp.ones_like(lp.mlp_norm),
            )._replace(final_norm=jnp.ones_like(p.final_norm)),
        ),
    },
}


@pytest.mark.parametrize("name", NAMES)
def test_model_alone_matches_and_a_wrong_model_is_caught(
    name: str, cpu_device: jax.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without any cache (one causal forward over the prompt and transformers' tokens)
    the model's argmax at every step is transformers' token; each mutation in MUTATIONS
    changes them, so the token-for-token checks see such bugs."""
    exp = expected(name)
    ckpt = checkpoint(name, "float32", cpu_device)
    req = exp["requests"][-1]  # the longest prompt
    seq = jnp.asarray(req["prompt_ids"] + req["generated_ids"][:-1], jnp.int32)
    first = len(req["prompt_ids"]) - 1

    def greedy(cfg: M.ModelConfig, params: M.Params) -> list[int]:
        with jax.default_device(cpu_device):
            logits = jax.jit(lambda p, t: M.forward_no_cache(p, t, cfg=cfg))(params, seq)
        return [int(t) for t in np.argmax(np.asarray(logits)[first:], axis=-1)]

    assert greedy(ckpt.config, ckpt.params) == req["generated_ids"]
    assert name in MUTATIONS, f"add a mutation for fixture {name}"
    for label, mutate in MUTATIONS[name].items():
        with monkeypatch.context() as mp:
            if mutate == "interleaved":
                mp.setattr(M, "rope", _rope_interleaved)
                cfg, params = ckpt.config, ckpt.params
            else:
                cfg, params = mutate(ckpt.config, ckpt.params)
            got = greedy(cfg, params)
        assert got != req["generated_ids"], f"{name}: '{label}' would go unnoticed"


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_error_within_twice_transformers_own(name: str, device: jax.Device) -> None:
    """bfloat16 weights and activations, teacher-forced with transformers' float32 ids
    (so every step is compared): the winning logit of every step within twice the
    largest error transformers itself makes in bfloat16 on this checkpoint (measured by
    the fixture script); the greedy choice may differ only where transformers' margin
    is within that tolerance. A real bug moves logits by about their spread (~8)."""
    exp = expected(name)
    ckpt = checkpoint(name, "bfloat16", device)
    requests = [
        E.Request(i, np.asarray(r["prompt_ids"], np.int32), exp["max_new_tokens"])
        for i, r in enumerate(exp["requests"])
    ]
    forced = {i: r["generated_ids"] for i, r in enumerate(exp["requests"])}
    with jax.default_device(device):
        report = G.serve(
            ckpt,
            requests,
            G.ServeOptions(batch=SLOTS),
            device=device,
            record_logits=True,
            force_tokens=forced,
        )
    tol = 2 * max(r["bf16_top1_error"] for r in exp["requests"])
    worst, flips = 0.0, 0
    for res, want in zip(report.results, exp["requests"], strict=True):
        ids = want["generated_ids"]
        logits = np.stack(res.logits)
        err = np.abs(logits[np.arange(len(ids)), ids] - np.asarray(want["top1_logits"]))
        worst = max(worst, float(err.max()))
        for step, (ours, theirs) in enumerate(zip(res.greedy, ids, strict=True)):
            if ours != theirs:
                flips += 1
                assert want["margins"][step] <= 2 * tol, (
                    f"request {res.id} step {step}: bf16 picks {ours}, transformers "
                    f"{theirs} by a margin of {want['margins'][step]} > {2 * tol:.3g}"
                )
    print(
        f"{name} bf16 on {device.platform}: worst top-1 logit error {worst:.3g} "
        f"(tolerance {tol:.3g}), greedy differs at {flips} of "
        f"{len(requests) * exp['max_new_tokens']} steps"
    )
    assert worst <= tol, f"bf16 top-1 logits off by {worst:.3g} > {tol:.3g}"


def test_top_k_1_sampling_is_greedy(cpu_device: jax.Device) -> None:
    """Through the engine's host-side token choice: top-k 1 at any temperature is
    greedy decoding, so it reproduces transformers' ids."""
    name = "qwen2_bias_bf16"
    exp = expected(name)
    out = G.generate(
        checkpoint(name, "float32", cpu_device),
        mixed_prompts(exp),
        max_new_tokens=exp["max_new_tokens"],
        device=cpu_device,
        sampling=SamplingConfig(temperature=1.7, top_k=1, seed=11),
        opts=G.ServeOptions(batch=SLOTS),
    )
    assert [r["generated_ids"] for r in out["requests"]] == [
        r["generated_ids"] for r in exp["requests"]
    ]


def test_sampling_is_seeded_and_independent_of_the_schedule(cpu_device: jax.Device) -> None:
    """One seed gives the same samples on either backend, whether the prompts share
    two slots or have one each; and sampling at temperature 1 is not greedy. (Other
    seeds giving other samples: tests/example/test_hf_sampling.py.)"""
    name = "mistral"
    exp = expected(name)
    ckpt = checkpoint(name, "float32", cpu_device)
    prompts = [r["prompt"] for r in exp["requests"]]

    def run(seed: int, backend: str, batch: int) -> list[list[int]]:
        out = G.generate(
            ckpt,
            prompts,
            max_new_tokens=12,
            device=cpu_device,
            sampling=SamplingConfig(temperature=1.0, top_p=0.9, seed=seed),
            opts=G.ServeOptions(backend=backend, batch=batch),
        )
        return [r["generated_ids"] for r in out["requests"]]

    a = run(3, "jax_vmm", SLOTS)
    assert a == run(3, "prealloc", len(prompts))
    assert a != [r["generated_ids"][:12] for r in exp["requests"]]


def test_stop_at_eos_ends_each_sequence_at_its_first_eos(cpu_device: jax.Device) -> None:
    """With a token that transformers' outputs contain declared EOS, each sequence ends
    right after its first occurrence (EOS kept in the ids, dropped from the text);
    sequences without it run to max_new_tokens."""
    name = "llama3_tied"
    exp = expected(name)
    ckpt = checkpoint(name, "float32", cpu_device)
    eos = exp["requests"][1]["generated_ids"][5]
    out = G.generate(
        ckpt,
        mixed_prompts(exp),
        max_new_tokens=exp["max_new_tokens"],
        stop_at_eos=True,
        eos_token_ids=[eos],
        device=cpu_device,
        opts=G.ServeOptions(batch=SLOTS),
    )
    cut = 0
    for got, want in zip(out["requests"], exp["requests"], strict=True):
        ids = want["generated_ids"]
        n = ids.index(eos) + 1 if eos in ids else len(ids)
        cut += n < len(ids)
        assert got["generated_ids"] == ids[:n]
        assert got["text"] == ckpt.tokenizer.decode(ids[:n])
    assert cut >= 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prefill_chunk", [None, 3])
def test_a_mistral_window_shorter_than_the_context_is_applied(
    backend: str, prefill_chunk: int | None, cpu_device: jax.Device
) -> None:
    """Mistral's sliding window (here narrowed to 4 tokens on every layer, the fixture's
    own 4096 being longer than any fixture sequence) is applied once a context outgrows
    it: every generated token's logits equal the cache-free reference forward with that
    window, whole prompts or in chunks, and differ from the same forward without it."""
    ckpt = checkpoint("mistral", "float32", cpu_device)
    window = 4
    spec = dataclasses.replace(
        ckpt.spec, sliding_window=window, sliding_layers=(window,) * ckpt.config.num_layers
    )
    narrow = dataclasses.replace(ckpt, spec=spec)
    out = G.generate(
        narrow,
        ["The quick brown fox jumps."],
        max_new_tokens=4,
        device=cpu_device,
        record_logits=True,
        opts=G.ServeOptions(backend=backend, prefill_chunk=prefill_chunk),
    )
    req = out["requests"][0]
    seq = jnp.asarray(req["prompt_ids"] + req["generated_ids"][:-1], jnp.int32)
    assert len(req["prompt_ids"]) > window
    start = len(req["prompt_ids"]) - 1  # the logits that chose the first new token
    with jax.default_device(cpu_device), jax.default_matmul_precision("highest"):
        windowed, plain = (
            np.asarray(M.forward_no_cache(ckpt.params, seq, cfg=cfg))[start:]
            for cfg in (spec.config_for(len(seq)), ckpt.config)
        )
    np.testing.assert_allclose(req["logits"], windowed, atol=F32_LOGIT_TOL, rtol=0)
    assert np.abs(windowed - plain).max() > 100 * F32_LOGIT_TOL  # the window matters


def test_serve_applies_the_window_a_long_context_needs(cpu_device: jax.Device) -> None:
    """serve() (the engine-facing call) without a config runs the sliding windows the
    requests' contexts need, as generate() does: the same tokens. (It ran the checkpoint's
    plain config, every layer attending to the whole context.)"""
    ckpt = checkpoint("mistral", "float32", cpu_device)
    spec = dataclasses.replace(
        ckpt.spec, sliding_window=4, sliding_layers=(4,) * ckpt.config.num_layers
    )
    narrow = dataclasses.replace(ckpt, spec=spec)
    prompt = [1, 5, 9, 33, 71, 12, 8, 100, 7]
    want = G.generate(narrow, [prompt], max_new_tokens=6, device=cpu_device)
    plain = G.generate(ckpt, [prompt], max_new_tokens=6, device=cpu_device)
    with jax.default_device(cpu_device), jax.default_matmul_precision("highest"):
        got = G.serve(
            narrow, [E.Request(0, np.asarray(prompt, np.int32), 6)], G.ServeOptions(),
            device=cpu_device,
        )  # fmt: skip
    assert got.results[0].tokens == want["requests"][0]["generated_ids"]
    assert want["requests"][0]["generated_ids"] != plain["requests"][0]["generated_ids"]


def test_the_natural_prompt_forms_are_one_prompt_each(cpu_device: jax.Device) -> None:
    """One text, one flat list of ids, a 1-D or 2-D integer array: the prompts they say
    (a text was split into a prompt per character, a flat id list raised TypeError);
    NumPy integers count as integers; a later text turn gets no second BOS."""
    ckpt = checkpoint("llama3_tied", "float32", cpu_device)
    ids = ckpt.tokenizer.encode("Hi")

    def gen(prompts, **kw):
        out = G.generate(ckpt, prompts, max_new_tokens=np.int64(2), device=cpu_device, **kw)
        return [(r["prompt_ids"], r["generated_ids"]) for r in out["requests"]]

    want = gen([ids])
    assert len(want) == 1
    for prompts in ("Hi", ids, np.asarray(ids), np.asarray([ids]), jnp.asarray(ids)):
        assert gen(prompts) == want, prompts
    assert ckpt.tokenizer.encode("Yo", special_tokens=False) == ckpt.tokenizer.encode("Yo")[1:]
    turn = G.generate(ckpt, "Hi", max_new_tokens=2, device=cpu_device, next_turns="Yo")
    (turns,) = [r["turns"] for r in turn["requests"]]
    assert len(turns) == 1
    assert turns[0]["prompt_ids"] == ckpt.tokenizer.encode("Yo", special_tokens=False)


def test_numpy_sizes_and_checkpoint_files_as_found(cpu_device: jax.Device, tmp_path, caplog):
    """A NumPy prefill_chunk is an integer like any other size; a generation_config.json
    that is not an object is named; EOS ids past the vocabulary (a config shared across
    model sizes) are left out of the stop tokens with a warning, not a refusal of the run;
    a tokenizer.json that is a directory is named as such."""
    ckpt = checkpoint("mistral", "float32", cpu_device)
    want = G.generate(ckpt, ["Hi"], max_new_tokens=3, device=cpu_device)
    got = G.generate(
        ckpt,
        ["Hi"],
        max_new_tokens=3,
        device=cpu_device,
        opts=G.ServeOptions(prefill_chunk=np.int64(4)),
    )
    assert [r["generated_ids"] for r in got["requests"]] == [
        r["generated_ids"] for r in want["requests"]
    ]
    model = tmp_path / "model"
    model.mkdir()
    for f in (FIXTURE_DIR / "mistral").iterdir():
        (model / f.name).symlink_to(f)
    (model / "generation_config.json").unlink(missing_ok=True)
    (model / "generation_config.json").write_text("[1]")
    with pytest.raises(G.CheckpointError, match="generation_config.json: expected a JSON object"):
        read_config(model)
    vocab = read_config(FIXTURE_DIR / "mistral").config.vocab
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, vocab + 5]}))
    with caplog.at_level("WARNING", logger="jax_vmm"):
        assert read_config(model).eos_token_ids == (1,)
    assert f"eos_token_id [{vocab + 5}] lies past the vocabulary" in caplog.text
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").mkdir()
    with pytest.raises(G.CheckpointError, match="tokenizer.json: not a file"):
        load_tokenizer(model)


def test_request_errors_name_the_problem(cpu_device: jax.Device, tmp_path) -> None:
    """Bad prompts and options fail before anything runs, saying what is wrong."""
    ckpt = checkpoint("mistral", "float32", cpu_device)
    vocab = ckpt.config.vocab
    with pytest.raises(ValueError, match=rf"outside the model's vocabulary \[0, {vocab}\)"):
        G.generate(ckpt, [[1, vocab]], max_new_tokens=2, device=cpu_device)
    with pytest.raises(ValueError, match="has no tokens"):
        G.generate(ckpt, [[]], max_new_tokens=2, device=cpu_device)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        G.generate(ckpt, ["Hi"], max_new_tokens=0, device=cpu_device)
    with pytest.raises(ValueError, match="no prompts"):
        G.generate(ckpt, [], max_new_tokens=2, device=cpu_device)
    with pytest.raises(ValueError, match=r"batch \(sequence slots\) must be an integer >= 1"):
        G.generate(ckpt, ["Hi"], max_new_tokens=2, device=cpu_device, opts=G.ServeOptions(batch=0))
    with pytest.raises(ValueError, match="backend must be one of"):
        G.generate(
            ckpt, ["Hi"], max_new_tokens=2, device=cpu_device, opts=G.ServeOptions(backend="paged")
        )
    no_eos = dataclasses.replace(ckpt, spec=dataclasses.replace(ckpt.spec, eos_token_ids=()))
    with pytest.raises(ValueError, match="names no EOS token"):
        G.generate(no_eos, ["Hi"], max_new_tokens=2, stop_at_eos=True, device=cpu_device)
    with pytest.raises(ValueError, match="eos_token_ids is empty; give the ids to stop at"):
        G.generate(
            ckpt, ["Hi"], max_new_tokens=2, stop_at_eos=True, eos_token_ids=[], device=cpu_device
        )
    with pytest.raises(ValueError, match=r"next turn 1 \(''\) has no tokens"):
        G.generate(ckpt, ["Hi"], max_new_tokens=2, next_turns=["Yo", ""], device=cpu_device)
    no_tok = dataclasses.replace(ckpt, tokenizer=None)
    with pytest.raises(ValueError, match="has no tokenizer.json; give token ids"):
        G.generate(no_tok, ["Hi"], max_new_tokens=2, device=cpu_device)
    with pytest.raises(ValueError, match=r"neither text nor a list of integer token ids"):
        G.generate(ckpt, [[5.7, 6.2]], max_new_tokens=2, device=cpu_device)
    with pytest.raises(TypeError, match=r"prompt 0 is bytes \(b'Hi'\); pass text as str"):
        G.generate(ckpt, [b"Hi"], max_new_tokens=2, device=cpu_device)  # read as ids [72, 105]
    with pytest.raises(
        ValueError, match=r"has no tokenizer.json; give token ids \(--next-turn-ids"
    ):
        G.generate(no_tok, [[1, 2]], max_new_tokens=2, next_turns=["Yo"], device=cpu_device)
    with pytest.raises(TypeError, match="device must be a jax.Device"):
        G.generate(ckpt, ["Hi"], max_new_tokens=2, device="cpu")
    with pytest.raises(ValueError, match="stops nothing without stop_at_eos=True"):
        G.generate(ckpt, ["Hi"], max_new_tokens=2, eos_token_ids=[5], device=cpu_device)
    with pytest.raises(TypeError, match="sampling must be a SamplingConfig"):
        G.generate(ckpt, ["Hi"], max_new_tokens=2, sampling={"temperature": 1.0})
    for bad in (-1, 1.5, None, True):
        with pytest.raises(ValueError, match="seed must be an integer"):
            SamplingConfig(temperature=1.0, seed=bad)
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingConfig(temperature=True)


def test_cli_prints_text_and_writes_json(tmp_path, capsys) -> None:
    """The issue's command line, with prompts given as text and as ids in one list
    (their order kept), into --json."""
    name = "qwen2_bias_bf16"
    exp = expected(name)
    r0, r1, r2 = exp["requests"][:3]
    out = tmp_path / "out.json"
    GC.main(
        [
            "--model",
            str(FIXTURE_DIR / name),
            "--prompt",
            r0["prompt"],
            "--prompt-ids",
            ",".join(map(str, r2["prompt_ids"])),
            "--prompt",
            r1["prompt"],
            "--max-new-tokens",
            "6",
            "--device",
            "cpu",
            "--json",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    assert [r["prompt"] for r in data["requests"]] == [r0["prompt"], None, r1["prompt"]]
    for got, want in zip(data["requests"], (r0, r2, r1), strict=True):
        assert got["prompt_ids"] == want["prompt_ids"]
        assert got["generated_ids"] == want["generated_ids"][:6]
        assert set(got) == {"prompt", "prompt_ids", "generated_ids", "text"}
    assert data["tokens_per_second"] > 0 and data["generated_tokens"] == 18
    printed = capsys.readouterr().out
    assert repr(data["requests"][0]["text"]) in printed and "tokens/s" in printed


def test_cli_errors_are_one_clear_line(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(
        SystemExit,
        match=r"generate\.py: .*config\.json: architecture "
        r"\['GPT2LMHeadModel'\] is not supported",
    ):
        GC.main(
            ["--model", str(tmp_path), "--prompt", "x", "--max-new-tokens", "2", "--device", "cpu"]
        )
    with pytest.raises(SystemExit, match="need a temperature > 0"):
        GC.main(
            [
                "--model",
                str(FIXTURE_DIR / "mistral"),
                "--prompt",
                "x",
                "--top-k",
                "5",
                "--max-new-tokens",
                "2",
                "--device",
                "cpu",
            ]
        )
    with pytest.raises(SystemExit, match="at least one --prompt"):
        GC.main(["--model", str(FIXTURE_DIR / "mistral"), "--max-new-tokens", "2"])
    model = ["--model", str(FIXTURE_DIR / "mistral"), "--prompt", "x", "--device", "cpu"]
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    with pytest.raises(SystemExit, match=r"--json .*a_file/out\.json"):  # before the run
        GC.main([*model, "--max-new-tokens", "2", "--json", str(blocked / "out.json")])
    with pytest.raises(SystemExit, match=r"max_new_tokens=1000000000000: the longest .* 2\*\*31"):
        GC.main([*model, "--max-new-tokens", str(10**12)])


@pytest.mark.parametrize("name", ["gemma2", "llama3_tied"])
def test_prefill_in_chunks_generates_what_transformers_generates(name, cpu_device) -> None:
    """Prompts prefilled 7 tokens at a time over the cache (jax_vmm.attention; the Gemma 2
    window of 8 spans chunks): transformers' ids and top-1 logits, as whole prompts."""
    exp = expected(name)
    n = exp["max_new_tokens"]
    out = G.generate(
        checkpoint(name, "float32", cpu_device),
        [r["prompt_ids"] for r in exp["requests"]],
        max_new_tokens=n,
        opts=G.ServeOptions(batch=SLOTS, prefill_chunk=7),
        device=cpu_device,
        record_logits=True,
    )
    for got, want in zip(out["requests"], exp["requests"], strict=True):
        assert got["generated_ids"] == want["generated_ids"]
        top1 = got["logits"][np.arange(n), want["generated_ids"]]
        np.testing.assert_allclose(top1, want["top1_logits"], atol=F32_LOGIT_TOL, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_next_turn_on_the_cache_continues_as_transformers(backend, cpu_device) -> None:
    """Gemma 2's longest fixture prompt split into a conversation: turn 1 is its first 20
    tokens, "answered" by the next 10 (fed back as if generated); turn 2 appends the
    rest on that cache (prefilled over it, past the window of 8) and generates. Its
    greedy tokens and top-1 logits are transformers' for the whole prompt."""
    exp = expected("gemma2")
    want = exp["requests"][-1]
    ids, n = want["prompt_ids"], exp["max_new_tokens"]
    requests = [
        E.Request(0, np.asarray(ids[:20], np.int32), 10),
        E.Request(1, np.asarray(ids[30:], np.int32), n, follows=0),
    ]
    forced = {0: ids[20:30], 1: want["generated_ids"]}
    ckpt = checkpoint("gemma2", "float32", cpu_device)
    with jax.default_device(cpu_device), jax.default_matmul_precision("highest"):
        report = G.serve(
            ckpt,
            requests,
            G.ServeOptions(backend=backend),
            device=cpu_device,
            record_logits=True,
            force_tokens=forced,
        )
    turn = report.results[1]
    assert turn.greedy == want["generated_ids"]
    top1 = np.stack(turn.logits)[np.arange(n), want["generated_ids"]]
    np.testing.assert_allclose(top1, want["top1_logits"], atol=F32_LOGIT_TOL, rtol=0)


def test_cli_prefill_chunk_and_next_turn(cpu_device, capsys) -> None:
    """examples/generate.py's --prefill-chunk and --next-turn-ids: the second turn of
    each conversation is printed, and its ids are the library's."""
    exp = expected("gemma2")
    want = exp["requests"][-1]["prompt_ids"]
    argv = ["--model", str(FIXTURE_DIR / "gemma2"), "--prompt-ids", ",".join(map(str, want[:20]))]
    argv += ["--next-turn-ids", ",".join(map(str, want[20:])), "--max-new-tokens", "3"]
    argv += ["--prefill-chunk", "6", "--device", "cpu"]
    result = GC.main(argv)
    (only,) = result["requests"]
    (turn,) = only["turns"]
    assert turn["prompt_ids"] == want[20:] and len(turn["generated_ids"]) == 3
    assert "turn 2:" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="prefill_chunk"):
        GC.main([*argv[:-4], "--prefill-chunk", "0", "--device", "cpu"])
