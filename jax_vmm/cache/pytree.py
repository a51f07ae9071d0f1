"""The KV cache as a JAX pytree: :class:`KVCache` (one :class:`KVLayer` per layer).

An *arena layer* (from ``kv.cache()``) carries no big array at all. Its leaves are one
int32 scalar, the layer's ordering token (plus, for an fp8 arena, the per-KV-head
scales); its static aux data is a :class:`LayerId`: the KV arena's uid, the layer index
and the geometry. So a jitted step that takes and returns the cache never copies it
(nothing big is an XLA value), donated or not, CPU or GPU, in any loop; the identity
survives ``jit``, ``lax.scan``, ``fori_loop``, ``while_loop`` and ``jax.tree_util``
round trips, and it is part of the compile-cache key (same arena: no retrace; another
arena: another executable). ``jax_vmm.kv_write(layer, ...)`` writes the arena in place
through one custom call that finds the buffers by that identity and returns the layer
with a new token; ``jax_vmm.decode_attention(q, layer, lengths)`` takes the token as an
operand, so it runs after the writes that produced it (data dependence).

An *array layer* (``KVLayer.from_arrays(k, v)``, e.g. a plain ``jnp.zeros`` cache)
carries its K/V arrays as leaves; the same functions work on it (a checked functional
scatter, the usual attention call), so a model can switch backends. Donate it on a GPU
for in-place updates.

See docs/kv_cache.md.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.array import ArrayImpl

from ..base.args import layer_index
from ..base.fp8 import FP8_DTYPE, check_scale_values
from ..memory.lookup import describe_buffer, find_view_buffer
from . import read_epochs
from . import registry as _registry
from .ids import LayerId
from .registry import arena_of, live_arenas

__all__ = ["KVCache", "KVLayer", "ArenaNotWrittenWarning", "KVWriteResultUnusedWarning"]


class ArenaNotWrittenWarning(UserWarning):
    """An array-level ``kv_write`` inside ``jit`` on arrays shaped like a live KV arena's
    layer, without ``dest``: XLA hands the call its own copy (always on the CPU, on a GPU
    unless donated), so the arena is not written. Use the cache API (``kv.cache()``,
    ``kv_write(layer, ...)``) or pass ``dest=kv.dest(layer)``."""


class KVWriteResultUnusedWarning(UserWarning):
    """A ``kv_write`` on an arena layer inside ``jit`` whose returned layer nothing uses
    (typically: the step does not return the cache). The write runs and ``kv.check()``
    waits for it, but nothing orders a later read after it, and the step leaves JAX's
    fast dispatch path. Return the cache from the step."""


def _flatten_arena_layer(layer: KVLayer) -> tuple[tuple, LayerId]:
    layer._renew_token()  # a dispatch: the step reads the table of the current epoch
    return layer._leaves, layer._id


#: Flattens an arena layer: (leaves, aux). The seam for
#: ``jax_vmm.testing.identity_stripped()``, which swaps in a flattening that carries the
#: layer's arena views as leaves instead (the naive cache pytree, which XLA copies);
#: nothing else should.
_arena_flatten = _flatten_arena_layer


@dataclasses.dataclass(frozen=True)
class _ArraysId:
    """Aux data of an array layer: it carries scales (fp8) or not."""

    fp8: bool


@jax.tree_util.register_pytree_node_class
class KVLayer:
    """One layer of a KV cache: an arena layer (``kv.cache()[l]``) or an array layer
    (:meth:`from_arrays`). Immutable: ``kv_write`` returns a new one."""

    __slots__ = ("_id", "_leaves", "_written_in_trace", "_epoch")

    def __init__(self, layer_id: LayerId | _ArraysId, leaves: tuple):
        self._id = layer_id
        self._leaves = tuple(leaves)
        # The read epoch its concrete token carries (read_epochs.py); None for a traced
        # token or an array layer.
        self._epoch: int | None = None
        if isinstance(layer_id, LayerId) and type(self._leaves[0]) is ArrayImpl:
            self._epoch = read_epochs.current(layer_id.cache_uid)
        # Set by kv_write when it ran inside the trace that holds this object (not pytree
        # data: a layer that crossed a jit or loop boundary was written in an earlier
        # computation or iteration). jax_vmm.ordered_views refuses such a layer.
        self._written_in_trace = False

    # -- construction ----------------------------------------------------------------
    @classmethod
    def _arena(cls, lid: LayerId, token: Any, scales: tuple = ()) -> KVLayer:
        layer = cls(lid, (token, *scales))
        layer._written_in_trace = isinstance(token, jax.core.Tracer)
        _registry.note_token(lid, token)
        return layer

    @classmethod
    def from_arrays(cls, k: Any, v: Any, *, k_scale: Any = None, v_scale: Any = None) -> KVLayer:
        """An array layer over ``k``, ``v`` (same shape and dtype, ``(..., H, D)``; for
        attention ``(B, T, H, D)``). An fp8 cache needs ``k_scale``, ``v_scale``: float32
        ``(H,)`` per-KV-head scales; it is float8_e4m3fn, or uint8 holding its bits (uint8
        with scales is fp8, without them plain bytes).

        Views of a KV arena are refused: inside ``jit`` XLA copies them, so writes would
        miss the arena; use ``kv.cache()[l]``."""
        warned = False
        for name, x in (("k", k), ("v", v)):
            if not hasattr(x, "shape") or not hasattr(x, "dtype"):
                raise TypeError(f"KVLayer.from_arrays: {name} must be an array, got {type(x)}")
            nbytes = int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
            if isinstance(x, jax.core.Tracer):
                warned = warned or _warn_if_arena_shaped(name, x)
                continue
            found = find_view_buffer(x, nbytes)
            if found is not None:
                raise ValueError(
                    f"KVLayer.from_arrays: {name} is a view of arena "
                    f"{describe_buffer(found['buffer_uid'])}. Inside jit XLA would copy it and "
                    "the arena would not be written: use the arena's own cache, kv.cache()[layer]"
                )
        if tuple(k.shape) != tuple(v.shape) or np.dtype(k.dtype) != np.dtype(v.dtype):
            raise ValueError(
                f"KVLayer.from_arrays: k and v must have one shape and dtype, got "
                f"{tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}"
            )
        if len(k.shape) < 3:
            raise ValueError(
                f"KVLayer.from_arrays: k must be (..., num_kv_heads, head_dim), got {k.shape}"
            )
        dtype = np.dtype(k.dtype)
        fp8 = dtype == FP8_DTYPE or (dtype == np.uint8 and k_scale is not None)
        if fp8 != (k_scale is not None) or (k_scale is None) != (v_scale is None):
            raise ValueError(
                "KVLayer.from_arrays: an fp8 cache (float8_e4m3fn, or uint8 bits) needs "
                "k_scale and v_scale, float32 (H,); other caches take none"
            )
        # NumPy arrays become jax Arrays (on the default device, as jit would put them):
        # an eager kv_write updates the layer with .at[].set.
        k, v = (jnp.asarray(x) if isinstance(x, np.ndarray) else x for x in (k, v))
        heads = k.shape[-2]
        scales = ()
        if fp8:
            scales = (
                check_scale(k_scale, heads, "k_scale"),
                check_scale(v_scale, heads, "v_scale"),
            )
        return cls(_ArraysId(fp8), (k, v, *scales))

    # -- pytree ----------------------------------------------------------------------
    def tree_flatten(self) -> tuple[tuple, Any]:
        if isinstance(self._id, LayerId):
            return _arena_flatten(self)
        return self._leaves, self._id

    @classmethod
    def tree_unflatten(cls, aux: Any, leaves: Sequence[Any]) -> KVLayer:
        # No checks: JAX unflattens with placeholder leaves while tracing.
        if isinstance(aux, _ViewsId):
            return aux.unflatten(leaves)
        if isinstance(aux, LayerId):
            # A jitted step's returned cache is rebuilt here, even on JAX's C++ fast
            # path: the token it carries is what kv.check() waits for.
            _registry.note_token(aux, leaves[0])
        return cls(aux, tuple(leaves))  # _written_in_trace False: it crossed a boundary

    # -- what it is ------------------------------------------------------------------
    @property
    def is_arena(self) -> bool:
        """An arena layer (the arena is the state; no big array travels with it)."""
        return isinstance(self._id, LayerId)

    @property
    def id(self) -> LayerId | None:
        """The static identity of an arena layer, or None for an array layer."""
        return self._id if self.is_arena else None

    @property
    def token(self) -> jax.Array:
        """An arena layer's ordering token (int32 scalar): the custom calls that take it run
        after the writes that produced it."""
        if not self.is_arena:
            raise AttributeError("an array layer has no token: its arrays carry the order")
        self._renew_token()
        return self._leaves[0]

    def _renew_token(self) -> None:
        """A concrete token of an older read epoch is replaced by one of the current epoch
        ordered after it (read_epochs.py): the same layer, read as of now."""
        if self._epoch is None or self._epoch == read_epochs.current(self._id.cache_uid):
            return
        if not read_epochs.renewing:
            return
        token, self._epoch = read_epochs.renew(self._id, self._leaves[0])
        self._leaves = (token, *self._leaves[1:])
        _registry.note_token(self._id, token)

    @property
    def fp8(self) -> bool:
        return self._id.fp8

    @property
    def k_scale(self) -> jax.Array | None:
        """The per-KV-head float32 scales of an fp8 cache (None otherwise)."""
        if not self.fp8:
            return None
        return self._leaves[1] if self.is_arena else self._leaves[2]

    @property
    def v_scale(self) -> jax.Array | None:
        if not self.fp8:
            return None
        return self._leaves[2] if self.is_arena else self._leaves[3]

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of each of K and V."""
        return self._id.shape if self.is_arena else tuple(self._leaves[0].shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self._id.dtype) if self.is_arena else np.dtype(self._leaves[0].dtype)

    # -- reading ---------------------------------------------------------------------
    @property
    def k(self) -> jax.Array:
        """K of this layer. Array layer: the array. Arena layer, outside ``jit``: waits for
        the layer's writes, then a fresh zero-copy view of the arena. Inside ``jit`` an
        arena layer has no K array (the arena is not an XLA value, so XLA never copies
        it): read it with jax_vmm ops, or see :func:`jax_vmm.ordered_views`."""
        return self._array(0, "k")

    @property
    def v(self) -> jax.Array:
        """V of this layer; see :attr:`k`."""
        return self._array(1, "v")

    def _array(self, side: int, name: str) -> jax.Array:
        if not self.is_arena:
            return self._leaves[side]
        token = self.token
        if isinstance(token, jax.core.Tracer):
            raise TypeError(
                f"KVLayer.{name}: inside jit an arena layer has no {name} array (the arena "
                "is not an XLA value, which is why XLA never copies it). Read it with "
                "jax_vmm.decode_attention(q, layer, lengths), or pass kv.k[l] and kv.v[l] "
                "into the jitted function as arguments (never returned) and order them "
                "after this layer's writes: k, v = jax_vmm.ordered_views(layer, k, v)"
            )
        kv = arena_of(self._id, f"KVLayer.{name}")
        jax.block_until_ready(token)
        return kv.fresh_view(side, self._id.layer)

    def __repr__(self) -> str:
        if self.is_arena:
            return f"KVLayer({self._id.describe()}, shape={self._id.shape}, dtype={self._id.dtype})"
        return f"KVLayer(arrays, shape={self.shape}, dtype={self.dtype})"


@dataclasses.dataclass(frozen=True)
class _ViewsId:
    """Aux data of an arena layer flattened with its views as leaves (the testing layer's
    ``identity_stripped()``): unflattens into an array layer, as a cache pytree whose
    leaves are the arrays would be."""

    fp8: bool

    def unflatten(self, leaves: Sequence[Any]) -> KVLayer:
        return KVLayer(_ArraysId(self.fp8), tuple(leaves))


def _warn_if_arena_shaped(name: str, x: Any) -> bool:
    """Inside jit the views of an arena are tracers (nothing says they are views), and
    XLA hands an array layer over them its own copy: the arena is not written. Warn when
    the array is shaped like a live KV arena's layer, as the array-level kv_write does."""
    shape, dtype = tuple(x.shape), np.dtype(x.dtype)
    for kv in live_arenas():
        if kv.layer_shape == shape and kv.dtype == dtype:
            warnings.warn(
                ArenaNotWrittenWarning(
                    f"KVLayer.from_arrays inside jit: {name} is shaped like a layer of a live "
                    f"KV arena ({shape} {dtype}). If it is a view of the arena (kv.{name}[l], "
                    "passed in or kept in a model's own cache), XLA hands this array layer "
                    "its own copy, so kv_write does NOT write the arena and a later read of "
                    "it misses these tokens. Use the arena's own cache: kv.cache()[l]"
                ),
                stacklevel=3,
            )
            return True
    return False


def check_scale(x: Any, heads: int, name: str) -> Any:
    """An fp8 cache's per-KV-head scale (``KVLayer.from_arrays``, ``kv_write_fp8``):
    float32 ``(heads,)``, its values checked when concrete; returned as given."""
    if not hasattr(x, "shape") or tuple(x.shape) != (heads,) or np.dtype(x.dtype) != np.float32:
        raise ValueError(
            f"{name} must be float32 of shape ({heads},), one scale per KV head; got "
            f"{getattr(x, 'dtype', type(x).__name__)} {getattr(x, 'shape', '')}"
        )
    if not isinstance(x, jax.core.Tracer):
        check_scale_values(np.asarray(x), name)  # as kv_arena(k_scales=) does
    return x


@jax.tree_util.register_pytree_node_class
class KVCache:
    """A KV cache: one :class:`KVLayer` per layer. ``len(cache)`` layers, ``cache[l]``,
    ``cache.replace(l, layer)``. Build it with ``kv.cache()`` (arena layers) or
    :meth:`from_arrays`. A registered pytree: pass it into and out of jitted steps and
    loops (donate it: free for an arena cache, an in-place update for an array cache on a
    GPU)."""

    __slots__ = ("_layers",)

    def __init__(self, layers: Sequence[KVLayer]):
        self._layers = tuple(layers)

    @classmethod
    def from_arrays(
        cls,
        ks: Sequence[Any],
        vs: Sequence[Any],
        *,
        k_scales: Sequence[Any] | None = None,
        v_scales: Sequence[Any] | None = None,
    ) -> KVCache:
        """An array cache: layer ``l`` is ``KVLayer.from_arrays(ks[l], vs[l])`` (with its
        scales for an fp8 cache)."""
        if len(ks) != len(vs):
            raise ValueError(f"KVCache.from_arrays: {len(ks)} K arrays but {len(vs)} V arrays")
        n = len(ks)
        k_scales = [None] * n if k_scales is None else list(k_scales)
        v_scales = [None] * n if v_scales is None else list(v_scales)
        if len(k_scales) != n or len(v_scales) != n:
            raise ValueError("KVCache.from_arrays: one k_scale and one v_scale per layer")
        return cls(
            [
                KVLayer.from_arrays(k, v, k_scale=a, v_scale=b)
                for k, v, a, b in zip(ks, vs, k_scales, v_scales)
            ]
        )

    def tree_flatten(self) -> tuple[tuple, None]:
        return self._layers, None

    @classmethod
    def tree_unflatten(cls, aux: None, layers: Sequence[KVLayer]) -> KVCache:
        return cls(layers)

    @property
    def layers(self) -> tuple[KVLayer, ...]:
        return self._layers

    def __len__(self) -> int:
        return len(self._layers)

    def __iter__(self) -> Iterator[KVLayer]:
        return iter(self._layers)

    def __getitem__(self, layer: int) -> KVLayer:
        return self._layers[self._index(layer, "KVCache[...]")]

    def replace(self, layer: int, new: KVLayer) -> KVCache:
        """A cache with layer ``layer`` replaced by ``new`` (``kv_write``'s result for it)."""
        i = self._index(layer, "KVCache.replace")
        if not isinstance(new, KVLayer):
            raise TypeError(f"KVCache.replace: expected a KVLayer, got {type(new).__name__}")
        old = self._layers[i]
        if old.is_arena != new.is_arena or (old.is_arena and old.id != new.id):
            raise ValueError(
                f"KVCache.replace: position {i} holds {old!r}; {new!r} cannot take its place "
                f"(pass the layer kv_write returned for cache[{i}])"
            )
        return KVCache(self._layers[:i] + (new,) + self._layers[i + 1 :])

    def _index(self, layer: Any, op: str) -> int:
        return layer_index(layer, len(self._layers), op)

    def __repr__(self) -> str:
        kinds = {("arena" if layer.is_arena else "arrays") for layer in self._layers}
        return f"KVCache({len(self)} layers, {'/'.join(sorted(kinds)) or 'empty'})"
