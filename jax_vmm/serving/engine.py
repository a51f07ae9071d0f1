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

The host loop of a run is `serving_loop.ServingLoop`; the run's data (`Request`, `Result`,
`StepRecord`, `RunReport`) is in `run_data`, importable from here.
"""

from __future__ import annotations

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

# Defined below engine and its loop (no import circle); callers take them from here.
from .run_data import Request, Result, RunReport, StepRecord, _is_token_id  # noqa: F401
from .serving_loop import ServingLoop

log = logging.getLogger(__name__)


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
        share: bool = True,
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
        share=False (with shared_prefix): the same schedule and prefills (the prefix into
        the last slot, and into each request's own slot before the rest), nothing shared:
        the unshared run whose tokens a shared one must equal bit for bit (a whole-prompt
        prefill rounds differently from a prefix and a rest, in bfloat16 on a GPU).

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
        if not isinstance(share, (bool, np.bool_)):
            raise TypeError(f"share must be True or False, got {share!r}")
        if not share and not shared_prefix:
            raise ValueError("share=False goes with shared_prefix=N (the prefix not to share)")
        if prefix_tokens is not None and share and pause_every is not None:
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
        loop = ServingLoop(
            self,
            requests,
            host_mode=host_mode,
            record_logits=record_logits,
            progress=progress,
            force_tokens=force_tokens,
            select_token=select_token,
            pause_every=pause_every,
            pause=pause,
            shared_prefix=shared_prefix,
            prefix_tokens=prefix_tokens,
            share=bool(share),
            ensure_blocks=ENSURE_BLOCKS,
            wait_slice=WAIT_SLICE,
        )
        t_start = time.perf_counter()
        try:
            loop.serve_all()
        except BaseException:
            # The slots' memory goes back (shared prefix last), so the cache is as
            # before the run: a failed commit, a failing pause() or Ctrl-C leaves nothing
            # held or shared for the next run to trip over.
            _give_back_slots(cache, loop.in_flight(), range(loop.batch))
            raise
        return loop.finish(t_start)


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
