"""Moving a KV arena's contents to host memory and back: ``sleep`` / ``wake`` for the
whole cache, ``offload`` / ``restore`` for one sequence (see ``docs/sleep.md``).

:class:`SequenceTransfers` is a mixin of :class:`jax_vmm.KVArena` (``jax_vmm/kv/arena.py``),
which owns the state it uses: ``arena``, ``_lock``, ``_offloaded`` (sequence -> its
:class:`~jax_vmm.Transfer`) and the sequence bookkeeping of
:class:`~jax_vmm.kv.backing.TokenBacking`.
"""

from __future__ import annotations

from ..base.args import as_flag
from ..memory.transfer import Transfer


class SequenceTransfers:
    def sleep(self, keep: str = "host") -> None:
        """:meth:`jax_vmm.Arena.sleep` for the whole cache: all physical memory goes back,
        contents to host memory (``keep="host"``) or dropped (``"discard"``). See
        ``docs/sleep.md``."""
        self.arena.sleep(keep)

    def wake(self) -> None:
        """:meth:`jax_vmm.Arena.wake`: the cache comes back at the same addresses."""
        self.arena.wake()

    @property
    def asleep(self) -> bool:
        return self.arena.asleep

    def offload(self, seq: int | None = None, *, wait: bool = True) -> Transfer:
        """Move sequence ``seq``'s tokens (every layer) to host memory and give its device
        memory back, keeping its addresses: the alternative to recomputing a preempted
        sequence. Kernels launched after the call skip its chunks (do not read it until
        :meth:`restore` finished); the copy starts once the device has finished the work
        launched before, on a copy stream, so it overlaps later steps of the other
        sequences. ``wait=False`` returns the :class:`Transfer` at once (check
        ``.done``/``.wait()``). A failure leaves the sequence in place: raised at once where
        the copy runs inline (host driver, raw views alive), else as
        :class:`jax_vmm.TransferError` from ``wait()``."""
        base = self._seq_base(seq, "KVArena.offload")
        wait = as_flag(wait, "wait")
        q = 0 if seq is None else int(seq)
        # A background commit of the sequence ends first (outside the lock it ends under):
        # the host copy then holds what it backed in every buffer or in none.
        self._ahead.wait_for(q, None)
        with self._lock:
            self.arena._check_open("KVArena.offload")
            if self._offloaded:
                self._settle(q)
            # Only the chunks wholly inside the sequence (the core rounds inward): one it
            # shares with a neighbour stays backed with its bytes in it, whether or not the
            # neighbour holds tokens now. Sent away, the neighbour's next ensure, prefetch or
            # commit ahead would back it again, and the restore could never take it back.
            ranges = [
                (b.id, base, min(base + self.seq_bytes, b.nbytes))
                for b in self.buffers
                if base < min(base + self.seq_bytes, b.nbytes)
            ]
            # The table first: from now on kernels drop writes to the sequence and clamp
            # (and count) reads of it, also in a chunk it shares with a neighbour, which
            # stays backed and is not part of the host copy.
            self.arena._wait_for_host_work()  # work in flight reads over the old table
            self._offloaded[q] = None  # type: ignore[assignment]
            try:
                self._publish_limits()
                ticket = self.arena._handle.offload(ranges)
            except BaseException:
                del self._offloaded[q]
                self._publish_limits()
                raise
            t = Transfer(self.arena._handle, ticket, seq, on_restored=lambda: self._landed(q, t))
            self._offloaded[q] = t
            self._covered[q] = 0
            self._epoch[q] += 1
        if wait:
            try:
                t.wait()
            finally:
                with self._lock:
                    if self._offloaded.get(q) is t and t.state == "failed":
                        self._settle(q)
        return t

    def _landed(self, q: int, t: Transfer) -> None:
        """``t.done`` or ``t.wait()`` saw the restore land: the sequence is back in the table."""
        with self._lock:
            if self._offloaded.get(q) is t:
                self._settle(q)

    def restore(self, seq: int | None = None, *, wait: bool = True) -> Transfer:
        """Bring an offloaded sequence back: the same chunks are backed again and its tokens
        copied back, at the same addresses. ``wait=False``: the copy runs in the background
        and the chunks join the page table when it lands; the sequence may be written and
        read once ``done`` is True (or ``wait()`` returned, or the next ``ensure`` of it,
        or :meth:`stats`): until then its writes
        are dropped and its reads clamped, both counted for :meth:`check`. A failure
        leaves the sequence offloaded, its host copy intact: raised at once when inline
        (``wait=True``, host driver), else as :class:`jax_vmm.TransferError` from
        ``wait()``."""
        self._seq_base(seq, "KVArena.restore")
        wait = as_flag(wait, "wait")
        q = 0 if seq is None else int(seq)
        with self._lock:
            self.arena._check_open("KVArena.restore")  # a closed arena has nothing offloaded
            t = self._offloaded.get(q)
            if t is None:
                raise ValueError(
                    f"KVArena.restore: sequence {q} is not offloaded (kv.offload(seq) first)"
                )
        self.arena._commit(lambda: self.arena._handle.restore(t.ticket, wait))
        if wait:
            t.wait()
            with self._lock:
                if self._offloaded.get(q) is t:
                    self._settle(q)
        return t
