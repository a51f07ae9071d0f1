"""KV-cache buffers on an arena, grown by sequence: one K and one V buffer per layer, or
one buffer that interleaves every layer (``layout="interleaved"``)."""

from __future__ import annotations

import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..base.args import as_flag, as_index, layer_index
from ..base.devices import resolve_device, xla_device_ordinal
from ..base.errors import DriverError, OutOfBoundsRead, OutOfBoundsWrite
from ..base.fp8 import FP8_DTYPE, check_scale_values
from ..base.loader import core as _core
from ..cache import read_epochs
from ..cache.ids import LayerId
from ..cache.registry import register_arena
from ..memory.arena import Arena, Buffer
from ..memory.budget import MemoryBudget, check_budget
from ..memory.transfer import Transfer
from ..ops.array_writes import KVDest
from .backing import TokenBacking
from .base import KVArenaBase, LayerViews, check_seq, layer_shape
from .prefetch import CommitAhead
from .sharing import PrefixSharing
from .stats import KVArenaStats
from .transfers import SequenceTransfers

#: Largest physical allocation of a KV arena's commit (rounded down to whole chunks): a
#: prefill or a growth of many chunks takes few driver calls, and a sequence's release
#: still frees all of its memory (a commit never puts two sequences in one allocation).
DEFAULT_KV_HANDLE_BYTES = 1 << 30

#: The layouts :func:`~jax_vmm.kv_arena` offers (``layout=``), the default first.
KV_LAYOUTS = ("per_layer", "interleaved")


class _InterleavedViews(LayerViews):
    """``kv.k[l]`` of an interleaved arena: there is no such array (a layer's tokens are
    strided in the one buffer), so every access explains what to use instead."""

    def _view(self, layer: int) -> jax.Array:
        raise TypeError(
            f"{self._name}[{layer}]: this KV arena interleaves every layer in one buffer "
            "(kv_arena(..., layout='interleaved')), so a layer is not a contiguous array and "
            "has no zero-copy view. Read and write it through its cache: "
            "layer = kv.cache()[l]; jax_vmm.kv_write(layer, ...), "
            "jax_vmm.decode_attention(q, layer, lengths) or jax_vmm.attention(...). For "
            "per-layer views make the arena with layout='per_layer' (the default)"
        )


class _LayerViews(LayerViews):
    """``kv.k[l]``: a zero-copy view of layer ``l``'s buffer. Views are cached and made
    anew once JAX has consumed (donated) the cached one."""

    def __init__(self, buffers: list[Buffer], name: str):
        super().__init__(len(buffers), name)
        self._buffers = buffers
        self._cache: list[jax.Array | None] = [None] * len(buffers)

    def _view(self, layer: int) -> jax.Array:
        cached = self._cache[layer]
        if cached is None or cached.is_deleted():
            cached = self._buffers[layer].array
            self._cache[layer] = cached
        return cached


class KVArena(KVArenaBase, PrefixSharing, TokenBacking, SequenceTransfers):
    """KV cache for ``num_layers`` layers in one :class:`~jax_vmm.Arena`.

    Layout per layer and per K/V: ``(max_tokens, num_kv_heads, head_dim)``, or with
    ``max_seqs`` ``(max_seqs, max_tokens, num_kv_heads, head_dim)`` (each sequence
    contiguous; flat slot = ``seq * max_tokens + position``). With ``layout="per_layer"``
    (the default) each is a buffer of its own and ``kv.k[l]`` a zero-copy ``jax.Array``.
    With ``layout="interleaved"`` one buffer ``(max_seqs, max_tokens, 2 * num_layers,
    num_kv_heads, head_dim)`` holds them all (layer ``l``'s K at ``2l``, V at ``2l + 1``),
    so that a chunk holds a token range of every layer: a sequence's partial last chunk
    is paid once instead of ``2 * num_layers`` times (memory for short sequences and
    shared prefixes, docs/sharing.md), and a growth is one commit instead of one per
    buffer. Its layers are strided, so it has no views (``kv.k[l]`` and ``kv.dest``
    raise): read and write it through :meth:`cache`. Physical memory follows
    :meth:`ensure`, :meth:`shrink` and :meth:`release`; :meth:`sleep` / :meth:`wake` give
    all of it back and take it again, :meth:`offload` / :meth:`restore` move one
    sequence to host memory and back. Create with :func:`kv_arena`.

    Defaults for a cache: ``zero_fill=False`` (tokens are written before the cache API
    reads them; unwritten tokens read as zeros only with ``zero_fill=True``, else a raw
    view may show stale bytes past the written tokens), ``handle_bytes`` =
    :data:`DEFAULT_KV_HANDLE_BYTES` (a commit of many chunks takes few allocations) and
    ``commit_ahead_tokens`` = an eighth of a chunk's tokens: once a sequence is that close
    to the end of its backed chunks, a background thread backs the next chunk, so that the
    decode loop's ``ensure`` makes no driver call (0 turns it off; it stops once the arena
    handed out a raw view, ``kv.k[l]``: hold none on the decode path). In a ``budget`` it
    defaults to 0: its background commits would take room from the budget's other arenas
    whenever the thread runs, so that their next ``ensure`` fits or not by timing; pass
    ``commit_ahead_tokens`` to turn it on there. Step with
    :meth:`cache` (the :class:`~jax_vmm.KVCache` pytree): it makes no raw view.

    The tokens each sequence has ensured form a device-visible table that the kernels
    read: a write past them is dropped and a read past them clamped, both counted for
    :meth:`check`, even where chunk rounding (or commit ahead) happens to back the memory
    (a neighbour's release may take such a chunk away).

    Thread-safe: one lock serialises growth and release; views may be read anywhere.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_tokens: int,
        dtype: Any = jnp.bfloat16,
        device: jax.Device | None = None,
        initial_tokens: int = 0,
        max_seqs: int | None = None,
        chunk_bytes: int | None = None,
        handle_bytes: int | None = None,
        zero_fill: bool = False,
        commit_ahead_tokens: int | None = None,
        k_scales: Any = None,
        v_scales: Any = None,
        budget: MemoryBudget | None = None,
        name: str | None = None,
        layout: str = "per_layer",
        _shard_of: int | None = None,
    ):
        # _shard_of (jax_vmm.kv.sharded only): this arena is one device's shard of a sharded
        # cache; 0 for the first shard (a new uid), else the uid of the first shard, which
        # this one joins. A shard is not registered by uid: its ShardedKVArena is.
        shape = layer_shape(num_layers, num_kv_heads, head_dim, max_tokens, max_seqs)
        initial_tokens = as_index(initial_tokens, "initial_tokens")
        if initial_tokens > max_tokens:
            raise ValueError(f"initial_tokens={initial_tokens} exceeds max_tokens={max_tokens}")
        zero_fill = as_flag(zero_fill, "zero_fill")
        if layout not in KV_LAYOUTS:
            raise ValueError(f"kv_arena: layout must be one of {KV_LAYOUTS}, got {layout!r}")
        self.layout = layout
        self.num_layers = int(num_layers)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.max_tokens = int(max_tokens)
        self.max_seqs = None if max_seqs is None else int(max_seqs)
        self.dtype = np.dtype(jnp.dtype(dtype))
        if np.dtype(jax.dtypes.canonicalize_dtype(self.dtype)) != self.dtype:
            raise TypeError(
                f"kv_arena: dtype {self.dtype} needs jax_enable_x64 (without it JAX computes "
                f"in {jax.dtypes.canonicalize_dtype(self.dtype)}, so no kv_write could match "
                "the cache); use a 32- or 16-bit dtype, or enable x64"
            )
        # One token of one layer's K; a buffer's rows are token_bytes apart (every layer's
        # K and V of a token when interleaved), its sequences seq_bytes.
        self.layer_token_bytes = self.num_kv_heads * self.head_dim * self.dtype.itemsize
        layers_per_buffer = 2 * self.num_layers if layout == "interleaved" else 1
        self.token_bytes = layers_per_buffer * self.layer_token_bytes
        self.seq_bytes = self.max_tokens * self.token_bytes
        seqs = 1 if self.max_seqs is None else self.max_seqs
        # Every buffer is rounded up to whole chunks; ask the driver what a chunk is.
        target = resolve_device(device)
        chunk = _core.resolve_chunk_bytes(
            target.driver,
            target.ordinal,
            0 if chunk_bytes is None else as_index(chunk_bytes, "chunk_bytes"),
        )
        budget = check_budget(budget, "kv_arena")
        if budget is not None:  # before anything is made
            budget._check(
                target, chunk, self._signature(), buffers=2 * self.num_layers // layers_per_buffer
            )
        if handle_bytes is None:
            handle_bytes = max(chunk, DEFAULT_KV_HANDLE_BYTES // chunk * chunk)
        buffer_bytes = seqs * self.seq_bytes
        reserve = 2 * self.num_layers // layers_per_buffer * -(-buffer_bytes // chunk) * chunk
        try:
            self.arena = Arena(
                reserve,
                device=device,
                chunk_bytes=chunk,
                handle_bytes=handle_bytes,
                zero_fill=zero_fill,
                budget=budget,
                name=name,
                _kind="KV arena",
            )
        except (DriverError, ValueError) as e:  # the reservation itself: name our arguments
            raise type(e)(
                f"{self._signature()}: needs {reserve} bytes of address space "
                f"({self._size_formula()}, in whole chunks), and the reservation "
                f"failed: {e}. Lower max_tokens or max_seqs"
            ) from e
        try:
            if layout == "interleaved":
                wide = shape[:-2] + (2 * self.num_layers,) + shape[-2:]
                self._buffers = [self.arena.allocate(wide, self.dtype, name="kv")]
                self.k_buffers = self.v_buffers = self._buffers * self.num_layers
                self.k: LayerViews = _InterleavedViews(self.num_layers, "kv.k")
                self.v: LayerViews = _InterleavedViews(self.num_layers, "kv.v")
            else:
                self.k_buffers = [
                    self.arena.allocate(shape, self.dtype, name=f"k{l}")
                    for l in range(self.num_layers)
                ]
                self.v_buffers = [
                    self.arena.allocate(shape, self.dtype, name=f"v{l}")
                    for l in range(self.num_layers)
                ]
                self._buffers = self.k_buffers + self.v_buffers
                self.k = _LayerViews(self.k_buffers, "kv.k")
                self.v = _LayerViews(self.v_buffers, "kv.v")
            self._scales = self._fp8_scales(k_scales, v_scales, target.device)
            # The identity the cache pytree carries, and the table of ensured tokens.
            self._core_cache = _core.create_kv_cache(
                self.arena._handle,
                [b.id for b in self.k_buffers],
                [b.id for b in self.v_buffers],
                seqs,
                self.max_seqs is not None,
                self.max_tokens,
                self.num_kv_heads,
                self.head_dim,
                self.dtype.name,
                self.dtype.itemsize,
                xla_device_ordinal(target.device),
                _shard_of or 0,
                layout == "interleaved",
            )
            self._shard = _shard_of is not None
            if _shard_of is None:
                register_arena(self)
                if target.device.platform == "cpu":  # its releases may advance the read epoch
                    read_epochs.warm_up(target.device)
            self._lock = threading.RLock()
            # Tokens each sequence asked for through ensure(): decides which chunks shared
            # by two sequences may be released (actual backing can be larger: chunk rounding).
            self._ensured = np.zeros(seqs, np.int64)
            # Tokens known backed (whole chunks from the last ensure), valid while the arena's
            # generation equals _valid_gen: ensure() within them needs no call into the core.
            self._covered = np.zeros(seqs, np.int64)
            self._valid_gen = np.full(seqs, -1, np.int64)
            # The most tokens each slot ever had ensured: past its ensured tokens, rows
            # below this may hold an earlier sequence's bytes (a zero-filling arena zeroes
            # them when they are ensured again: _zero_stale_rows).
            self._ever_ensured = np.zeros(seqs, np.int64)
            self._offloaded: dict[int, Transfer] = {}
            self._sharing_init(seqs)
            self.arena._on_sleep(self._on_arena_sleep)  # the table goes to 0 while asleep
            # Commit ahead: bumped per sequence when its memory is released, so that a commit
            # that was on its way is not counted for (or left to) a sequence that is gone.
            self._epoch = [0] * seqs
            # Per sequence released (or shrunk) while XLA:CPU work was in flight: that work,
            # waited for before the table admits the sequence's tokens again (_outlive_old_writes).
            self._old_work: dict[int, list] = {}
            tokens_per_chunk = max(1, chunk // self.token_bytes)
            # Off by default in a budget: a background commit takes room from the budget's
            # other arenas at a time the caller does not choose, so whether their next
            # ensure fits would depend on a thread's timing.
            self.commit_ahead_tokens = (
                (0 if budget is not None else max(1, tokens_per_chunk // 8))
                if commit_ahead_tokens is None
                else as_index(commit_ahead_tokens, "commit_ahead_tokens")
            )
            self._ahead = CommitAhead(self)
            # covered when a commit ahead was skipped
            self._ahead_blocked = np.full(seqs, -1, np.int64)
            self._ahead_skipped = 0
            self._ahead_failures = 0
            if initial_tokens:
                for seq in range(seqs):
                    self.ensure(initial_tokens, None if self.max_seqs is None else seq)
        except BaseException:  # leave nothing behind: no memory, no place in a budget
            self._abandon()
            raise

    def _abandon(self) -> None:
        """Undo a constructor that raised after its arena was made (an initial_tokens
        commit refused, bad fp8 scales): nobody can reach this object to close it."""
        ahead = getattr(self, "_ahead", None)
        if ahead is not None:
            ahead.stop()
        core = getattr(self, "_core_cache", None)
        if core is not None:
            core.close()
        self.arena.close()

    def _fp8_scales(self, k_scales: Any, v_scales: Any, device: jax.Device) -> tuple | None:
        """Per-layer, per-KV-head float32 scales of an fp8 arena, on its device (None for
        other dtypes)."""
        if self.dtype != FP8_DTYPE:
            if k_scales is not None or v_scales is not None:
                raise ValueError(
                    f"k_scales/v_scales are for fp8 arenas (dtype float8_e4m3fn); this one "
                    f"holds {self.dtype}"
                )
            return None
        shape = (self.num_layers, self.num_kv_heads)
        out = []
        for name, given in (("k_scales", k_scales), ("v_scales", v_scales)):
            x = np.ones(shape, np.float32) if given is None else np.asarray(given)
            if x.dtype != np.float32 or x.shape != shape:
                raise ValueError(
                    f"{name} must be float32 of shape {shape} (num_layers, num_kv_heads), "
                    f"got {x.dtype} {x.shape}"
                )
            check_scale_values(x, name)
            out.append(tuple(jax.device_put(row, device) for row in x))
        return tuple(out)

    @property
    def uid(self) -> int:
        """Process-unique identity of this KV cache (never reused): what a
        :class:`~jax_vmm.KVCache` of it names."""
        return self._core_cache.uid

    def shards_of(self) -> list[KVArena]:
        return [self]

    def layer_id(self, layer: int) -> LayerId:
        layer = layer_index(layer, self.num_layers, "KVArena.layer_id")
        return LayerId(
            cache_uid=self.uid,
            layer=layer,
            num_layers=self.num_layers,
            shape=self.layer_shape,
            dtype=self.dtype.name,
            platform="cpu" if self.arena.device.platform == "cpu" else "gpu",
        )

    def _new_token(self) -> jax.Array:
        # Its value is the read epoch it is made in (read_epochs.py).
        return jax.device_put(np.int32(read_epochs.current(self.uid)), self.arena.device)

    def _layer_scales(self, layer: int) -> tuple[jax.Array, jax.Array]:
        return self._scales[0][layer], self._scales[1][layer]

    def _signature(self) -> str:
        layout = "" if self.layout == "per_layer" else f", layout={self.layout!r}"
        return (
            f"kv_arena(num_layers={self.num_layers}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, max_tokens={self.max_tokens}, "
            f"max_seqs={self.max_seqs}, dtype={self.dtype}{layout})"
        )

    def _size_formula(self) -> str:
        seqs = "" if self.max_seqs is None else " x max_seqs"
        return (
            f"2 x num_layers{seqs} x max_tokens x num_kv_heads x head_dim x "
            f"{self.dtype.itemsize} bytes"
        )

    # -- geometry ------------------------------------------------------------------
    def fresh_view(self, side: int, layer: int) -> jax.Array:
        if self.layout == "interleaved":
            return (self.k if side == 0 else self.v)[layer]  # raises: no such view
        return (self.k_buffers if side == 0 else self.v_buffers)[layer].array

    @property
    def buffers(self) -> list[Buffer]:
        """The arena buffers of the cache, each once (growth and release run over them)."""
        return self._buffers

    def _seq_base(self, seq: int | None, op: str) -> int:
        q = check_seq(seq, self.max_seqs, op)
        return 0 if q is None else q * self.seq_bytes

    def dest(self, layer: int) -> KVDest:
        """The static destination of layer ``layer`` for :func:`jax_vmm.kv_write` /
        ``kv_write_through`` (``dest=kv.dest(l)``): inside ``jit`` it makes the tokens land
        in this arena whatever buffer XLA hands the custom call (a copy when the cache is
        not donated, or on CPU). It names the layer's buffers by uid: once this arena is
        closed or gone, a step traced with it refuses to run instead of writing whatever
        sits at those addresses then."""
        layer = layer_index(layer, self.num_layers, "KVArena.dest")
        self.arena._check_open("KVArena.dest")
        if self.layout == "interleaved":
            raise TypeError(
                "KVArena.dest: this KV arena interleaves every layer in one buffer "
                "(layout='interleaved'), so the array-level kv_write cannot address a layer. "
                "Write through its cache: jax_vmm.kv_write(kv.cache()[layer], k, v, slots)"
            )
        k, v = self.k_buffers[layer], self.v_buffers[layer]
        return KVDest(
            k_address=k.address, v_address=v.address, nbytes=k.nbytes, k_uid=k.uid, v_uid=v.uid
        )

    # -- checks and stats ------------------------------------------------------------------
    def check(self, *arrays: Any) -> None:
        """Raise if a write was dropped or a read clamped since the last check (and reset
        both counts): :class:`~jax_vmm.errors.OutOfBoundsWrite` for dropped writes (its
        message also counts clamped reads), else
        :class:`~jax_vmm.errors.OutOfBoundsRead`.

        Waits for what can still count first: for ``arrays`` (any pytrees of arrays, e.g.
        a step's results), through ``jax.effects_barrier()`` for every computation with a
        kv_write that this thread dispatched, and for every computation on the arena's
        device whose results are still alive (a step that writes a layer, reads it and
        returns only what it read). A step whose results were all dropped is covered by
        none of these: nothing of it can be observed but these counts."""
        writes = self.dropped_writes(*arrays)
        reads = int(self._core_cache.read_clamps())
        if not writes and not reads:
            return
        for b in self.buffers:
            self.arena._handle.reset_drop_count(b.id)
        self._core_cache.reset_read_clamps()
        read_note = (
            f"{reads} attention reads of a sequence (decode_attention, attention, "
            "cudnn_attention) asked for more tokens than it "
            "ensured (none while it is offloaded or the arena asleep) and were clamped to them"
        )
        if writes:
            raise OutOfBoundsWrite(
                f"{writes} K/V row writes into this KV arena were dropped (a token's K and V "
                "rows count apiece): their slot was >= "
                f"num_slots={self.num_slots}, on a page not committed, or past the tokens its "
                "sequence ensured (none while it is offloaded or the arena asleep). Call "
                "kv.ensure(n, seq) for every token before writing it "
                "(slot = seq * max_tokens + position)."
                + self._shared_write_note()
                + (f" Also {read_note}." if reads else ""),
                writes,
                dropped_reads=reads,
            )
        raise OutOfBoundsRead(
            f"{read_note} (lengths past kv.ensure(n, seq) would read zeros or a neighbour's "
            "memory). Pass lengths of at most the tokens each sequence ensured.",
            reads,
        )

    def _away_seqs(self) -> list[int]:
        """Sequences offloaded or on their way: a transfer that has ended (a restore
        landed, an offload failed) is settled first, as the next ensure would."""
        with self._lock:
            if self.arena.closed:  # its transfers and their host copies went with it
                return []
            for q, t in list(self._offloaded.items()):
                if t is not None and t.state in ("restored", "failed"):
                    self._settle(q)
            return sorted(self._offloaded)

    def stats(self) -> KVArenaStats:
        s: Any = self.arena.stats()
        seqs = range(1 if self.max_seqs is None else self.max_seqs)
        tokens = [self.backed_tokens(None if self.max_seqs is None else q) for q in seqs]
        s.update(
            num_layers=self.num_layers,
            max_tokens=self.max_tokens,
            max_seqs=self.max_seqs,
            token_bytes_all_layers=2 * self.num_layers * self.layer_token_bytes,
            backed_tokens=tokens,
            offloaded_seqs=self._away_seqs(),
            commit_ahead_tokens=self.commit_ahead_tokens,
            commits_ahead_skipped=self._ahead_skipped,
            commits_ahead_failed=self._ahead_failures,
            preallocated_equivalent_bytes=2
            * self.num_layers
            * len(tokens)
            * self.max_tokens
            * self.layer_token_bytes,
            **self._sharing_stats(),
        )
        return s

    def __repr__(self) -> str:
        return (
            f"KVArena(layers={self.num_layers}, max_seqs={self.max_seqs}, "
            f"max_tokens={self.max_tokens}, "
            f"heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, "
            f"layout={self.layout}, backed={self.arena.backed_bytes})"
        )
