"""Continuous-batching generation over a KV cache backend, decoded in blocks on the device.

`Generator` owns the compiled programs of `jax_vmm.serving.steps` (prefill into a slot per
prompt-length bucket; a block of N greedy decode steps in one device loop; cache and
decode state donated in both); `Generator.run` serves a list of requests with
`max_seqs` slots: a finished sequence releases its memory and its slot takes the next
request. The host schedules (admits, prefills, ensures, releases) while the device runs
the previous block, and reads a block's tokens only after it dispatched the next. The
memory of the prompts being admitted is committed on the cache's background thread
(`prefetch`) while the device runs the prefills dispatched before. The
schedule depends only on the requests and the stop tokens, so two backends given the
same requests run exactly the same steps.

Prompts are prefilled whole (one causal pass over the prompt, from position 0), or with
`prefill_chunk=N` in chunks of N tokens, each attending over the cache
(`jax_vmm.attention` with N queries per sequence): the same tokens, a bounded prefill
shape. A request with `follows=ID` is a conversation's next turn: its prompt is appended
to request ID's prompt and generated tokens in ID's slot, prefilled over that cache.
`run(shared_prefix=N)` prefills the prompts' common first N tokens once, maps them into
each request's slot (`kv.share_prefix`) and prefills the rest of each prompt the same way,
over the cache: one program appends tokens to a slot, whatever it caches already.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..base.args import is_int
from . import model as M
from . import steps as S
from .cache import CacheBackend

log = logging.getLogger(__name__)


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


def make_requests(
    cfg: M.ModelConfig,
    *,
    num: int,
    prompt_len: tuple[int, int],
    new_tokens: tuple[int, int],
    seed: int,
) -> list[Request]:
    """Seeded requests with prompt lengths and generation lengths uniform in the ranges."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        plen = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        out.append(
            Request(
                id=i,
                prompt=rng.integers(0, cfg.vocab, plen, dtype=np.int32),
                max_new_tokens=int(rng.integers(new_tokens[0], new_tokens[1] + 1)),
            )
        )
    return out


def prompt_bucket(length: int, minimum: int = 64) -> int:
    """Padded prompt length: next power of two, at least `minimum` (bounds the number of
    prefill compiles; each costs about a second of CPU)."""
    b = minimum
    while b < length:
        b *= 2
    return b


DEFAULT_BLOCK = 16  # decode steps per host call (see Generator)
# Blocks of tokens ensured per ensure_all: each call publishes the cache's device table
# (a copy the host waits for, ~0.25 ms on the H200 while the device runs the main job).
ENSURE_BLOCKS = 2
WAIT_SLICE = 2e-4  # seconds between looks at the device while waiting for a prompt's memory


@dataclasses.dataclass(eq=False)
class _Slot:
    """A request in a slot, as the host sees it (the device state may be ahead)."""

    request: Request
    result: Result
    blocks: int = 0  # blocks dispatched since its prefill
    feed: int = -1  # host-chosen next token (tokens chosen on the host), else -1
    ensured: int = 0  # tokens the engine has ensured for it
    prefix: tuple[int, ...] = ()  # earlier turns of its conversation (follows), in order

    @property
    def prompt_len(self) -> int:
        """Tokens cached once its prompt is prefilled (earlier turns included)."""
        return len(self.prefix) + len(self.request.prompt)

    def context(self) -> tuple[int, ...]:
        """The conversation so far: earlier turns, the prompt and the tokens generated
        (the last of which is not cached yet)."""
        return self.prefix + tuple(int(t) for t in self.request.prompt) + tuple(self.result.tokens)

    def cached_after(self, blocks: int, block: int) -> int:
        """Tokens in the cache once `blocks` blocks of `block` steps have run (at most:
        a stop token ends it sooner)."""
        return self.prompt_len + min(blocks * block, self.request.max_new_tokens - 1)


@dataclasses.dataclass
class _Read:
    """A dispatched call whose tokens the host has not read yet."""

    slots: list[_Slot | None]  # who each column belonged to at dispatch
    tokens: jax.Array  # (steps, B) int32, -1 = no step; or () for a prefill
    logits: jax.Array | None  # (steps, B, vocab) / (vocab,) when needed on the host


def _is_token_id(t: object, vocab: int) -> bool:
    """A Python or NumPy integer in [0, vocab): what the embedding takes unclamped."""
    return is_int(t) and 0 <= t < vocab  # type: ignore[operator]


def check_block(block: object) -> None:
    if not is_int(block) or block < 1:
        raise ValueError(
            f"block (decode steps per host call) must be an integer >= 1, got {block!r}"
        )


def check_prefill_chunk(chunk: object) -> None:
    if chunk is not None and (not is_int(chunk) or chunk < 1):  # NumPy integers too
        raise ValueError(
            f"prefill_chunk (prompt tokens per prefill call) must be an integer >= 1 or None "
            f"(whole prompts), got {chunk!r}"
        )


def context_lengths(requests: list[Request]) -> dict[int, tuple[int, int]]:
    """{request id: (tokens cached before its prompt, the most it can cache)}; checks
    that ids are unique and that every `follows` names an earlier request."""
    out: dict[int, tuple[int, int]] = {}
    for r in requests:
        if r.id in out:
            raise ValueError(f"request id {r.id} is used twice; ids must be unique")
        before = 0
        if r.follows is not None:
            if r.follows not in out:
                raise ValueError(
                    f"request {r.id} follows {r.follows!r}, which is not an earlier request "
                    "of this run; a conversation's next turn comes after the turn it continues"
                )
            # The parent's context: its cache plus its last token (never fed back).
            before = out[r.follows][1] + 1
        out[r.id] = (before, before + len(r.prompt) + r.max_new_tokens - 1)
    followed = [r.follows for r in requests if r.follows is not None]
    twice = sorted({f for f in followed if followed.count(f) > 1})
    if twice:
        raise ValueError(f"requests {twice} are followed more than once; a turn has one next turn")
    return out


class Generator:
    """Compiled prefill and decode-block programs for one model, cache backend and
    attention choice; `run` serves requests with continuous batching. Not thread-safe.

    block: decode steps per host call, in one device loop (`jax_vmm.serving.steps`). Before
    each call the host ensures the tokens every live sequence can reach in it (the next
    ENSURE_BLOCKS blocks' worth, so that one table update serves several calls); it
    dispatches block k+1 before it reads block k's tokens, so admitting requests, prefill
    dispatch and ensure/release overlap the device. A sequence that finishes inside a
    block (its last token, or a stop token) is masked for the rest of it. 16 (the
    default): the loop length measured to replay as a graph on the H200; each finished
    sequence leaves its slot idle for the rest of its block, at most block - 1 steps.
    stop_tokens: a sequence ends at the first of these it generates (kept in its
    tokens), on the device, inside a block.
    attend_chunk: the multi-query attention over the cache (`model.ChunkAttendFn`,
    `jax_vmm.attention`), for prompts prefilled in chunks, for requests that follow
    another (a conversation's next turn) and for the prompts after a shared prefix
    (`run(shared_prefix=)`); prefill_chunk: prefill every prompt in chunks
    of this many tokens over the cache (None: whole prompts in one pass; a follow-up
    request's new tokens then go in one chunk of their padded length).
    keep_slot_memory: when a request will take a finished sequence's slot, the slot keeps
    the memory of the new prompt's tokens (``release(seq, keep_tokens=)``) instead of
    giving all of it back and committing the prompt again in the background. Fewer
    commits; but an allocation that straddles the kept tokens stays whole (its chunks
    past them park until the new sequence grows into them), so more memory can be held
    (on the H200 main job the peaks were the same either way: docs/benchmarks.md, "Tried and
    not kept")."""

    def __init__(
        self,
        params: M.Params,
        cfg: M.ModelConfig,
        cache: CacheBackend,
        attend: M.AttendFn,
        *,
        block: int = DEFAULT_BLOCK,
        stop_tokens: tuple[int, ...] = (),
        keep_slot_memory: bool = True,
        attend_chunk: M.ChunkAttendFn | None = None,
        prefill_chunk: int | None = None,
    ) -> None:
        check_block(block)
        check_prefill_chunk(prefill_chunk)
        if prefill_chunk is not None and attend_chunk is None:
            raise ValueError(
                "prefill_chunk needs attend_chunk, the attention of a chunk over the cache "
                "(jax_vmm.attention, or jax_vmm.serving.attention.chunk_attention(name))"
            )
        self.attend_chunk, self.prefill_chunk = attend_chunk, prefill_chunk
        if isinstance(stop_tokens, (int, np.integer)):
            raise TypeError(f"stop_tokens must be a sequence of token ids, got {stop_tokens!r}")
        bad = [t for t in stop_tokens if not _is_token_id(t, cfg.vocab)]
        if bad:
            raise ValueError(f"stop tokens {bad} are not token ids of the model's [0, {cfg.vocab})")
        self.params, self.cfg, self.cache, self.attend = params, cfg, cache, attend
        self.block, self.stop_tokens = int(block), tuple(sorted({int(t) for t in stop_tokens}))
        if not isinstance(keep_slot_memory, bool):
            raise ValueError(
                f"keep_slot_memory must be True or False, got {keep_slot_memory!r} "
                "(decode.py spells it --slot-memory keep|release)"
            )
        self.keep_slot_memory = keep_slot_memory
        self._compiled: dict[tuple, Callable] = {}
        self.compile_seconds = 0.0

    # -- compiled programs -------------------------------------------------------------
    def _get(self, key: tuple, make: Callable[[], Callable], *args: object) -> Callable:
        # AOT compile so serving time excludes compilation (reported separately).
        if key not in self._compiled:
            t0 = time.perf_counter()
            self._compiled[key] = make().lower(*args).compile()
            self.compile_seconds += time.perf_counter() - t0
        return self._compiled[key]

    def _prefill_fn(self, bucket: int, stops: tuple[int, ...], args: tuple) -> Callable:
        def make():
            return jax.jit(
                functools.partial(
                    S.prefill_slot, cfg=self.cfg, write=self.cache.write, stop_tokens=stops
                ),
                donate_argnums=(1, 2),
            )

        return self._get(("prefill", bucket, stops), make, *args)

    def _chunk_fn(self, size: int, stops: tuple[int, ...], args: tuple) -> Callable:
        def make():
            return jax.jit(
                functools.partial(
                    S.prefill_chunk_slot,
                    cfg=self.cfg,
                    write=self.cache.write,
                    attend_chunk=self.attend_chunk,
                    stop_tokens=stops,
                ),
                donate_argnums=(1, 2),
            )

        return self._get(("chunk", size, stops), make, *args)

    def _chunk_size(self, new_tokens: int) -> int:
        return self.prefill_chunk or prompt_bucket(new_tokens, minimum=16)

    def _chunk_args(
        self, state: S.DecodeState, tokens: np.ndarray, start: int, seq: int, new: int, size: int
    ) -> tuple:
        padded = np.zeros(size, np.int32)
        padded[: len(tokens)] = tokens
        return (
            self.params,
            self.cache.cache(),
            state,
            jnp.asarray(padded),
            jnp.int32(start),
            jnp.int32(len(tokens)),
            jnp.int32(seq),
            jnp.int32(new),
        )

    def _block_fn(self, steps: int, stops: tuple[int, ...], logits: bool, args: tuple):
        def make():
            return jax.jit(
                functools.partial(
                    S.decode_block,
                    num_steps=steps,
                    cfg=self.cfg,
                    write=self.cache.write,
                    attend=self.attend,
                    stop_tokens=stops,
                    with_logits=logits,
                ),
                donate_argnums=(1, 2),
            )

        return self._get(("block", steps, stops, logits), make, *args)

    def _prefill_args(self, state: S.DecodeState, prompt: np.ndarray, seq: int, new: int):
        bucket = prompt_bucket(len(prompt))
        padded = np.zeros(bucket, np.int32)
        padded[: len(prompt)] = prompt
        return bucket, (
            self.params,
            self.cache.cache(),
            state,
            jnp.asarray(padded),
            jnp.int32(len(prompt)),
            jnp.int32(seq),
            jnp.int32(new),
        )

    def _check_forced(self, requests: list[Request], force_tokens: dict) -> None:
        """force_tokens: for every request, max_new_tokens token ids of the model."""
        for r in requests:
            forced = force_tokens.get(r.id) if isinstance(force_tokens, dict) else None
            if forced is None or len(forced) < r.max_new_tokens:
                raise ValueError(
                    f"force_tokens must map every request id to its max_new_tokens token ids; "
                    f"request {r.id} needs {r.max_new_tokens}, got "
                    f"{'none' if forced is None else len(forced)}"
                )
            ids = np.asarray(forced[: r.max_new_tokens])
            if (
                not np.issubdtype(ids.dtype, np.integer)
                or ((ids < 0) | (ids >= self.cfg.vocab)).any()
            ):
                raise ValueError(
                    f"force_tokens[{r.id}] holds values that are not token ids of the model's "
                    f"[0, {self.cfg.vocab})"
                )

    def _host_mode(self, force_tokens, select_token) -> bool:
        return force_tokens is not None or select_token is not None

    def _appends(self, request: Request, shared_prefix: int) -> tuple[int, int]:
        """(tokens the request's slot caches before its prefill, tokens the prefill
        appends) as far as the compiled shapes go: a next turn appends its parent's last
        token (never cached) and its prompt after the earlier turns (their length is
        known only when the parent ends: 1 stands for it); after a shared prefix, a
        first turn appends the rest of its prompt."""
        if request.follows is not None:
            return 1, len(request.prompt) + 1
        if shared_prefix:
            return shared_prefix, len(request.prompt) - shared_prefix
        return 0, len(request.prompt)

    def _program(self, start: int, new: int) -> tuple[str, int]:
        """The prefill of `new` tokens into a slot that caches `start`: ("prefill",
        bucket), one causal pass from position 0 (model.prefill), for a whole prompt;
        ("chunk", size), chunks over the cache (model.prefill_chunk), for tokens after
        cached ones and for every prompt with prefill_chunk."""
        if start == 0 and self.prefill_chunk is None:
            return "prefill", prompt_bucket(new)
        return "chunk", self._chunk_size(new)

    def _prefill(
        self,
        state: S.DecodeState,
        stops: tuple[int, ...],
        seq: int,
        tokens: np.ndarray,
        start: int,
        new: int,
    ) -> tuple[jax.Array, jax.Array, S.DecodeState, int]:
        """Dispatches the prefill of `tokens` into slot `seq`, which caches `start` tokens,
        and starts the slot with `new` tokens to generate; a prompt's chunks go back to
        back (no decode block between). Returns (the last token's logits, the first
        token, the state, device calls)."""
        kind, size = self._program(start, len(tokens))
        if kind == "prefill":
            _, args = self._prefill_args(state, tokens, seq, new)
            logits, first, out, state = self._prefill_fn(size, stops, args)(*args)
            self.cache.update(out)
            return logits, first, state, 1
        fn = self._chunk_fn(size, stops, self._chunk_args(state, tokens[:1], 0, 0, 1, size))
        for lo in range(0, len(tokens), size):
            args = self._chunk_args(state, tokens[lo : lo + size], start + lo, seq, new, size)
            logits, first, out, state = fn(*args)
            self.cache.update(out)
        return logits, first, state, -(-len(tokens) // size)

    def precompile(
        self,
        requests: list[Request],
        *,
        host_tokens: bool = False,
        record_logits: bool = False,
        shared_prefix: int = 0,
    ) -> None:
        """Compiles every program `run` will need (with the same options), without
        running any. host_tokens: run() gets force_tokens or select_token."""
        b = self.cache.max_seqs
        state = S.idle_state(b)
        stops = () if host_tokens else self.stop_tokens
        steps = 1 if host_tokens else self.block
        control = jnp.full(b, S.KEEP, jnp.int32)
        logits = record_logits or host_tokens
        appends = [self._appends(r, shared_prefix) for r in requests]
        if shared_prefix:
            self._check_shared_prefix(requests, shared_prefix)
            appends.append((0, shared_prefix))  # the prefix itself, from position 0
        if self.attend_chunk is None and any(start for start, _ in appends):
            what = (
                "a request that follows another"
                if any(r.follows is not None for r in requests)
                else "a prompt after a shared prefix"
            )
            raise ValueError(
                f"{what} is prefilled over the cache: the Generator needs attend_chunk "
                "(jax_vmm.attention, or jax_vmm.serving.attention.chunk_attention(name))"
            )
        self._block_fn(steps, stops, logits, (self.params, self.cache.cache(), state, control))
        for kind, size in sorted({self._program(start, new) for start, new in appends}):
            if kind == "prefill":
                _, args = self._prefill_args(state, np.zeros(size, np.int32), 0, 1)
                self._prefill_fn(size, stops, args)
            else:
                self._chunk_fn(size, stops, self._chunk_args(state, np.zeros(1), 0, 0, 1, size))

    def _check_request(self, r: Request, before: int, need: int) -> None:
        """One request checked against the model and the cache (``before``: tokens of its
        earlier turns; ``need``: the cached tokens it needs in all)."""
        if len(r.prompt) < 1:
            raise ValueError(f"request {r.id}: the prompt is empty; give it at least one token")
        if isinstance(r.max_new_tokens, bool) or not isinstance(
            r.max_new_tokens, (int, np.integer)
        ):
            raise ValueError(
                f"request {r.id}: max_new_tokens must be an integer >= 1, got {r.max_new_tokens!r}"
            )
        if r.max_new_tokens < 1:
            raise ValueError(
                f"request {r.id}: max_new_tokens must be >= 1 (the engine generates at least "
                f"one token per request), got {r.max_new_tokens}"
            )
        ids = np.asarray(r.prompt)
        vocab = self.cfg.vocab
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"request {r.id}: prompt token ids must be integers, got {ids.dtype}")
        bad = ids[(ids < 0) | (ids >= vocab)]
        if bad.size:
            raise ValueError(
                f"request {r.id}: prompt token ids {bad[:8].tolist()} are not token ids of the "
                f"model's [0, {vocab}) (the embedding would clamp them silently)"
            )
        if need > self.cache.max_tokens:
            earlier = f"{before} tokens of earlier turns + " if before else ""
            raise ValueError(
                f"request {r.id}: {earlier}prompt {len(r.prompt)} + {r.max_new_tokens} new "
                f"tokens needs {need} cached tokens; the cache holds {self.cache.max_tokens} "
                "per sequence"
            )

    def _check_shared_prefix(self, requests: list[Request], n: int) -> np.ndarray | None:
        """run(shared_prefix=n) checked: the prefix's tokens (None for 0)."""
        if not is_int(n) or n < 0:
            raise ValueError(f"shared_prefix must be an integer >= 0, got {n!r}")
        if n == 0:
            return None
        if not hasattr(self.cache, "share_prefix"):
            raise ValueError(
                f"shared_prefix needs the jax_vmm cache backend (kv.share_prefix); the "
                f"{self.cache.name} backend cannot map one prefix into several sequences"
            )
        if self.cache.max_seqs < 2:
            raise ValueError("shared_prefix needs 2 or more slots: the prefix takes one")
        kv = getattr(self.cache, "kv", None)
        for shard in [] if kv is None else kv.shards_of():
            chunk, row = shard.arena.chunk_bytes, shard.seq_bytes
            if row % chunk:  # share_prefix maps chunks: every sequence must start on one
                step = chunk // math.gcd(chunk, shard.token_bytes)
                raise ValueError(
                    f"shared_prefix needs every sequence of the cache to start on a chunk: "
                    f"max_tokens {shard.max_tokens} x {shard.token_bytes} bytes per token is "
                    f"not a multiple of the arena's {chunk}-byte chunk; make max_tokens a "
                    f"multiple of {step} (or change chunk_bytes)"
                )
        # A next turn (follows) goes on in its parent's slot, prefix included.
        firsts = [r for r in requests if r.follows is None]
        prefix = np.asarray(firsts[0].prompt[:n]) if firsts else np.zeros(0, np.int32)
        for r in firsts:
            if len(r.prompt) <= n or not np.array_equal(np.asarray(r.prompt[:n]), prefix):
                raise ValueError(
                    f"request {r.id}: shared_prefix={n} needs every prompt to start with the "
                    f"same {n} tokens and to have at least one more ({len(r.prompt)} tokens)"
                )
        return prefix

    # -- serving -----------------------------------------------------------------------
    def run(
        self,
        requests: list[Request],
        *,
        record_logits: bool = False,
        progress: Callable[[int], None] | None = None,
        force_tokens: dict[int, list[int]] | None = None,
        select_token: Callable[[int, np.ndarray], int] | None = None,
        pause_every: int | None = None,
        pause: Callable[[], None] | None = None,
        shared_prefix: int = 0,
    ) -> RunReport:
        """Serves all requests with continuous batching; greedy on the device.

        force_tokens (request id -> tokens): feed these back instead of the greedy ones
        (teacher forcing), so that two runs compare logits at every step even after a
        near-tie; ``Result.greedy`` still records each step's argmax.
        select_token(request id, logits (vocab,) fp32) -> token: choose each fed-back
        token on the host instead (sampling). Either makes every token a host decision:
        one step per host call, each read before the next is dispatched, stop tokens
        checked on the host.
        pause_every K, pause(): after every K blocks, wait for everything dispatched and
        call pause() with sequences in flight (sleep/wake the engine), then go on.
        shared_prefix N: every prompt starts with the same N tokens; they are prefilled
        once into the last slot, which serves no request, and shared into each request's
        slot (kv.share_prefix: the same memory, no copy of whole chunks), whose prefill
        then runs only the rest of its prompt, over the cache (attend_chunk); a next turn
        (follows) goes on in its parent's slot, so only first turns need the prefix.

        A run that raises midway (a commit past the memory budget, a failing pause(),
        KeyboardInterrupt) first waits for its dispatched calls and releases every slot,
        so the cache holds nothing of it."""
        cache = self.cache
        for r in requests:
            if np.ndim(r.prompt) != 1:
                raise ValueError(
                    f"request {getattr(r, 'id', '?')}: the prompt must be a 1-D sequence of "
                    f"token ids, got shape {np.shape(r.prompt)}"
                )
        contexts = context_lengths(requests)
        for r in requests:
            self._check_request(r, *contexts[r.id])
        if pause_every is not None and (not is_int(pause_every) or pause_every < 1):
            raise ValueError(f"pause_every must be an integer >= 1 or None, got {pause_every!r}")
        if (pause_every is None) != (pause is None):
            raise ValueError("pause_every and pause go together: give both or neither")
        prefix_tokens = self._check_shared_prefix(requests, shared_prefix)
        shared_prefix = int(shared_prefix)
        if prefix_tokens is not None and pause_every is not None:
            # A sleep refuses while memory is shared (docs/sharing.md), and the first pause
            # would come after work was dispatched.
            raise ValueError(
                "shared_prefix and pause_every go separately: the arena cannot sleep while "
                "sequences share a prefix's memory; run the two in separate calls"
            )
        if force_tokens is not None and select_token is not None:
            raise ValueError(
                "force_tokens and select_token both choose the fed-back tokens: give one"
            )
        if force_tokens is not None:
            self._check_forced(requests, force_tokens)
        host_mode = self._host_mode(force_tokens, select_token)
        self.precompile(
            requests,
            host_tokens=host_mode,
            record_logits=record_logits,
            shared_prefix=shared_prefix,
        )
        n = 1 if host_mode else self.block
        stops = () if host_mode else self.stop_tokens
        want_logits = record_logits or host_mode
        host_stops = set(self.stop_tokens) if host_mode else set()
        bpt = cache.token_bytes
        batch = cache.max_seqs
        queue = collections.deque(requests)
        slots: list[_Slot | None] = [None] * batch
        results: dict[int, Result] = {}
        trace: list[StepRecord] = []
        pending: collections.deque[_Read] = collections.deque()
        counts = collections.Counter()
        wait_seconds = idle_seconds = 0.0
        held: set[int] = set()  # finished, memory kept for the request that takes the slot
        followed = {r.follows for r in requests if r.follows is not None}
        # Finished turns whose next turn is queued: request id -> (slot, conversation).
        turns: dict[int, tuple[int, tuple[int, ...]]] = {}

        calls: dict[str, tuple[int, float, float]] = {}

        def timed(fn: Callable, *args, name: str | None = None) -> None:
            t0 = time.perf_counter()
            fn(*args)
            dt = time.perf_counter() - t0
            key = name or fn.__name__
            n_calls, total, longest = calls.get(key, (0, 0.0, 0.0))
            calls[key] = (n_calls + 1, total + dt, max(longest, dt))

        def record(kind: str) -> None:
            live = sum(s.cached_after(s.blocks, n) for s in slots if s is not None)
            active = sum(s is not None for s in slots)
            # The prefix slot holds the prefix from its prefill to the end; every request
            # maps it (kv.share_prefix) rather than holding a copy.
            held = live - (active - (kind != "end")) * shared_prefix if shared_prefix else live
            trace.append(StepRecord(kind, cache.backed_bytes(), live * bpt, active, held * bpt))

        def retire(seq: int) -> None:
            # Called once the call that ended the sequence has been read, so has run: a
            # release changes the table kernels check when they run, and a block still
            # queued would drop its last writes. With keep_slot_memory, when a request
            # will take the slot, the release waits for it (admit): the memory its prompt
            # needs then stays backed instead of going back and being committed again.
            # Otherwise it goes back now (without waiting for the device). A turn whose
            # next turn is queued keeps its slot and cache for it. A slot shared into
            # must hold nothing before the share (kv.share_prefix): it keeps no memory.
            slot = slots[seq]
            if slot.request.id in followed:
                turns[slot.request.id] = (seq, slot.context())
            elif (
                not shared_prefix
                and self.keep_slot_memory
                # next turns run in their parent's slot: only first turns take a free one
                and sum(r.follows is None for r in queue) > sum(s is None for s in slots)
            ):
                held.add(seq)
            else:
                timed(cache.release, seq)
            slots[seq] = None

        def emit(slot: _Slot, token: int, logits: np.ndarray | None) -> bool:
            """Takes one generated token; True when the request is complete."""
            res = slot.result
            res.greedy.append(token)
            if force_tokens is not None:
                token = int(force_tokens[slot.request.id][len(res.tokens)])
            elif select_token is not None:
                chosen = select_token(slot.request.id, logits)
                if not _is_token_id(chosen, self.cfg.vocab):
                    raise ValueError(
                        f"select_token returned {chosen!r} for request {slot.request.id} at "
                        f"its token {len(res.tokens)}: expected a token id of the model's "
                        f"[0, {self.cfg.vocab})"
                    )
                token = int(chosen)
            res.tokens.append(token)
            if record_logits:
                res.logits.append(logits)
            slot.feed = token
            counts["generated"] += 1
            return (
                len(res.tokens) == slot.request.max_new_tokens
                or token in host_stops
                or (not host_mode and token in self.stop_tokens)
            )

        def read(item: _Read) -> None:
            tokens = np.asarray(item.tokens)
            logits = None if item.logits is None else np.asarray(item.logits)
            if tokens.ndim == 0:  # a prefill: its one slot
                (slot,) = [s for s in item.slots if s is not None]
                steps = [(slot, int(tokens), logits)]
            else:
                steps = [
                    (slot, int(tokens[i, seq]), None if logits is None else logits[i, seq])
                    for i in range(tokens.shape[0])
                    for seq, slot in enumerate(item.slots)
                    if slot is not None and tokens[i, seq] >= 0
                ]
            for slot, token, lg in steps:
                if emit(slot, token, lg):
                    seq = next((q for q, s in enumerate(slots) if s is slot), None)
                    if seq is not None:
                        retire(seq)
            if progress is not None and steps:
                progress(len(steps))

        def device_idle() -> bool:
            # The newest dispatched call done: nothing is left queued on the device.
            return not pending or pending[-1].tokens.is_ready()

        def wait_for_memory(seq: int) -> None:
            # The prompt's memory is committed on the cache's background thread; the
            # device meanwhile runs the prefills and blocks dispatched before.
            nonlocal wait_seconds, idle_seconds
            t0 = time.perf_counter()
            while True:
                done = cache.wait_prefetch(seq, WAIT_SLICE)
                t1 = time.perf_counter()
                if device_idle():
                    idle_seconds += t1 - t0
                wait_seconds += t1 - t0
                t0 = t1
                if done:
                    return

        def take_requests() -> list[tuple[int, Request, tuple[int, ...]]]:
            """(slot, request, earlier turns) for every queued request that can start:
            in queue order, a next turn in its finished parent's slot, others in free
            slots (not one kept for a next turn)."""
            kept = {seq for seq, _ in turns.values()}
            free = [seq for seq in range(serving) if slots[seq] is None and seq not in kept]
            taken, waiting = [], collections.deque()
            while queue:
                req = queue.popleft()
                if req.follows is not None and req.follows in turns:
                    seq, prefix = turns.pop(req.follows)
                    taken.append((seq, req, prefix))
                elif req.follows is None and free:
                    taken.append((free.pop(0), req, ()))
                else:
                    waiting.append(req)
            queue.extend(waiting)
            return taken

        def admit_free_slots() -> None:
            taken = take_requests()
            for seq, req, prefix in taken:  # every prompt's memory, in the background
                if seq in held:  # the slot keeps the chunks of the new prompt
                    held.discard(seq)
                    timed(
                        lambda: cache.release(seq, keep_tokens=len(req.prompt)),
                        name="release(keep_tokens)",
                    )
                if not (shared_prefix and not prefix):  # a slot shared into holds nothing
                    timed(cache.prefetch, seq, len(prefix) + len(req.prompt))
            for seq, req, prefix in taken:
                wait_for_memory(seq)
                admit(seq, req, prefix)

        def admit(seq: int, req: Request, prefix: tuple[int, ...]) -> None:
            nonlocal state
            slot = _Slot(
                req, results.setdefault(req.id, Result(req.id, len(req.prompt))), prefix=prefix
            )
            if prefix:  # a next turn: cached, the earlier turns but their last token
                start = len(prefix) - 1
                new = prefix[start:] + tuple(int(t) for t in req.prompt)
            elif shared_prefix:
                timed(cache.share_prefix, prefix_seq, seq, shared_prefix)
                start, new = shared_prefix, req.prompt[shared_prefix:]
            else:
                start, new = 0, req.prompt
            timed(cache.ensure, seq, slot.prompt_len)
            slot.ensured = slot.prompt_len
            slots[seq] = slot
            logits, first, state, dispatched = self._prefill(
                state, stops, seq, np.asarray(new, np.int32), start, req.max_new_tokens
            )
            counts["prefills"] += dispatched
            cols: list[_Slot | None] = [None] * batch
            cols[seq] = slot
            pending.append(_Read(cols, first, logits if want_logits else None))
            record("prefill")

        state = S.idle_state(batch)
        # The shared prefix: prefilled once into the last slot (one token asked, so the
        # slot stays idle), which then only lends its memory.
        serving = batch - 1 if shared_prefix else batch
        prefix_seq = batch - 1

        def serve_all() -> None:
            nonlocal state
            if shared_prefix:
                timed(cache.ensure_shareable, prefix_seq, shared_prefix)
                _, _, state, dispatched = self._prefill(
                    state, stops, prefix_seq, prefix_tokens, 0, 1
                )
                counts["prefills"] += dispatched
                record("prefill")
            while queue or any(slots) or pending:
                admit_free_slots()  # continuous batching: free slots take requests
                if host_mode:
                    while pending:  # every token is a host decision: read before going on
                        read(pending.popleft())
                    if not any(slots):
                        continue
                elif not any(slots):
                    while pending:
                        read(pending.popleft())
                    continue
                control = np.full(batch, S.STOP, np.int32)
                live = [(seq, s) for seq, s in enumerate(slots) if s is not None]
                for seq, s in live:
                    control[seq] = s.feed if host_mode else S.KEEP
                # What the block can write, ensured ENSURE_BLOCKS blocks at a time: one table
                # update (a driver copy) serves that many blocks.
                if any(s.cached_after(s.blocks + 1, n) > s.ensured for _, s in live):
                    need = np.zeros(batch, np.int64)
                    for seq, s in live:
                        s.ensured = max(s.ensured, s.cached_after(s.blocks + ENSURE_BLOCKS, n))
                        need[seq] = s.ensured
                    timed(cache.ensure_all, need)
                args = (self.params, cache.cache(), state, jnp.asarray(control))
                tokens, logits, out, state = self._block_fn(n, stops, want_logits, args)(*args)
                cache.update(out)
                counts["blocks"] += 1
                pending.append(_Read(list(slots), tokens, logits if want_logits else None))
                for s in slots:
                    if s is not None:
                        s.blocks += 1
                record("decode")
                # Double buffering: read everything but the block just dispatched.
                while len(pending) > (0 if host_mode else 1):
                    read(pending.popleft())
                if pause_every is not None and counts["blocks"] % pause_every == 0:
                    while pending:
                        read(pending.popleft())
                    jax.block_until_ready(state)
                    pause()
                    counts["pauses"] += 1
            for seq in sorted(held):  # no request took it after all
                timed(cache.release, seq)
            if shared_prefix:
                timed(cache.release, prefix_seq)

        t_start = time.perf_counter()
        try:
            serve_all()
        except BaseException:
            # The slots' memory goes back (shared prefix last), so the cache is as
            # before the run: a failed commit, a failing pause() or Ctrl-C leaves nothing
            # held or shared for the next run to trip over.
            _give_back_slots(cache, [*(r.tokens for r in pending), state], range(batch))
            raise
        record("end")
        seconds = time.perf_counter() - t_start
        cache.check()  # no write was dropped (every token was ensured before its step)
        return RunReport(
            results=[results[r.id] for r in requests],
            trace=trace,
            seconds=seconds,
            compile_seconds=self.compile_seconds,
            generated_tokens=counts["generated"],
            decode_steps=counts["blocks"] * n,
            prefills=counts["prefills"],
            ensure_seconds=sum(total for _, total, _ in calls.values()),
            blocks=counts["blocks"],
            block=n,
            pauses=counts["pauses"],
            memory_wait_seconds=wait_seconds,
            memory_wait_idle_seconds=idle_seconds,
            host_calls=calls,
        )


def _give_back_slots(cache: CacheBackend, in_flight: list, seqs: range) -> None:
    """After a run failed: waits for the calls in flight (their outputs `in_flight`, the
    decode state included, which a prefill unread yet, the shared prefix's, produced; an
    error of theirs is the run's, raised already or by them), then releases every slot in
    order (a shared prefix's slot is the last), logging a release that cannot be made (an
    arena left asleep)."""
    for out in in_flight:
        try:
            jax.block_until_ready(out)
        except Exception:  # noqa: BLE001, S110 - the run's own error is being raised
            pass
    for seq in seqs:
        try:
            cache.release(seq)
        except Exception as e:  # noqa: BLE001
            log.warning("a failed run could not release slot %d of its cache: %s", seq, e)
