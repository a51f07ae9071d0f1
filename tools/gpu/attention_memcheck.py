"""A few calls of every decode-attention kernel variant, for compute-sanitizer memcheck
(tools/gpu/run.sh sanitize:attention): split-K tensor-core kernels at head dims 64, 128,
256 in bf16 and f16, the simple kernel in f32, each with the scratch and the XLA
workspace and a forced split-K plan; the streaming kernel (stream, stream_combine,
stream_tma) on bf16 and fp8 caches at the same head dims, with forced partitions (units cut
into pieces across CTAs) and the automatic plan; the split-K kernels' general-attention
instantiations (S query rows, q_lengths, window, softcap). Ragged lengths (full, 1, a
third). The
sanitizer judges the memory accesses; this script only checks that every output is
finite.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_vmm import attention_stats, quantize_fp8
from jax_vmm.ops.attention import decode_attention_tuned
from jax_vmm.ops.general_attention import attention_tuned

CASES = [  # (B, T, Hq, Hkv, D, dtype, impl)
    (3, 300, 8, 2, 128, jnp.bfloat16, "tensor_core"),
    (2, 200, 12, 1, 64, jnp.float16, "tensor_core"),
    (2, 64, 4, 4, 256, jnp.bfloat16, "tensor_core"),
    (2, 100, 6, 3, 80, jnp.float32, "simple"),
]
STREAM_CASES = [  # (B, T, Hq, Hkv, D, fp8)
    (3, 300, 8, 2, 128, False),
    (2, 200, 12, 1, 64, True),
    (2, 64, 16, 1, 256, False),
    (2, 64, 4, 4, 256, True),
]


def main() -> None:
    rng = np.random.default_rng(0)
    for B, T, Hq, Hkv, D, dtype, impl in CASES:
        q = jnp.asarray(rng.standard_normal((B, Hq, D), dtype=np.float32)).astype(dtype)
        k = jnp.asarray(rng.standard_normal((B, T, Hkv, D), dtype=np.float32)).astype(dtype)
        lens = jnp.asarray([T, 1] + [T // 3] * (B - 2), jnp.int32)
        for workspace in ("scratch", "xla"):
            out = decode_attention_tuned(
                q, k, k, lens, impl=impl, workspace=workspace, chunk=48, splits=2
            )
            if not np.isfinite(np.asarray(out.astype(jnp.float32))).all():
                raise SystemExit(f"non-finite output: B={B} T={T} D={D} {impl} {workspace}")
    for B, T, Hq, Hkv, D, fp8 in STREAM_CASES:
        q = jnp.asarray(rng.standard_normal((B, Hq, D), dtype=np.float32)).astype(jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((B, T, Hkv, D), dtype=np.float32))
        scales = {}
        if fp8:
            s = jnp.full((Hkv,), 0.01, jnp.float32)
            k, scales = quantize_fp8(k, s), dict(k_scale=s, v_scale=s)
        else:
            k = k.astype(jnp.bfloat16)
        lens = jnp.asarray([T, 1] + [T // 3] * (B - 2), jnp.int32)
        for impl in ("stream", "stream_combine", "stream_tma"):
            for plan in (dict(ctas=5, min_tiles=1), {}):
                out = decode_attention_tuned(q, k, k, lens, impl=impl, **scales, **plan)
                if not np.isfinite(np.asarray(out.astype(jnp.float32))).all():
                    raise SystemExit(
                        f"non-finite output: B={B} T={T} D={D} fp8={fp8} {impl} {plan}"
                    )
    for B, T, Hq, Hkv, D, dtype, impl in CASES:  # S = 5 rows (17 for GQA 12: 12 row blocks)
        S = 17 if Hq // Hkv == 12 else 5
        q = jnp.asarray(rng.standard_normal((B, S, Hq, D), dtype=np.float32)).astype(dtype)
        k = jnp.asarray(rng.standard_normal((B, T, Hkv, D), dtype=np.float32)).astype(dtype)
        lens = jnp.asarray([T, 1] + [T // 3] * (B - 2), jnp.int32)
        qlens = jnp.asarray([S, 0] + [2] * (B - 2), jnp.int32)
        for workspace in ("scratch", "xla"):
            out = attention_tuned(
                q, k, k, lens, q_lengths=qlens, window=40, softcap=30.0, impl=impl,
                workspace=workspace, chunk=48, splits=2,
            )  # fmt: skip
            if not np.isfinite(np.asarray(out.astype(jnp.float32))).all():
                raise SystemExit(f"non-finite output: S={S} D={D} {impl} {workspace}")
    print("memcheck workload done", attention_stats())


if __name__ == "__main__":
    main()
