"""Which implementation serves an attention call over an arena layer on a GPU when the
caller left the choice to jax_vmm (``impl="auto"``, no plan knobs): cuDNN's SDPA inside
jax_vmm's custom call (``jax_vmm.ops.cudnn_attention``) where the build has it and it
supports the call, else jax_vmm's own kernels.

Why cuDNN first: side by side on the H200 (docs/benchmarks.md, "Older measurements";
``bench/cudnn_attention.py``)
it runs decode at 0.63-1.06x of JAX's own cuDNN call over the same tokens and S > 1 at
0.74-0.99x, where jax_vmm's split-K kernel runs decode at 0.64-1.28x. jax_vmm's kernels
keep what cuDNN does not take: fp8 caches, sharded layers, the CPU, and every explicit
``impl``/plan knob.

``JAX_VMM_ATTENTION=kernels`` keeps jax_vmm's kernels everywhere. It is read when a step is
traced: a step already traced (jit caches traces per function) keeps its choice.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .cudnn_attention import _DTYPES, _MAX_HEAD_DIM, cudnn_available

__all__ = ["attention_backend_mode", "routes_to_cudnn"]

_MODES = ("auto", "kernels")


def attention_backend_mode() -> str:
    """``JAX_VMM_ATTENTION``: "auto" (default) or "kernels"."""
    mode = os.environ.get("JAX_VMM_ATTENTION", "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(
            f"JAX_VMM_ATTENTION={mode!r}: expected one of {_MODES} ('kernels' keeps jax_vmm's "
            "own attention kernels; 'auto' lets cuDNN serve the calls it supports)"
        )
    return mode


def routes_to_cudnn(q_dtype: Any, layer_id: Any, *, default_knobs: bool) -> bool:
    """Whether an attention call of ``q_dtype`` queries over the arena layer ``layer_id``
    runs cuDNN. ``default_knobs``: the caller passed no impl/plan/workspace choice."""
    if not default_knobs or attention_backend_mode() == "kernels":
        return False
    if layer_id.platform != "gpu" or layer_id.sharded or len(layer_id.shape) != 4:
        return False
    dtype = np.dtype(q_dtype)
    if dtype != np.dtype(layer_id.dtype) or dtype not in _DTYPES:
        return False  # fp8 caches and float32 stay with jax_vmm's kernels
    head_dim = layer_id.shape[-1]
    if head_dim % 8 or head_dim > _MAX_HEAD_DIM:
        return False
    return cudnn_available()
