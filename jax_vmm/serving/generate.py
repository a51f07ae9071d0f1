"""Generate text with a Hugging Face checkpoint (Llama, Mistral, Qwen2, Gemma 2) on the
jax_vmm cache.

    ckpt = load_checkpoint("DIR")                       # jax_vmm.serving.hf
    out = generate(ckpt, ["text", [1, 2, 3]], max_new_tokens=N)

Greedy by default; a `SamplingConfig` with temperature > 0 samples (with top-k, top-p,
seed). The prompts are served together on `ServeOptions.batch` sequence slots with
continuous batching, by the same engine, cache backends and attention as the decode demo
(`jax_vmm.serving.cli.decode`). Without stop_at_eos exactly N tokens are generated per
prompt; with it, a sequence ends at its first EOS token (kept in the ids, not in the text).
The command line (`examples/generate.py`) is `jax_vmm.serving.cli.generate`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ..base.args import is_int
from ..kv.base import MAX_TOKEN_SLOTS
from . import engine as E
from . import model as M
from .attention import choose_attention, chunk_attention
from .cache import make_cache
from .hf.checkpoint import Checkpoint, CheckpointError
from .sampling import RequestSampler, SamplingConfig

DEFAULT_MAX_SLOTS = 8


@dataclasses.dataclass(frozen=True)
class Prompt:
    text: str | None  # None: given as token ids
    ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """How the engine serves the requests (the knobs of the decode demo)."""

    backend: str = "jax_vmm"
    batch: int | None = None  # sequence slots; None: min(prompts, 8)
    attention: str = "auto"
    chunk_bytes: int | None = None
    block: int = E.DEFAULT_BLOCK  # decode steps per host call (jax_vmm.serving.engine)
    # Prefill prompts in chunks of this many tokens over the cache; None: whole prompts.
    prefill_chunk: int | None = None


GREEDY = SamplingConfig()
DEFAULT_SERVING = ServeOptions()


def prompt_list(prompts: Any, what: str = "prompts") -> list[str | list[int]]:
    """The prompts as a list, one entry per prompt, from what a caller naturally passes:
    a list of texts or of id lists, one text, one flat list (or 1-D array) of ids, or a
    2-D integer array (a prompt per row)."""
    if isinstance(prompts, str):
        return [prompts]
    if hasattr(prompts, "__array__") and not isinstance(prompts, (list, tuple)):
        prompts = np.asarray(prompts)  # a jax.Array too
    if isinstance(prompts, np.ndarray):
        if prompts.ndim not in (1, 2) or not np.issubdtype(prompts.dtype, np.integer):
            raise ValueError(
                f"{what}: an array of prompts must hold integer token ids, 1-D (one prompt) "
                f"or 2-D (a prompt per row); got {prompts.ndim}-D {prompts.dtype}"
            )
        return [prompts.tolist()] if prompts.ndim == 1 else prompts.tolist()
    if isinstance(prompts, (bytes, dict)) or not isinstance(prompts, Sequence):
        raise TypeError(
            f"{what} must be a list of prompts (texts or lists of token ids), got "
            f"{type(prompts).__name__}"
        )
    items = list(prompts)
    if items and all(is_int(t) for t in items):
        return [items]  # one prompt of ids
    return items


def encode_prompts(
    ckpt: Checkpoint,
    prompts: Sequence[str | Sequence[int]],
    *,
    first_turn: bool = True,
    what: str = "prompt",
) -> list[Prompt]:
    """Text prompts through the checkpoint's tokenizer (with BOS only for a first turn:
    a later turn continues a conversation that has one); id prompts checked against the
    model's vocabulary (an out-of-range id would be clamped by the embedding gather)."""
    out = []
    vocab = ckpt.config.vocab
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if ckpt.tokenizer is None:
                ids_flag = "--next-turn-ids" if what == "next turn" else "--prompt-ids"
                raise CheckpointError(
                    f"{what} {i} is text, but {ckpt.path} has no "
                    f"tokenizer.json; give token ids ({ids_flag})"
                )
            ids, text = ckpt.tokenizer.encode(p, special_tokens=first_turn), p
        else:
            p = np.asarray(p).tolist() if hasattr(p, "__array__") else p
            if isinstance(p, (bytes, bytearray)):  # a Sequence of ints, but not token ids
                raise TypeError(
                    f"{what} {i} is bytes ({p!r}); pass text as str (decode it first) or "
                    "token ids as a list of ints"
                )
            if not isinstance(p, Sequence) or not all(is_int(t) for t in p):
                raise ValueError(
                    f"{what} {i} ({p!r}) is neither text nor a list of integer token ids"
                )
            ids, text = [int(t) for t in p], None
        if not ids:
            raise ValueError(f"{what} {i} ({p!r}) has no tokens; a prompt needs at least one")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"{what} {i}: token ids {bad[:5]} are outside the model's vocabulary [0, {vocab})"
            )
        out.append(Prompt(text, tuple(ids)))
    return out


def checked_max_new_tokens(n: Any, what: str = "max_new_tokens") -> int:
    """``n`` as an int >= 1 (``what`` names it in the error: the argument or the flag)."""
    if not is_int(n) or n < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {n!r}")
    return int(n)


def num_slots(opts: ServeOptions, num_requests: int) -> int:
    if opts.batch is not None and (not is_int(opts.batch) or opts.batch < 1):
        raise ValueError(f"batch (sequence slots) must be an integer >= 1, got {opts.batch!r}")
    return min(int(opts.batch or DEFAULT_MAX_SLOTS), num_requests)


def serve(
    ckpt: Checkpoint,
    requests: list[E.Request],
    opts: ServeOptions,
    *,
    device: jax.Device,
    select_token: Callable[[int, np.ndarray], int] | None = None,
    record_logits: bool = False,
    force_tokens: dict[int, list[int]] | None = None,
    stop_tokens: tuple[int, ...] = (),
    config: M.ModelConfig | None = None,
) -> E.RunReport:
    """The engine-facing glue: one cache, one Generator, one run. `requests` are served
    on min(batch, len(requests)) slots, each with room for its prompt and new tokens.
    select_token, record_logits, force_tokens: as `Generator.run`; stop_tokens: as
    `Generator` (a sequence ends at the first it generates). config: the model's config
    to run (default: ckpt.config with the sliding windows the requests' longest context
    needs, HFModelSpec.config_for)."""
    E.check_prefill_chunk(opts.prefill_chunk)
    slots = num_slots(opts, sum(r.follows is None for r in requests))  # conversations
    max_tokens = max(need for _, need in E.context_lengths(requests).values())
    cfg = ckpt.spec.config_for(max_tokens) if config is None else config
    cache = make_cache(
        opts.backend,
        cfg,
        max_seqs=slots,
        max_tokens=max_tokens,
        device=device,
        chunk_bytes=opts.chunk_bytes,
    )
    try:
        name, attend = choose_attention(
            opts.attention,
            backend=opts.backend,
            platform=device.platform,
            tail_may_be_garbage=cache.tail_may_be_garbage,
            dtype=cfg.dtype,
        )
        chunked = opts.prefill_chunk is not None or any(r.follows is not None for r in requests)
        gen = E.Generator(
            ckpt.params,
            cfg,
            cache,
            attend,
            block=opts.block,
            stop_tokens=stop_tokens,
            attend_chunk=chunk_attention(name) if chunked else None,
            prefill_chunk=opts.prefill_chunk,
        )
        return gen.run(
            requests,
            select_token=select_token,
            record_logits=record_logits,
            force_tokens=force_tokens,
        )
    finally:
        cache.close()


def _eos_ids(eos_token_ids: Any, stop_at_eos: bool) -> list[int]:
    """eos_token_ids as ints; given, they must come with stop_at_eos (else they would do
    nothing)."""
    ids = [eos_token_ids] if is_int(eos_token_ids) else list(eos_token_ids)
    if not all(is_int(t) for t in ids):
        raise ValueError(f"eos_token_ids must be integer token ids, got {eos_token_ids!r}")
    if not stop_at_eos:
        raise ValueError(
            f"eos_token_ids={ids} stops nothing without stop_at_eos=True; pass both to "
            "end each sequence at its first of them"
        )
    return [int(t) for t in ids]


def generate(
    ckpt: Checkpoint,
    prompts: Sequence[str | Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = GREEDY,
    stop_at_eos: bool = False,
    eos_token_ids: Sequence[int] | None = None,
    opts: ServeOptions = DEFAULT_SERVING,
    device: jax.Device | None = None,
    record_logits: bool = False,
    next_turns: Sequence[str | Sequence[int]] = (),
) -> dict[str, Any]:
    """Generates `max_new_tokens` per prompt (text, or a sequence of token ids).

    prompts: a list of texts or of token-id lists; one text, or one flat list of ids, is
    one prompt. next_turns: further user messages (text, tokenized without BOS, or ids), each
    appended in order to every prompt's conversation once its previous turn is done,
    on that conversation's cache (prefilled over it); their outputs are each request's
    "turns" (a list of {"prompt", "prompt_ids", "generated_ids", "text"}).

    Returns {"requests": [{"prompt", "prompt_ids", "generated_ids", "text"}, ...],
    "tokens_per_second", ...}. stop_at_eos: each sequence ends at its first token in
    `eos_token_ids` (default: the checkpoint's), kept in its ids; the engine stops it
    there (on the device, inside a decode block, when greedy). record_logits: each
    request also gets "logits", the float32
    (steps, vocab) array each generated token was chosen from. device: where the steps
    run (default: where the checkpoint's weights are)."""
    max_new_tokens = checked_max_new_tokens(max_new_tokens)
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    if not isinstance(opts, ServeOptions):
        raise TypeError(f"opts must be a ServeOptions, got {type(opts).__name__}")
    prompts = prompt_list(prompts)
    if not prompts:
        raise ValueError("no prompts: give at least one (--prompt or --prompt-ids)")
    if eos_token_ids is not None:
        eos_token_ids = _eos_ids(eos_token_ids, stop_at_eos)
    if device is not None and not isinstance(device, jax.Device):
        raise TypeError(
            f"generate: device must be a jax.Device (e.g. jax.devices('cpu')[0]) or None, "
            f"got {type(device).__name__} {device!r}"
        )
    device = device or next(iter(ckpt.params.embed.devices()))  # where the weights are
    encoded = encode_prompts(ckpt, prompts)
    turns = encode_prompts(
        ckpt, prompt_list(next_turns, "next_turns"), first_turn=False, what="next turn"
    )
    # The last new token is never fed back: the longest context is prompt + N - 1.
    longest = max(len(p.ids) for p in encoded) + max_new_tokens - 1
    longest += sum(len(t.ids) + max_new_tokens for t in turns)
    slots = num_slots(opts, len(encoded))
    if slots * longest >= MAX_TOKEN_SLOTS:  # docs/errors.md E22b
        raise ValueError(
            f"max_new_tokens={max_new_tokens}: the longest conversation caches {longest} "
            f"tokens, and {slots} sequence slots of that many exceed the 2**31 token slots a "
            "KV cache addresses; ask for fewer new tokens (or fewer slots: ServeOptions.batch)"
        )
    config = ckpt.spec.config_for(longest)
    eos = set(ckpt.spec.eos_token_ids if eos_token_ids is None else eos_token_ids)
    if stop_at_eos and not eos:
        raise ValueError(
            "--stop-at-eos: eos_token_ids is empty; give the ids to stop at"
            if eos_token_ids is not None
            else f"--stop-at-eos: {ckpt.path} names no EOS token "
            "(eos_token_id in config.json / generation_config.json)"
        )
    # Turn t of prompt i is request t * P + i, following request (t - 1) * P + i.
    n = len(encoded)
    requests = [
        E.Request(
            t * n + i,
            np.asarray(p.ids, np.int32),
            max_new_tokens,
            follows=None if t == 0 else (t - 1) * n + i,
        )
        for t, turn in enumerate([encoded, *([t] * n for t in turns)])
        for i, p in enumerate(turn)
    ]
    select = None if sampling.greedy else RequestSampler(sampling)
    # float32 means float32: no TF32 matmuls on GPUs (the default precision there).
    precision = "highest" if ckpt.config.dtype == "float32" else "default"
    with jax.default_device(device), jax.default_matmul_precision(precision):
        report = serve(
            ckpt,
            requests,
            opts,
            device=device,
            select_token=select,
            record_logits=record_logits,
            stop_tokens=tuple(sorted(eos)) if stop_at_eos else (),
            config=config,
        )

    def entry(prompt: Prompt, res: E.Result) -> dict[str, Any]:
        ids = list(res.tokens)
        text = ckpt.tokenizer.decode(ids) if ckpt.tokenizer is not None else None
        item = {"prompt": prompt.text, "prompt_ids": list(prompt.ids), "generated_ids": ids}
        item["text"] = text
        if record_logits:
            item["logits"] = np.stack(res.logits)[: len(ids)]
        return item

    out = [entry(p, res) for p, res in zip(encoded, report.results[:n], strict=True)]
    for t, turn in enumerate(turns, start=1):
        for i, item in enumerate(out):
            item.setdefault("turns", []).append(entry(turn, report.results[t * n + i]))
    return {
        "requests": out,
        "tokens_per_second": report.generated_tokens / max(report.seconds, 1e-9),
        "generated_tokens": report.generated_tokens,
        "seconds": report.seconds,
        "compile_seconds": report.compile_seconds,
        "decode_steps": report.decode_steps,
        "model": str(ckpt.path),
        "architecture": ckpt.spec.architecture,
        "dtype": ckpt.config.dtype,
        "backend": opts.backend,
        "device": device.platform,
        "slots": num_slots(opts, n),
        "sampling": dataclasses.asdict(sampling),
    }
