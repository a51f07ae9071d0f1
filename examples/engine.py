"""Continuous-batching greedy generation over a KV cache backend.

`Generator` owns the compiled steps (prefill per prompt-length bucket, one decode step,
cache donated in both); `Generator.run` serves a list of requests with `max_seqs` slots:
a finished sequence releases its memory and its slot takes the next request. The
schedule depends only on the requests (fixed prompt and generation lengths, no EOS), so
two backends given the same requests run exactly the same steps.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from examples import model as M
from examples.cache import CacheBackend


@dataclasses.dataclass(frozen=True)
class Request:
    id: int
    prompt: np.ndarray  # int32 (L,), L >= 1
    max_new_tokens: int  # >= 1; the first comes from prefill


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
    """Memory after one engine step (a prefill or a decode step), finished sequences
    already released."""

    kind: str  # "prefill" | "decode"
    backed_bytes: int  # physical KV memory held by the backend
    live_bytes: int  # bytes of the tokens actually cached
    active: int  # sequences in flight


@dataclasses.dataclass
class RunReport:
    results: list[Result]
    trace: list[StepRecord]
    seconds: float  # wall time of the serving loop (compile excluded)
    compile_seconds: float
    generated_tokens: int
    decode_steps: int
    prefills: int
    ensure_seconds: float  # host time spent in cache.ensure/release


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


@dataclasses.dataclass
class _Slot:
    request: Request
    result: Result
    position: int  # position of the next input token (= tokens cached)
    last_token: int


class Generator:
    """Compiled prefill/decode steps for one model, cache backend and attention choice.
    Not thread-safe."""

    def __init__(
        self, params: M.Params, cfg: M.ModelConfig, cache: CacheBackend, attend: M.AttendFn
    ) -> None:
        self.params, self.cfg, self.cache = params, cfg, cache
        # The cache (a jax_vmm.KVCache) is donated: an array cache is updated in place where
        # XLA can; an arena cache carries only tokens (the arena is written in place anyway).
        self._decode = jax.jit(
            functools.partial(M.decode_step, cfg=cfg, write=cache.write, attend=attend),
            donate_argnums=(1,),
        )
        self._prefill = jax.jit(
            functools.partial(M.prefill, cfg=cfg, write=cache.write), donate_argnums=(1,)
        )
        self._compiled: dict[tuple, Callable] = {}
        self.compile_seconds = 0.0

    def _get(self, key: tuple, fn: Callable, *args: object) -> Callable:
        # AOT compile so serving time excludes compilation (reported separately).
        if key not in self._compiled:
            t0 = time.perf_counter()
            self._compiled[key] = fn.lower(*args).compile()
            self.compile_seconds += time.perf_counter() - t0
        return self._compiled[key]

    def decode(self, tokens: np.ndarray, positions: np.ndarray) -> tuple[jax.Array, jax.Array]:
        """One decode step over all slots (positions -1 = idle). Returns (logits, next)."""
        args = (
            self.params,
            self.cache.cache(),
            jnp.asarray(tokens, jnp.int32),
            jnp.asarray(positions, jnp.int32),
        )
        fn = self._get(("decode",), self._decode, *args)
        logits, nxt, out = fn(*args)
        self.cache.update(out)
        return logits, nxt

    def prefill(self, seq: int, prompt: np.ndarray) -> jax.Array:
        """Prefills one prompt into slot `seq`. Returns the last token's logits."""
        bucket = prompt_bucket(len(prompt))
        padded = np.zeros(bucket, np.int32)
        padded[: len(prompt)] = prompt
        args = (
            self.params,
            self.cache.cache(),
            jnp.asarray(padded),
            jnp.int32(len(prompt)),
            jnp.int32(seq),
        )
        fn = self._get(("prefill", bucket), self._prefill, *args)
        logits, out = fn(*args)
        self.cache.update(out)
        return logits

    def decode_temp_bytes(self) -> int:
        """XLA temp memory of the compiled decode step (-1 where XLA does not say)."""
        try:
            return int(self._compiled[("decode",)].memory_analysis().temp_size_in_bytes)
        except Exception:  # memory_analysis is best effort on some backends
            return -1

    def precompile(self, requests: list[Request]) -> None:
        """Compiles every step `run` will need, without running any."""
        b = self.cache.max_seqs
        z = np.zeros(b, np.int32)
        args = (self.params, self.cache.cache(), jnp.asarray(z), jnp.asarray(z))
        self._get(("decode",), self._decode, *args)
        for bucket in sorted({prompt_bucket(len(r.prompt)) for r in requests}):
            args = (
                self.params,
                self.cache.cache(),
                jnp.zeros(bucket, jnp.int32),
                jnp.int32(1),
                jnp.int32(0),
            )
            self._get(("prefill", bucket), self._prefill, *args)

    def run(
        self,
        requests: list[Request],
        *,
        record_logits: bool = False,
        progress: Callable[[int], None] | None = None,
        force_tokens: dict[int, list[int]] | None = None,
        select_token: Callable[[int, np.ndarray], int] | None = None,
    ) -> RunReport:
        """Serves all requests with continuous batching; greedy sampling.

        force_tokens (request id -> tokens): feed these back instead of the greedy ones
        (teacher forcing), so that two runs compare logits at every step even after a
        near-tie; ``Result.greedy`` still records each step's argmax.
        select_token(request id, logits (vocab,) fp32) -> token: choose each fed-back
        token on the host instead (sampling); every step's logits then come to the host."""
        cache, max_tokens = self.cache, self.cache.max_tokens
        for r in requests:
            need = len(r.prompt) + r.max_new_tokens - 1
            if len(r.prompt) < 1 or r.max_new_tokens < 1 or need > max_tokens:
                raise ValueError(
                    f"request {r.id}: prompt {len(r.prompt)} + {r.max_new_tokens} new tokens "
                    f"needs {need} cached tokens; the cache holds 1..{max_tokens} per sequence"
                )
        self.precompile(requests)
        bpt = self.cfg.kv_bytes_per_token
        host_logits_needed = record_logits or select_token is not None
        queue = collections.deque(requests)
        slots: list[_Slot | None] = [None] * cache.max_seqs
        results: dict[int, Result] = {}
        trace: list[StepRecord] = []
        host_seconds = 0.0
        decode_steps = prefills = generated = 0

        def record(kind: str) -> None:
            live = sum(s.position for s in slots if s is not None)
            trace.append(
                StepRecord(
                    kind, cache.backed_bytes(), live * bpt, sum(s is not None for s in slots)
                )
            )

        def emit(seq: int, token: int, logits: np.ndarray | None) -> None:
            nonlocal generated, host_seconds
            s = slots[seq]
            s.result.greedy.append(token)
            if force_tokens is not None:
                token = int(force_tokens[s.request.id][len(s.result.tokens)])
            elif select_token is not None:
                token = int(select_token(s.request.id, logits))
            s.result.tokens.append(token)
            if record_logits:
                s.result.logits.append(logits)
            s.last_token = token
            generated += 1
            if progress is not None:
                progress(1)
            if len(s.result.tokens) == s.request.max_new_tokens:
                t0 = time.perf_counter()
                cache.release(seq)  # finished: give its memory back now
                host_seconds += time.perf_counter() - t0
                slots[seq] = None

        t_start = time.perf_counter()
        while queue or any(slots):
            # Continuous batching: every free slot takes the next waiting request.
            for seq in range(cache.max_seqs):
                while slots[seq] is None and queue:
                    req = queue.popleft()
                    res = results[req.id] = Result(req.id, len(req.prompt))
                    t0 = time.perf_counter()
                    cache.ensure(seq, len(req.prompt))
                    host_seconds += time.perf_counter() - t0
                    slots[seq] = _Slot(req, res, len(req.prompt), -1)
                    logits = self.prefill(seq, req.prompt)
                    host_logits = np.asarray(logits)
                    prefills += 1
                    emit(
                        seq,
                        int(np.argmax(host_logits)),
                        host_logits if host_logits_needed else None,
                    )
                    record("prefill")
            if not any(slots):
                continue
            tokens = np.zeros(cache.max_seqs, np.int32)
            positions = np.full(cache.max_seqs, -1, np.int32)
            t0 = time.perf_counter()
            for seq, s in enumerate(slots):
                if s is not None:
                    cache.ensure(seq, s.position + 1)  # commit before the step writes
                    tokens[seq], positions[seq] = s.last_token, s.position
            host_seconds += time.perf_counter() - t0
            logits, nxt = self.decode(tokens, positions)
            nxt = np.asarray(nxt)
            host_logits = np.asarray(logits) if host_logits_needed else None
            decode_steps += 1
            for seq in range(cache.max_seqs):
                if slots[seq] is not None:
                    slots[seq].position += 1
            for seq in range(cache.max_seqs):
                if slots[seq] is not None:
                    emit(seq, int(nxt[seq]), host_logits[seq] if host_logits is not None else None)
            record("decode")
        seconds = time.perf_counter() - t_start
        cache.check()  # no write was dropped (every token was committed before its step)
        return RunReport(
            results=[results[r.id] for r in requests],
            trace=trace,
            seconds=seconds,
            compile_seconds=self.compile_seconds,
            generated_tokens=generated,
            decode_steps=decode_steps,
            prefills=prefills,
            ensure_seconds=host_seconds,
        )
