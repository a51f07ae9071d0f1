"""One call of the cuDNN attention backend, small shapes, checked against the reference:
the first thing to run (under cuda-gdb for a native backtrace) when the backend fails."""

import jax
import jax.numpy as jnp
import numpy as np

from jax_vmm.ops import cudnn_attention as ca

print("cudnn:", ca.cudnn_info(), flush=True)
B, T, S, HQ, HKV, D = 2, 256, 1, 8, 2, 128
rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((B, S, HQ, D)), jnp.bfloat16)
k = jnp.asarray(rng.standard_normal((B, T, HKV, D)), jnp.bfloat16)
v = jnp.asarray(rng.standard_normal((B, T, HKV, D)), jnp.bfloat16)
lengths = jnp.array([100, 200], jnp.int32)
out = jax.block_until_ready(ca.cudnn_attention(q, k, v, lengths))
print("out", out.shape, out.dtype, float(jnp.abs(out.astype(jnp.float32)).sum()), flush=True)
