"""What cuDNN's decode graph (S = 1) writes into the output row of a length-0 sequence.

jax_vmm's decode over cuDNN runs no zero-rows kernel because cuDNN writes +0 there itself
(docs/cudnn_attention.md); this sweeps that claim over shapes and options, with the
output prefilled with NaN and with 7.0 so that "left unwritten" and "written" differ:

    python3 tools/gpu/cudnn_decode_zero_rows.py      # needs a GPU build with cuDNN

Prints one line per configuration and a PROBE summary line.
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np

from jax_vmm.ops import cudnn_attention as ca


def main() -> None:
    rng = np.random.default_rng(0)
    bad = 0
    shapes = itertools.product((1, 4, 16, 64), (256, 2048), (64, 128, 256))
    options = ({}, {"window": 64}, {"softcap": 30.0})
    Hq, Hkv = 32, 8
    for (B, T, D), opt, fill in itertools.product(shapes, options, (np.nan, 7.0)):
        q = jnp.asarray(rng.standard_normal((B, 1, Hq, D)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((B, T, Hkv, D)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((B, T, Hkv, D)), jnp.bfloat16)
        n = rng.integers(1, T + 1, B).astype(np.int32)
        n[::2] = 0
        out = jnp.full(q.shape, fill, jnp.bfloat16)
        got = ca.cudnn_attention(q, k, v, jnp.asarray(n), out=out, zero_rows=False, **opt)
        rows = np.asarray(got.astype(jnp.float32))[n == 0]
        zeros = bool((rows == 0).all()) and not np.signbit(rows).any()
        if zeros:
            kind = "zeros"
        elif np.isnan(rows).any():
            kind = "nan"
        else:
            kind = "fill" if (rows == fill).all() else "other"
        bad += not zeros
        print(f"B{B} T{T} D{D} {opt or 'plain'} fill={fill}: length-0 rows {kind}", flush=True)
    print("PROBE", "every length-0 row is +0" if bad == 0 else f"{bad} configurations not +0")


if __name__ == "__main__":
    main()
