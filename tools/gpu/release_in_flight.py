"""Does a release reach a step that was dispatched before it but has not run yet?

    python3 tools/gpu/release_in_flight.py

`kv.release(seq)` documents that it may be called right after dispatching a step that
still reads the sequence. On the GPU the ensured-tokens table is lowered at once (a copy
on the driver's own stream); a step still queued behind other work reads the table when
it runs. This script queues a step behind a long chain of matmuls, releases sequence 0
straight after the dispatch, and compares the step's attention output for sequence 0
with the same step run without the release. Prints one RESULT line: `unchanged` (the
step saw the table of its dispatch) or `clamped` (the release reached it early), with
the clamped-read counter as a second witness, and how long the release and a re-ensure of
the slot took while the step was queued (neither should wait for it).
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_vmm  # noqa: E402

H_KV, D, T = 8, 128, 2048


@jax.jit
def delayed_attention(cache, q, lengths, w):
    x = w
    for _ in range(48):  # ~50 ms of matmuls on an H200 ahead of the attention
        x = jnp.tanh(x @ w)
    q = q + (x[0, 0] * 0).astype(q.dtype)  # the attention waits for the chain
    return jax_vmm.decode_attention(q, cache[0], lengths)


def main() -> int:
    gpu = jax.default_backend() == "gpu"  # on the CPU: the same check, smaller
    kv = jax_vmm.kv_arena(
        num_layers=1, num_kv_heads=H_KV, head_dim=D, max_tokens=T, max_seqs=2, dtype=jnp.bfloat16
    )
    for s in range(2):
        kv.ensure(T, seq=s)
    rng = np.random.default_rng(0)
    new = jnp.asarray(rng.standard_normal((2 * T, H_KV, D)), jnp.bfloat16)
    seq = jnp.repeat(jnp.arange(2, dtype=jnp.int32), T)
    pos = jnp.tile(jnp.arange(T, dtype=jnp.int32), 2)
    cache = kv.cache()
    cache = cache.replace(0, jax_vmm.kv_write(cache[0], new, new, seq=seq, pos=pos))
    kv.check()
    q = jnp.asarray(rng.standard_normal((2, 4 * H_KV, D)), jnp.bfloat16)
    lengths = jnp.full((2,), T, jnp.int32)
    n = 8192 if gpu else 768
    w = jnp.asarray(rng.standard_normal((n, n)) / np.sqrt(n), jnp.bfloat16)
    want = np.asarray(delayed_attention(cache, q, lengths, w), np.float32)
    kv.check()
    out = delayed_attention(cache, q, lengths, w)  # queued behind the matmuls
    t0 = time.perf_counter()
    kv.release(0)  # "safe to call right after dispatching a step that still reads it"
    release_ms = 1e3 * (time.perf_counter() - t0)
    t0 = time.perf_counter()
    kv.ensure(T // 2, seq=0)  # the slot's next sequence, the step still queued
    ensure_ms = 1e3 * (time.perf_counter() - t0)
    queued = not out.is_ready()
    got = np.asarray(out, np.float32)
    try:
        kv.check()
        counter = "kv.check() passed"
    except Exception as e:  # noqa: BLE001 - reported, not handled
        counter = f"kv.check() raised {type(e).__name__}: {str(e)[:160]}"
    same0 = bool(np.array_equal(got[0], want[0]))
    same1 = bool(np.array_equal(got[1], want[1]))
    print(f"sequence 0 (released after dispatch) equal to the unreleased run: {same0}")
    print(f"sequence 1 (untouched) equal: {same1}; {counter}")
    print(
        f"release {release_ms:.2f} ms, ensure {ensure_ms:.2f} ms while the step was "
        f"{'still queued' if queued else 'already done (the check saw nothing)'}"
    )
    print(f"RESULT {'unchanged' if same0 else 'clamped'}")
    kv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
