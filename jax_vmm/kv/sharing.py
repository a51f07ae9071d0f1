"""Shared prefixes: ``kv.share_prefix(src, dst, n)`` makes sequence ``dst`` start with
sequence ``src``'s first ``n`` tokens, in every layer, mapping the same physical memory at
``dst``'s addresses where it can (no copy) and copying the rest (see ``docs/sharing.md``).

* Chunks wholly inside the prefix are mapped at both addresses (``Arena::ShareSpans``):
  every kernel, jax_vmm's and cuDNN's, reads them as ordinary memory. The memory goes back
  to the driver when the last sequence holding it is released.
* The prefix's partial chunks (its first one when the sequence does not start on a chunk
  boundary, its last one) and, on CUDA, chunks of an allocation that reaches past the
  prefix (cuMemMap maps allocations whole) are committed as ``dst``'s own memory and
  copied. :meth:`PrefixSharing.ensure_shareable` commits a prefix so that all of its whole
  chunks form an allocation of their own, shared on CUDA too.
* Shared tokens are read-only: every sharer's *floor* in the KV cache's device table
  (``KvCache::SetFloor``) makes kv_write drop and count a write below it (status
  ``DROPPED_SHARED``), on the CPU and in the CUDA kernels, also when replayed in a graph.
  ``dst``'s floor is ``n``; ``src``'s ends with the last chunk mapped into ``dst`` (a
  chunk copied past it is ``src``'s own, and stays writable).
* Operations that would write or move shared memory refuse with a ``ValueError`` that
  says what to do: ``shrink`` below a floor, ``release(keep_tokens=)`` of a sequence
  that maps memory shared with another, ``offload`` of one, ``sleep`` while any does. A
  share that mapped nothing (all copied) blocks none of the last three: ``dst`` keeps its
  floor, and moves with its copy.
* A shard of a :class:`~jax_vmm.ShardedKVArena` names the sharded arena and its global
  sequences in these messages (``_api``, ``_seq_offset``, set by the sharded arena): they
  reach the caller of the sharded arena, whose sequence numbers they must be.

:class:`PrefixSharing` is a mixin of :class:`jax_vmm.KVArena` (``jax_vmm/kv/arena.py``);
it uses the state and helpers of :class:`~jax_vmm.kv.backing.TokenBacking` under ``_lock``.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ..base.args import as_flag
from .base import check_seq

_log = logging.getLogger("jax_vmm")


def _publish_floor(core_cache: Any, seq: int, tokens: int) -> None:
    """Publishes sequence ``seq``'s floor of writable tokens to the device table.
    ``jax_vmm.testing.shared_writes_allowed()`` swaps it for a no-op (the one seam for
    that test hook): the tests then see writes land in shared memory."""
    core_cache.set_floor(seq, tokens)


class PrefixSharing:
    #: How the messages below name this arena's methods and sequences: a shard of a
    #: ShardedKVArena names the sharded arena and its global sequences (the first global
    #: sequence the shard holds is its local sequence 0; jax_vmm/kv/sharded.py sets both).
    _api = "KVArena"
    _seq_offset = 0

    def _op(self, method: str) -> str:
        return f"{self._api}.{method}"

    def _seq_name(self, q: int) -> int:
        """Local sequence ``q`` as the caller numbers it (a sharded arena: global)."""
        return int(q) + self._seq_offset

    def _sharing_init(self, seqs: int) -> None:
        # Host mirror of the floors; one record per dst of a share still in place.
        self._floors = np.zeros(seqs, np.int64)
        self._shares: dict[int, dict[str, int]] = {}
        # Per dst of a share in place: the sequence whose memory it maps (its src; once
        # that is released, the src's own source; None when there is none). A sequence
        # named here keeps its floor (_lower_stale_floors, at each sharer's release).
        self._memory_of: dict[int, int | None] = {}
        # The dsts of shares in place whose src was released since (_free_lone_destinations).
        self._source_gone: set[int] = set()
        # A sharer was released since the last reclaim: its addresses may still map a
        # source's allocations, which the core then counts as shared
        # (_reclaim_released_sharers).
        self._released_sharer_addresses = False

    # -- the spans -----------------------------------------------------------------------
    def _whole_chunks(self, q: int, num_tokens: int) -> tuple[int, int]:
        """Byte offsets [lo, hi) of the chunks wholly inside tokens [0, num_tokens) of
        sequence q (lo >= hi: none)."""
        c = self.arena.chunk_bytes
        base = q * self.seq_bytes
        return -(-base // c) * c, (base + num_tokens * self.token_bytes) // c * c

    def ensure_shareable(self, num_tokens: int, seq: int | None = None) -> int:
        """:meth:`ensure`, committing the whole chunks of tokens [0, ``num_tokens``) as an
        allocation of their own (the partial last chunk as another), so that
        :meth:`share_prefix` of them maps them on CUDA too, where an allocation is mapped
        only whole; the host driver does the same (docs/sharing.md), so a prefix committed
        by plain ``ensure`` with more tokens after it is copied there too. Returns the bytes
        newly committed.

        No commit ahead follows: shareable tokens are usually all their sequence holds (a
        prefix's own slot), and a chunk backed for tokens it never writes would be memory
        no sharer uses. A sequence that goes on growing backs its next chunk at its next
        ``ensure`` past them, and commit ahead resumes from there."""
        num_tokens = self._check_tokens(num_tokens, "KVArena.ensure_shareable")
        self._seq_base(seq, "KVArena.ensure_shareable")
        q = 0 if seq is None else int(seq)
        lo, hi = self._whole_chunks(q, num_tokens)
        whole = (hi - q * self.seq_bytes) // self.token_bytes if hi > lo else 0
        with self._lock:
            self.arena._check_open("KVArena.ensure_shareable")
            # Marked as if a commit ahead at that end had been skipped: _maybe_ahead and
            # ahead_due pass over the sequence until its backed end moves.
            held = self._ahead_blocked[q]
            self._ahead_blocked[q] = max(int(self._covered[q]), self._covered_tokens(q, num_tokens))
            try:
                return self._ensure_shareable(seq, q, num_tokens, whole, lo, hi)
            except BaseException:
                self._ahead_blocked[q] = held
                raise

    def _ensure_shareable(
        self, seq: int | None, q: int, num_tokens: int, whole: int, lo: int, hi: int
    ) -> int:
        """ensure_shareable's commit, under the lock (``whole``: tokens in whole chunks)."""
        if not whole or self._backed_already(np.int64(num_tokens), q):
            if whole and self._ensured[q] < num_tokens:
                _log.warning(
                    "KVArena.ensure_shareable(%d, seq=%d): those tokens' chunks were "
                    "backed ahead already (kv.prefetch, commit ahead, or release with "
                    "keep_tokens), not as an allocation of their own; share_prefix "
                    "copies what it cannot map (an allocation that reaches past the "
                    "prefix). Call ensure_shareable before any prefetch of the "
                    "sequence (or release it without keep_tokens first).",
                    num_tokens, q,
                )  # fmt: skip
            return self.ensure(num_tokens, seq)
        # The whole chunks first: one commit of them (its own allocations), then the
        # rest (a commit never joins new chunks to an existing allocation).
        if self._offloaded:
            self._settle(q)
        # A refusal gives back only what this call committed: chunks backed before
        # it (tokens ensured, a kept or prefetched chunk) stay, as ensure's would.
        point = self._ensure_point({q: num_tokens})
        ranges = [(b.id, lo, hi) for b in self.buffers]
        added = self.arena._commit(lambda: self.arena._handle.commit_ranges(ranges))
        try:
            return added + self.ensure(num_tokens, seq)
        except BaseException:
            self._roll_back(point)
            raise

    # -- share ---------------------------------------------------------------------------
    def share_prefix(self, src_seq: int, dst_seq: int, num_tokens: int) -> dict[str, int]:
        """Make sequence ``dst_seq`` start with sequence ``src_seq``'s first
        ``num_tokens`` tokens, in every layer, and ensure them for ``dst_seq``.

        Chunks wholly inside the prefix become the same physical memory at both
        sequences' addresses (no copy); the rest of the prefix is copied into
        ``dst_seq``'s own memory. From then on the shared tokens are read-only for both
        sequences: a kv_write into them is dropped and counted (``check()`` reports it),
        while ``dst_seq``'s writes at ``num_tokens`` and beyond land in its own memory.
        Releasing either sequence keeps the memory for the other; it goes back once the
        last sharer is released.

        ``src_seq`` must have ``num_tokens`` tokens ensured (and written), ``dst_seq``
        must hold nothing (released, or never used: no tokens, no chunks backed ahead; a
        background commit still on its way for its previous sequence is waited for),
        and the two sequences' starts must lie the same distance from a chunk boundary
        (always so when ``max_tokens * token_bytes`` is a multiple of ``chunk_bytes``).
        Returns ``{"mapped_bytes", "copied_bytes"}`` summed over K and V of every layer.
        Raises ``ValueError`` (nothing changed) otherwise."""
        return self._share_prefix(src_seq, dst_seq, num_tokens, wait_for_dst=True)

    def _share_prefix(
        self, src_seq: int, dst_seq: int, num_tokens: int, wait_for_dst: bool
    ) -> dict[str, int]:
        """:meth:`share_prefix`; ``wait_for_dst=False`` for a caller that holds the lock
        (a sharded arena holds every shard's) and waited for dst's background commit
        before taking it. Messages name the sequences as the caller does (_seq_name)."""
        op = self._op("share_prefix")
        if self.max_seqs is None:
            raise ValueError(f"{op}: this KV arena has one sequence (max_seqs=None)")
        src = check_seq(src_seq, self.max_seqs, op)
        dst = check_seq(dst_seq, self.max_seqs, op)
        src_name, dst_name = self._seq_name(src), self._seq_name(dst)
        if src == dst:
            raise ValueError(f"{op}: src_seq and dst_seq are both {src_name}; pass two sequences")
        n = self._check_tokens(num_tokens, op, minimum=1)
        shift = (dst - src) * self.seq_bytes
        c = self.arena.chunk_bytes
        if shift % c:
            raise ValueError(
                f"{op}: sequences {src_name} and {dst_name} start at different offsets "
                f"within a chunk of {c} bytes (each sequence spans {self.seq_bytes} bytes), "
                "so no chunk can be mapped at both; pick sequences a multiple of chunk_bytes "
                "apart, or max_tokens with max_tokens * token_bytes a multiple of chunk_bytes"
            )
        # A background commit of dst's previous sequence may still be mapping chunks that
        # its release gave back (it gives them back again when it ends): let it end first,
        # outside the lock it ends under, so that dst holds nothing when it is checked.
        if wait_for_dst:
            self._ahead.wait_for(dst, None)
        with self._lock:
            self.arena._check_open(op)
            self._check_awake(op)
            for q in (src, dst):
                if q in self._offloaded:
                    self._settle(q)  # raises while it is away
            if self._ensured[src] < n:
                raise ValueError(
                    f"{op}: sequence {src_name} has {int(self._ensured[src])} tokens "
                    f"ensured; sharing {n} needs them all: kv.ensure({n}, {src_name}) and "
                    "write them first"
                )
            covered = self._covered[dst] if self._valid_gen[dst] == self.arena._generation else 0
            if self._ensured[dst] or covered or self._floors[dst]:
                raise ValueError(
                    f"{op}: sequence {dst_name} holds memory ({int(self._ensured[dst])} "
                    f"tokens ensured, {int(covered)} backed); share into a sequence that "
                    f"holds nothing: kv.release({dst_name}) first (without reuse or "
                    "keep_tokens)"
                )
            self._ahead.cancel(dst)  # a commit ahead not begun was for dst's old tokens
            self._epoch[dst] += 1  # ... and one on its way is not counted for it
            base_src, base_dst = src * self.seq_bytes, dst * self.seq_bytes
            lo, hi = self._whole_chunks(src, n)
            spans = [(b.id, lo, b.id, lo + shift, hi - lo) for b in self.buffers] if hi > lo else []
            # The work in flight (which may still write src) finishes first: the CPU's
            # here, the device's inside share_spans. Then src's shared chunks go read-only
            # for what is dispatched from now on.
            self.arena._wait_for_host_work()
            mapped, left_out = self.arena._handle.share_spans(spans)
            # src's floor covers the chunks now mapped at dst's addresses too; a chunk
            # copied instead stays src's own, writable.
            old_src_floor = int(self._floors[src])
            if mapped:
                end = self._mapped_end(spans, left_out, shift)
                src_floor = max(old_src_floor, -(-(end - base_src) // self.token_bytes))
                if src_floor > old_src_floor:
                    self._set_floor(src, src_floor)
            try:
                # dst's own memory for the rest (the shared chunks are backed already).
                self._commit_seqs([(dst, n)])
                copies = [
                    (b.id, s - shift, b.id, s, e - s)
                    for b in self.buffers
                    for s, e in self._own_spans(base_dst, base_dst + n * self.token_bytes, spans)
                ]
                copies += [(b, s - shift, b, s, e - s) for b, s, e in left_out]
                self.arena._handle.copy_spans(copies)
            except BaseException:
                self._undo_share(dst)
                self._set_floor(src, old_src_floor)
                raise
            copied = sum(x[-1] for x in copies)
            if left_out:
                _log.warning(
                    "%s(%d, %d, %d): %d bytes of whole chunks were copied, "
                    "not mapped: their allocation also backs tokens past the prefix (a "
                    "longer prefix committed by ensure_shareable than the one shared here, a "
                    "plain ensure, or chunks backed ahead by a prefetch, commit ahead or "
                    "release(keep_tokens=)). Share the whole prefix that "
                    "kv.ensure_shareable(n, seq) committed, before anything else backs it.",
                    op, src_name, dst_name, n, sum(e - s for _, s, e in left_out),
                )  # fmt: skip
            self._set_floor(dst, n)
            self._ever_ensured[dst] = max(int(self._ever_ensured[dst]), n)  # copies stay
            self._outlive_old_writes([dst])
            self._core_cache.set_limit(dst, n)  # the floor first: the table admits dst now
            self._shares[dst] = dict(
                src=src, dst=dst, tokens=n, mapped_bytes=mapped, copied_bytes=copied
            )
            # dst reads src's memory only where something was mapped: a share that copied
            # everything must not keep src's floor up once src's real sharers are gone.
            self._memory_of[dst] = src if mapped else None
            return {"mapped_bytes": mapped, "copied_bytes": copied}

    def _mapped_end(self, spans: list, left_out: list, shift: int) -> int:
        """The end (a byte offset of src's, as in ``spans``) of the last chunk that
        ``share_spans(spans)`` mapped in any buffer: ``left_out`` lists (buffer, start,
        stop) of dst's chunks it did not map (copied instead), in dst's offsets."""
        c = self.arena.chunk_bytes
        skipped: dict[int, set[int]] = {}
        for b, start, stop in left_out:
            skipped.setdefault(b, set()).update(range(start // c, -(-stop // c)))
        end = 0
        for _, _, b, dst_start, nbytes in spans:
            gone = skipped.get(b, set())
            last = next(
                (k for k in range((dst_start + nbytes) // c - 1, dst_start // c - 1, -1)
                 if k not in gone),
                None,
            )  # fmt: skip
            if last is not None:
                end = max(end, (last + 1) * c - shift)
        return end

    def _own_spans(self, start: int, stop: int, spans: list) -> list[tuple[int, int]]:
        """Byte spans of [start, stop) (dst's prefix) outside the shared chunks."""
        if not spans:
            return [(start, stop)]
        lo, hi = spans[0][3], spans[0][3] + spans[0][4]
        return [(s, e) for s, e in ((start, lo), (hi, stop)) if s < e]

    def _undo_share(self, dst: int) -> None:
        """A share that failed after mapping: dst gives back everything it got (the source
        keeps its memory). Caller holds the lock."""
        self._ensured[dst] = 0
        self._covered[dst] = 0
        self._epoch[dst] += 1
        self._core_cache.set_limit(dst, 0)
        base = dst * self.seq_bytes
        self.arena._handle.decommit_ranges(
            self._release_ranges(base, base + self.seq_bytes, dst), False
        )
        self._released_sharer_addresses = True

    def _set_floor(self, q: int, tokens: int) -> None:
        self._floors[q] = tokens
        _publish_floor(self._core_cache, q, tokens)

    # -- what sharing forbids --------------------------------------------------------------
    def _sharing_memory(self) -> list[int]:
        """The sequences whose addresses map memory that another sequence's map too: the
        destinations of shares that mapped chunks (while no other address maps them any
        more, _free_lone_destinations ends their share) and the sequences whose chunks are
        mapped elsewhere. A destination whose prefix was all copied (a share that mapped
        nothing) is not one: its floor keeps its prefix read-only, but its memory is its
        own, and may sleep, move and be released by part. Caller holds the lock, after
        _reclaim_released_sharers."""
        sources = {q for q in self._memory_of.values() if q is not None}
        mapping = {q for q, r in self._shares.items() if r["mapped_bytes"]}
        return sorted(sources | mapping)

    def _refuse_if_shared(self, q: int, op: str, what: str) -> None:
        with self._lock:
            self.arena._check_open(op)
            self._reclaim_released_sharers()
            if q in self._sharing_memory():
                raise self._shared_error(q, op, what)

    def _shared_error(self, q: int, op: str, what: str) -> ValueError:
        return ValueError(
            f"{op}: sequence {self._seq_name(q)} shares its first {int(self._floors[q])} "
            f"tokens with another sequence (kv.share_prefix); {what}"
        )

    def _forget_share(self, q: int) -> None:
        """After q's memory is released: its tokens are writable again (it holds none).
        The shares made from q read memory that came from q's own source (the chunks q
        shared from it), so that source's floor stays while they last."""
        self._shares.pop(q, None)
        self._source_gone.discard(q)
        self._source_gone.update(d for d, r in self._shares.items() if r["src"] == q)
        if self._floors[q]:
            self._set_floor(q, 0)
        upstream = self._memory_of.pop(q, None)
        for d, source in self._memory_of.items():
            if source == q:
                self._memory_of[d] = upstream

    def _lower_stale_floors(self) -> bool:
        """Lowers the floor of every source whose sharers were all released: its shared
        chunks are its own again (its floor drops to what it holds as a dst itself), so
        writes into its first tokens land from the next dispatch on. Returns whether a
        floor dropped. Caller holds the lock."""
        sources = {q for q in self._memory_of.values() if q is not None}
        own = {q: r["tokens"] for q, r in self._shares.items()}
        stale = [
            int(q)
            for q in np.flatnonzero(self._floors)
            if q not in sources and self._floors[q] > own.get(int(q), 0)
        ]
        for q in stale:
            self._set_floor(q, own.get(q, 0))
        return bool(stale)

    def _reclaim_released_sharers(self) -> None:
        """Before an operation that moves memory or releases it by part (sleep, offload,
        release with keep_tokens, shrink): reclaims the addresses of the sharers released
        since the last call, so that the core holds each source allocation at one
        address again and allows it. Kept out of release itself, so that a release never
        waits for the device. Caller holds the lock."""
        if self._released_sharer_addresses:
            self.arena.reclaim()
            self._released_sharer_addresses = False
        self._free_lone_destinations()

    def _free_lone_destinations(self) -> None:
        """A destination whose source was released holds the shared chunks alone once no
        other address maps them any more (the core says so once those addresses were
        reclaimed; a share that copied everything maps none): its prefix is its own
        again, writable, and it may sleep, move and be released by part. Caller holds
        the lock."""
        sources = {q for q in self._memory_of.values() if q is not None}
        for dst in list(self._shares):
            if dst not in self._source_gone or self._memory_of.get(dst) is not None:
                continue  # its source lives, or holds the memory through a chain
            if dst in sources:
                continue
            base = dst * self.seq_bytes
            stop = base + int(self._floors[dst]) * self.token_bytes
            if self.arena._handle.shared_bytes([(b.id, base, stop) for b in self.buffers]):
                continue  # another destination of the same source still maps it
            del self._shares[dst]
            del self._memory_of[dst]
            self._source_gone.discard(dst)
            self._set_floor(dst, 0)

    def release(
        self,
        seq: int | None = None,
        *,
        wait: bool = False,
        reuse: bool = False,
        keep_tokens: int = 0,
        writes_in_flight: bool = True,
    ) -> int:
        # Every argument is checked here first, as the base class checks them (it checks
        # again): a concrete JAX or NumPy scalar is a sequence number as much as an int,
        # and must meet the sharing check too; a bad keep_tokens is refused for what it
        # is, not for the sharing, and before that check waits for the device.
        q = check_seq(seq, self.max_seqs, "KVArena.release")
        q = 0 if q is None else q
        as_flag(wait, "wait")
        as_flag(writes_in_flight, "writes_in_flight")
        as_flag(reuse, "reuse")
        keep = self._check_keep_tokens(keep_tokens, "KVArena.release")
        if keep:
            self._refuse_if_shared(
                q,
                self._op("release"),
                "its kept chunks would be written by the next sequence: release it without "
                "keep_tokens",
            )
        released = super().release(
            seq, wait=wait, reuse=reuse, keep_tokens=keep, writes_in_flight=writes_in_flight
        )
        with self._lock:
            # A source's addresses as much as a destination's: until reclaimed, the core
            # counts the chunks they map as shared (on a GPU the release is deferred).
            was_sharer = int(q) in self._shares or int(q) in self._memory_of.values()
            self._forget_share(int(q))
            if was_sharer:  # only a sharer's release leaves a source's floor stale
                self._lower_stale_floors()
                self._released_sharer_addresses = not wait
        return released

    def _over_floor(self, num_tokens: int) -> dict[int, int]:
        """{sequence (as the caller numbers it): floor} of every sequence whose floor is
        above ``num_tokens``: a shrink to ``num_tokens`` would cut its read-only prefix.
        Caller holds the lock."""
        self._reclaim_released_sharers()
        over = np.flatnonzero(self._floors > num_tokens)
        return {self._seq_name(q): int(self._floors[q]) for q in over}

    def shrink(self, num_tokens: int, *, wait: bool = False) -> int:
        n = self._check_tokens(num_tokens, "KVArena.shrink")
        with self._lock:
            self.arena._check_open("KVArena.shrink")
            over = self._over_floor(n)
            if over:
                raise shrink_refused(self._op("shrink"), over)
            return super().shrink(num_tokens, wait=wait)

    def offload(self, seq: int | None = None, *, wait: bool = True) -> Any:
        q = check_seq(seq, self.max_seqs, "KVArena.offload")
        as_flag(wait, "wait")
        self._refuse_if_shared(
            0 if q is None else q,
            self._op("offload"),
            "shared memory cannot move to the host; release it (or its sharers) instead",
        )
        return super().offload(seq, wait=wait)

    def sleep(self, keep: str = "host") -> None:
        with self._lock:
            if not self.arena.closed:  # the arena's sleep says it is closed
                self._reclaim_released_sharers()
                sharing = [self._seq_name(q) for q in self._sharing_memory()]
            else:
                sharing = []
        if sharing:
            raise ValueError(
                f"{self._op('sleep')}: sequences {sharing} share memory (kv.share_prefix), "
                "which sleep would split into copies; release them first"
            )
        super().sleep(keep)

    def _shared_write_note(self) -> str:
        """For ``check()``'s message: which sequences drop writes into a shared prefix."""
        with self._lock:
            floors = {self._seq_name(q): int(self._floors[q]) for q in np.flatnonzero(self._floors)}
        if not floors:
            return ""
        return (
            f" Writes into a shared prefix (kv.share_prefix) are dropped too: its tokens are "
            f"read-only for every sharer (sequence: first tokens read-only {floors})."
        )

    def _sharing_stats(self) -> dict[str, Any]:
        with self._lock:
            if self.arena.closed:  # its memory, and every share of it, went with it
                return {"shared_prefixes": [], "sharing_seqs": []}
            self._free_lone_destinations()
            return {
                # A released source's slot may hold another request by now: no source.
                "shared_prefixes": [
                    dict(r, src=None if dst in self._source_gone else r["src"])
                    for dst, r in self._shares.items()
                ],
                "sharing_seqs": np.flatnonzero(self._floors).tolist(),
            }


def shrink_refused(op: str, over: dict[int, int]) -> ValueError:
    """The refusal of a shrink that would cut the read-only prefixes ``over`` ({sequence:
    floor}, as the caller numbers the sequences; not empty)."""
    q = min(over)
    return ValueError(
        f"{op}: sequence {q} shares its first {over[q]} tokens with another sequence "
        f"(kv.share_prefix); shrink to at least {max(over.values())} tokens, or release "
        "the sequences that share first"
    )
