"""The host's serving loop of one `Generator.run`: free slots take queued requests (their
prompts' memory committed in the background, then prefilled), decode blocks are
dispatched over the live slots, each block's tokens read once the next is dispatched,
finished sequences released; with the run's trace, counts and cache-call timings.

`jax_vmm.serving.engine.Generator.run` checks the arguments, compiles the programs, builds
a `ServingLoop` and runs it; on failure it gives the slots back (`in_flight`).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from . import model as M
from . import steps as S
from .cache import CacheBackend
from .run_data import Request, Result, RunReport, StepRecord, _is_token_id


class _Generator(Protocol):
    """What the loop uses of `engine.Generator` (a Protocol: engine imports this module)."""

    params: M.Params
    cfg: M.ModelConfig
    cache: CacheBackend
    block: int
    stop_tokens: tuple[int, ...]
    keep_slot_memory: bool
    compile_seconds: float
    # (state, stops, seq, tokens, start, new) -> (logits, first, state, calls dispatched)
    _prefill: Callable[..., tuple[jax.Array, jax.Array, S.DecodeState, int]]
    _block_fn: Callable[..., Callable]  # (steps, stops, logits, args) -> the block program


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


class ServingLoop:
    """One run of a Generator over its requests (checked by `Generator.run`, programs
    compiled): `serve_all` serves them, `finish` reports. Built per run and used once.
    Not thread-safe: the thread that calls `Generator.run` drives it (the cache's
    background commits are the cache's own)."""

    def __init__(
        self,
        generator: _Generator,
        requests: list[Request],
        *,
        host_mode: bool,
        record_logits: bool,
        progress: Callable[[int], None] | None,
        force_tokens: dict[int, list[int]] | None,
        select_token: Callable[[int, np.ndarray], int] | None,
        pause_every: int | None,
        pause: Callable[[], None] | None,
        shared_prefix: int,
        prefix_tokens: np.ndarray | None,
        share: bool,
        ensure_blocks: int,
        wait_slice: float,
    ) -> None:
        self.generator, self.cache, self.requests = generator, generator.cache, requests
        self.host_mode, self.record_logits, self.progress = host_mode, record_logits, progress
        self.force_tokens, self.select_token = force_tokens, select_token
        self.pause_every, self.pause = pause_every, pause
        self.shared_prefix, self.prefix_tokens = shared_prefix, prefix_tokens
        # share=False: the same prefills, each request's prefix in its own memory.
        self.sharing = bool(shared_prefix) and share
        self.ensure_blocks, self.wait_slice = ensure_blocks, wait_slice
        self.block_steps = 1 if host_mode else generator.block  # decode steps per block call
        self.stops = () if host_mode else generator.stop_tokens
        self.want_logits = record_logits or host_mode
        self.host_stops = set(generator.stop_tokens) if host_mode else set()
        self.token_bytes = self.cache.token_bytes
        self.batch = batch = self.cache.max_seqs
        self.queue = collections.deque(requests)
        self.slots: list[_Slot | None] = [None] * batch
        self.results: dict[int, Result] = {}
        self.trace: list[StepRecord] = []
        self.pending: collections.deque[_Read] = collections.deque()
        self.counts = collections.Counter()
        self.wait_seconds = self.idle_seconds = 0.0
        self.held: set[int] = set()  # finished, memory kept for the request that takes the slot
        self.followed = {r.follows for r in requests if r.follows is not None}
        # Finished turns whose next turn is queued: request id -> (slot, conversation).
        self.turns: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.calls: dict[str, tuple[int, float, float]] = {}
        self.state = S.idle_state(batch)
        # The shared prefix: prefilled once into the last slot (one token asked, so the
        # slot stays idle), which then only lends its memory. share=False keeps that slot
        # too, so that both runs serve the same requests side by side in every step and
        # only the memory under each request's prefix differs.
        self.serving = batch - 1 if shared_prefix else batch
        self.prefix_seq = batch - 1

    def timed(self, fn: Callable, *args, name: str | None = None) -> None:
        t0 = time.perf_counter()
        fn(*args)
        dt = time.perf_counter() - t0
        key = name or fn.__name__
        n_calls, total, longest = self.calls.get(key, (0, 0.0, 0.0))
        self.calls[key] = (n_calls + 1, total + dt, max(longest, dt))

    def record(self, kind: str) -> None:
        slots, shared_prefix = self.slots, self.shared_prefix if self.sharing else 0
        live = sum(s.cached_after(s.blocks, self.block_steps) for s in slots if s is not None)
        active = sum(s is not None for s in slots)
        # The prefix slot holds the prefix from its prefill to the end; every request
        # maps it (kv.share_prefix) rather than holding a copy.
        held = live - (active - (kind != "end")) * shared_prefix if shared_prefix else live
        self.trace.append(
            StepRecord(
                kind,
                self.cache.backed_bytes(),
                live * self.token_bytes,
                active,
                held * self.token_bytes,
            )
        )

    def retire(self, seq: int) -> None:
        # Called once the call that ended the sequence has been read, so has run: a
        # release changes the table kernels check when they run, and a block still
        # queued would drop its last writes. With keep_slot_memory, when a request
        # will take the slot, the release waits for it (admit): the memory its prompt
        # needs then stays backed instead of going back and being committed again.
        # Otherwise it goes back now (without waiting for the device). A turn whose
        # next turn is queued keeps its slot and cache for it. A slot shared into
        # must hold nothing before the share (kv.share_prefix): it keeps no memory.
        slots = self.slots
        slot = slots[seq]
        if slot.request.id in self.followed:
            self.turns[slot.request.id] = (seq, slot.context())
        elif (
            not self.sharing
            and self.generator.keep_slot_memory
            # next turns run in their parent's slot: only first turns take a free one
            and sum(r.follows is None for r in self.queue) > sum(s is None for s in slots)
        ):
            self.held.add(seq)
        else:
            self.timed(self.cache.release, seq)
        slots[seq] = None

    def emit(self, slot: _Slot, token: int, logits: np.ndarray | None) -> bool:
        """Takes one generated token; True when the request is complete."""
        res = slot.result
        res.greedy.append(token)
        if self.force_tokens is not None:
            token = int(self.force_tokens[slot.request.id][len(res.tokens)])
        elif self.select_token is not None:
            chosen = self.select_token(slot.request.id, logits)
            vocab = self.generator.cfg.vocab
            if not _is_token_id(chosen, vocab):
                raise ValueError(
                    f"select_token returned {chosen!r} for request {slot.request.id} at "
                    f"its token {len(res.tokens)}: expected a token id of the model's "
                    f"[0, {vocab})"
                )
            token = int(chosen)
        res.tokens.append(token)
        if self.record_logits:
            res.logits.append(logits)
        slot.feed = token
        self.counts["generated"] += 1
        return (
            len(res.tokens) == slot.request.max_new_tokens
            or token in self.host_stops
            or (not self.host_mode and token in self.generator.stop_tokens)
        )

    def read(self, item: _Read) -> None:
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
            if self.emit(slot, token, lg):
                seq = next((q for q, s in enumerate(self.slots) if s is slot), None)
                if seq is not None:
                    self.retire(seq)
        if self.progress is not None and steps:
            self.progress(len(steps))

    def device_idle(self) -> bool:
        # The newest dispatched call done: nothing is left queued on the device.
        return not self.pending or self.pending[-1].tokens.is_ready()

    def wait_for_memory(self, seq: int) -> None:
        # The prompt's memory is committed on the cache's background thread; the
        # device meanwhile runs the prefills and blocks dispatched before.
        t0 = time.perf_counter()
        while True:
            done = self.cache.wait_prefetch(seq, self.wait_slice)
            t1 = time.perf_counter()
            if self.device_idle():
                self.idle_seconds += t1 - t0
            self.wait_seconds += t1 - t0
            t0 = t1
            if done:
                return

    def take_requests(self) -> list[tuple[int, Request, tuple[int, ...]]]:
        """(slot, request, earlier turns) for every queued request that can start:
        in queue order, a next turn in its finished parent's slot, others in free
        slots (not one kept for a next turn)."""
        queue, turns = self.queue, self.turns
        kept = {seq for seq, _ in turns.values()}
        free = [seq for seq in range(self.serving) if self.slots[seq] is None and seq not in kept]
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

    def admit_free_slots(self) -> None:
        cache = self.cache
        taken = self.take_requests()
        for seq, req, prefix in taken:  # every prompt's memory, in the background
            if seq in self.held:  # the slot keeps the chunks of the new prompt
                self.held.discard(seq)
                self.timed(
                    lambda: cache.release(seq, keep_tokens=len(req.prompt)),
                    name="release(keep_tokens)",
                )
            if not (self.sharing and not prefix):  # a slot shared into holds nothing
                self.timed(cache.prefetch, seq, len(prefix) + len(req.prompt))
        for seq, req, prefix in taken:
            self.wait_for_memory(seq)
            self.admit(seq, req, prefix)

    def admit(self, seq: int, req: Request, prefix: tuple[int, ...]) -> None:
        cache, shared_prefix = self.cache, self.shared_prefix
        slot = _Slot(
            req, self.results.setdefault(req.id, Result(req.id, len(req.prompt))), prefix=prefix
        )
        if prefix:  # a next turn: cached, the earlier turns but their last token
            start = len(prefix) - 1
            new = prefix[start:] + tuple(int(t) for t in req.prompt)
        elif shared_prefix:
            if self.sharing:
                self.timed(cache.share_prefix, self.prefix_seq, seq, shared_prefix)
            start, new = shared_prefix, req.prompt[shared_prefix:]
        else:
            start, new = 0, req.prompt
        self.timed(cache.ensure, seq, slot.prompt_len)
        slot.ensured = slot.prompt_len
        self.slots[seq] = slot
        if shared_prefix and not prefix and not self.sharing:
            self.prefill_prefix(seq)  # the prefix slot's prefill, in this slot's memory
        logits, first, self.state, dispatched = self.generator._prefill(
            self.state, self.stops, seq, np.asarray(new, np.int32), start, req.max_new_tokens
        )
        self.counts["prefills"] += dispatched
        cols: list[_Slot | None] = [None] * self.batch
        cols[seq] = slot
        self.pending.append(_Read(cols, first, logits if self.want_logits else None))
        self.record("prefill")

    def prefill_prefix(self, seq: int) -> None:
        """The shared prefix's prefill into slot ``seq`` (one token asked: the slot's
        request, if any, is started by the prefill of the rest that follows)."""
        _, _, self.state, dispatched = self.generator._prefill(
            self.state, self.stops, seq, self.prefix_tokens, 0, 1
        )
        self.counts["prefills"] += dispatched

    def serve_all(self) -> None:
        cache, slots, pending, counts = self.cache, self.slots, self.pending, self.counts
        host_mode, n, batch = self.host_mode, self.block_steps, self.batch
        if self.shared_prefix:
            ensure = cache.ensure_shareable if self.sharing else cache.ensure
            self.timed(ensure, self.prefix_seq, self.shared_prefix)
            self.prefill_prefix(self.prefix_seq)
            self.record("prefill")
        while self.queue or any(slots) or pending:
            self.admit_free_slots()  # continuous batching: free slots take requests
            if host_mode:
                while pending:  # every token is a host decision: read before going on
                    self.read(pending.popleft())
                if not any(slots):
                    continue
            elif not any(slots):
                while pending:
                    self.read(pending.popleft())
                continue
            control = np.full(batch, S.STOP, np.int32)
            live = [(seq, s) for seq, s in enumerate(slots) if s is not None]
            for seq, s in live:
                control[seq] = s.feed if host_mode else S.KEEP
            # What the block can write, ensured ENSURE_BLOCKS (engine) blocks at a time: one
            # table update (a driver copy) serves that many blocks.
            if any(s.cached_after(s.blocks + 1, n) > s.ensured for _, s in live):
                need = np.zeros(batch, np.int64)
                for seq, s in live:
                    s.ensured = max(s.ensured, s.cached_after(s.blocks + self.ensure_blocks, n))
                    need[seq] = s.ensured
                self.timed(cache.ensure_all, need)
            args = (self.generator.params, cache.cache(), self.state, jnp.asarray(control))
            tokens, logits, out, self.state = self.generator._block_fn(
                n, self.stops, self.want_logits, args
            )(*args)
            cache.update(out)
            counts["blocks"] += 1
            pending.append(_Read(list(slots), tokens, logits if self.want_logits else None))
            for s in slots:
                if s is not None:
                    s.blocks += 1
            self.record("decode")
            # Double buffering: read everything but the block just dispatched.
            while len(pending) > (0 if host_mode else 1):
                self.read(pending.popleft())
            if self.pause_every is not None and counts["blocks"] % self.pause_every == 0:
                while pending:
                    self.read(pending.popleft())
                jax.block_until_ready(self.state)
                self.pause()
                counts["pauses"] += 1
        for seq in sorted(self.held):  # no request took it after all
            self.timed(cache.release, seq)
        if self.shared_prefix:
            self.timed(cache.release, self.prefix_seq)

    def in_flight(self) -> list:
        """The outputs of the calls dispatched and not read yet, the decode state last:
        what a failed run waits for before it gives the slots back."""
        return [*(r.tokens for r in self.pending), self.state]

    def finish(self, t_start: float) -> RunReport:
        """The last trace record, the cache checked, and the run's report (its wall time
        from `t_start`, taken just before `serve_all`)."""
        self.record("end")
        seconds = time.perf_counter() - t_start
        self.cache.check()  # no write was dropped (every token was ensured before its step)
        counts, n = self.counts, self.block_steps
        return RunReport(
            results=[self.results[r.id] for r in self.requests],
            trace=self.trace,
            seconds=seconds,
            compile_seconds=self.generator.compile_seconds,
            generated_tokens=counts["generated"],
            decode_steps=counts["blocks"] * n,
            prefills=counts["prefills"],
            ensure_seconds=sum(total for _, total, _ in self.calls.values()),
            blocks=counts["blocks"],
            block=n,
            pauses=counts["pauses"],
            memory_wait_seconds=self.wait_seconds,
            memory_wait_idle_seconds=self.idle_seconds,
            host_calls=self.calls,
        )
