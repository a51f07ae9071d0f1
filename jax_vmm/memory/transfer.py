"""A KV sequence's trip to host memory and back (``KVArena.offload`` / ``restore``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..base.errors import ArenaClosedError, TransferError

_STATES = ("offloading", "offloaded", "restoring", "restored", "failed")  # the core's codes
_IN_FLIGHT = ("offloading", "restoring")


class Transfer:
    """The offload of one sequence (:meth:`jax_vmm.KVArena.offload`) and its restore.

    ``state`` is one of ``"offloading"`` (waiting for earlier device work, or copying to
    the host), ``"offloaded"`` (the contents are in host memory, the device memory is given
    back), ``"restoring"`` (copying back), ``"restored"`` (back at the same addresses),
    ``"failed"`` (the offload failed and was undone: the contents never left) and
    ``"released"`` (the sequence was released while offloaded: the host copy is gone). A
    restore that fails in the background returns to ``"offloaded"`` with :attr:`error`
    set; one refused at the call (out of memory) raises there and leaves the transfer as
    it was. Thread-safe.
    """

    def __init__(
        self,
        core_arena: Any,
        ticket: int,
        seq: int | None,
        on_restored: Callable[[], None] | None = None,
    ):
        self._core = core_arena
        # Called by wait() once the restore landed: the KV arena opens the sequence again.
        self._on_restored = on_restored
        self._ticket = int(ticket)
        self._seq = seq
        self._final: str | None = None  # once the arena forgot the ticket
        self._final_error = ""

    @property
    def seq(self) -> int | None:
        return self._seq

    @property
    def ticket(self) -> int:
        return self._ticket

    def _check_open(self, op: str) -> None:
        """A closed arena dropped its transfers: say so, not "no transfer"."""
        if self._core.closed:
            raise ArenaClosedError(
                f"Transfer.{op}: the arena of sequence {self._seq}'s transfer was closed (its "
                "host copy went with it)"
            )

    def _query(self) -> tuple[str, str]:
        if self._final is not None:
            return self._final, self._final_error
        self._check_open("state")
        return self._ask_core(self._core.transfer_state)

    def _ask_core(self, call: Callable[[int], tuple[int, str]]) -> tuple[str, str]:
        """``call(ticket)``'s (state, error); the settled ones when another thread settled
        the transfer meanwhile (the core forgot the ticket between our two looks)."""
        try:
            code, error = call(self._ticket)
        except ValueError:
            if self._final is None:
                raise
            return self._final, self._final_error
        return _STATES[code], error

    @property
    def state(self) -> str:
        return self._query()[0]

    @property
    def error(self) -> str:
        """Why the last step failed ('' when nothing did)."""
        return self._query()[1]

    @property
    def done(self) -> bool:
        """Nothing is in flight (the last step finished, or failed). Once a restore has
        landed, the first ``done`` (like ``wait()``) opens the sequence to writes and reads
        again."""
        state = self._query()[0]
        if state == "restored":
            self._opened()
        return state not in _IN_FLIGHT

    def _opened(self) -> None:
        """The restore landed: the KV arena admits the sequence again (once)."""
        on_restored, self._on_restored = self._on_restored, None
        if on_restored is not None:
            on_restored()

    def wait(self) -> Transfer:
        """Block until nothing is in flight. Raises :class:`jax_vmm.TransferError` when the
        offload failed (the sequence stayed in place) or the last restore failed (the
        sequence is still offloaded)."""
        if self._final is None:
            self._check_open("wait")
            state, error = self._ask_core(self._core.wait_transfer)
        else:
            state, error = self._final, self._final_error
        if state == "failed" or (state == "offloaded" and error):
            raise TransferError(f"sequence {self._seq}: {error}")
        if state == "restored":
            self._opened()
        return self

    def _finish(self, released: bool = False) -> str:
        """Wait for anything in flight (without raising), then let the arena forget the
        ticket and its host copy; remember how it ended (``released``: the sequence was
        released, so a copy still away is gone)."""
        if self._final is None:
            code, error = self._core.wait_transfer(self._ticket)
            state = _STATES[code]
            self._final = "released" if released and state == "offloaded" else state
            self._final_error = error
            self._core.drop_transfer(self._ticket)
        return self._final

    def __repr__(self) -> str:
        return f"Transfer(seq={self._seq}, state={self.state!r})"
