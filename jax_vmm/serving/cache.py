"""KV-cache backends for the example, behind one small interface.

Both backends are a `jax_vmm.KVCache` pytree that the jitted steps take and return
(donated), and both are written by `jax_vmm.kv_write(layer, ...)` and read by the chosen
attention: the model does not know which backend it runs on.

* `PreallocatedCache`: the plain-JAX baseline. One `jnp.zeros` (B, T, H_kv, D) per layer
  for K and V (`jax_vmm.KVCache.from_arrays`), written by the checked functional scatter
  of array layers; donated, so XLA updates it in place. All memory is held from the
  start, whatever the sequences need.
* `VmmCache`: `jax_vmm.kv_arena(..., max_seqs=B)` and its `kv.cache()`. The pytree
  carries no big array (one token per layer): every step writes the arena in place on
  any platform, with nothing copied and nothing to donate. Physical memory is committed
  per sequence just before a step needs it (`ensure`) and given back when the sequence
  finishes (`release`).

The host-side methods move memory between steps. Not thread-safe: one decode loop drives
one cache.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

import jax_vmm

from .model import ModelConfig

BACKENDS = ("jax_vmm", "prealloc")
# KV storage: the model's dtype, or fp8 (float8_e4m3fn with float32 scales per layer and
# KV head, here 1.0: the example's random weights give O(1) keys and values).
KV_DTYPES = ("model", "fp8")


def write_layer(
    layer: jax_vmm.KVLayer, new_k: jax.Array, new_v: jax.Array, slots: jax.Array
) -> jax_vmm.KVLayer:
    """What both backends write with (the model's `write`): jax_vmm's cache API."""
    return jax_vmm.kv_write(layer, new_k, new_v, slots)


class CacheBackend(Protocol):
    name: str
    max_seqs: int
    max_tokens: int
    kv_dtype: str  # "model" | "fp8"
    token_bytes: int  # KV bytes per token, all layers
    tail_may_be_garbage: bool  # past a sequence's length: maybe non-finite bit patterns

    def cache(self) -> jax_vmm.KVCache: ...
    def update(self, cache: jax_vmm.KVCache) -> None: ...
    def write(
        self, layer: jax_vmm.KVLayer, new_k: jax.Array, new_v: jax.Array, slots: jax.Array
    ) -> jax_vmm.KVLayer: ...
    def ensure(self, seq: int, num_tokens: int) -> None: ...
    def ensure_all(self, num_tokens: np.ndarray) -> None: ...
    def prefetch(self, seq: int, num_tokens: int) -> None: ...
    def wait_prefetch(self, seq: int, timeout: float) -> bool: ...
    def release(self, seq: int, *, keep_tokens: int = 0) -> None: ...
    def check(self) -> None: ...
    def backed_bytes(self) -> int: ...
    def reserved_bytes(self) -> int: ...
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


class _ReturnedBytes:
    """The largest cache a step returned, in bytes of its arrays: the copy a step would
    pay for a cache pytree that carries its arrays (an arena cache carries tokens)."""

    def __init__(self) -> None:
        self.max = 0

    def note(self, cache: jax_vmm.KVCache) -> None:
        self.max = max(
            self.max,
            sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(cache)),
        )


def kv_storage_dtype(cfg: ModelConfig, kv_dtype: str = "model") -> np.dtype:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    return np.dtype(jnp.float8_e4m3fn) if kv_dtype == "fp8" else np.dtype(cfg.jnp_dtype)


def kv_token_bytes(cfg: ModelConfig, kv_dtype: str = "model") -> int:
    """Bytes one token occupies in the KV cache over all layers (K and V)."""
    itemsize = kv_storage_dtype(cfg, kv_dtype).itemsize
    return cfg.kv_bytes_per_token // cfg.jnp_dtype.itemsize * itemsize


def capacity_bytes(
    cfg: ModelConfig, max_seqs: int, max_tokens: int, kv_dtype: str = "model"
) -> int:
    """What a preallocated cache of this shape holds: every slot at full length."""
    return kv_token_bytes(cfg, kv_dtype) * max_seqs * max_tokens


def _unit_scales(cfg: ModelConfig) -> np.ndarray:
    return np.ones((cfg.num_layers, cfg.num_kv_heads), np.float32)


class PreallocatedCache:
    """Plain-JAX baseline: zeros for the full (max_seqs, max_tokens) from the start."""

    name = "prealloc"
    tail_may_be_garbage = False  # zeros, or finite tokens the model wrote earlier
    write = staticmethod(write_layer)

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        max_seqs: int,
        max_tokens: int,
        device: jax.Device | None = None,
        kv_dtype: str = "model",
    ) -> None:
        self.max_seqs, self.max_tokens = max_seqs, max_tokens
        self.kv_dtype, self.token_bytes = kv_dtype, kv_token_bytes(cfg, kv_dtype)
        dtype = kv_storage_dtype(cfg, kv_dtype)
        shape = (max_seqs, max_tokens, cfg.num_kv_heads, cfg.head_dim)
        with jax.default_device(device) if device is not None else contextlib.nullcontext():
            zeros = jax.jit(lambda: jnp.zeros(shape, dtype))
            ks = [zeros() for _ in range(cfg.num_layers)]
            vs = [zeros() for _ in range(cfg.num_layers)]
            fp8 = kv_dtype == "fp8"
            k_scales = [jnp.asarray(row) for row in _unit_scales(cfg)] if fp8 else None
            v_scales = [jnp.asarray(row) for row in _unit_scales(cfg)] if fp8 else None
        self._cache = jax_vmm.KVCache.from_arrays(ks, vs, k_scales=k_scales, v_scales=v_scales)
        self._bytes = capacity_bytes(cfg, max_seqs, max_tokens, kv_dtype)
        self._returned = _ReturnedBytes()

    def cache(self) -> jax_vmm.KVCache:
        return self._cache

    def update(self, cache: jax_vmm.KVCache) -> None:
        """Takes a step's returned cache (the donated input, updated in place)."""
        self._returned.note(cache)
        self._cache = cache

    def ensure(self, seq: int, num_tokens: int) -> None:
        if num_tokens > self.max_tokens:
            raise ValueError(
                f"sequence {seq} needs {num_tokens} tokens, cache holds "
                f"{self.max_tokens} per sequence"
            )

    def ensure_all(self, num_tokens: np.ndarray) -> None:
        for seq, n in enumerate(num_tokens):
            self.ensure(seq, int(n))

    def prefetch(self, seq: int, num_tokens: int) -> None:
        self.ensure(seq, num_tokens)  # all memory is there: only the bounds check

    def wait_prefetch(self, seq: int, timeout: float) -> bool:
        return True

    def release(self, seq: int, *, keep_tokens: int = 0) -> None:
        pass  # the memory stays held: that is the baseline's cost

    def check(self) -> None:
        pass  # mode="drop" writes past the cache are padding by construction

    def backed_bytes(self) -> int:
        return self._bytes

    def reserved_bytes(self) -> int:
        return self._bytes

    def stats(self) -> dict[str, Any]:
        return {
            "backed_bytes": self._bytes,
            "peak_backed_bytes": self._bytes,
            "commit_calls": 0,
            "commit_seconds": 0.0,
            "returned_cache_bytes": self._returned.max,
        }

    def close(self) -> None:
        for a in jax.tree_util.tree_leaves(self._cache):
            a.delete()
        self._cache = jax_vmm.KVCache([])


class VmmCache:
    """jax_vmm arena cache: memory committed per sequence as it grows, released when the
    sequence finishes."""

    name = "jax_vmm"
    write = staticmethod(write_layer)

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        max_seqs: int,
        max_tokens: int,
        device: jax.Device | None = None,
        chunk_bytes: int | None = None,
        zero_fill: bool = False,
        kv_dtype: str = "model",
        sharding: Any = None,
        commit_ahead_tokens: int | None = None,
        budget: jax_vmm.MemoryBudget | None = None,
        arena_name: str | None = None,
        kv_layout: str = "per_layer",
    ) -> None:
        """zero_fill: committed tokens read as zeros until written (costs a fill per
        commit; for readers of tokens never written). commit_ahead_tokens: how close to
        the end of its backed chunks a sequence gets before the next chunk is committed in
        the background (None: kv_arena's default; see commit_lead_tokens). kv_dtype:
        "model" = the model's dtype, or "fp8" (float8_e4m3fn, scale 1 per layer and KV
        head: docs/kv_cache.md). sharding (jax_vmm.serving.tensor_parallel): one arena per
        device of its mesh. budget: the MemoryBudget the arena draws from
        (docs/sharing.md); arena_name: what its stats and errors call the arena.
        kv_layout: kv_arena's layout ("interleaved": every layer in one buffer, so a
        short sequence or a shared prefix's partial chunk is paid once, not per layer)."""
        device = device or jax.devices()[0]
        # CUDA physical memory (cuMemCreate) comes uninitialised; the host's reads zeros,
        # but is treated alike, so that the CPU runs the GPU's code (and a test run with
        # jax_vmm.testing.fresh_memory_poisoned() shows what the GPU would read).
        self.tail_may_be_garbage = not zero_fill
        self.max_seqs, self.max_tokens = max_seqs, max_tokens
        self.kv_dtype, self.token_bytes = kv_dtype, kv_token_bytes(cfg, kv_dtype)
        fp8 = kv_dtype == "fp8"
        self.kv = jax_vmm.kv_arena(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            max_tokens=max_tokens,
            dtype=kv_storage_dtype(cfg, kv_dtype),
            k_scales=_unit_scales(cfg) if fp8 else None,
            v_scales=_unit_scales(cfg) if fp8 else None,
            device=None if sharding is not None else device,
            max_seqs=max_seqs,
            chunk_bytes=chunk_bytes,
            zero_fill=zero_fill,
            sharding=sharding,
            commit_ahead_tokens=commit_ahead_tokens,
            budget=budget,
            name=arena_name,
            layout=kv_layout,
        )
        self._arenas = [s.arena for s in getattr(self.kv, "shards", [self.kv])]
        self._cache = self.kv.cache()
        # A sharded fp8 cache's scale leaves' first placement (tokens: None), for update.
        self._scale_shardings = (
            [
                None if np.dtype(x.dtype) == np.int32 else x.sharding
                for x in jax.tree.leaves(self._cache)
            ]
            if fp8 and sharding is not None
            else None
        )
        self._returned = _ReturnedBytes()

    def cache(self) -> jax_vmm.KVCache:
        return self._cache

    def update(self, cache: jax_vmm.KVCache) -> None:
        """Takes a step's returned cache: the same arena, with the tokens that order the
        next step after this one's writes."""
        self._returned.note(cache)
        if self._scale_shardings is not None:
            cache = self._scales_placed_as_first(cache)
        self._cache = cache

    def _scales_placed_as_first(self, cache: jax_vmm.KVCache) -> jax_vmm.KVCache:
        """The returned cache with its fp8 scale leaves placed as the first cache's: a step
        returns them as XLA chose (replicated over a mesh), while the next step was
        compiled ahead of time for the first placement (split over the KV heads). The
        values are the arena's fixed scales; the tokens stay as the step returned them."""
        leaves, tree = jax.tree_util.tree_flatten(cache)
        placed = [
            x if want is None or x.sharding == want else jax.device_put(x, want)
            for x, want in zip(leaves, self._scale_shardings)
        ]
        return jax.tree_util.tree_unflatten(tree, placed)

    def ensure(self, seq: int, num_tokens: int) -> None:
        # Exactly what the sequence needs: the arena's table then admits writes up to
        # there, a chunk it shares with a neighbour stays while either needs it, and
        # commit ahead backs the next chunk only once the sequence nears its end. Within
        # backed chunks this makes no call into the core.
        self.kv.ensure(num_tokens, seq)

    def ensure_all(self, num_tokens: np.ndarray) -> None:
        """ensure for every sequence at once (0: nothing asked), one table update."""
        self.kv.ensure_all(num_tokens)

    def prefetch(self, seq: int, num_tokens: int) -> None:
        """Back the tokens on the arena's commit-ahead thread (jax_vmm.KVArena.prefetch):
        the engine ensures them once wait_prefetch says the thread is done."""
        self.kv.prefetch(num_tokens, seq)

    def wait_prefetch(self, seq: int, timeout: float) -> bool:
        return self.kv.wait_prefetch(seq, timeout)

    def release(self, seq: int, *, keep_tokens: int = 0) -> None:
        """keep_tokens: the slot's next sequence starts with that many tokens, whose
        memory stays backed (jax_vmm.KVArena.release). The engine releases a slot only
        once its request finished, and the steps in flight then write the slot's rows as
        idle (slot -1): so no write in flight is for it (writes_in_flight=False), and the
        slot's next ensure does not wait for those steps."""
        if isinstance(self.kv, jax_vmm.KVArena):
            self.kv.release(seq, keep_tokens=keep_tokens, writes_in_flight=False)
        else:  # a sharded arena's shards wait at the release itself
            self.kv.release(seq, keep_tokens=keep_tokens)

    def ensure_shareable(self, seq: int, num_tokens: int) -> None:
        """ensure, with the whole chunks of the tokens as an allocation of their own, so
        that share_prefix maps them on a GPU too (jax_vmm.KVArena.ensure_shareable)."""
        self.kv.ensure_shareable(num_tokens, seq)

    def share_prefix(self, src: int, dst: int, num_tokens: int) -> None:
        """Sequence dst starts with src's first num_tokens tokens, their whole chunks the
        same memory (jax_vmm.KVArena.share_prefix); dst must hold nothing."""
        self.kv.share_prefix(src, dst, num_tokens)

    def check(self) -> None:
        """Raises jax_vmm.OutOfBoundsWrite if a write was dropped (a token not ensured),
        jax_vmm.OutOfBoundsRead if attention read past the ensured tokens."""
        self.kv.check()

    def backed_bytes(self) -> int:
        """Memory held for sequences: backed chunks, and released chunks still inside an
        allocation in use (parked; a kept prompt's allocation can hold some). A chunk
        shared by several sequences (share_prefix) counts once."""
        stats = [a.stats() for a in self._arenas]  # one read of each arena's counters
        return sum(s["backed_bytes"] - s["alias_bytes"] + s["parked_bytes"] for s in stats)

    def reserved_bytes(self) -> int:
        return int(self.kv.reserved_bytes)

    def stats(self) -> dict[str, Any]:
        return dict(self.kv.stats(), returned_cache_bytes=self._returned.max)

    def close(self) -> None:
        self.kv.close()


def commit_lead_tokens(block: int) -> int:
    """The commit-ahead margin the engine needs: it ensures a block's tokens before
    dispatching it, and dispatches block k+1 before reading block k, so a chunk committed
    once a sequence is two blocks from its backed end is ready a block early. Tighter
    than kv_arena's default (an eighth of a chunk: 128 tokens of the gpu preset), which
    backs each next chunk that many tokens earlier than needed."""
    return 2 * block


def make_cache(
    backend: str,
    cfg: ModelConfig,
    *,
    max_seqs: int,
    max_tokens: int,
    device: jax.Device | None = None,
    chunk_bytes: int | None = None,
    kv_dtype: str = "model",
    sharding: Any = None,
    commit_ahead_tokens: int | None = None,
    budget: jax_vmm.MemoryBudget | None = None,
    arena_name: str | None = None,
    kv_layout: str = "per_layer",
) -> CacheBackend:
    """The serving cache of ``backend``; ``arena_name`` names a jax_vmm arena in budget
    stats and errors (a preallocated cache has no arena); ``kv_layout``: the jax_vmm
    arena's layout (``kv_arena(layout=...)``)."""
    kv_storage_dtype(cfg, kv_dtype)  # a bad kv_dtype fails here, before any memory
    if backend == "prealloc":
        if budget is not None:
            raise ValueError("a memory budget (--budget) needs the jax_vmm backend")
        if sharding is not None:
            raise ValueError("a sharded (--tp) cache needs the jax_vmm backend")
        if kv_layout != "per_layer":
            raise ValueError(f"kv layout {kv_layout!r} (--kv-layout) needs the jax_vmm backend")
        return PreallocatedCache(
            cfg, max_seqs=max_seqs, max_tokens=max_tokens, device=device, kv_dtype=kv_dtype
        )
    if backend == "jax_vmm":
        return VmmCache(
            cfg,
            max_seqs=max_seqs,
            max_tokens=max_tokens,
            device=device,
            chunk_bytes=chunk_bytes,
            kv_dtype=kv_dtype,
            sharding=sharding,
            commit_ahead_tokens=commit_ahead_tokens,
            budget=budget,
            arena_name=arena_name,
            kv_layout=kv_layout,
        )
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
