"""The plain data of `Generator.run`: `Request` in; `Result`, `StepRecord` and `RunReport`
out. Here, below both, so that the engine and its serving loop share them without an
import circle; `jax_vmm.serving.engine` re-exports them (``E.Request``, ``E.RunReport``)."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..base.args import is_int


@dataclasses.dataclass(frozen=True)
class Request:
    id: int
    prompt: np.ndarray  # int32 (L,), L >= 1
    max_new_tokens: int  # >= 1; the first comes from prefill
    # The id of an earlier request of the same run whose conversation this continues:
    # the prompt is appended after that request's prompt and generated tokens, on its
    # cache (its slot is kept for this request when it finishes).
    follows: int | None = None


@dataclasses.dataclass
class Result:
    id: int
    prompt_len: int
    tokens: list[int] = dataclasses.field(default_factory=list)  # fed back (= greedy
    # unless run() was given force_tokens)
    greedy: list[int] = dataclasses.field(default_factory=list)  # argmax of each step
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)  # if recorded


@dataclasses.dataclass
class StepRecord:
    """Memory after one engine call is dispatched (a prefill or a decode block), the
    sequences read as finished by then already released."""

    kind: str  # "prefill" | "decode" (a block) | "end" (after the last release)
    backed_bytes: int  # physical KV memory held by the backend
    live_bytes: int  # bytes of the tokens actually cached
    active: int  # sequences in flight
    held_bytes: int = 0  # live_bytes with a shared prefix counted once (run(shared_prefix=))


@dataclasses.dataclass
class RunReport:
    results: list[Result]
    trace: list[StepRecord]
    seconds: float  # wall time of the serving loop (compile excluded)
    compile_seconds: float
    generated_tokens: int
    decode_steps: int  # device steps (blocks x steps per block)
    prefills: int
    ensure_seconds: float  # host time spent in cache calls (ensure/release/prefetch)
    blocks: int = 0  # host calls of the decode block
    block: int = 1  # decode steps per block
    pauses: int = 0  # pause() calls (sleep/wake)
    # Time spent waiting for background commits of prompts (cache.prefetch), and the
    # part of it with nothing left queued on the device (the device idled on memory).
    memory_wait_seconds: float = 0.0
    memory_wait_idle_seconds: float = 0.0
    # ensure_seconds by cache call: name -> (calls, seconds, longest call's seconds).
    host_calls: dict[str, tuple[int, float, float]] = dataclasses.field(default_factory=dict)


def _is_token_id(t: object, vocab: int) -> bool:
    """A Python or NumPy integer in [0, vocab): what the embedding takes unclamped."""
    return is_int(t) and 0 <= t < vocab  # type: ignore[operator]
