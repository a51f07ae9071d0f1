"""KV-cache backends for the example, behind one small interface.

* `PreallocatedCache`: the plain-JAX baseline. One `jnp.zeros` (B, T, H_kv, D) per layer
  for K and V, updated by a donated scatter (`.at[slots].set`). All memory is held from
  the start, whatever the sequences need.
* `VmmCache`: `jax_vmm.kv_arena(..., max_seqs=B)`. Physical memory is committed per
  sequence just before a step needs it (`ensure`) and given back when the sequence
  finishes (`release`). Both ways of writing (`write=`) name the layer's arena buffers
  with `dest=kv.dest(layer)`, so the tokens always land in the arena:
  - "kv_write" (default on a GPU): `jax_vmm.kv_write`, the cache donated to the step and
    returned by it. With donation honoured (GPU) the returned arrays are the arena
    itself, updated in place, no copy.
  - "through" (default on the CPU): `jax_vmm.kv_write_through`, the cache passed but
    neither donated nor returned. On the CPU, PjRt copies a donated buffer before the
    program runs, so kv_write would also fill an XLA copy of the whole cache every
    step; write-through writes only the arena, with no copy at all.

The jitted steps see only `arrays()` (a pytree of per-layer K and V) and the `write`
function; the host-side methods move memory between steps.
Not thread-safe: one decode loop drives one cache.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from examples.model import Cache, ModelConfig

BACKENDS = ("jax_vmm", "prealloc")


WRITE_MODES = ("auto", "kv_write", "through")


class KVCache(Protocol):
    name: str
    max_seqs: int
    max_tokens: int
    write_through: bool  # steps return write statuses, not the cache (nothing donated)
    tail_may_be_garbage: bool  # past a sequence's length: maybe non-finite bit patterns

    def arrays(self) -> Cache: ...
    def update(self, cache: Cache) -> None: ...
    def write(
        self,
        layer: int,
        k: jax.Array,
        v: jax.Array,
        new_k: jax.Array,
        new_v: jax.Array,
        slots: jax.Array,
    ) -> Any: ...
    def ensure(self, seq: int, num_tokens: int) -> None: ...
    def release(self, seq: int) -> None: ...
    def check(self) -> None: ...
    def backed_bytes(self) -> int: ...
    def reserved_bytes(self) -> int: ...
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


def capacity_bytes(cfg: ModelConfig, max_seqs: int, max_tokens: int) -> int:
    """What a preallocated cache of this shape holds: every slot at full length."""
    return cfg.kv_bytes_per_token * max_seqs * max_tokens


class PreallocatedCache:
    """Plain-JAX baseline: zeros for the full (max_seqs, max_tokens) from the start."""

    name = "prealloc"
    write_through = False
    tail_may_be_garbage = False  # zeros, or finite tokens the model wrote earlier

    def __init__(
        self, cfg: ModelConfig, *, max_seqs: int, max_tokens: int, device: jax.Device | None = None
    ) -> None:
        self.max_seqs, self.max_tokens = max_seqs, max_tokens
        shape = (max_seqs, max_tokens, cfg.num_kv_heads, cfg.head_dim)
        with jax.default_device(device) if device is not None else contextlib.nullcontext():
            zeros = jax.jit(lambda: jnp.zeros(shape, cfg.jnp_dtype))
            self._k = tuple(zeros() for _ in range(cfg.num_layers))
            self._v = tuple(zeros() for _ in range(cfg.num_layers))
        self._bytes = capacity_bytes(cfg, max_seqs, max_tokens)

    def arrays(self) -> Cache:
        return self._k, self._v

    def update(self, cache: Cache) -> None:
        self._k, self._v = cache

    @staticmethod
    def write(
        layer: int, k: jax.Array, v: jax.Array, new_k: jax.Array, new_v: jax.Array, slots: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        b, t, h, d = k.shape
        # Negative slots would wrap around in JAX indexing: send them out of range, where
        # mode="drop" skips them.
        idx = jnp.where(slots < 0, b * t, slots)

        def scatter(cache: jax.Array, new: jax.Array) -> jax.Array:
            flat = cache.reshape(b * t, h, d).at[idx].set(new.astype(cache.dtype), mode="drop")
            return flat.reshape(b, t, h, d)

        return scatter(k, new_k), scatter(v, new_v)

    def ensure(self, seq: int, num_tokens: int) -> None:
        if num_tokens > self.max_tokens:
            raise ValueError(
                f"sequence {seq} needs {num_tokens} tokens, cache holds "
                f"{self.max_tokens} per sequence"
            )

    def release(self, seq: int) -> None:
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
        }

    def close(self) -> None:
        for a in (*self._k, *self._v):
            a.delete()
        self._k = self._v = ()


class VmmCache:
    """jax_vmm arena cache: memory committed per sequence as it grows, released when the
    sequence finishes."""

    name = "jax_vmm"

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        max_seqs: int,
        max_tokens: int,
        device: jax.Device | None = None,
        chunk_bytes: int | None = None,
        write: str = "auto",
    ) -> None:
        import jax_vmm  # only this backend needs the extension

        if write not in WRITE_MODES:
            raise ValueError(f"write must be one of {WRITE_MODES}, got {write!r}")
        device = device or jax.devices()[0]
        if write == "auto":
            write = "through" if device.platform == "cpu" else "kv_write"
        self.write_through = write == "through"
        # Host arenas hand out zero-filled pages (memfd) and read zeros where unbacked;
        # CUDA physical memory (cuMemCreate) comes uninitialised.
        self.tail_may_be_garbage = device.platform != "cpu"
        self._write_fn = jax_vmm.kv_write_through if self.write_through else jax_vmm.kv_write
        self.max_seqs, self.max_tokens = max_seqs, max_tokens
        self.kv = jax_vmm.kv_arena(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            max_tokens=max_tokens,
            dtype=cfg.jnp_dtype,
            device=device,
            max_seqs=max_seqs,
            chunk_bytes=chunk_bytes,
        )
        self._dests = [self.kv.dest(i) for i in range(cfg.num_layers)]
        self._backed_tokens = [0] * max_seqs  # host mirror: skip no-op ensure() calls
        self._cache: Cache | None = None
        self.alias_misses = 0  # steps whose outputs were XLA copies, not the arena
        self.ensure_calls = 0
        self.ensure_seconds = 0.0

    def write(
        self,
        layer: int,
        k: jax.Array,
        v: jax.Array,
        new_k: jax.Array,
        new_v: jax.Array,
        slots: jax.Array,
    ) -> Any:
        return self._write_fn(k, v, new_k, new_v, slots, dest=self._dests[layer])

    def arrays(self) -> Cache:
        if self._cache is not None:
            return self._cache
        # Zero-copy views of the arena (kv_arena caches them until a donation uses one up).
        return (
            tuple(self.kv.k[i] for i in range(self.kv.num_layers)),
            tuple(self.kv.v[i] for i in range(self.kv.num_layers)),
        )

    def update(self, cache: Cache) -> None:
        """Takes a kv_write step's returned cache. With donation honoured (GPU) those
        arrays ARE the arena buffers, updated in place: keep them. Otherwise (an alias
        miss) they are XLA copies; the arena got the same tokens (dest), so drop the
        copies and go on from fresh arena views. Counted: each miss cost a cache copy."""
        aliased = all(
            _address(a) == buf.address
            for arrs, bufs in ((cache[0], self.kv.k_buffers), (cache[1], self.kv.v_buffers))
            for a, buf in zip(arrs, bufs)
        )
        self.alias_misses += not aliased
        self._cache = cache if aliased else None

    def ensure(self, seq: int, num_tokens: int) -> None:
        if num_tokens <= self._backed_tokens[seq]:
            return
        t0 = time.perf_counter()
        self.kv.ensure(num_tokens, seq)
        backed = self.kv.backed_tokens(seq)  # chunk rounding: usually more than asked
        if backed > num_tokens:
            # Claim the rounded-up tokens too (no new memory): the steps will write them
            # without asking again, so a neighbour sharing the last chunk must not
            # release it when it finishes.
            self.kv.ensure(backed, seq)
        self.ensure_seconds += time.perf_counter() - t0
        self.ensure_calls += 1
        self._backed_tokens[seq] = backed

    def release(self, seq: int) -> None:
        self.kv.release(seq)
        self._backed_tokens[seq] = 0

    def check(self) -> None:
        """Raises jax_vmm.OutOfBoundsWrite if a write was dropped (slot not committed)."""
        self.kv.check()

    def backed_bytes(self) -> int:
        return int(self.kv.arena.backed_bytes)

    def reserved_bytes(self) -> int:
        return int(self.kv.arena.reserved_bytes)

    def stats(self) -> dict[str, Any]:
        return dict(self.kv.stats(), alias_misses=self.alias_misses)

    def close(self) -> None:
        self._cache = None
        self.kv.close()


def _address(a: jax.Array) -> int:
    try:
        return a.unsafe_buffer_pointer()
    except Exception:  # deleted or not a single-device array: treat as not aliasing
        return -1


def make_cache(
    backend: str,
    cfg: ModelConfig,
    *,
    max_seqs: int,
    max_tokens: int,
    device: jax.Device | None = None,
    chunk_bytes: int | None = None,
    write: str = "auto",
) -> KVCache:
    if backend == "prealloc":
        return PreallocatedCache(cfg, max_seqs=max_seqs, max_tokens=max_tokens, device=device)
    if backend == "jax_vmm":
        return VmmCache(
            cfg,
            max_seqs=max_seqs,
            max_tokens=max_tokens,
            device=device,
            chunk_bytes=chunk_bytes,
            write=write,
        )
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
