"""cuDNN decode attention over a page layout that spans every layer, against its dense form.

Why: with one 2 MiB chunk per layer buffer, a sequence's partial last chunk is repeated in
each of the 2L buffers, so the memory goals (issue 29's equal memory, issue 32's shared
prefix at <= 1.1x) miss by the chunk granularity (docs/benchmarks.md). A layout whose 2 MiB
page holds P tokens of every (layer, K/V) buffer (P = 2 MiB / (2L x H x D x bytes): 64 at 8
layers, 16 at 32, for 8 x 128 bf16) wastes less than P tokens per sequence. A layer is no
longer one strided array then, so cuDNN would read it through its paged mode: the whole
arena as the block container, block (page, 2l) for K and (page, 2l + 1) for V.

This measures what that costs before anything is built. Per point, in one process, best of
``--repeats`` calls of ``--layers-timed`` layers each, us per layer call:

  dense     JAX's cuDNN (padding mask, kv_seqlen) over per-layer (B, T, H, D) arrays: what
            jax_vmm's arena layers are today
  contig    cuDNN's paged mode over a per-layer container of B x T/P blocks (identity table)
  spanning  cuDNN's paged mode over one container of every layer's blocks, B x T/P x 2L of
            them, block index (page x 2L + 2l) for K: the spanning layout's addresses (the
            container is bigger than JAX's wrapper allows, so its block-count check is
            skipped for this variant)

The outputs of the three are compared (same tokens). Plain JAX, no jax_vmm.

    python3 tools/gpu/spanning_layout_probe.py [--layers 8 32] [--json FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.cudnn import fused_attention_stablehlo as fa

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _common import hbm_tbps  # noqa: E402  (the bench helpers, plain JAX)

PAGE_BYTES = 2 << 20
POINTS = (
    (1, 1024),
    (1, 32768),
    (4, 1024),
    (4, 8192),
    (16, 1024),
    (16, 4096),
    (64, 1024),
    (64, 4096),
)


def tokens_per_page(layers: int, heads: int, dim: int, itemsize: int) -> int:
    return PAGE_BYTES // (2 * layers * heads * dim * itemsize)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _filled(shape: tuple, dtype) -> jax.Array:
    """Distinct values in [-1, 1] per element, without a float32 copy of the array."""
    rows = jax.lax.broadcasted_iota(jnp.float32, shape, 0)
    cols = jax.lax.broadcasted_iota(jnp.float32, shape, 1) * shape[2] * shape[3]
    cols = cols + jax.lax.broadcasted_iota(jnp.float32, shape, 2) * shape[3]
    cols = cols + jax.lax.broadcasted_iota(jnp.float32, shape, 3)
    return jnp.sin(rows * 0.3717 + cols * 0.0131).astype(dtype)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _layer_blocks(arena: jax.Array, layer: int, kv: int, layers: int) -> jax.Array:
    """Layer ``layer``'s K (kv 0) or V (1) blocks, copied out of the spanning arena."""
    pages = arena.shape[0] // (2 * layers)
    return arena.reshape(pages, 2 * layers, *arena.shape[1:])[:, 2 * layer + kv]


def time_us(fn, args, calls: int) -> float:
    """Per-call time of ``calls`` back-to-back calls (compiled and run before)."""
    t0 = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / calls * 1e6


def run_point(layers: int, batch: int, tokens: int, args: argparse.Namespace) -> dict:
    H, D, Hq = args.kv_heads, args.head_dim, args.q_heads
    dtype = jnp.bfloat16
    P = tokens_per_page(layers, H, D, 2)
    pages = tokens // P
    timed = [l * layers // args.layers_timed for l in range(args.layers_timed)]
    # The arena in the spanning layout: (B, pages, 2L, P, H, D), as blocks (B*pages*2L, P, H, D),
    # filled in one fused pass (random.normal's float32 temporaries would not fit at B64 T4k).
    arena = _filled((batch * pages * 2 * layers, P, H, D), dtype)
    q = jax.random.normal(jax.random.key(1), (batch, 1, Hq, D), dtype)
    lengths = jnp.full((batch,), tokens, jnp.int32)
    ones = jnp.ones((batch,), jnp.int32)
    scale = 1.0 / np.sqrt(D)
    page_ids = jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, 1, pages, 1)

    dense = [
        tuple(_layer_blocks(arena, l, kv, layers).reshape(batch, tokens, H, D) for kv in (0, 1))
        for l in timed
    ]
    contig = [tuple(_layer_blocks(arena, l, kv, layers) for kv in (0, 1)) for l in timed]
    tables = [(page_ids * 2 * layers + 2 * l, page_ids * 2 * layers + 2 * l + 1) for l in timed]
    jax.block_until_ready((dense, contig, tables))

    def dense_step(q, layers_kv):
        return [
            fa.dot_product_attention(
                q,
                k,
                v,
                q_seqlen=ones,
                kv_seqlen=lengths,
                scale=scale,
                mask_type=fa.MaskType.PADDING,
            )
            for k, v in layers_kv
        ]

    def paged_step(q, layers):  # layers: (k container, v container, k table, v table)
        return [
            fa.paged_attention(
                q, k, v, ones, lengths, tk, tv, scale=scale, mask_type=fa.MaskType.PADDING
            )
            for k, v, tk, tv in layers
        ]

    variants = {
        "dense": (jax.jit(dense_step), (q, dense)),
        "contig": (jax.jit(paged_step), (q, [(k, v, page_ids, page_ids) for k, v in contig])),
        "spanning": (jax.jit(paged_step), (q, [(arena, arena, tk, tv) for tk, tv in tables])),
    }
    row = {"layers": layers, "batch": batch, "tokens": tokens, "P": P}
    outs, ready = {}, {}
    check = fa.check_layout
    for name, (fn, fargs) in variants.items():  # compile and check each once
        if name == "spanning":
            fa.check_layout = lambda *a, **k: None  # noqa: E731 (the container is 2L x bigger)
        try:
            outs[name] = np.asarray(jnp.stack(fn(*fargs)).astype(jnp.float32))
            ready[name] = (fn, fargs)
        except Exception as e:  # noqa: BLE001 (a probe: report and go on)
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        finally:
            fa.check_layout = check
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(args.repeats):  # rounds interleaved: a drifting clock slows all alike
        for name, (fn, fargs) in ready.items():
            best[name] = min(best[name], time_us(fn, fargs, args.calls))
    for name in variants:
        row[name] = best[name] / len(timed) if name in ready else None
    for name in ("contig", "spanning"):
        if name in outs and "dense" in outs:
            row[f"{name}_max_abs_diff"] = float(np.max(np.abs(outs[name] - outs["dense"])))
            if row[name] and row["dense"]:
                row[f"{name}_ratio"] = row[name] / row["dense"]
    bytes_read = 2 * batch * tokens * H * D * 2
    row["floor_us"] = bytes_read / (args.hbm_tbps * 1e12) * 1e6  # of one layer call
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    ap.add_argument(
        "--points",
        default=",".join(f"{b}x{t}" for b, t in POINTS),
        help="BxT,... (batch x cached tokens)",
    )
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers-timed", type=int, default=8, help="layers per timed call")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--hbm-tbps", type=float, help="the floor's bandwidth (default: the device's)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.hbm_tbps = args.hbm_tbps or hbm_tbps(jax.devices()[0])
    kind = jax.devices()[0].device_kind
    print(f"device: {kind}, jax {jax.__version__}, floor at {args.hbm_tbps} TB/s")
    rows = []
    header = (
        "L",
        "P",
        "B",
        "T",
        "dense",
        "contig",
        "spanning",
        "contig/dense",
        "spanning/dense",
        "floor",
        "max|diff|",
    )
    print(" | ".join(header))
    for layers in args.layers:
        for point in args.points.split(","):
            b, t = (int(x) for x in point.split("x"))
            try:
                row = run_point(layers, b, t, args)
            except jax.errors.JaxRuntimeError as e:  # a point too big for this card
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                print(f"{layers} | B{b} T{t}: does not fit ({str(e).splitlines()[0][:80]})")
                continue
            rows.append(row)

            def f(x, p=1):
                return "-" if x is None else f"{x:.{p}f}"

            print(
                " | ".join(
                    (
                        str(layers),
                        str(row["P"]),
                        str(b),
                        str(t),
                        f(row["dense"]),
                        f(row["contig"]),
                        f(row["spanning"]),
                        f(row.get("contig_ratio"), 3),
                        f(row.get("spanning_ratio"), 3),
                        f(row["floor_us"]),
                        f(row.get("spanning_max_abs_diff"), 4),
                    )
                ),
                flush=True,
            )
            for name in ("dense", "contig", "spanning"):
                if row.get(f"{name}_error"):
                    print(f"  {name}: {row[f'{name}_error']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
