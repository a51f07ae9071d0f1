"""How a KV arena backs its sequences' tokens: ``ensure`` / ``ensure_all`` / ``prefetch`` /
``shrink`` / ``release``, the byte ranges each needs, the commit-ahead hook and the all-or-nothing
rollback that a sharded cache uses across devices.

A chunk that two sequences share gets a commit range of its own, so that no physical
allocation holds memory of two sequences and a release frees all of a sequence's memory.
The device-side table of ensured tokens is published after the memory on growth and
before it goes on release: a kernel may write only what the table admits.

:class:`TokenBacking` is a mixin of :class:`jax_vmm.KVArena` (``jax_vmm/kv/arena.py``), which
owns the state it works on: ``arena``, ``buffers``, the geometry (``max_seqs``, ``max_tokens``,
``seq_bytes``, ``token_bytes``), ``_lock`` (held around every change below), the
per-sequence tables ``_ensured`` (tokens the kernels may touch), ``_covered`` (tokens
within chunks known backed), ``_valid_gen`` (the arena generation ``_covered`` is valid
for), ``_epoch`` (bumped on release: a commit ahead that started before is not counted),
``_offloaded``, and the commit-ahead worker ``_ahead`` with its counters.
"""

from __future__ import annotations

import dataclasses
import numbers
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..base.args import as_flag, as_index
from ..base.errors import ArenaAsleepError
from ..base.loader import core as _core
from ..cache import read_epochs
from ..memory import host_wait

# cuDNN's attention reads keys and values in whole tiles counted from each sequence's
# start and masks what lies past its length, so it touches up to the next multiple of a
# tile. Where a chunk holds fewer tokens than that (the interleaved layout: 64 per 2 MiB
# on the gpu preset), the last tile crosses into the next chunk. On a CUDA arena that
# chunk is unsafe to read until the arena hands out a view: with zeros deferred it is
# unmapped (a read faults; probed on an H100 by tools/gpu/cudnn_deferred_zeros_probe.py:
# 64-token chunks faulted, 128 and 1024 never), and with eager zeros a commit swaps its
# zero piece for memory without waiting for the device (only a view makes commits wait),
# so a read in flight could meet the address unmapped mid-swap.
READ_TILE_TOKENS = 128  # kReadTileTokens in ffi/src/ops/attention/cudnn/cudnn_rows.h


def tile_end(tokens: Any, tile: int, max_tokens: int | None = None) -> Any:
    """``tokens`` (an int or an array) rounded up to a multiple of ``tile``, at most
    ``max_tokens``: where a reader of whole tiles stops."""
    end = -(-tokens // tile) * tile
    return end if max_tokens is None else np.minimum(end, max_tokens)


class TokenBacking:
    def _tile_tail_unsafe(self) -> bool:
        """Whether a read past a sequence's backed chunks may fault: a CUDA arena that
        has not handed out a view (zeros deferred, or eager zeros that a view-free commit
        swaps without a device wait; docs/design.md "Zero reads"). The host's unbacked
        pages read zeros and its commits swap them atomically."""
        handle = self.arena._handle
        return handle.driver_kind == "cuda" and not handle.views_exported

    def _read_ends(self, tokens: np.ndarray) -> np.ndarray:
        """Per sequence, the tokens from its start that a reader of its first ``tokens``
        may touch, so the chunks that ``ensure`` backs: ``tokens`` rounded up to a
        :data:`READ_TILE_TOKENS` tile (at most ``max_tokens``) while such a read may fault
        (:meth:`_tile_tail_unsafe`), else ``tokens`` itself."""
        if not self._tile_tail_unsafe():
            return tokens
        return tile_end(tokens, READ_TILE_TOKENS, self.max_tokens)

    def _read_end(self, num_tokens: int) -> int:
        """:meth:`_read_ends` of one sequence's token count."""
        return int(self._read_ends(num_tokens))

    def _check_tokens(self, n: Any, op: str, name: str = "num_tokens", minimum: int = 0) -> int:
        n = as_index(n, f"{op}: {name}", minimum)
        if n > self.max_tokens:
            raise ValueError(f"{op}: {name}={n} exceeds max_tokens={self.max_tokens}")
        return n

    def _check_keep_tokens(self, keep_tokens: Any, op: str) -> int:
        """``release(keep_tokens=)`` validated: an int in [0, max_tokens], and 0 on a
        zero-filling arena (kept bytes would not read as zeros)."""
        keep = self._check_tokens(keep_tokens, op, "keep_tokens")
        if keep and self.arena.zero_fill:
            raise ValueError(
                f"{op}: keep_tokens keeps the old sequence's bytes, but this arena "
                "zero-fills (unwritten tokens must read as zeros); release without "
                "keep_tokens, or create the arena with zero_fill=False"
            )
        return keep

    def _commit_ranges(self, q: int, num_tokens: int) -> list[tuple[int, int]]:
        """Byte ranges (inside each buffer) that back tokens [0, num_tokens) of sequence
        q. A chunk that the sequence shares with a neighbour gets a range of its own, so
        that no allocation holds memory of two sequences (releasing one then frees all of
        its own memory)."""
        c = self.arena.chunk_bytes
        base = q * self.seq_bytes
        stop = base + num_tokens * self.token_bytes
        cuts = {base, stop}
        if self.max_seqs is not None:
            if base % c:
                cuts.add(-(-base // c) * c)
            end = base + self.seq_bytes
            if end % c:
                cuts.add(end // c * c)
        points = sorted(x for x in cuts if base <= x <= stop)
        return list(zip(points, points[1:]))

    def _covered_tokens(self, q: int, num_tokens: int) -> int:
        """Tokens of sequence q backed once tokens [0, num_tokens) are: whole chunks."""
        c = self.arena.chunk_bytes
        base = q * self.seq_bytes
        end = min(-(-(base + num_tokens * self.token_bytes) // c) * c, base + self.seq_bytes)
        return (end - base) // self.token_bytes

    def _settle(self, q: int) -> None:
        """Raise if sequence q is away (offloaded, or its transfer in flight); forget a
        transfer that has ended (restored, or a failed offload: the tokens stayed)."""
        t = self._offloaded.get(q)
        if t is None:
            return
        state = t.state
        if state in ("restored", "failed"):
            del self._offloaded[q]
            t._finish()
            self._publish_limits()  # back: the table admits its ensured tokens again
            return
        arg = "" if self.max_seqs is None else str(q)
        raise ValueError(
            f"sequence {q} is {state} (kv.offload); call kv.restore({arg}) and wait "
            "for it before growing, writing or reading it"
        )

    def ensure(self, num_tokens: int, seq: int | None = None) -> int:
        """Back the first ``num_tokens`` tokens (of sequence ``seq``) in every layer, all
        or nothing. Returns the bytes newly committed (0 when already backed). Within the
        chunks an earlier call backed it returns at once; otherwise it never waits for the
        device unless the arena has handed out raw views (``kv.k[l]``)."""
        num_tokens = self._check_tokens(num_tokens, "KVArena.ensure")
        self._seq_base(seq, "KVArena.ensure")
        if num_tokens == 0:
            return 0
        q = 0 if seq is None else int(seq)
        with self._lock:
            if self._offloaded:
                self._settle(q)
            read_end = self._read_end(num_tokens)
            if read_end <= self._covered[q] and self._valid_gen[q] == self.arena._generation:
                if num_tokens > self._ensured[q]:
                    self._outlive_old_writes([q])
                    self._zero_stale_rows([(q, int(self._ensured[q]), num_tokens)])
                    self._ensured[q] = num_tokens
                    self._core_cache.set_limit(q, num_tokens)  # the memory is there already
                self._maybe_ahead(q, num_tokens)
                return 0
            before = int(self._ensured[q])
            added = self._commit_seqs([(q, num_tokens)])
            self._outlive_old_writes([q])
            self._zero_stale_rows([(q, before, int(self._ensured[q]))])
            # Published after the memory: the kernels may write what the table admits.
            self._core_cache.set_limit(q, int(self._ensured[q]))
            self._maybe_ahead(q, num_tokens)
            return added

    def ensure_all(self, num_tokens: Sequence[int]) -> int:
        """:meth:`ensure` for every sequence at once: ``num_tokens[q]`` tokens of sequence
        ``q`` (a list or NumPy array of ints, one per sequence; 0 asks for nothing), in one
        all-or-nothing commit. The cheap way to grow a batch each decode step: sequences
        within their backed chunks cost no driver call, and the whole call makes one copy
        of the device table (none when nothing grew)."""
        tokens = self._token_array(num_tokens)
        with self._lock:
            self.arena._check_open("KVArena.ensure_all")
            for q in list(self._offloaded):
                if tokens[q] > 0:
                    self._settle(q)
            need = _core.ensure_need(
                self._read_ends(tokens), self._covered, self._valid_gen, self.arena._generation
            )
            # The memory first, then the table (kernels may write what it admits); a failed
            # commit leaves both as they were.
            grown = np.flatnonzero(tokens > self._ensured).tolist() if self._old_work else []
            before = self._ensured.copy()
            added = self._commit_seqs([(q, int(tokens[q])) for q in need]) if need else 0
            self._outlive_old_writes(grown)
            if self.arena.zero_fill:  # (the list costs a pass over the sequences)
                self._zero_stale_rows(
                    [(q, int(before[q]), int(tokens[q])) for q in np.flatnonzero(tokens > before)]
                )
            np.maximum(self._ensured, tokens, out=self._ensured)
            self._core_cache.raise_limits(tokens)
            if self.commit_ahead_tokens:
                due = _core.ahead_due(
                    tokens,
                    self._covered,
                    self._ahead_blocked,
                    self.commit_ahead_tokens,
                    self.max_tokens,
                )
                for q in due:
                    self._ahead.schedule(
                        q, self._covered_tokens(q, int(self._covered[q]) + 1), self._epoch[q]
                    )
            return added

    def prefetch(self, num_tokens: int, seq: int | None = None) -> None:
        """Back the first ``num_tokens`` tokens (of sequence ``seq``) in the background, on
        the commit-ahead thread, and return at once; once that is done (:meth:`is_backed`,
        :meth:`wait_prefetch`), ``ensure`` makes no driver call for them. The way to take
        an admission's commit off the thread that dispatches device work: prefetch the
        next prompts, dispatch what is ready, ensure the next one when it is backed.

        It changes nothing a kernel may touch: the tokens are not ensured (the device
        table), so writes to them are dropped until ``ensure``. A prefetch that cannot be
        done (out of memory, raw views handed out, the sequence released meanwhile) is
        dropped; the ``ensure`` that follows then commits on its own thread, or raises."""
        num_tokens = self._check_tokens(num_tokens, "KVArena.prefetch")
        self._seq_base(seq, "KVArena.prefetch")
        q = 0 if seq is None else int(seq)
        with self._lock:
            self.arena._check_open("KVArena.prefetch")
            if self._offloaded:
                self._settle(q)
            if num_tokens == 0 or self._backed_already(np.int64(num_tokens), q):
                return
            if self._valid_gen[q] != self.arena._generation:
                # Nothing known backed yet: a true statement for this generation, and what
                # lets the worker count what it backs.
                self._covered[q], self._valid_gen[q] = 0, self.arena._generation
            self._ahead.schedule(
                q, self._covered_tokens(q, self._read_end(num_tokens)), self._epoch[q]
            )

    def is_backed(self, num_tokens: int, seq: int | None = None) -> bool:
        """Would ``ensure(num_tokens, seq)`` now return without a driver call (the chunks
        of those tokens known backed)?"""
        num_tokens = self._check_tokens(num_tokens, "KVArena.is_backed")
        self._seq_base(seq, "KVArena.is_backed")
        q = 0 if seq is None else int(seq)
        with self._lock:
            return bool(num_tokens == 0 or self._backed_already(np.int64(num_tokens), q))

    def wait_prefetch(self, seq: int | None = None, timeout: float | None = None) -> bool:
        """Wait until no background commit (:meth:`prefetch`, commit ahead) is scheduled or
        running for sequence ``seq``. Returns False if ``timeout`` seconds passed first.
        It does not say that the tokens are backed (a prefetch can be dropped):
        :meth:`is_backed` does."""
        self._seq_base(seq, "KVArena.wait_prefetch")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
        ):
            raise TypeError(
                "KVArena.wait_prefetch: timeout must be a number of seconds or None, got "
                f"{type(timeout).__name__}"
            )
        if timeout is not None and timeout == float("inf"):
            timeout = None  # wait as long as it takes (threading takes no infinite timeout)
        if timeout is not None and not timeout >= 0:
            raise ValueError(
                f"KVArena.wait_prefetch: timeout must be seconds >= 0 or None, got {timeout!r}"
            )
        return self._ahead.wait_for(0 if seq is None else int(seq), timeout)

    def _backed_already(self, tokens: np.ndarray, seqs: Any = slice(None)) -> np.ndarray:
        """Per sequence (of ``seqs``): are its first ``tokens`` tokens within chunks an
        earlier ensure backed (so ensuring them makes no call into the core)? Caller
        holds the lock."""
        gen = self.arena._generation
        return (self._read_ends(tokens) <= self._covered[seqs]) & (self._valid_gen[seqs] == gen)

    def _ensure_point(self, asks: dict[int, int]) -> _EnsurePoint:
        """What :meth:`_roll_back` needs to undo ensures that succeed after this call (a
        sharded cache's commit that failed on another device): ``asks`` maps each sequence
        that may commit to the tokens it asks for. Caller holds the lock until the roll
        back, if any, is done."""
        spans = {}
        for q, tokens in asks.items():
            base = q * self.seq_bytes
            prefix = min(b.backed_prefix(base, base + self.seq_bytes) for b in self.buffers)
            spans[q] = (prefix, self._read_end(tokens) * self.token_bytes)
        return _EnsurePoint(
            self._ensured.copy(), self._covered.copy(), self._valid_gen.copy(), spans
        )

    def _roll_back(self, point: _EnsurePoint) -> None:
        """Undo the ensures since ``point``: the table and the bookkeeping as they were, and
        the chunks the asked tokens needed past what was backed from each sequence's start
        given back (a chunk a neighbouring sequence holds tokens in stays)."""
        with self._lock:
            self._ensured[:] = point.ensured
            self._publish_limits()  # the table first
            self._covered[:] = point.covered
            self._valid_gen[:] = point.valid_gen
            ranges = []
            for q, (prefix, asked) in point.spans.items():
                self._epoch[q] += 1  # a commit ahead on its way is not counted for q
                if asked <= prefix:
                    continue
                base = q * self.seq_bytes
                ranges += self._release_ranges(
                    base + prefix, base + asked, q, keep_before=prefix > 0
                )
            if ranges:
                self.arena._wait_for_host_work()
                self.arena._handle.decommit_ranges(ranges, False)

    def _publish_limits(
        self, asleep: bool | None = None, ensured: np.ndarray | None = None
    ) -> None:
        """Publish the device table of ensured tokens (``ensured``, default the arena's
        record): 0 for a sequence that is away (offloaded, or restored but not yet settled)
        and for every sequence while the arena sleeps (``asleep``: the state to publish
        for, default the arena's), so the kernels drop (and count) writes to their memory
        and clamp (and count) reads of it instead of reading zeros or a neighbour's chunk.
        Caller holds the lock."""
        asleep = self.arena.asleep if asleep is None else asleep
        ensured = self._ensured if ensured is None else ensured
        visible = np.zeros_like(ensured) if asleep else ensured.copy()
        for q in self._offloaded:
            visible[q] = 0
        self._core_cache.set_limits(visible.tolist())

    def _on_arena_sleep(self, asleep: bool) -> None:
        """Arena hook: the table goes to 0 before the arena sleeps and back after it
        woke (or after a sleep that failed). Before the sleep, background commits end
        first (outside the lock they end under): one still inside the core could not give
        back what it backed once the arena sleeps, and the wake would bring that back."""
        if asleep:
            self._ahead.wait_idle()
        with self._lock:
            if not self.arena.closed:
                self._publish_limits(asleep)

    def _check_awake(self, op: str) -> None:
        """A release while asleep raises before it changes anything (the table, the
        bookkeeping, an offloaded sequence's host copy)."""
        if self.arena.asleep:
            raise ArenaAsleepError(
                f"{op}: the arena is asleep (sleep() gave its memory back); call wake() first"
            )

    def _token_array(self, num_tokens: Any) -> np.ndarray:
        """``ensure_all``'s argument checked, as a C-contiguous int64 array (the engine's
        own int64 array passes through without a copy)."""
        seqs = len(self._ensured)
        arr = num_tokens
        ready = (
            type(arr) is np.ndarray
            and arr.dtype == np.int64
            and arr.shape == (seqs,)
            and arr.flags.c_contiguous
        )
        if ready:
            lo, hi = _core.token_range(arr)
        else:
            if isinstance(num_tokens, (str, bytes)):
                num_tokens = None
            arr = np.asarray(num_tokens)
            # np.asarray([True, 1]) is an int array: a bool among ints is refused here too
            has_bool = isinstance(num_tokens, (list, tuple)) and any(
                isinstance(x, (bool, np.bool_)) for x in num_tokens
            )
            if has_bool or arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
                raise TypeError(
                    f"KVArena.ensure_all: num_tokens must be {seqs} ints (one per "
                    f"sequence), got {num_tokens!r}"
                )
            if arr.shape != (seqs,):
                raise ValueError(
                    f"KVArena.ensure_all: num_tokens has shape {arr.shape}; expected "
                    f"({seqs},), one entry per sequence"
                )
            lo, hi = (arr.min(), arr.max()) if arr.size else (0, 0)
        if lo < 0 or hi > self.max_tokens:
            raise ValueError(
                f"KVArena.ensure_all: num_tokens must be in [0, {self.max_tokens}] "
                f"(max_tokens); got min {lo}, max {hi}"
            )
        return arr if ready else np.ascontiguousarray(arr, dtype=np.int64)

    def _maybe_ahead(self, q: int, n: int) -> None:
        """Schedule the next chunk of sequence q when n is close to its backed end."""
        covered = self._covered[q]
        if (
            not self.commit_ahead_tokens
            or covered - n > self.commit_ahead_tokens
            or covered >= self.max_tokens
            or self._ahead_blocked[q] == covered
        ):
            return
        self._ahead.schedule(q, self._covered_tokens(q, covered + 1), self._epoch[q])

    def _commit_ahead(self, q: int, tokens: int, epoch: int) -> None:
        """On the commit-ahead thread: back tokens [0, tokens) of sequence q, scheduled at
        its ``epoch`` (a release since then makes it void).

        One core call per layer buffer: each holds the arena's mutex for one buffer's
        driver calls (~0.2 ms at 2 MiB chunks) instead of a whole prompt's (~3 ms over 16
        buffers), so the dispatching thread's releases and statistics, which take the same
        mutex, never wait for a full commit. Not all-or-nothing across buffers, so a
        commit that stops partway (out of memory, raw views, a release) gives back what
        it added before it says anything; once raw views are out it keeps it instead
        (an unmap here could run under their readers)."""
        with self._lock:
            if (
                self._epoch[q] != epoch
                or q in self._offloaded
                or self._covered[q] >= tokens
                or self.arena.closed
                or self._valid_gen[q] != self.arena._generation
            ):
                return
            gen, covered = self.arena._generation, self._covered[q]
            spans = self._commit_ranges(q, tokens)
            groups = [[(b.id, lo, hi) for lo, hi in spans] for b in self.buffers]
        done, skipped = 0, False
        try:
            for group in groups:
                if self._epoch[q] != epoch:  # released meanwhile: the rest is not needed
                    break
                if self.arena._handle.commit_ahead(group) < 0:
                    skipped = True  # raw views were handed out: the decode thread commits
                    break
                done += 1
        except (MemoryError, RuntimeError):  # out of memory, closed, asleep: ensure() will say
            self._ahead_failures += 1
        with self._lock:
            if skipped:
                self._ahead_skipped += 1
                self._ahead_blocked[q] = covered
            current = self._epoch[q] == epoch and self._valid_gen[q] == gen
            if current and done == len(groups):
                self._covered[q] = max(self._covered[q], self._covered_tokens(q, tokens))
                return
            if not done or self.arena.closed or q in self._offloaded:
                return
            # Stopped partway, or made void by a release meanwhile: give back what this
            # call backed past what the sequence counts on now (its ensured tokens, its
            # chunks known backed: kept by release(keep_tokens=), or raised by an ensure on
            # another thread). Never less: a kept chunk holds the next prompt's tokens.
            valid = self._valid_gen[q] == self.arena._generation
            keep = max(int(self._ensured[q]), int(self._covered[q]) if valid else 0)
            # With raw views out, a reader may run on another thread now, and on a GPU an
            # unmap leaves a hole under it until zeros are mapped back (its copy fails, its
            # kernel faults). So the chunks then stay backed, uncounted: the sequence's
            # next ensure takes them, its release or the arena's close frees them.
            if keep < tokens and not self.arena._handle.views_exported:
                base = q * self.seq_bytes
                self.arena._wait_for_host_work()
                self.arena._handle.decommit_ranges(
                    self._release_ranges(
                        base + keep * self.token_bytes,
                        base + tokens * self.token_bytes,
                        q,
                        keep_before=keep > 0,
                    ),
                    False,
                )

    def _commit_seqs(self, need: list[tuple[int, int]]) -> int:
        """One all-or-nothing commit of tokens [0, n) for each (q, n), and of what a reader
        of them touches (:meth:`_read_end`); caller holds the lock."""
        self.arena._check_open("KVArena.ensure")
        gen = self.arena._generation
        reads = [(q, n, self._read_end(n)) for q, n in need]
        ranges = [
            (b.id, lo, hi)
            for q, _, r in reads
            for lo, hi in self._commit_ranges(q, r)
            for b in self.buffers
        ]
        added = self.arena._commit(lambda: self.arena._handle.commit_ranges(ranges))
        for q, n, r in reads:
            self._ensured[q] = max(self._ensured[q], n)  # the caller publishes the table
            self._covered[q] = max(
                self._covered[q] if self._valid_gen[q] == gen else 0, self._covered_tokens(q, r)
            )
            self._valid_gen[q] = gen
        return added

    def shrink(self, num_tokens: int, *, wait: bool = False) -> int:
        """Release memory past the first ``num_tokens`` tokens (of every sequence).
        Returns bytes released. Like :meth:`release`, it does not wait for the device
        (``wait=True``: until the memory is back with the driver). With large allocations
        (``handle_bytes``), the released chunks of an allocation that keeps other chunks
        stay held (``stats()['parked_bytes']``) until the rest of it is released."""
        num_tokens = self._check_tokens(num_tokens, "KVArena.shrink")
        wait = as_flag(wait, "wait")
        with self._lock:
            self.arena._check_open("KVArena.shrink")
            self._check_awake("KVArena.shrink")
            for q, t in list(self._offloaded.items()):
                # An offloaded sequence that the shrink would cut is refused; one it leaves
                # whole stays away (a transfer that ended is settled either way).
                if self._ensured[q] > num_tokens or t.state in ("restored", "failed"):
                    self._settle(q)
            work = self._release_begins(wait)
            self._note_old_work(range(len(self._ensured)), work)
            self._publish_limits(ensured=np.minimum(self._ensured, num_tokens))
            self._ahead.cancel()
            # The ranges are found against every sequence's state after the shrink: a chunk
            # two sequences share goes too when neither keeps tokens in it.
            before = self._ensured.copy(), self._covered.copy()
            np.minimum(self._ensured, num_tokens, out=self._ensured)
            np.minimum(self._covered, num_tokens, out=self._covered)
            try:
                ranges = []
                for seq in range(1 if self.max_seqs is None else self.max_seqs):
                    base = seq * self.seq_bytes
                    q = None if self.max_seqs is None else seq
                    ranges += self._release_ranges(
                        base + num_tokens * self.token_bytes,
                        base + self.seq_bytes,
                        q,
                        keep_before=num_tokens > 0,
                    )
                released = self.arena._handle.decommit_ranges(ranges, wait, bool(work))
            except BaseException:
                self._ensured[:], self._covered[:] = before
                raise
            self._release_ends(work)
            for seq in range(len(self._epoch)):
                self._epoch[seq] += 1
        return released

    def release(
        self,
        seq: int | None = None,
        *,
        wait: bool = False,
        reuse: bool = False,
        keep_tokens: int = 0,
        writes_in_flight: bool = True,
    ) -> int:
        """Give back all memory of sequence ``seq``. Returns bytes released.

        Kernels launched after the call skip its chunks; its memory goes back to the
        driver once the device has finished the work launched before (``wait=True``: before
        returning), so it is safe to call right after dispatching a step that still reads
        the sequence. An offloaded sequence's host copy is dropped.

        ``reuse=True``: the slot takes a new sequence soon (continuous batching); with
        commit ahead on, the first chunk is backed again in the background (taking back the
        memory just released where it can), so the new sequence's first ensure makes no
        driver call. That chunk stays held until the slot is released without reuse.

        ``keep_tokens=n`` (implies ``reuse``): the slot's next sequence starts with ``n``
        tokens (its prompt), so the memory backing the first ``n`` tokens stays, rounded
        up to chunks, instead of being released and committed again; with commit ahead
        on, what the old sequence had not backed of them is backed in the background. As
        after any release the sequence has 0 tokens ensured: nothing writes or reads them
        until ``ensure``, which then makes no driver call for the kept chunks. Until the
        next sequence writes them they hold the old sequence's bytes, so a zero-filling
        arena refuses ``keep_tokens``.

        ``writes_in_flight=False``: the caller knows no step dispatched so far writes this
        sequence (say its rows there are idle, seq=-1), so the slot's next ``ensure`` need
        not wait for those steps. By default it does, on the CPU, where the slot's chunk
        stayed backed: a write still in flight is then dropped and counted, never landing
        in the next sequence's tokens."""
        base = self._seq_base(seq, "KVArena.release")
        wait = as_flag(wait, "wait")
        in_flight = as_flag(writes_in_flight, "writes_in_flight")
        reuse = as_flag(reuse, "reuse")
        keep = self._check_keep_tokens(keep_tokens, "KVArena.release")
        q = 0 if seq is None else int(seq)
        with self._lock:
            self.arena._check_open("KVArena.release")
            self._check_awake("KVArena.release")
            work = self._release_begins(wait)
            self._note_old_work([q], work if in_flight else [])
            t = self._offloaded.pop(q, None)
            if t is not None:
                t._finish(released=True)  # drops the host copy
            self._ensured[q] = 0
            self._core_cache.set_limit(q, 0)  # the table first: nothing may write what goes
            self._ahead.cancel(q)  # a prefetch or commit ahead not begun is for the old sequence
            kept = keep and self._valid_gen[q] == self.arena._generation
            self._covered[q] = min(self._covered[q], self._covered_tokens(q, keep)) if kept else 0
            self._epoch[q] += 1
            self._ahead_blocked[q] = -1  # a mark (ensure_shareable, a skip) was the old sequence's
            ranges = self._release_ranges(
                base + keep * self.token_bytes, base + self.seq_bytes, seq, keep_before=keep > 0
            )
            released = self.arena._handle.decommit_ranges(ranges, wait, bool(work))
            self._release_ends(work)
            if (reuse or keep) and self.commit_ahead_tokens:
                want = self._covered_tokens(q, self._read_end(max(keep, 1)))
                if self._covered[q] < want:
                    self._ahead.schedule(q, want, self._epoch[q])
            return released

    def _release_begins(self, wait: bool) -> list:
        """Before a release or shrink lowers the table (caller holds the lock): what the
        XLA:CPU work in flight must still see, without waiting for it. Returns that work
        (arrays; empty on a GPU, whose core defers the unmapping itself, or with nothing
        in flight). When there is some, the read epoch advances first: the core keeps the
        table as it stands for the steps dispatched so far (their attention reads it,
        read_epochs.py), and the memory that goes is unmapped once the work has finished
        (:meth:`_release_ends`). ``wait=True``, a shard of a sharded cache (its tokens
        are the sharded cache's) and raw views handed out wait here instead."""
        work = None if wait or self._shard else self.arena._host_work_to_outlive()
        if work is None:
            self.arena._wait_for_host_work()
            return []
        if work:
            epoch = self._core_cache.begin_epoch()
            read_epochs.advance(self.uid, epoch)
        return work

    def _note_old_work(self, seqs: Any, work: list) -> None:
        """A release or shrink of ``seqs`` lowered the table with ``work`` (XLA:CPU arrays)
        in flight: its writes to those sequences are dropped while the table stays low.
        Caller holds the lock."""
        for q in seqs:
            if work:
                self._old_work[q] = work
            else:
                self._old_work.pop(q, None)
        # Work that has finished needs no wait: drop it rather than hold its arrays.
        for q in [q for q, w in self._old_work.items() if w is not work and _finished(w)]:
            del self._old_work[q]

    def _zero_stale_rows(self, grown: list[tuple[int, int, int]]) -> None:
        """For each (q, old, new) ensure of sequence q from ``old`` to ``new`` tokens: on a
        zero-filling arena, rows [old, new) that an earlier sequence of the slot had ensured
        are zeroed (after the device's work) before the table admits them. A fresh commit
        zero-fills whole chunks, but a chunk that stayed backed (a neighbour's, or the part
        of a shrink's last chunk) keeps its bytes. Records the high-water mark either way.
        Caller holds the lock, after ``_outlive_old_writes``."""
        if not self.arena.zero_fill:
            return
        ranges = []
        for q, old, new in grown:
            stale = min(new, int(self._ever_ensured[q]))
            if stale > old:
                base = q * self.seq_bytes
                lo, hi = base + old * self.token_bytes, base + stale * self.token_bytes
                ranges += [(b.id, lo, hi) for b in self.buffers]
            self._ever_ensured[q] = max(int(self._ever_ensured[q]), new)
        if ranges:
            self.arena._handle.zero_ranges(ranges)

    def _outlive_old_writes(self, seqs: list[int]) -> None:
        """Before the table admits tokens of ``seqs`` again: the work in flight at their
        release finishes first, so a write it still holds for the old sequence is dropped
        (and counted), never landing in the tokens of the sequence that follows in the
        slot (where the slot's chunk stayed backed: kept tokens, a neighbour's chunk).
        Caller holds the lock."""
        for q in seqs:
            work = self._old_work.pop(q, None)
            if work:
                host_wait.wait_for(work)

    def _release_ends(self, work: list) -> None:
        """After a release that deferred its unmapping (``decommit_ranges(defer_unmap=)``):
        once ``work`` has finished, the retired memory goes and the tables kept for it."""
        if work:
            epoch = self._core_cache.epoch
            ref = weakref.ref(self)  # held by a job that may still be queued at exit

            def forget() -> None:
                kv = ref()
                if kv is not None:
                    kv._core_cache.forget_epochs_before(epoch)

            self.arena._reclaim_after(work, forget)

    def reclaim(self) -> int:
        """:meth:`jax_vmm.Arena.reclaim`: wait for the device and give released memory
        back now. Returns the bytes given back."""
        return self.arena.reclaim()

    def _release_ranges(
        self, start: int, stop: int, seq: int | None, keep_before: bool = False
    ) -> list[tuple[int, int, int]]:
        # Sequences need not start on chunk boundaries. A chunk that straddles the span's
        # edge is freed only when the neighbouring sequence holds no tokens in it.
        chunk = self.arena.chunk_bytes
        lo = start // chunk * chunk
        # keep_before: the bytes before the span are this sequence's own kept tokens.
        if lo < start and not keep_before and not self._neighbour_uses(lo, start, seq, before=True):
            start = lo
        hi = -(-stop // chunk) * chunk
        if hi > stop and not self._neighbour_uses(stop, hi, seq, before=False):
            stop = hi
        return [
            (b.id, start, min(stop, b.nbytes)) for b in self.buffers if start < min(stop, b.nbytes)
        ]

    def _neighbour_uses(self, lo: int, hi: int, seq: int | None, before: bool) -> bool:
        """Does a sequence other than ``seq`` count on bytes [lo, hi) being backed: its
        ensured tokens, or the chunks it knows backed (kept by ``release(keep_tokens=)`` or
        committed ahead), which its next ensure takes without a commit?"""
        if self.max_seqs is None or seq is None:
            # One sequence: the bytes before the span are its own kept tokens.
            return before
        valid = self._valid_gen == self.arena._generation
        counted = np.maximum(self._ensured, np.where(valid, self._covered, 0))
        q_lo = np.arange(len(counted), dtype=np.int64) * self.seq_bytes
        q_hi = q_lo + counted * self.token_bytes
        uses = (counted > 0) & (q_lo < hi) & (q_hi > lo)
        uses[seq] = False
        return bool(uses.any())

    def backed_tokens(self, seq: int | None = None) -> int:
        """Tokens from position 0 (of sequence ``seq``) backed in every layer."""
        base = self._seq_base(seq, "KVArena.backed_tokens")
        stop = base + self.seq_bytes
        prefix = min(b.backed_prefix(base, stop) for b in self.buffers)
        return prefix // self.token_bytes


def _finished(arrays: list) -> bool:
    """Every array of ``arrays`` ready (or gone: deleted, donated)."""
    try:
        return all(a.is_deleted() or a.is_ready() for a in arrays)
    except RuntimeError:  # deleted meanwhile by another thread
        return False


@dataclasses.dataclass(frozen=True)
class _EnsurePoint:
    """A KV arena's ensure state (:meth:`KVArena._ensure_point`): the table, the chunks
    known backed, and per sequence that may commit (bytes backed from its start, bytes its
    asked tokens span)."""

    ensured: np.ndarray
    covered: np.ndarray
    valid_gen: np.ndarray
    spans: dict[int, tuple[int, int]]
