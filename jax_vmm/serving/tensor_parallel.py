"""Tensor parallelism for the example (`--tp N`): the model's attention heads and MLP split
over N devices, the KV cache split over its KV heads (one jax_vmm arena per device).

Megatron-style column/row splits, left to XLA's SPMD partitioner through the weights'
shardings: q/k/v projections and the MLP's gate/up by output columns (heads, hidden
units), the attention output projection and the MLP's down projection by input rows, so
each layer needs one all-reduce after attention and one after the MLP; embeddings, norms
and the unembedding stay replicated. The model code (`jax_vmm.serving.model`) is unchanged:
its k/v come out of the projections split over KV heads, which is how the sharded cache
takes them (`jax_vmm.kv_write` and `jax_vmm.decode_attention` run per device through
`shard_map`, with no collective over the cache).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import model as M

AXIS = "tp"


def tp_mesh(n: int, platform: str) -> Mesh:
    """A 1-D mesh over the first ``n`` devices of ``platform`` (axis ``tp``)."""
    devices = jax.devices(platform)
    if not 1 <= n <= len(devices):
        raise ValueError(
            f"--tp {n}: needs {max(n, 1)} devices of platform {platform!r}, this machine "
            f"has {len(devices)} (on the CPU, XLA_FLAGS="
            f"--xla_force_host_platform_device_count={max(n, 1)} gives more)"
        )
    return Mesh(np.array(devices[:n]), (AXIS,))


#: What tensor parallelism splits over the devices: the head counts and the MLP width.
SPLIT_FIELDS = ("num_q_heads", "num_kv_heads", "ffn_dim")


def splits_over(cfg: M.ModelConfig, n: int) -> bool:
    return all(getattr(cfg, name) % n == 0 for name in SPLIT_FIELDS)


def check_divisible(cfg: M.ModelConfig, n: int) -> None:
    """The head counts and the MLP width must split evenly over ``n`` devices."""
    for name in SPLIT_FIELDS:
        if getattr(cfg, name) % n:
            raise ValueError(
                f"--tp {n}: the model's {name}={getattr(cfg, name)} is not divisible by {n}"
            )


def cache_sharding(mesh: Mesh) -> NamedSharding:
    """The KV cache split over its KV heads: (max_seqs, max_tokens, H_kv / N, head_dim)."""
    return NamedSharding(mesh, P(None, None, AXIS, None))


def _layer_specs(lp: M.LayerParams) -> M.LayerParams:
    columns, rows, replicated = P(None, AXIS), P(AXIS, None), P()
    bias = None if lp.bq is None else P(AXIS)
    post = None if lp.post_attn_norm is None else replicated
    return M.LayerParams(
        attn_norm=replicated,
        wq=columns,
        wk=columns,
        wv=columns,
        wo=rows,
        mlp_norm=replicated,
        w_gate=columns,
        w_up=columns,
        w_down=rows,
        bq=bias,
        bk=bias,
        bv=bias,
        post_attn_norm=post,
        post_mlp_norm=post,
    )


def param_specs(params: M.Params) -> M.Params:
    """The PartitionSpec of every weight (a Params of specs)."""
    return M.Params(
        embed=P(),
        layers=tuple(_layer_specs(lp) for lp in params.layers),
        final_norm=P(),
        unembed=None if params.unembed is None else P(),
    )


def shard_params(params: M.Params, cfg: M.ModelConfig, mesh: Mesh) -> M.Params:
    """``params`` placed on ``mesh``: heads and MLP split over its devices."""
    check_divisible(cfg, mesh.size)

    def place(x: Any, spec: P) -> Any:
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map(
        place, params, param_specs(params), is_leaf=lambda x: isinstance(x, P)
    )
