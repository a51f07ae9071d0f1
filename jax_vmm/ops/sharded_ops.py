"""``kv_write``, ``decode_attention`` and ``attention`` (S query rows, options) on a layer
of a sharded KV arena (jax_vmm/kv/sharded.py).

Each op is a ``shard_map`` over the cache's mesh whose body is the single-device cache op
(jax_vmm/ops/layer_ops.py) on the device's shard: the same custom call with the same
attributes on every device (the cache uid names every shard; each handler resolves its
own by device ordinal). The cache is not an XLA value, so nothing of it is gathered or
moved between devices: the operands are the new tokens (split over the KV heads), the
slots and lengths, the queries (split like the cache) and one token per device.

Slots are global (``seq * max_tokens + position``). Each device keeps the slots of its own
block of sequences (as local slots) and turns the others into padding (negative: not
written, not counted); a slot past the whole cache goes, out of range, to the shards of the
first block of sequences, which drop and count it, as a single-device arena would.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..cache.pytree import KVLayer
from ..cache.registry import arena_of
from ..cache.sharding import ShardedLayerId
from . import array_writes as _ops
from . import layer_ops
from .lengths import clamped_counts

__all__ = ["write", "attention", "rows_attention"]


def _token_spec(lid: ShardedLayerId) -> P:
    return P(*lid.mesh.axis_names)


def _local_layer(lid: ShardedLayerId, token: Any, scales: tuple) -> KVLayer:
    """Inside the shard_map body: the device's shard as a single-device arena layer."""
    return KVLayer._arena(lid.local(), token.reshape(()), scales)


def _scales(layer: KVLayer) -> tuple[tuple, tuple]:
    """An fp8 layer's (k_scale, v_scale), split like the KV heads, and their specs; ()
    for other layers."""
    if not layer.id.fp8:
        return (), ()
    return (layer.k_scale, layer.v_scale), (P(layer.id.head_axes),) * 2


def _shard_map(lid: ShardedLayerId, body: Any, in_specs: tuple, out_specs: Any) -> Any:
    # check_vma off: a mesh axis the spec does not name holds replicas whose results
    # agree by construction (each wrote and read the same tokens), which the custom call
    # cannot tell the checker.
    mapped = jax.shard_map(
        body, mesh=lid.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )

    def run(*args: Any) -> Any:
        _refuse_inputs_off_the_mesh(lid, args)
        return mapped(*args)

    return run


def _refuse_inputs_off_the_mesh(lid: ShardedLayerId, args: tuple) -> None:
    """A concrete input committed to a device outside the cache's mesh, said plainly (JAX's
    own error names an internal function). Inside jit, JAX refuses such an argument at
    the jitted call itself."""
    mesh_devices = set(lid.mesh.devices.flat)
    for x in args:
        concrete = isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
        if not concrete or not getattr(x, "committed", True):  # uncommitted: JAX moves it
            continue
        try:
            off = set(x.devices()) - mesh_devices
        except RuntimeError:  # deleted: the call itself will say so
            continue
        if off:
            raise ValueError(
                f"{lid.describe()}: an input of shape {tuple(x.shape)} is committed to "
                f"{sorted(str(d) for d in off)}, off the cache's mesh "
                f"({sorted(str(d) for d in mesh_devices)}); put it on the mesh, e.g. "
                "jax.device_put(x, jax.sharding.NamedSharding(mesh, P()))"
            )


def _local_slots(lid: ShardedLayerId, slots: jax.Array) -> jax.Array:
    """This device's slots: its own sequences' as local slots, the rest padding (-1), and
    a slot past the global cache out of range on the first block of sequences."""
    if lid.seq_axes is None:
        return slots
    local_seqs, tokens = lid.local_shape[0], lid.local_shape[1]
    block = jax.lax.axis_index(lid.seq_axes)
    seq = slots // tokens
    local = seq - block * local_seqs
    mine = (slots >= 0) & (local >= 0) & (local < local_seqs)
    past = (slots >= lid.shape[0] * tokens) & (block == 0)
    out = jnp.where(mine, local * tokens + slots % tokens, -1)
    return jnp.where(past, local_seqs * tokens, out).astype(slots.dtype)


def write(layer: KVLayer, new_k: Any, new_v: Any, slots: Any) -> KVLayer:
    """``jax_vmm.kv_write(layer, new_k, new_v, slots)`` on a sharded arena layer: ``new_k``,
    ``new_v`` ``(n, num_kv_heads, head_dim)`` (global heads), ``slots`` ``(n,)`` global."""
    lid = layer.id
    # Refused here, at the call: a device's refusal inside the shard_map would surface
    # only when its result is waited for (and again at exit).
    arena_of(lid, "kv_write")
    spec = jax.ShapeDtypeStruct(lid.shape, jnp.dtype(lid.dtype))
    n = _ops.check_write("kv_write", spec, spec, new_k, new_v, slots, fp8=lid.fp8)
    if n == 0:
        return layer
    heads = P(None, lid.head_axes, None)
    scales, scale_specs = _scales(layer)

    def body(nk, nv, sl, token, *sc):
        local = _local_layer(lid, token, sc)
        # With the JAX effect: a shard_map whose token went unused would be dropped whole.
        out = layer_ops.write(local, nk, nv, _local_slots(lid, sl), effectful=True)
        return out.token.reshape(token.shape)

    token = _shard_map(
        lid,
        body,
        (heads, heads, P(), _token_spec(lid), *scale_specs),
        _token_spec(lid),
    )(new_k, new_v, slots, layer.token, *scales)
    return KVLayer._arena(lid, token, scales)


def attention(q: Any, layer: KVLayer, lengths: Any, *, scale: float | None = None, **knobs: Any):
    """``jax_vmm.decode_attention(q, layer, lengths)`` on a sharded arena layer: ``q``
    ``(max_seqs, num_q_heads, head_dim)``, ``lengths`` ``(max_seqs,)``, both global; the
    result is split like ``q``'s sequences and heads."""
    lid = layer.id
    if len(lid.shape) != 4:
        raise ValueError(
            f"decode_attention: {lid.describe()} has shape {lid.shape}; attention needs one "
            "buffer row per sequence (kv_arena(..., max_seqs=batch))"
        )
    q_shape = tuple(np.shape(q))
    if len(q_shape) != 3 or q_shape[0] != lid.shape[0] or q_shape[2] != lid.shape[3]:
        raise ValueError(
            f"decode_attention: q must be (max_seqs={lid.shape[0]}, num_q_heads, "
            f"head_dim={lid.shape[3]}) for {lid.describe()}, got {q_shape}"
        )
    if q_shape[1] % lid.shape[2]:
        raise ValueError(
            f"decode_attention: num_q_heads={q_shape[1]} must be a multiple of the cache's "
            f"{lid.shape[2]} KV heads"
        )
    # As an array before shard_map, which would take a list for a pytree of scalars and
    # truncate int64 to int32 (T + 1: see attention_call._clamped_lengths).
    lengths = clamped_counts(lengths, lid.shape[1] + 1)
    if tuple(lengths.shape) != (lid.shape[0],):
        raise ValueError(
            f"decode_attention: lengths must be ({lid.shape[0]},), one per sequence, got "
            f"shape {tuple(lengths.shape)}"
        )
    qspec = P(lid.seq_axes, lid.head_axes, None)
    scales, scale_specs = _scales(layer)

    def body(q_local, len_local, token, *sc):
        local = _local_layer(lid, token, sc)
        return layer_ops.attention(q_local, local, len_local, scale=scale, **knobs)

    return _shard_map(
        lid,
        body,
        (qspec, P(lid.seq_axes), _token_spec(lid), *scale_specs),
        qspec,
    )(q, lengths, layer.token, *scales)


def rows_attention(
    q: jax.Array, layer: KVLayer, lengths: Any, options: dict, *, scale: Any, knobs: dict
) -> jax.Array:
    """``jax_vmm.attention(q, layer, lengths, **options)`` on a sharded arena layer: ``q``
    ``(max_seqs, S, num_q_heads, head_dim)``, ``lengths`` and ``options["q_lengths"]``
    ``(max_seqs,)``, all global and checked by the caller (lengths an array, as
    ``clamped_counts`` makes it); each device runs
    ``layer_ops.rows_attention`` on its shard (an fp8 one with its heads' scales). The
    result is split like ``q``'s sequences and heads."""
    lid = layer.id
    qspec = P(lid.seq_axes, None, lid.head_axes, None)
    q_lengths = options["q_lengths"]
    rest = {k: v for k, v in options.items() if k != "q_lengths"}
    scales, scale_specs = _scales(layer)
    extra = () if q_lengths is None else (q_lengths,)
    extra_specs = () if q_lengths is None else (P(lid.seq_axes),)

    def body(q_local, len_local, token, *rest_args):
        sc, ql = rest_args[: len(scales)], rest_args[len(scales) :]
        local = _local_layer(lid, token, sc)
        local_options = dict(rest, q_lengths=ql[0] if ql else None)
        return layer_ops.rows_attention(
            q_local, local, len_local, local_options, scale=scale, knobs=knobs
        )

    return _shard_map(
        lid,
        body,
        (qspec, P(lid.seq_axes), _token_spec(lid), *scale_specs, *extra_specs),
        qspec,
    )(q, lengths, layer.token, *scales, *extra)
