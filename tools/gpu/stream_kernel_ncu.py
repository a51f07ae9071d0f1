"""The streaming decode-attention kernel at B32 T8k (H_q 32, H_kv 8, D 128), bf16 and fp8
caches, a few launches each with the default plan, for Nsight Compute (issue 28):

    ncu --clock-control none -k regex:StreamKernel --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
        --section Occupancy python3 tools/gpu/stream_kernel_ncu.py [both|bf16|fp8]

Each dtype's function runs 4 times (compile, then steady launches), so skipping 2
launches profiles one steady launch of each. Prints "done"; the numbers are ncu's.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_vmm import quantize_fp8  # noqa: E402
from jax_vmm.ops.attention import decode_attention_tuned  # noqa: E402

B, T, HQ, HKV, D = 32, 8192, 32, 8, 128


def main(which: str) -> None:
    key = jax.random.PRNGKey(0)
    q = jax.random.normal(key, (B, HQ, D), jnp.float32).astype(jnp.bfloat16)
    lengths = jnp.full((B,), T, jnp.int32)
    k = jax.random.normal(jax.random.fold_in(key, 1), (B, T, HKV, D), jnp.bfloat16)
    v = jax.random.normal(jax.random.fold_in(key, 2), (B, T, HKV, D), jnp.bfloat16)
    k_scale = jnp.full((HKV,), 0.01, jnp.float32)
    v_scale = jnp.full((HKV,), 0.008, jnp.float32)
    k8, v8 = quantize_fp8(k, k_scale), quantize_fp8(v, v_scale)
    fp8 = jax.jit(
        lambda q, k, v, n: decode_attention_tuned(
            q, k, v, n, k_scale=k_scale, v_scale=v_scale, impl="stream"
        )
    )
    bf16 = jax.jit(lambda q, k, v, n: decode_attention_tuned(q, k, v, n, impl="stream"))
    for _ in range(4):
        if which in ("both", "fp8"):
            fp8(q, k8, v8, lengths).block_until_ready()
        if which in ("both", "bf16"):
            bf16(q, k, v, lengths).block_until_ready()
    print("done")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "both")
