"""A jax_vmm kernel in flight while its pages are released and new pages are mapped next to
them: the scenario of kvcached #465 / vLLM #28714 (remapping under running kernels).

    python tools/gpu/memory_hazard.py release [safe|unsafe] [OUT.json]
    python tools/gpu/memory_hazard.py commit  [safe|unsafe] [OUT.json]

release: one jitted call runs CALLS decode-attention kernels over sequence 0 of a KV
  arena (reached through an uncounted view: what jax_vmm's ops touch by identity). While
  it runs, the host releases sequence 0 and commits sequence 1 next to it. Safe: the
  release is deferred until the device is done, so the result is bit-identical to a
  reference run and compute-sanitizer memcheck reports nothing. Unsafe
  (jax_vmm.testing's skip_device_waits): the pages are unmapped under the kernels: a
  fault or a wrong result.
commit: an XLA reduction reads a whole buffer through a raw (counted) view while the host
  commits and decommits pages in it. Safe: commits wait for the device while views are
  alive. Unsafe: the zero mapping is swapped under the reader: a fault.

Prints "RESULT {json}" and exits 0 when the run looked right (in unsafe mode a clean run
means the hazard was not hit: the caller treats that as a failure to detect). Used by
tests/integration/test_memory_gpu.py (in a child process: a device fault is sticky) and by
tools/gpu/run.sh sanitize:memory.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_vmm
from jax_vmm import testing

# Under compute-sanitizer (kernels run far slower) run.sh makes it small: HAZARD_SMALL=1.
SMALL = os.environ.get("HAZARD_SMALL") == "1"
CALLS = 8 if SMALL else 64
T = (16 if SMALL else 256) * 1024  # tokens per sequence: 512 MiB of K each (8 x 128 bf16)
H_KV, H_Q, D = 8, 8, 128


def release_scenario(unsafe: bool) -> dict:
    with testing.fault_injection() as faults:
        kv = jax_vmm.kv_arena(
            num_layers=1,
            num_kv_heads=H_KV,
            head_dim=D,
            max_tokens=T,
            max_seqs=2,
            dtype=jnp.bfloat16,
        )
    if unsafe:
        faults.skip_device_waits(kv)
    kv.ensure(T, seq=0)
    rng = np.random.default_rng(0)
    for buf in kv.buffers:  # sequence 0's tokens, copied in by the driver
        data = rng.standard_normal(kv.seq_bytes // 2, dtype=np.float32).astype(jnp.bfloat16)
        kv.arena._handle.copy_in(buf.id, 0, data.ctypes.data, data.nbytes)
    k = testing.uncounted_view(kv.k_buffers[0])
    v = testing.uncounted_view(kv.v_buffers[0])
    q = jnp.asarray(rng.standard_normal((2, H_Q, D), dtype=np.float32), jnp.bfloat16)
    lengths = jnp.asarray([T, 0], jnp.int32)

    @jax.jit
    def many(q, k, v, lengths):
        acc = jnp.zeros((2, H_Q, D), jnp.float32)
        for i in range(CALLS):  # distinct inputs: no call is merged with another
            qi = (q.astype(jnp.float32) * (1.0 + i / CALLS)).astype(jnp.bfloat16)
            acc = acc + jax_vmm.decode_attention(qi, k, v, lengths).astype(jnp.float32)
        return acc

    want = np.asarray(many(q, k, v, lengths))  # compiles, and the reference result
    out = many(q, k, v, lengths)  # in flight ...
    print("RELEASING while the kernels run", flush=True)
    kv.release(0)  # ... its pages released
    s = kv.arena.stats()  # before the kernels end (then the reclaimer frees the pages)
    kv.ensure(T, seq=1)  # ... and new pages mapped next to them
    got = np.asarray(out)
    kv.reclaim()
    return {
        "mode": "unsafe" if unsafe else "safe",
        "bit_identical": bool(np.array_equal(got.view(np.uint32), want.view(np.uint32))),
        "deferred_releases": s["deferred_releases"],
        "retired_after_release": s["retired_bytes"],
        "held_after_reclaim": kv.arena.stats()["held_bytes"],
    }


def commit_scenario(unsafe: bool) -> dict:
    size = (64 << 20) if SMALL else (1 << 30)
    iterations = 30 if SMALL else 3000
    with testing.fault_injection() as faults:
        arena = jax_vmm.Arena(2 * size)
    if unsafe:
        faults.skip_device_waits(arena)
    buf = arena.allocate((size // 4,), jnp.float32)
    c = arena.chunk_bytes

    @jax.jit
    def reread(x):  # long reads over the whole buffer (i keeps XLA from hoisting)
        body = lambda i, acc: acc + jnp.sum(x * (i + 1).astype(jnp.float32))  # noqa: E731
        return jax.lax.fori_loop(0, iterations, body, 0.0)

    view = buf.array  # a raw view: XLA reads every byte, unbacked ones included
    reread(view).block_until_ready()
    drains = arena.stats()["commit_drains"]
    print("COMMITTING under the reader", flush=True)
    for _ in range(10):
        out = reread(view)
        for _ in range(4):
            buf.commit(0, min(64 * c, buf.nbytes))
            buf.decommit()
        out.block_until_ready()
    return {
        "mode": "unsafe" if unsafe else "safe",
        "commit_drains": arena.stats()["commit_drains"] - drains,
        "finite": bool(np.isfinite(float(out))),
    }


def main(argv: list[str]) -> int:
    which = argv[1] if len(argv) > 1 else "release"
    unsafe = len(argv) > 2 and argv[2] == "unsafe"
    result = release_scenario(unsafe) if which == "release" else commit_scenario(unsafe)
    if len(argv) > 3:
        Path(argv[3]).write_text(json.dumps(result))
    print("RESULT", json.dumps(result), flush=True)
    ok = result.get("bit_identical", True) and result.get("finite", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
