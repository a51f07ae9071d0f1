"""A few calls of every decode-attention kernel variant, for compute-sanitizer memcheck
(tools/gpu/run.sh sanitize:attention): tensor-core kernels at head dims 64, 128, 256 in
bf16 and f16, the simple kernel in f32, each with the scratch and the XLA workspace, with
ragged lengths (full, 1, a third) and a forced split-K plan. The sanitizer judges the
memory accesses; this script only checks that every output is finite.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_vmm.attention import _decode_attention, attention_stats

CASES = [  # (B, T, Hq, Hkv, D, dtype, impl)
    (3, 300, 8, 2, 128, jnp.bfloat16, "tensor_core"),
    (2, 200, 12, 1, 64, jnp.float16, "tensor_core"),
    (2, 64, 4, 4, 256, jnp.bfloat16, "tensor_core"),
    (2, 100, 6, 3, 80, jnp.float32, "simple"),
]


def main() -> None:
    rng = np.random.default_rng(0)
    for B, T, Hq, Hkv, D, dtype, impl in CASES:
        q = jnp.asarray(rng.standard_normal((B, Hq, D), dtype=np.float32)).astype(dtype)
        k = jnp.asarray(rng.standard_normal((B, T, Hkv, D), dtype=np.float32)).astype(dtype)
        lens = jnp.asarray([T, 1] + [T // 3] * (B - 2), jnp.int32)
        for workspace in ("scratch", "xla"):
            out = _decode_attention(
                q, k, k, lens, impl=impl, workspace=workspace, chunk=48, splits=2
            )
            if not np.isfinite(np.asarray(out.astype(jnp.float32))).all():
                raise SystemExit(f"non-finite output: B={B} T={T} D={D} {impl} {workspace}")
    print("memcheck workload done", attention_stats())


if __name__ == "__main__":
    main()
