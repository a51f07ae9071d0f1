"""Which inputs make a small jitted cache loop re-record its CUDA command buffer?

The open question (issue 30, GPU findings): a 2-layer jitted ``fori_loop`` of 16 cache
steps, called 20 times with fresh inputs, runs every ``kv_write`` and attention handler
under capture (re-records its command buffer on every call), while the main job's decode
block replays. This runs that loop in several variants, each its own jitted function, and
prints per variant how many handler calls ran on the host over calls 2..N (a replayed
command buffer runs none) and how many of them ran under capture (a recording), from
``jax_vmm.kv_write_stats()`` (``kv_cache_write``) and ``jax_vmm.attention_stats()``
(``cuda_execute_calls``, ``cuda_captured_calls``), plus XLA's command-buffer log lines
of that variant by kind (``TF_CPP_VMODULE``, set below before JAX loads; stderr is
redirected per variant).

Variants:
  fresh        new q / new_k / new_v / lengths arrays every call (the issue's loop)
  same         the same input arrays every call (no new buffers)
  donated      the loop's carry (x, lengths) donated and fed back from the last call
  arena_lens   lengths read from an arena buffer updated in place (stable address, as
               tests/ops/test_attention.py::test_gpu_step_is_captured_and_replays...)
  fresh_cache  as "same", but the cache pytree is a new kv.cache() every call
  unrolled     as "fresh", with the loop unrolled (no while loop in the HLO)

Run (H200, ~1-2 minutes): python3 tools/gpu/fori_replay.py [--calls 20] [--steps 16]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0")
os.environ.setdefault(
    "TF_CPP_VMODULE", "command_buffer_thunk=3,command_buffer_cmd=2,command_buffer_conversion_pass=2"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_vmm  # noqa: E402

L, B, T, HKV, D, HQ = 2, 8, 4096, 8, 128, 32
DTYPE = jnp.bfloat16
LOG_KIND = re.compile(r"[A-Za-z]+ (?:a |the )?command buffer[a-z ]{0,24}")


def _counters() -> tuple[int, int, int, int]:
    w = jax_vmm.kv_write_stats()["kv_cache_write"]
    a = jax_vmm.attention_stats()
    return w["calls"], w["captured_calls"], a["cuda_execute_calls"], a["cuda_captured_calls"]


def _loop(steps: int, unroll: bool, lengths_from_arena: bool):
    """A jitted function (cache, x, lengths, q, new_kv) -> (cache, x, lengths): ``steps``
    decode steps, each writing one token per sequence in every layer and attending over
    it; ``x`` is the loop's carried activation."""

    def run(cache, x, lengths, q, new_kv):
        seq = jnp.arange(B, dtype=jnp.int32)

        def step(i, carry):
            cache, x, lens = carry
            layers = list(cache)
            for l in range(L):
                nk = (new_kv[l] + x[:, None, :1].astype(DTYPE)).astype(DTYPE)
                layers[l] = jax_vmm.kv_write(layers[l], nk, nk, seq=seq, pos=lens)
                out = jax_vmm.decode_attention(q[l], layers[l], lens + 1)
                x = x + out[:, :1, :].reshape(B, D).astype(jnp.float32) * 1e-3
            return jax_vmm.KVCache(layers), x, lens + 1

        n = steps
        if unroll:
            carry = (cache, x, lengths)
            for i in range(n):
                carry = step(i, carry)
            cache, x, lengths2 = carry
        else:
            cache, x, lengths2 = jax.lax.fori_loop(0, n, step, (cache, x, lengths))
        return cache, x, lengths if lengths_from_arena else lengths2

    return run


def _variant(name: str, kv, dev, calls: int, steps: int, lens_buf) -> dict:
    rng = np.random.default_rng(0)

    def fresh_inputs():
        q = jax.device_put(jnp.asarray(rng.standard_normal((L, B, HQ, D)), DTYPE), dev)
        nkv = jax.device_put(jnp.asarray(rng.standard_normal((L, B, HKV, D)), DTYPE), dev)
        x = jax.device_put(jnp.zeros((B, D), jnp.float32), dev)
        lens = jax.device_put(jnp.zeros((B,), jnp.int32), dev)
        return q, nkv, x, lens

    unroll = name == "unrolled"
    from_arena = name == "arena_lens"
    fn = _loop(steps, unroll, from_arena)
    jitted = jax.jit(fn, donate_argnums=(1, 2) if name == "donated" else ())
    q, nkv, x, lens = fresh_inputs()
    cache = kv.cache()
    if from_arena:
        lens = lens_buf.array
    per_call = []
    for _ in range(calls):
        if name in ("fresh", "unrolled"):
            q, nkv, x, lens = fresh_inputs()
        before = _counters()
        out_cache, out_x, out_lens = jitted(
            kv.cache() if name == "fresh_cache" else cache, x, lens, q, nkv
        )
        jax.block_until_ready((out_x, out_lens))
        after = _counters()
        per_call.append(tuple(b - a for a, b in zip(before, after)))
        if name != "fresh_cache":
            cache = out_cache
        if name == "donated":
            x, lens = out_x, out_lens
        del out_x, out_lens
    rest = [sum(col) for col in zip(*per_call[1:])] if calls > 1 else [0, 0, 0, 0]
    return {"first": per_call[0], "rest": rest, "calls": calls}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument(
        "--variants",
        default="fresh,same,donated,arena_lens,fresh_cache,unrolled",
        help="comma-separated subset",
    )
    p.add_argument("--cpu", action="store_true", help="smoke-run the loops on the CPU")
    args = p.parse_args()
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus and not args.cpu:
        print("fori_replay: no GPU (this probe is for the H200; --cpu smoke-runs it)")
        return 2
    dev = jax.devices("cpu")[0] if args.cpu else gpus[0]
    kv = jax_vmm.kv_arena(
        num_layers=L,
        num_kv_heads=HKV,
        head_dim=D,
        max_tokens=T,
        dtype=DTYPE,
        max_seqs=B,
        device=dev,
    )
    lens_arena = jax_vmm.Arena(1 << 21, device=dev)
    lens_buf = lens_arena.allocate((B,), jnp.int32, name="lengths")
    lens_buf.commit()
    kv.ensure_all(np.full(B, T, np.int64))
    rows = []
    for name in args.variants.split(","):
        log = tempfile.NamedTemporaryFile(prefix=f"fori_{name}_", suffix=".log", delete=False)
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            r = _variant(name, kv, dev, args.calls, args.steps, lens_buf)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        with open(log.name, errors="replace") as f:
            kinds = collections.Counter(m.strip() for m in LOG_KIND.findall(f.read()))
        rows.append((name, r, kinds, log.name))
    n_rest = (args.calls - 1) * args.steps * L
    print(
        f"\n{L} layers x {args.steps} steps per call, {args.calls} calls; calls 2..{args.calls} "
        f"would run {n_rest} kv_write and {n_rest} attention handler calls without replay"
    )
    print(
        f"{'variant':<12} {'write calls':>11} {'(captured)':>10} {'attn calls':>10} "
        f"{'(captured)':>10}   first call (w, w cap, a, a cap)"
    )
    for name, r, _, _ in rows:
        w, wc, a, ac = r["rest"]
        print(f"{name:<12} {w:>11} {wc:>10} {a:>10} {ac:>10}   {r['first']}")
    print("\nXLA command-buffer log lines by kind, per variant (top 6):")
    for name, _, kinds, path in rows:
        top = ", ".join(f"{k!r}: {n}" for k, n in kinds.most_common(6)) or "(none)"
        print(f"  {name:<12} {top}\n  {'':<12} log: {path}")
    kv.close()
    lens_arena.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
