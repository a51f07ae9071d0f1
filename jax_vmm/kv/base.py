"""What a single-device :class:`~jax_vmm.KVArena` and a :class:`~jax_vmm.ShardedKVArena`
have in common: :class:`KVArenaBase`, one interface with one implementation of every
member that does not depend on how many devices hold the cache.

A KV arena is a set of *shards* (:meth:`KVArenaBase.shards_of`): a ``KVArena`` is its own
single shard, a ``ShardedKVArena`` one ``KVArena`` per device. Liveness, byte totals,
drop and clamp counts, closing and the cache pytree are written once over the shards and
four primitives (:meth:`~KVArenaBase.layer_id`, ``_new_token``, ``_layer_scales``,
:meth:`~KVArenaBase.fresh_view`); growth and release, which a sharded arena must run all
or nothing across devices, are the subclasses' own.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ..base.args import as_index, as_int, layer_index, refuse_copy
from ..cache import read_epochs
from ..cache.ids import LayerId
from ..cache.pytree import KVCache, KVLayer
from ..cache.registry import forget_tokens, latest_tokens
from ..memory import host_wait

__all__ = [
    "KVArenaBase",
    "LayerViews",
    "MAX_TOKEN_SLOTS",
    "check_seq",
    "layer_shape",
    "wait_for_writes",
]

#: kv_write addresses a token by an int32 slot (seq * max_tokens + pos): a cache has fewer.
MAX_TOKEN_SLOTS = 2**31


def layer_shape(
    num_layers: Any, num_kv_heads: Any, head_dim: Any, max_tokens: Any, max_seqs: Any
) -> tuple[int, ...]:
    """Checks a KV arena's geometry arguments; returns the shape of each layer's K and V:
    ``(max_seqs, max_tokens, num_kv_heads, head_dim)`` or ``(max_tokens, H, D)``."""
    for name, value in (
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("max_tokens", max_tokens),
    ):
        as_index(value, name, minimum=1)
    shape: tuple[int, ...] = (int(max_tokens), int(num_kv_heads), int(head_dim))
    if max_seqs is not None:
        if isinstance(max_seqs, (bool, np.bool_)):
            raise TypeError("max_seqs must be an integer or None, got bool")
        if as_int(max_seqs, "max_seqs") <= 0:
            raise ValueError(f"max_seqs must be > 0 or None, got {max_seqs}")
        shape = (int(max_seqs),) + shape
    slots = int(np.prod(shape[:-2], dtype=np.int64))
    if slots >= MAX_TOKEN_SLOTS:
        raise ValueError(
            f"max_seqs x max_tokens = {slots} token slots: kv_write addresses a token by an "
            f"int32 slot (seq * max_tokens + pos), so it must be below 2**31; use fewer "
            "sequences or a smaller max_tokens (or several arenas)"
        )
    return shape


def check_seq(seq: Any, max_seqs: int | None, op: str) -> int | None:
    """``seq`` as a sequence index of an arena of ``max_seqs`` sequences (None: an arena
    without a per-sequence layout, which takes seq=None)."""
    if max_seqs is None:
        if seq is not None:
            raise ValueError(
                f"{op}: this KV arena has no per-sequence layout (max_seqs=None); pass seq=None"
            )
        return None
    if seq is None:
        raise ValueError(
            f"{op}: this KV arena has max_seqs={max_seqs}; pass seq=<0..{max_seqs - 1}>"
        )
    seq = as_index(seq, f"{op}: seq")
    if seq >= max_seqs:
        raise ValueError(f"{op}: seq={seq} is out of range; expected 0 <= seq < {max_seqs}")
    return seq


def wait_for_writes(arrays: tuple, uid: int | None = None, devices: Any = ()) -> None:
    """Blocks until the given arrays are computed, the latest returned cache tokens of
    arena ``uid`` are (each waits for every write of its layer before it), every
    computation with a JAX effect (array-level kv_write, kv_write_through, a cache write
    whose result went unused) dispatched from this thread has finished, and so has every
    computation on ``devices`` whose results are alive (a step that writes a layer, reads
    it and returns only what it read has none of the other three)."""
    if arrays:
        jax.block_until_ready(arrays)
    if devices:
        wait_for_live_results(set(devices))
    for token in () if uid is None else latest_tokens(uid):
        try:
            token.block_until_ready()
        except jax.errors.JaxRuntimeError:
            pass  # a failed step's token: it has finished; its error is its results'
    try:
        jax.effects_barrier()
    except jax.errors.JaxRuntimeError:
        # The last such computation failed (JAX keeps raising its error from every barrier
        # until another one replaces it): it has finished, and its error belongs to its
        # own results, not to this check of the counters.
        pass


def wait_for_live_results(devices: set) -> None:
    """``kv.check()``'s wait for the live results on the arena's devices (the seam
    ``jax_vmm.testing.live_results_unwaited()`` swaps)."""
    host_wait.wait_for_live_arrays(devices)


class LayerViews(Sequence[jax.Array]):
    """``kv.k[l]`` / ``kv.v[l]``: a view of layer ``l``'s K or V buffer (a slice gives a
    list). Subclasses say how a view is made."""

    def __init__(self, num_layers: int, name: str):
        self._num_layers = num_layers
        self._name = name

    def __len__(self) -> int:
        return self._num_layers

    def __getitem__(self, layer):  # type: ignore[override]
        if isinstance(layer, slice):
            return [self[i] for i in range(*layer.indices(len(self)))]
        return self._view(layer_index(layer, len(self), self._name))

    @abc.abstractmethod
    def _view(self, layer: int) -> jax.Array: ...


class KVArenaBase(abc.ABC):
    """The interface of a KV arena, single-device or sharded (see the module docstring).

    Subclasses set ``num_layers``, ``num_kv_heads``, ``head_dim``, ``max_tokens``,
    ``max_seqs``, ``dtype`` and ``token_bytes``, and implement the primitives below and
    the growth API (``ensure``, ``ensure_all``, ``prefetch``, ``is_backed``,
    ``wait_prefetch``, ``shrink``, ``release``, ``reclaim``, ``backed_tokens``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_tokens: int
    max_seqs: int | None
    dtype: np.dtype
    token_bytes: int

    # -- primitives ------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def uid(self) -> int:
        """Process-unique identity of this KV cache (never reused): what a
        :class:`~jax_vmm.KVCache` of it names."""

    @abc.abstractmethod
    def shards_of(self) -> Sequence[Any]:
        """The single-device arenas (:class:`~jax_vmm.KVArena`) that hold this cache (a
        KVArena: itself). Typed ``Any`` here: ``kv.arena`` imports this module."""

    @abc.abstractmethod
    def layer_id(self, layer: int) -> LayerId:
        """The static identity of layer ``layer`` (what its cache layer carries)."""

    @abc.abstractmethod
    def fresh_view(self, side: int, layer: int) -> jax.Array:
        """A new zero-copy view of layer ``layer``'s K (side 0) or V (side 1)."""

    @abc.abstractmethod
    def _new_token(self) -> jax.Array:
        """A fresh ordering token for one cache layer."""

    @abc.abstractmethod
    def _layer_scales(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """(k_scale, v_scale) of layer ``layer`` of an fp8 arena."""

    @property
    def _name(self) -> str:
        return type(self).__name__

    @property
    def _fp8(self) -> bool:
        return self.shards_of()[0]._scales is not None

    # -- identity and geometry -------------------------------------------------------
    @property
    def closed(self) -> bool:
        return any(s.arena.closed for s in self.shards_of())

    def check_open(self, op: str) -> None:
        """Raise :class:`~jax_vmm.ArenaClosedError` for ``op`` if the arena was closed."""
        for s in self.shards_of():
            s.arena._check_open(op)

    @property
    def backed_bytes(self) -> int:
        """Bytes backed (summed over the devices of a sharded arena)."""
        return sum(s.arena.backed_bytes for s in self.shards_of())

    @property
    def reserved_bytes(self) -> int:
        return sum(s.arena.reserved_bytes for s in self.shards_of())

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """Shape of each layer's K and V: ``(max_seqs, max_tokens, H, D)`` or ``(T, H, D)``
        (a sharded arena: the global shape)."""
        shape: tuple[int, ...] = (self.max_tokens, self.num_kv_heads, self.head_dim)
        return shape if self.max_seqs is None else (self.max_seqs,) + shape

    @property
    def num_slots(self) -> int:
        return (1 if self.max_seqs is None else self.max_seqs) * self.max_tokens

    # -- the cache pytree ------------------------------------------------------------
    def cache(self) -> KVCache:
        """This arena as a :class:`~jax_vmm.KVCache`: one arena layer per layer. It carries
        no big array (the arena is the state): pass it into and out of jitted steps,
        ``lax.scan``, ``fori_loop``, ``while_loop``; ``jax_vmm.kv_write(cache[l], ...)``
        writes the arena in place and ``jax_vmm.decode_attention(q, cache[l], lengths)``
        reads it. Cheap: call it again for a fresh cache (the arena is the same). A
        sharded arena's layers carry one token element per device and run their ops per
        device (``shard_map``), with no collective over the cache."""
        self.check_open(f"{self._name}.cache")
        fp8 = self._fp8
        return KVCache(
            [
                KVLayer._arena(
                    self.layer_id(layer),
                    self._new_token(),
                    self._layer_scales(layer) if fp8 else (),
                )
                for layer in range(self.num_layers)
            ]
        )

    def scales(self, layer: int) -> tuple[jax.Array, jax.Array] | None:
        """(k_scale, v_scale) of an fp8 arena's layer: float32 ``(num_kv_heads,)``, what
        its tokens are quantized with (a sharded arena: global arrays sharded like the KV
        heads); None for other dtypes."""
        layer = layer_index(layer, self.num_layers, f"{self._name}.scales")
        return self._layer_scales(layer) if self._fp8 else None

    # -- checks ----------------------------------------------------------------------
    def dropped_writes(self, *arrays: Any) -> int:
        """Token writes dropped by kv_write (slot out of range, on an unbacked page, or past
        its sequence's ensured tokens) since the last :meth:`check`, summed over K and V of
        every layer (and every shard: a token dropped on a sequence split over ``h`` head
        shards counts ``h`` times). Waits first, as :meth:`check` does."""
        wait_for_writes(arrays, self.uid, [s.arena.device for s in self.shards_of()])
        return sum(s.arena._handle.drop_count(b.id) for s in self.shards_of() for b in s.buffers)

    def dropped_reads(self, *arrays: Any) -> int:
        """Sequences that ``decode_attention`` over a layer of this cache asked to read past
        their ensured tokens since the last :meth:`check` (each was clamped to them), over
        every layer and call. Waits first, as :meth:`check` does."""
        wait_for_writes(arrays, self.uid, [s.arena.device for s in self.shards_of()])
        return sum(int(s._core_cache.read_clamps()) for s in self.shards_of())

    # -- lifetime --------------------------------------------------------------------
    def close(self) -> None:
        """Close the arena (every shard; idempotent): its memory goes at once and views read
        zeros. A KVCache of it, and a step traced with one, refuse to run after this."""
        forget_tokens(self.uid)
        read_epochs.forget(self.uid)
        for s in self.shards_of():
            s._ahead.stop()
            if not s.arena.closed:  # work in flight still sees its tables (CPU)
                s.arena._wait_for_host_work()
            s._core_cache.close()
            s.arena.close()

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise refuse_copy(self._name, self.shards_of()[0].arena.device, "np.asarray(kv.k[layer])")

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
