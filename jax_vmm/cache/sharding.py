"""How a ``NamedSharding`` lays the KV cache's per-layer shape over a mesh: which mesh axes
split the sequences and the KV heads (the tokens and head_dim axes stay whole), the block
each device holds, and the static identity of a sharded layer (``ShardedLayerId``) that
the sharded ops (``jax_vmm/ops/sharded_ops.py``) run ``shard_map`` over.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .ids import LayerId

__all__ = ["ShardedLayerId", "Layout", "layout"]

SEQS, TOKENS, HEADS, HEAD_DIM = "sequences", "tokens", "KV heads", "head_dim"


@dataclasses.dataclass(frozen=True)
class ShardedLayerId(LayerId):
    """The static identity of one layer of a sharded KV arena. ``shape`` is the global
    layer shape; ``local_shape`` what each device's shard holds; ``mesh`` and ``spec``
    the cache's sharding (``spec`` padded to the layer's rank)."""

    local_shape: tuple[int, ...]
    mesh: jax.sharding.Mesh
    spec: PartitionSpec

    @property
    def sharded(self) -> bool:
        return True

    @property
    def seq_axes(self) -> Any:
        """The mesh axes the sequences are split over (None: not split, or no max_seqs)."""
        return self.spec[0] if len(self.shape) == 4 else None

    @property
    def head_axes(self) -> Any:
        return self.spec[-2]

    def local(self) -> LayerId:
        """The identity each device's handler sees inside ``shard_map``: same uid, the
        shard's shape."""
        return LayerId(
            cache_uid=self.cache_uid,
            layer=self.layer,
            num_layers=self.num_layers,
            shape=self.local_shape,
            dtype=self.dtype,
            platform=self.platform,
        )

    def describe(self) -> str:
        return f"layer {self.layer} of sharded KV arena {self.cache_uid}"


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each device's shard sits in the global layer: its first sequence and head."""

    mesh: jax.sharding.Mesh
    spec: PartitionSpec  # padded to the layer's rank
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    devices: tuple[jax.Device, ...]  # the local devices of the mesh, in mesh order
    seq_start: tuple[int, ...]  # per device
    head_start: tuple[int, ...]  # per device

    @property
    def per_sequence(self) -> bool:
        return len(self.global_shape) == 4

    @property
    def local_seqs(self) -> int:
        return self.local_shape[0] if self.per_sequence else 1

    @property
    def local_heads(self) -> int:
        return self.local_shape[-2]

    @property
    def sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec)


def layout(sharding: Any, global_shape: tuple[int, ...]) -> Layout:
    """Validate ``sharding`` for a layer of ``global_shape`` and place each device's shard."""
    if not isinstance(sharding, NamedSharding):
        raise TypeError(
            "kv_arena: sharding must be a jax.sharding.NamedSharding(mesh, spec) over the "
            f"layer shape {global_shape}, got {type(sharding).__name__}"
        )
    mesh, spec = sharding.mesh, sharding.spec
    rank = len(global_shape)
    names = (SEQS, TOKENS, HEADS, HEAD_DIM) if rank == 4 else (TOKENS, HEADS, HEAD_DIM)
    if len(spec) > rank:
        raise ValueError(
            f"kv_arena: the spec {spec} has {len(spec)} entries; the layer shape "
            f"{global_shape} ({', '.join(names)}) has {rank}"
        )
    entries = tuple(spec) + (None,) * (rank - len(spec))
    for entry, name, size in zip(entries, names, global_shape):
        axes = _axes(entry)
        for a in axes:
            if a not in mesh.axis_names:
                raise ValueError(
                    f"kv_arena: the spec {spec} names mesh axis {a!r}; the mesh has axes "
                    f"{tuple(mesh.axis_names)}"
                )
        if axes and name in (TOKENS, HEAD_DIM):
            raise ValueError(
                f"kv_arena: the spec {spec} shards the {name} axis; a KV arena shards only "
                "the sequences axis (data parallel, needs max_seqs) and the KV-heads axis "
                "(tensor parallel): a sequence's tokens and a head's vector stay on one device"
            )
        ways = math.prod(mesh.shape[a] for a in axes)
        if size % ways:
            what = "max_seqs" if name == SEQS else "num_kv_heads"
            raise ValueError(
                f"kv_arena: {what}={size} is not divisible by the {ways} devices of mesh "
                f"axes {axes} that the spec {spec} splits the {name} over; pick a {what} "
                f"that is a multiple of {ways}"
            )
    devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    if not devices:
        raise ValueError(
            f"kv_arena: the mesh has no device of this process ({jax.process_index()}); each "
            "process makes the arenas of its own devices (docs/sharding.md)"
        )
    platforms = {d.platform for d in devices}
    if len(platforms) != 1:
        raise ValueError(f"kv_arena: the mesh mixes device platforms {sorted(platforms)}")
    padded = PartitionSpec(*entries)
    full = NamedSharding(mesh, padded)
    index_map = full.devices_indices_map(tuple(global_shape))
    first = index_map[devices[0]]
    local_shape = tuple(
        (s.stop if s.stop is not None else n) - (s.start or 0) for s, n in zip(first, global_shape)
    )
    head_dim = rank - 2
    return Layout(
        mesh=mesh,
        spec=padded,
        global_shape=tuple(global_shape),
        local_shape=local_shape,
        devices=tuple(devices),
        seq_start=tuple((index_map[d][0].start or 0) if rank == 4 else 0 for d in devices),
        head_start=tuple(index_map[d][head_dim].start or 0 for d in devices),
    )
