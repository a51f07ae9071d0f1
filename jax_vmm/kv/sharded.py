"""A KV arena sharded across devices: ``kv_arena(..., sharding=NamedSharding(mesh, spec))``.

``spec`` describes the per-layer cache shape ``(max_seqs, max_tokens, num_kv_heads,
head_dim)`` (or ``(max_tokens, num_kv_heads, head_dim)`` without ``max_seqs``): it may
shard the sequences axis (data parallel) and/or the KV-heads axis (tensor parallel).
Every device of the mesh gets a :class:`~jax_vmm.KVArena` of its own for its block of
sequences and heads (a mesh axis the spec does not name holds replicas: each of its
devices keeps a full copy of its block). All shards share one cache uid, so a jitted step
names the cache once and each device's handler finds its own shard
(``ffi/src/ops/kv_cache/kv_cache.h``). ``kv.k[l]`` is a global ``jax.Array`` with that
sharding whose shards are zero-copy views of the devices' arenas.

Growth and release act on every shard that holds the sequence, all or nothing: a commit
that fails on one device rolls back the shards that had succeeded. See docs/sharding.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ..base.args import as_flag, layer_index
from ..base.errors import OutOfBoundsRead, OutOfBoundsWrite
from ..base.fp8 import FP8_DTYPE
from ..cache.registry import register_arena
from ..cache.sharding import ShardedLayerId, layout
from ..memory.budget import MemoryBudget, check_budget
from .arena import KVArena
from .base import KVArenaBase, LayerViews, check_seq, layer_shape, wait_for_writes
from .sharing import shrink_refused
from .stats import ShardedKVArenaStats

__all__ = ["ShardedKVArena", "ShardedLayerId"]


#: Undoes one shard's ensures after another shard's commit failed (KVArena._roll_back).
#: The seam for ``jax_vmm.testing.sharded_rollback_skipped()``, which swaps in a no-op to
#: show the tests catch a missing rollback; nothing else should.
def _roll_back_shard(shard: KVArena, point: Any) -> None:
    shard._roll_back(point)


def _budgets_by_device(budget: Any, devices: Sequence[jax.Device]) -> dict[jax.Device, Any]:
    """The budget of each device of the mesh: none, or one MemoryBudget per device (a
    budget caps one device, so a single one fits only a one-device mesh)."""
    if budget is None:
        return {}
    if isinstance(budget, MemoryBudget):
        budget = [budget]
    if isinstance(budget, (str, bytes)) or not isinstance(budget, Sequence):
        raise TypeError(
            "kv_arena(sharding=...): budget must be a sequence of jax_vmm.MemoryBudget, one "
            f"per device of the mesh, got {type(budget).__name__}"
        )
    out: dict[jax.Device, Any] = {}
    for b in budget:
        check_budget(b, "kv_arena(sharding=...)")
        if b is None or b.device in out:
            raise ValueError(
                "kv_arena(sharding=...): budget must hold one MemoryBudget per device of "
                f"the mesh; {'None' if b is None else b.device} is given twice or is None"
            )
        out[b.device] = b
    if set(out) != set(devices):
        raise ValueError(
            "kv_arena(sharding=...): a budget caps one device, and the mesh has "
            f"{len(devices)}: pass one MemoryBudget per device of the mesh "
            f"({sorted(str(d) for d in devices)}), got budgets on "
            f"{sorted(str(d) for d in out)}"
        )
    return out


class ShardedKVArena(KVArenaBase):
    """A KV arena split over the devices of a mesh: one :class:`~jax_vmm.KVArena` per local
    device (``kv.shards``, in mesh order), each over its block of sequences and KV heads.
    Create with ``jax_vmm.kv_arena(..., sharding=NamedSharding(mesh, spec))``.

    Sequence numbers and slots are global (``slot = seq * max_tokens + position``);
    ``ensure``, ``ensure_all``, ``shrink`` and ``release`` act on every shard that holds a
    sequence, all or nothing for growth (a commit that fails on one device is rolled back
    on the others). ``check`` and ``stats`` cover every shard. ``kv.k[l]`` / ``kv.v[l]``:
    global arrays of ``sharding`` whose shards are zero-copy views of the arenas (raw
    views: see :class:`~jax_vmm.KVArena`). ``cache()``: the :class:`~jax_vmm.KVCache`
    pytree, whose ops run per device through ``shard_map``.

    Not offered for a sharded cache (yet): sleep/wake, offload/restore, ``dest``,
    ``ordered_views``; use the shards' own methods only through this class.

    Thread-safe: growth, release and checks take every shard's lock, in mesh order.
    """

    def __init__(self, *, sharding: Any, **kw: Any):
        num_layers = kw["num_layers"]
        max_seqs = kw.get("max_seqs")
        heads, head_dim, max_tokens = kw["num_kv_heads"], kw["head_dim"], kw["max_tokens"]
        if kw.get("device") is not None:
            raise ValueError(
                "kv_arena: pass either device= (one arena) or sharding= (one per device of "
                "the mesh), not both"
            )
        if kw.get("layout", "per_layer") != "per_layer":
            raise ValueError(
                f"kv_arena: layout={kw['layout']!r} is for one device; a sharded arena "
                "(sharding=) keeps its layers in buffers of their own (layout='per_layer')"
            )
        kw.pop("layout", None)
        # The shards check every other argument; the layout needs the geometry first.
        shape = layer_shape(num_layers, heads, head_dim, max_tokens, max_seqs)
        self._layout = split = layout(sharding, shape)
        self.sharding = split.sharding
        self.mesh = split.mesh
        self.num_layers = int(num_layers)
        self.num_kv_heads = int(heads)
        self.head_dim = int(head_dim)
        self.max_tokens = int(max_tokens)
        self.max_seqs = None if max_seqs is None else int(max_seqs)
        scales = {k: kw.pop(k, None) for k in ("k_scales", "v_scales")}
        if _is_fp8(kw.get("dtype")):
            _check_global_scales(scales, int(num_layers), int(heads))
        budgets = _budgets_by_device(kw.pop("budget", None), split.devices)
        self.shards: list[KVArena] = []
        try:
            for i, device in enumerate(split.devices):
                h0 = split.head_start[i]
                local = {
                    k: None
                    if v is None
                    else np.asarray(v)[:, h0 : h0 + split.local_heads]
                    if np.ndim(v) == 2
                    else v  # a bad shape: the shard says what it needs
                    for k, v in scales.items()
                }
                self.shards.append(
                    KVArena(
                        **{
                            **kw,
                            "device": device,
                            "num_kv_heads": split.local_heads,
                            "max_seqs": None if max_seqs is None else split.local_seqs,
                            "budget": budgets.get(device),
                        },
                        **local,
                        _shard_of=self.shards[0].uid if self.shards else 0,
                    )
                )
                # Its sharing refusals reach this arena's caller: they name this class
                # and the global sequences (the shard's local q is global q + start).
                self.shards[-1]._api = "ShardedKVArena"
                self.shards[-1]._seq_offset = split.seq_start[i]
        except BaseException:
            for shard in self.shards:
                shard.close()
            raise
        self.dtype = self.shards[0].dtype
        self.token_bytes = self.shards[0].token_bytes * (self.num_kv_heads // split.local_heads)
        self.k = _GlobalViews(self, 0, "kv.k")
        self.v = _GlobalViews(self, 1, "kv.v")
        register_arena(self)

    # -- identity and geometry ---------------------------------------------------------
    @property
    def uid(self) -> int:
        """The cache uid every shard registers under (what a KVCache of it names)."""
        return self.shards[0].uid

    def layer_id(self, layer: int) -> ShardedLayerId:
        layer = layer_index(layer, self.num_layers, "ShardedKVArena.layer_id")
        device = self._layout.devices[0]
        return ShardedLayerId(
            cache_uid=self.uid,
            layer=layer,
            num_layers=self.num_layers,
            shape=self._layout.global_shape,
            dtype=self.dtype.name,
            platform="cpu" if device.platform == "cpu" else "gpu",
            local_shape=self._layout.local_shape,
            mesh=self.mesh,
            spec=self._layout.spec,
        )

    def _global(self, shape: tuple[int, ...], spec: PartitionSpec, parts: list) -> jax.Array:
        """One global array of ``shape`` and ``spec`` from the shards' per-device arrays."""
        return jax.make_array_from_single_device_arrays(
            shape, NamedSharding(self.mesh, spec), parts
        )

    def shards_of(self) -> list[KVArena]:
        return self.shards

    def _new_token(self) -> jax.Array:
        """One int32 per device, laid out like the mesh."""
        ones = (1,) * len(self.mesh.axis_names)
        return self._global(
            tuple(self.mesh.devices.shape),
            PartitionSpec(*self.mesh.axis_names),
            [jax.device_put(np.zeros(ones, np.int32), d) for d in self._layout.devices],
        )

    def _layer_scales(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """Global ``(num_kv_heads,)`` scales, sharded like the KV heads."""
        spec = PartitionSpec(self.layer_id(layer).head_axes)
        k, v = (
            self._global(
                (self.num_kv_heads,), spec, [s._layer_scales(layer)[i] for s in self.shards]
            )
            for i in (0, 1)
        )
        return k, v

    def fresh_view(self, side: int, layer: int) -> jax.Array:
        return self._global(
            self._layout.global_shape,
            self._layout.spec,
            [s.fresh_view(side, layer) for s in self.shards],
        )

    # -- which shards hold a sequence ----------------------------------------------------
    def _holders(self, seq: Any, op: str) -> list[tuple[KVArena, int | None]]:
        """(shard, local sequence) for every shard that holds global sequence ``seq``."""
        seq = check_seq(seq, self.max_seqs, op)
        if seq is None:
            return [(s, None) for s in self.shards]
        n = self._layout.local_seqs
        return [
            (s, int(seq) - start)
            for s, start in zip(self.shards, self._layout.seq_start)
            if start <= seq < start + n
        ]

    def _locked(self) -> _AllLocks:
        return _AllLocks(self.shards)

    # -- growth and release: all or nothing ----------------------------------------------
    def _all_or_nothing(self, steps: list[tuple[KVArena, dict[int, int], Any]]) -> int:
        """Run ``step()`` for each (shard, {local seq: tokens} it may commit, step); if one
        raises, roll back the shards that had succeeded and re-raise. Caller holds every
        shard's lock."""
        done: list[tuple[KVArena, Any]] = []
        added = 0
        for shard, asks, step in steps:
            point = shard._ensure_point(asks)
            try:
                added += step()
            except BaseException:
                for other, p in reversed(done):
                    _roll_back_shard(other, p)
                _roll_back_shard(shard, point)  # a failed ensure undid itself; the table too
                raise
            done.append((shard, point))
        return added

    def ensure(self, num_tokens: int, seq: int | None = None) -> int:
        """Back the first ``num_tokens`` tokens of global sequence ``seq`` on every shard
        that holds it, all or nothing across devices. Returns the bytes newly committed,
        summed over the devices."""
        num_tokens = self.shards[0]._check_tokens(num_tokens, "ShardedKVArena.ensure")
        holders = self._holders(seq, "ShardedKVArena.ensure")
        with self._locked():
            self.check_open("ShardedKVArena.ensure")
            steps = []
            for shard, q in holders:
                q0 = 0 if q is None else q
                commits = not shard._backed_already(np.array([num_tokens]), [q0])[0]
                asks = {q0: num_tokens} if commits else {}
                steps.append((shard, asks, lambda s=shard, q=q: s.ensure(num_tokens, q)))
            return self._all_or_nothing(steps)

    def ensure_all(self, num_tokens: Sequence[int]) -> int:
        """:meth:`ensure` for every global sequence at once (``num_tokens[q]`` for sequence
        ``q``), one all-or-nothing commit across devices."""
        if self.max_seqs is None:
            raise ValueError("ShardedKVArena.ensure_all needs a per-sequence layout (max_seqs)")
        tokens = np.asarray(None if isinstance(num_tokens, (str, bytes)) else num_tokens)
        if tokens.dtype == np.bool_ or not np.issubdtype(tokens.dtype, np.integer):
            raise TypeError(
                f"ShardedKVArena.ensure_all: num_tokens must be {self.max_seqs} ints (one per "
                f"sequence), got {num_tokens!r}"
            )
        if tokens.shape != (self.max_seqs,):
            raise ValueError(
                f"ShardedKVArena.ensure_all: num_tokens has shape {tokens.shape}; expected "
                f"({self.max_seqs},), one entry per sequence"
            )
        n = self._layout.local_seqs
        with self._locked():
            self.check_open("ShardedKVArena.ensure_all")
            steps = []
            for shard, start in zip(self.shards, self._layout.seq_start):
                local = shard._token_array(tokens[start : start + n])
                need = np.flatnonzero((local > 0) & ~shard._backed_already(local))
                asks = {int(q): int(local[q]) for q in need}
                steps.append((shard, asks, lambda s=shard, t=local: s.ensure_all(t)))
            return self._all_or_nothing(steps)

    def prefetch(self, num_tokens: int, seq: int | None = None) -> None:
        """:meth:`KVArena.prefetch` on every shard that holds global sequence ``seq``."""
        num_tokens = self.shards[0]._check_tokens(num_tokens, "ShardedKVArena.prefetch")
        self.check_open("ShardedKVArena.prefetch")
        for shard, q in self._holders(seq, "ShardedKVArena.prefetch"):
            shard.prefetch(num_tokens, q)

    def is_backed(self, num_tokens: int, seq: int | None = None) -> bool:
        """:meth:`KVArena.is_backed` on every shard that holds global sequence ``seq``."""
        num_tokens = self.shards[0]._check_tokens(num_tokens, "ShardedKVArena.is_backed")
        return all(
            s.is_backed(num_tokens, q) for s, q in self._holders(seq, "ShardedKVArena.is_backed")
        )

    def wait_prefetch(self, seq: int | None = None, timeout: float | None = None) -> bool:
        """:meth:`KVArena.wait_prefetch` on every shard that holds global sequence ``seq``
        (``timeout`` for each)."""
        holders = self._holders(seq, "ShardedKVArena.wait_prefetch")
        return all([s.wait_prefetch(q, timeout) for s, q in holders])

    def shrink(self, num_tokens: int, *, wait: bool = False) -> int:
        """Release memory past the first ``num_tokens`` tokens of every sequence, on every
        shard. Returns bytes released, summed over the devices."""
        num_tokens = self.shards[0]._check_tokens(num_tokens, "ShardedKVArena.shrink")
        wait = as_flag(wait, "wait")
        with self._locked():
            self.check_open("ShardedKVArena.shrink")
            for s in self.shards:  # a shard asleep: no shard changes
                s._check_awake("ShardedKVArena.shrink")
            over: dict[int, int] = {}  # a prefix shared on any shard: no shard changes
            for s in self.shards:
                over.update(s._over_floor(num_tokens))
            if over:
                raise shrink_refused("ShardedKVArena.shrink", over)
            return _each(self.shards, lambda s: s.shrink(num_tokens, wait=wait))

    def release(
        self,
        seq: int | None = None,
        *,
        wait: bool = False,
        reuse: bool = False,
        keep_tokens: int = 0,
    ) -> int:
        """Give back all memory of global sequence ``seq`` on every shard that holds it
        (``keep_tokens``: :meth:`KVArena.release`). Returns bytes released, summed over the
        devices. Every shard is released even if one raises (its error is raised after)."""
        holders = self._holders(seq, "ShardedKVArena.release")
        wait = as_flag(wait, "wait")
        reuse = as_flag(reuse, "reuse")
        keep = self.shards[0]._check_keep_tokens(keep_tokens, "ShardedKVArena.release")
        with self._locked():
            self.check_open("ShardedKVArena.release")
            for s, _ in holders:  # a shard asleep: no shard changes
                s._check_awake("ShardedKVArena.release")
            return _each(
                holders,
                lambda h: h[0].release(h[1], wait=wait, reuse=reuse, keep_tokens=keep),
            )

    def ensure_shareable(self, num_tokens: int, seq: int | None = None) -> int:
        """:meth:`KVArena.ensure_shareable` on every shard that holds global sequence
        ``seq``, all or nothing across devices."""
        num_tokens = self.shards[0]._check_tokens(num_tokens, "ShardedKVArena.ensure_shareable")
        holders = self._holders(seq, "ShardedKVArena.ensure_shareable")
        with self._locked():
            self.check_open("ShardedKVArena.ensure_shareable")
            steps = [
                (
                    shard,
                    {0 if q is None else q: num_tokens},
                    lambda s=shard, q=q: s.ensure_shareable(num_tokens, q),
                )
                for shard, q in holders
            ]
            return self._all_or_nothing(steps)

    def share_prefix(self, src_seq: int, dst_seq: int, num_tokens: int) -> dict[str, int]:
        """:meth:`KVArena.share_prefix` on every shard that holds the two global sequences
        (each device maps its own memory), all or nothing: a shard that refuses or fails
        releases ``dst_seq`` on the shards done before it. Both sequences must be held by
        the same shards (heads sharded, or one sequence shard holding both); sequences on
        different devices cannot share memory. Returns the byte counts summed over the
        devices."""
        op = "ShardedKVArena.share_prefix"
        src = self._holders(src_seq, op)
        dst = self._holders(dst_seq, op)
        if [s for s, _ in src] != [s for s, _ in dst]:
            raise ValueError(
                f"{op}: sequences {src_seq} and {dst_seq} live on different devices; a "
                "prefix is shared within one device's memory only: pick a dst_seq on the "
                "same sequence shard"
            )
        total = {"mapped_bytes": 0, "copied_bytes": 0}
        # Each shard's background commit of dst ends first, before the shards' locks are
        # taken: it ends under its shard's lock (KVArena.share_prefix).
        for shard, qd in dst:
            shard._ahead.wait_for(qd, None)
        with self._locked():
            done: list[tuple[KVArena, int]] = []
            for (shard, qs), (_, qd) in zip(src, dst):
                try:
                    got = shard._share_prefix(qs, qd, num_tokens, wait_for_dst=False)
                except BaseException:
                    for other, q in reversed(done):
                        other.release(q)
                    raise
                done.append((shard, qd))
                for key in total:
                    total[key] += got[key]
        return total

    def reclaim(self) -> int:
        return _each(self.shards, lambda s: s.reclaim())

    def backed_tokens(self, seq: int | None = None) -> int:
        """Tokens from position 0 of global sequence ``seq`` backed on every shard holding it."""
        return min(
            s.backed_tokens(q) for s, q in self._holders(seq, "ShardedKVArena.backed_tokens")
        )

    # -- checks and stats ----------------------------------------------------------------
    def check(self, *arrays: Any) -> None:
        """:meth:`KVArena.check` over every shard: waits for ``arrays`` and this thread's
        writes, then raises :class:`~jax_vmm.errors.OutOfBoundsWrite` (or
        ``OutOfBoundsRead``) if any shard dropped a write (clamped a read), naming the
        devices; every shard's counts are reset."""
        wait_for_writes(arrays, self.uid, [s.arena.device for s in self.shards])
        with self._locked():
            errors = []
            for shard in self.shards:
                try:
                    shard.check()
                except (OutOfBoundsWrite, OutOfBoundsRead) as e:
                    errors.append((shard, e))
        if not errors:
            return
        writes = sum(e.count for _, e in errors if isinstance(e, OutOfBoundsWrite))
        reads = sum(
            e.dropped_reads if isinstance(e, OutOfBoundsWrite) else e.count for _, e in errors
        )
        where = "; ".join(f"{s.arena.device}: {e}" for s, e in errors)
        if writes:
            raise OutOfBoundsWrite(
                f"sharded KV arena: {writes} K/V row writes dropped over "
                f"{len(errors)} of {len(self.shards)} devices (one per device holding the "
                f"token's heads) -- {where}",
                writes,
                dropped_reads=reads,
            )
        raise OutOfBoundsRead(f"sharded KV arena: {where}", reads)

    def stats(self) -> ShardedKVArenaStats:
        """Totals over the devices (bytes reserved, backed, peak backed, held and shared,
        chunks shared; commit and decommit calls and seconds), ``backed_tokens`` per global
        sequence, and ``devices``: each shard's :meth:`KVArena.stats` with its device."""
        per = [dict(s.stats(), device=str(s.arena.device)) for s in self.shards]
        totals = (
            "reserved_bytes",
            "backed_bytes",
            "peak_backed_bytes",
            "held_bytes",
            "shared_bytes",
            "chunks_shared",
            "commit_calls",
            "commit_seconds",
            "decommit_calls",
            "decommit_seconds",
        )
        out: Any = {key: sum(p[key] for p in per) for key in totals}
        seqs = [None] if self.max_seqs is None else range(self.max_seqs)
        out.update(
            num_layers=self.num_layers,
            max_tokens=self.max_tokens,
            max_seqs=self.max_seqs,
            num_devices=len(self.shards),
            sharding=str(self.sharding),
            backed_tokens=[self.backed_tokens(q) for q in seqs],
            devices=per,
        )
        return out

    # -- not offered for a sharded cache --------------------------------------------
    def _unsupported(self, op: str, instead: str) -> NotImplementedError:
        return NotImplementedError(
            f"ShardedKVArena.{op} is not supported for a sharded KV arena (one KVArena per "
            f"device, kv.shards); {instead}"
        )

    def sleep(self, keep: str = "host") -> None:
        raise self._unsupported(
            "sleep", "close() it to give its memory back, or use an unsharded kv_arena"
        )

    def wake(self) -> None:
        raise self._unsupported("wake", "a sharded KV arena cannot sleep")

    def offload(self, seq: int | None = None, *, wait: bool = True) -> Any:
        raise self._unsupported(
            "offload", "release(seq) a sequence's memory instead, or use an unsharded kv_arena"
        )

    def restore(self, seq: int | None = None, *, wait: bool = True) -> Any:
        raise self._unsupported("restore", "a sharded KV arena cannot offload")

    def dest(self, layer: int) -> Any:
        raise self._unsupported(
            "dest",
            "write it through the cache API: cache = kv.cache(); "
            "jax_vmm.kv_write(cache[l], new_k, new_v, slots)",
        )

    def __repr__(self) -> str:
        return (
            f"ShardedKVArena(layers={self.num_layers}, shape={self._layout.global_shape}, "
            f"spec={self._layout.spec}, devices={len(self.shards)}, dtype={self.dtype})"
        )


def _is_fp8(dtype: Any) -> bool:
    try:
        return np.dtype(dtype) == FP8_DTYPE
    except TypeError:
        return False  # the shards say what is wrong with it


def _check_global_scales(scales: dict[str, Any], num_layers: int, heads: int) -> None:
    """The shards check their own slices; a wrong global shape is named here as given
    (the shard would name its slice's shape)."""
    want = (num_layers, heads)
    for name, given in scales.items():
        if given is None:
            continue
        shape = tuple(np.shape(given))
        if shape != want:
            raise ValueError(
                f"{name} must be float32 of shape {want} (num_layers, num_kv_heads: the "
                f"global KV heads of the sharded arena), got {np.asarray(given).dtype} {shape}"
            )


def _each(items: Sequence[Any], op: Any) -> int:
    """``op(item)`` for every item even if some raise; the sum, or the first error."""
    total, error = 0, None
    for item in items:
        try:
            total += op(item)
        except Exception as e:  # noqa: BLE001 - re-raised below, after every shard ran
            error = error or e
    if error is not None:
        raise error
    return total


class _AllLocks:
    """Every shard's lock, taken in mesh order (one order everywhere: no deadlock)."""

    def __init__(self, shards: Sequence[KVArena]):
        self._locks = [s._lock for s in shards]

    def __enter__(self) -> None:
        for lock in self._locks:
            lock.acquire()

    def __exit__(self, *exc: object) -> None:
        for lock in reversed(self._locks):
            lock.release()


class _GlobalViews(LayerViews):
    """``kv.k[l]``: a global array of the arena's sharding over the shards' views."""

    def __init__(self, kv: ShardedKVArena, side: int, name: str):
        super().__init__(kv.num_layers, name)
        self._kv, self._side = kv, side

    def _view(self, layer: int) -> jax.Array:
        return self._kv._global(
            self._kv._layout.global_shape,
            self._kv._layout.spec,
            [(s.k if self._side == 0 else s.v)[layer] for s in self._kv.shards],
        )
