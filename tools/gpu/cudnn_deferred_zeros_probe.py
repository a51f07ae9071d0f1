"""Does cuDNN over an arena layer read past the memory its sequences' ensured tokens back?

With deferred zeros (`JAX_VMM_DEFER_ZERO_READS=1`, docs/design.md "Zero reads") an
unbacked byte is not mapped until the arena hands out a view, so a read of it faults.
jax_vmm's own kernels read what the page table admits; cuDNN's graph (the route of
`jax_vmm.decode_attention` / `jax_vmm.attention` over an arena layer) reads tiles of key
and value rows, and a tile that runs past a sequence's length may cross into the next,
unbacked chunk. Making deferred zeros the default needs this to never happen, or the
route to turn zeros on first. The probe runs, each in a child process (a fault ends
only that one):

    python3 tools/gpu/cudnn_deferred_zeros_probe.py       # a GPU build with cuDNN

geometries whose chunk holds 1024, 256 and 128 tokens (and one whose rows are not
chunk-aligned), and the interleaved layout's 64, fewer than a tile (there only
`ensure`'s rounding to READ_TILE_TOKENS, jax_vmm/kv/backing.py, keeps the last tile
backed; `--one --untiled ...` runs a case without it), with lengths ending 1..255
tokens before and exactly at a chunk boundary, decode (S = 1) and S = 16 queries,
nothing backed past what `ensure(length)` backs (`commit_ahead_tokens=0`). Prints one
line per case and a PROBE summary line.

A control case first reads an unbacked byte of a layer raw (cupy, no view): with
deferred zeros it must fault, with eager zeros it must read 0. Without it a clean probe
could mean that unbacked reads do not fault at all.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

# (kv heads, head dim, max_tokens, layers): chunk tokens 2 MiB / token bytes, which are
# heads x dim x 2 B per layer buffer, or 2 x layers x that in the interleaved layout
# (layers > 1): 64 tokens per chunk, fewer than a cuDNN tile.
GEOMETRIES = (
    (8, 128, 4096, 1),
    (32, 128, 4096, 1),
    (64, 128, 4096, 1),
    (8, 128, 1000, 1),
    (4, 256, 3000, 1),
    (8, 128, 4096, 8),
)
BEFORE_BOUNDARY = (255, 191, 100, 64, 1, 0)


def one(heads: int, dim: int, max_tokens: int, before: int, queries: int, layers: int = 1) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_vmm
    from jax_vmm.ops.cudnn_attention import cudnn_attention_stats

    kv = jax_vmm.kv_arena(
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=dim,
        max_tokens=max_tokens,
        max_seqs=4,
        commit_ahead_tokens=0,
        layout="per_layer" if layers == 1 else "interleaved",
    )
    chunk_tokens = kv.arena.chunk_bytes // kv.token_bytes
    target = max(chunk_tokens, queries + before)
    lengths = np.array(
        [min(max_tokens, target - before), min(max_tokens, 2 * target - before), 0, max_tokens],
        np.int32,
    )
    for seq, n in enumerate(lengths):
        if n:
            kv.ensure(int(n), seq=seq)
    q = jnp.ones((4, queries, 4 * heads, dim), jnp.bfloat16)
    layer = kv.cache()[0]
    executions = cudnn_attention_stats().get("execute_calls", 0)
    if queries == 1:
        out = jax_vmm.decode_attention(q[:, 0], layer, jnp.asarray(lengths))
    else:
        q_lengths = np.minimum(lengths, queries).astype(np.int32)
        out = jax_vmm.attention(q, layer, jnp.asarray(lengths), q_lengths=jnp.asarray(q_lengths))
    jax.block_until_ready(out)
    stats = kv.arena.stats()
    # A view would have turned zeros on: then this case proves nothing.
    assert not stats["views_exported"], "a view was made: zeros are on, the case proves nothing"
    executions = cudnn_attention_stats().get("execute_calls", 0) - executions
    print(
        f"lengths {lengths.tolist()}, {chunk_tokens} tokens per chunk, "
        f"{stats['backed_bytes'] >> 20} MiB backed, cuDNN executions {executions}",
        flush=True,
    )


def control() -> None:
    """Reads the first bytes of an unbacked layer buffer without a view and prints them.
    The address goes in as an integer: cupy's pointer checks must not stand in for the
    read (they refuse an unmapped address before any kernel runs)."""
    import cupy

    import jax_vmm

    kv = jax_vmm.kv_arena(num_layers=1, num_kv_heads=8, head_dim=128, max_tokens=4096, max_seqs=4)
    read = cupy.RawKernel(
        r"""extern "C" __global__ void read(unsigned long long address, int* out) {
          out[threadIdx.x] = reinterpret_cast<const unsigned char*>(address)[threadIdx.x];
        }""",
        "read",
    )
    out = cupy.full((16,), -1, cupy.int32)
    read((1,), (16,), (cupy.uint64(kv.k_buffers[0].address), out))
    cupy.cuda.runtime.deviceSynchronize()
    print("control read", int(out.sum()), flush=True)


def run_child(args: list[str], defer: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_VMM_DEFER_ZERO_READS=defer, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    command = [sys.executable, __file__, *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)


def last_line(r: subprocess.CompletedProcess) -> str:
    return ((r.stdout + r.stderr).strip().splitlines()[-1:] or [""])[0][:160]


def case_failure(r: subprocess.CompletedProcess) -> str | None:
    """Why a case's child proves nothing or failed; None when it read through cuDNN and
    survived."""
    if r.returncode != 0:
        return f"FAILED rc={r.returncode}"
    ran = re.search(r"cuDNN executions (\d+)", r.stdout)
    if not ran or int(ran.group(1)) == 0:
        return "FAILED: cuDNN did not run (a build without it proves nothing)"
    return None


def control_failure(
    eager: subprocess.CompletedProcess, deferred: subprocess.CompletedProcess
) -> str | None:
    """Why the control did not behave; None when the unbacked read read 0 with eager zeros
    and faulted (an illegal address, not some other error) with deferred ones."""
    if eager.returncode != 0 or "control read 0" not in eager.stdout:
        return f"eager zeros: rc={eager.returncode} {last_line(eager)} (expected 'control read 0')"
    if deferred.returncode == 0 or "illegal" not in (deferred.stdout + deferred.stderr).lower():
        rc = deferred.returncode
        return f"deferred zeros: no illegal-address fault (rc={rc}, {last_line(deferred)})"
    return None


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        args = sys.argv[2:]
        if args and args[0] == "--untiled":  # the protection off: such a case must fault
            from jax_vmm import testing

            with testing.untiled_reads():
                one(*(int(x) for x in args[1:]))
            return
        one(*(int(x) for x in args))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--control":
        control()
        return
    eager, deferred = run_child(["--control"], "0"), run_child(["--control"], "1")
    control_problem = control_failure(eager, deferred)
    print(f"control, eager zeros: rc={eager.returncode} {last_line(eager)}")
    print(f"control, deferred zeros (must fail): rc={deferred.returncode} {last_line(deferred)}")
    cases = [
        (heads, dim, max_tokens, before, queries, layers)
        for heads, dim, max_tokens, layers in GEOMETRIES
        for before in BEFORE_BOUNDARY
        for queries in (1, 16)
    ]
    # Each case is a small process of its own: four at a time share the GPU.
    with ThreadPoolExecutor(4) as pool:
        runs = pool.map(lambda c: run_child(["--one", *map(str, c)], "1"), cases)
        bad = 0
        for (heads, dim, max_tokens, before, queries, layers), r in zip(cases, runs):
            failure = case_failure(r)
            bad += failure is not None
            status = failure or "ok"
            print(
                f"H{heads} D{dim} T{max_tokens} L{layers} before={before} S={queries}: "
                f"{status} {last_line(r)}",
                flush=True,
            )
    if control_problem is not None:
        print("PROBE control did not behave:", control_problem)
    print("PROBE", "no case faulted" if bad == 0 else f"{bad} cases failed")
    sys.exit(0 if control_problem is None and bad == 0 else 1)


if __name__ == "__main__":
    main()
