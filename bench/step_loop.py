"""One decode step per call: the per-call cost of a jitted step over a jax_vmm arena cache
against the same step over a preallocated array cache.

    python bench/step_loop.py                       # CPU or GPU, small shapes
    python bench/step_loop.py --layers 2 8 --calls 2000

A sampler that calls one jitted step per token from a Python loop pays JAX's dispatch
cost at every call. Both variants run the same step (every layer: write one token per
sequence; "write+attention": then decode attention over it; "views+write": first
attention with plain XLA ops over what the layer holds, cuDNN on a GPU) eagerly in a
Python loop:

    arena    kv.cache() (jax_vmm.kv_write + jax_vmm.decode_attention over arena layers,
             which runs cuDNN in jax_vmm's call on a GPU, or the read over
             jax_vmm.ordered_views of kv.k[l], kv.v[l])
    prealloc KVCache.from_arrays(jnp.zeros...) (kv_write: a donated functional scatter;
             the attention a user picks over arrays: JAX's cuDNN on a GPU, XLA's on the
             CPU, in both attention steps)

and prints the per-call time of each and their ratio (goal: arena / prealloc <= 1.2),
plus whether the arena step takes JAX's C++ fast path (no effects in its jaxpr).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_vmm  # noqa: E402
from jax_vmm.serving.attention import cudnn_decode_attention  # noqa: E402

STEPS = ("write", "write+attention", "views+write")


def _views_read(q, layer, views, lengths):
    """Attention through plain XLA ops over the layer's K/V: an arena layer's ordered
    views, an array layer's arrays. cuDNN on a GPU (what a JAX user picks), XLA's
    implementation of the same call on the CPU."""
    k, v = jax_vmm.ordered_views(layer, *views) if layer.is_arena else (layer.k, layer.v)
    impl = "cudnn" if jax.default_backend() == "gpu" else "xla"
    return cudnn_decode_attention(q, k, v, lengths, implementation=impl)


def _attention_after_write(q, layer, lengths):
    """An arena layer through jax_vmm.decode_attention (the only read of a layer written
    in the same step); an array layer through what a user picks over arrays, as in
    _views_read (jax_vmm's own split-K kernel, which decode_attention runs over arrays,
    is slower than cuDNN)."""
    if layer.is_arena:
        return jax_vmm.decode_attention(q, layer, lengths)
    impl = "cudnn" if jax.default_backend() == "gpu" else "xla"
    return cudnn_decode_attention(q, layer.k, layer.v, lengths, implementation=impl)


def make_step(num_layers: int, kind: str):
    """One decode step over every layer: "write" (kv_write only), "write+attention"
    (jax_vmm.decode_attention after the write), "views+write" (attention over the layer
    read before the write: the arena through jax_vmm.ordered_views, as bench/_stack.py
    reads it with cuDNN)."""

    def step(cache, views, q, new_k, new_v, seq, pos, lengths):
        out = q
        for layer in range(num_layers):
            if kind == "views+write":
                view = views[layer] if views else None
                out = out + _views_read(out, cache[layer], view, lengths)
            written = jax_vmm.kv_write(cache[layer], new_k, new_v, seq=seq, pos=pos)
            cache = cache.replace(layer, written)
            if kind == "write+attention":
                out = out + _attention_after_write(out, written, lengths)
            elif kind == "write":
                out = out + new_k
        return cache, out

    return jax.jit(step, donate_argnums=0)


def loop_us(step, cache, args, calls: int) -> tuple[float, object]:
    """Per-call time of ``calls`` calls in a Python loop; returns it and the last cache.
    args: the step's arguments after the cache (views first)."""
    t0 = time.perf_counter()
    for _ in range(calls):
        cache, out = step(cache, *args)
    jax.block_until_ready((cache, out))
    return (time.perf_counter() - t0) / calls * 1e6, cache


def best_of(steps: dict, caches: dict, args: dict, calls: int, repeats: int) -> dict:
    """Best per-call time of each variant (args: each one's arguments after the cache),
    the variants' loops interleaved so that a noisy machine slows them alike."""
    for name, step in steps.items():  # compile
        caches[name], out = step(caches[name], *args[name])
        jax.block_until_ready(out)
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(repeats):
        for name, step in steps.items():
            us, caches[name] = loop_us(step, caches[name], args[name], calls)
            best[name] = min(best[name], us)
    return best


def setup_point(num_layers: int, batch: int, kind: str, args: argparse.Namespace):
    """One point's two caches and arguments: (kv, prealloc cache, views, step arguments
    after the cache and views). The arena's sequences are ensured whole; the tokens
    written and read are the same on both sides."""
    heads, dim, tokens = args.kv_heads, args.head_dim, args.max_tokens
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    kv = jax_vmm.kv_arena(
        num_layers=num_layers,
        num_kv_heads=heads,
        head_dim=dim,
        max_tokens=tokens,
        max_seqs=batch,
        dtype=dtype,
    )
    for s in range(batch):
        kv.ensure(tokens, s)
    shape = (batch, tokens, heads, dim)
    prealloc = jax_vmm.KVCache.from_arrays(
        [jnp.zeros(shape, dtype) for _ in range(num_layers)],
        [jnp.zeros(shape, dtype) for _ in range(num_layers)],
    )
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((batch, heads, dim)), dtype)
    new = jnp.asarray(rng.standard_normal((batch, heads, dim)), dtype)
    seq = jnp.arange(batch, dtype=jnp.int32)
    pos = jnp.full((batch,), tokens // 2, jnp.int32)
    lengths = jnp.full((batch,), tokens // 2 + 1, jnp.int32)
    step_args = (q, new, new, seq, pos, lengths)
    views = tuple((kv.k[l], kv.v[l]) for l in range(num_layers)) if kind == "views+write" else ()
    return kv, prealloc, views, step_args


def run_point(num_layers: int, batch: int, kind: str, args: argparse.Namespace) -> dict:
    kv, prealloc, views, step_args = setup_point(num_layers, batch, kind, args)
    step = make_step(num_layers, kind)
    arena_cache = kv.cache()
    effects = jax.make_jaxpr(step)(arena_cache, views, *step_args).effects
    best = best_of(
        {"arena": step, "prealloc": make_step(num_layers, kind)},
        {"arena": arena_cache, "prealloc": prealloc},
        {"arena": (views, *step_args), "prealloc": ((), *step_args)},
        args.calls,
        args.repeats,
    )
    arena_us, prealloc_us = best["arena"], best["prealloc"]
    kv.check()
    kv.close()
    return {
        "step": kind,
        "layers": num_layers,
        "batch": batch,
        "arena_us": arena_us,
        "prealloc_us": prealloc_us,
        "ratio": arena_us / prealloc_us,
        "fast_path": not effects,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    args = p.parse_args(argv)
    print(f"one step per call on {jax.devices()[0].device_kind} (best of {args.repeats})")
    print(
        f"{'step':>15} {'layers':>6} {'batch':>5} {'arena us':>9} {'prealloc us':>11} "
        f"{'ratio':>6}  fast path"
    )
    rows = []
    for kind in args.steps:
        for layers in args.layers:
            r = run_point(layers, args.batch, kind, args)
            rows.append(r)
            print(
                f"{r['step']:>15} {r['layers']:>6} {r['batch']:>5} {r['arena_us']:>9.1f} "
                f"{r['prealloc_us']:>11.1f} "
                f"{r['ratio']:>6.2f}  {'yes' if r['fast_path'] else 'no (effects)'}"
            )
    return rows


if __name__ == "__main__":
    main()
