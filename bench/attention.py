"""Decode attention over jax_vmm KV-arena views, side by side with its JAX peers.

First the floor: the device's copy bandwidth (a large device-to-device copy, bytes read
plus bytes written per second) and, per configuration, KV bytes / that bandwidth. Then,
over a grid of batch and context sizes, one decode step's attention over R layers
(layer i reads kv.k[i], kv.v[i] of one kv_arena, so repeated runs do not hit in L2):

  ours     jax_vmm.decode_attention (split-K custom call, reads live tokens only)
  xla      plain-JAX masked attention over the same views (jax_vmm.ops.attention.
           reference_decode_attention: reads all T tokens, fp32 softmax)
  pallas   jax.experimental.pallas.ops.gpu.decode_attention.gqa(..., kv_seq_len=lengths)
           (GPU only; skipped when it does not import or compile)
  cudnn    jax.nn.dot_product_attention(..., key_value_seq_lengths=lengths,
           implementation="cudnn") over the same views: what a JAX user picks (GPU,
           bf16/fp16); "cud/ours" is its time over ours (> 1: ours is faster)

Times are per attention call (median over repeats of N back-to-back executions, each
running R calls). "bw%" = live KV bytes per second / copy bandwidth (goal >= 80% at
batch 32, context 8k, H_kv 8, D 128, bf16); "xla/ours" (goal >= 2) and "pallas/ours"
(goal >= 1.5) are time ratios. Lengths: "full" = T; "ragged" rows draw them uniformly
from [1, T]; "quarter" rows use T / 4 (a cache reserved for 4x the live context).
"u1" is ours with one 16-token tile in flight per warp instead of two (tuning record).

  python bench/attention.py                     # GPU grid (or a CPU smoke run)
  python bench/attention.py --smoke             # tiny sizes on any device, seconds
  python bench/attention.py --batches 32 --contexts 8192 --json out.json
"""

from __future__ import annotations

import argparse
import ctypes
import math
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_vmm
from _common import (
    GiB,
    MiB,
    Table,
    copy_bandwidth,
    fmt,
    median_time,
    parse_list,
    pick_device,
    ratio,
    rel_err,
    write_json,
)
from jax_vmm.ops.attention import attention_plan, decode_attention_tuned, reference_decode_attention
from jax_vmm.serving.attention import cudnn_decode_attention

# -- filling arena memory ------------------------------------------------------------


def copy_into(buf: jax_vmm.Buffer, src: jax.Array) -> None:
    """Copy a device array into an arena buffer (same device) outside JAX."""
    src = jax.block_until_ready(src)
    n = src.size * src.dtype.itemsize
    assert n <= buf.nbytes
    ptr = src.unsafe_buffer_pointer()
    if src.devices().pop().platform == "cpu":
        ctypes.memmove(buf.address, ptr, n)
    else:
        import cupy

        cupy.cuda.runtime.memcpy(buf.address, ptr, n, cupy.cuda.runtime.memcpyDeviceToDevice)


# -- one configuration ------------------------------------------------------------------


def make_lengths(mode: str, B: int, T: int, rng: np.random.Generator) -> np.ndarray:
    """full: every sequence at capacity T; ragged: uniform in [1, T]; quarter: T / 4
    (a cache sized for 4x the live context, as an arena reserved for the longest
    sequence is)."""
    if mode == "full":
        return np.full(B, T, np.int32)
    if mode == "ragged":
        return rng.integers(1, T + 1, size=B).astype(np.int32)
    if mode == "quarter":
        return np.full(B, max(1, T // 4), np.int32)
    raise ValueError(f"unknown lengths mode {mode!r}")


def run_config(
    device: jax.Device,
    B: int,
    T: int,
    Hq: int,
    Hkv: int,
    D: int,
    dtype: Any,
    mode: str,
    copy_bw: float,
    runs: int,
    repeats: int,
    layers_budget: int,
    with_pallas: bool,
    seed: int = 0,
) -> dict:
    itemsize = np.dtype(dtype).itemsize
    layer_bytes = 2 * B * T * Hkv * D * itemsize
    R = int(min(32, max(2, math.ceil(layers_budget / layer_bytes))))
    rng = np.random.default_rng(seed)
    lengths = make_lengths(mode, B, T, rng)
    live_bytes = int(2 * lengths.sum() * Hkv * D * itemsize)

    kv = jax_vmm.kv_arena(
        num_layers=R,
        num_kv_heads=Hkv,
        head_dim=D,
        max_tokens=T,
        dtype=dtype,
        device=device,
        max_seqs=B,
        initial_tokens=T,
    )
    try:
        key = jax.random.PRNGKey(seed)
        for l in range(R):
            for buf in (kv.k_buffers[l], kv.v_buffers[l]):
                key, sub = jax.random.split(key)
                copy_into(
                    buf,
                    jax.device_put(
                        jax.random.normal(sub, (B, T, Hkv, D), jnp.float32).astype(dtype), device
                    ),
                )
        key, sub = jax.random.split(key)
        qs = jax.device_put(
            jax.random.normal(sub, (R, B, Hq, D), jnp.float32).astype(dtype), device
        )
        lens = jax.device_put(jnp.asarray(lengths), device)
        ks = [kv.k[l] for l in range(R)]
        vs = [kv.v[l] for l in range(R)]

        def over_layers(attend):
            @jax.jit
            def step(qs, ks, vs, lens):
                return jnp.stack([attend(qs[l], ks[l], vs[l], lens) for l in range(R)])

            return lambda: step(qs, ks, vs, lens)

        impls: dict[str, Callable] = {
            "ours": lambda q, k, v, n: jax_vmm.decode_attention(q, k, v, n),
            "xla": lambda q, k, v, n: reference_decode_attention(q, k, v, n),
        }
        pallas_error = None
        if with_pallas and D in (64, 128) and np.dtype(dtype) != np.float32:
            # the tensor-core kernel with one tile in flight per warp, for comparison
            impls["ours_u1"] = lambda q, k, v, n: decode_attention_tuned(
                q, k, v, n, impl="tensor_core_u1"
            )
        if with_pallas and np.dtype(dtype) != np.float32:  # cuDNN takes bf16/fp16 only
            impls["cudnn"] = lambda q, k, v, n: cudnn_decode_attention(q, k, v, n)
        if with_pallas:
            try:
                from jax.experimental.pallas.ops.gpu import decode_attention as pallas_da

                impls["pallas"] = lambda q, k, v, n: pallas_da.gqa(q, k, v, kv_seq_len=n)
            except Exception as exc:  # noqa: BLE001 - the peer is optional
                pallas_error = f"import: {type(exc).__name__}: {exc}"

        row: dict[str, Any] = dict(
            batch=B,
            context=T,
            q_heads=Hq,
            kv_heads=Hkv,
            head_dim=D,
            dtype=np.dtype(dtype).name,
            lengths=mode,
            layers=R,
            live_kv_bytes=live_bytes,
            floor_s=live_bytes / copy_bw,
            plan=attention_plan(B, T, Hq, Hkv, D),
        )
        # correctness of ours against the plain-JAX path on layer 0 (both bf16 outputs)
        ref = np.asarray(reference_decode_attention(qs[0], ks[0], vs[0], lens).astype(jnp.float32))
        got = np.asarray(jax_vmm.decode_attention(qs[0], ks[0], vs[0], lens).astype(jnp.float32))
        row["rel_err_vs_xla"] = rel_err(got, ref)
        for name, attend in impls.items():
            try:
                row[f"{name}_s"] = median_time(over_layers(attend), repeats, runs) / R
            except Exception as exc:  # noqa: BLE001 - report and keep going
                row[f"{name}_s"] = None
                row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        if pallas_error:
            row["pallas_s"], row["pallas_error"] = None, pallas_error
        return row
    finally:
        kv.close()


# -- reporting ----------------------------------------------------------------------------


TABLE = Table(
    ("B", 3),
    ("ctx", 6),
    ("Hq/Hkv", 6),
    ("len", 7),
    ("KV MB", 8),
    ("floor", 7),
    ("ours", 7),
    ("bw%", 5),
    ("xla", 7),
    ("xla/ours", 8),
    ("pallas", 7),
    ("pal/ours", 8),
    ("cudnn", 7),
    ("cud/ours", 8),
    ("err", 8),
    ("u1", 7),
)


def fmt_us(t: float | None) -> str:
    return fmt(None if t is None else t * 1e6, "{:.1f}")


def print_table(rows: list[dict], copy_bw: float) -> None:
    print(
        f"\ncopy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s; "
        "times are us per attention call"
    )
    print(TABLE.header())
    print(TABLE.rule())
    for r in rows:
        ours = r.get("ours_s")
        bw = fmt(None if ours is None else 100 * r["live_kv_bytes"] / ours / copy_bw, "{:.1f}")
        print(
            TABLE.row(
                r["batch"],
                r["context"],
                f"{r['q_heads']:>3}/{r['kv_heads']:<2}",
                r["lengths"],
                f"{r['live_kv_bytes'] / MiB:.1f}",
                fmt_us(r["floor_s"]),
                fmt_us(ours),
                bw,
                fmt_us(r.get("xla_s")),
                fmt(ratio(r.get("xla_s"), ours), "{:.2f}"),
                fmt_us(r.get("pallas_s")),
                fmt(ratio(r.get("pallas_s"), ours), "{:.2f}"),
                fmt_us(r.get("cudnn_s")),
                fmt(ratio(r.get("cudnn_s"), ours), "{:.3f}"),
                f"{r['rel_err_vs_xla']:.1e}",
                fmt_us(r.get("ours_u1_s")),
            )
        )
    for r in rows:
        for k, v in r.items():
            if k.endswith("_error"):
                print(f"  B={r['batch']} ctx={r['context']}: {k}: {v}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds on any device")
    p.add_argument("--batches", type=parse_list(int), default=None)
    p.add_argument("--contexts", type=parse_list(int), default=None)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument(
        "--no-extra",
        action="store_true",
        help="skip the extra rows (ragged and quarter lengths; GQA 8 and MHA at batch 32)",
    )
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="write all numbers here")
    args = p.parse_args(argv)

    device = pick_device(args.device)
    on_gpu = device.platform != "cpu"
    dtype = jnp.dtype(args.dtype)
    smoke = args.smoke or not on_gpu
    if smoke:
        batches = args.batches or [2]
        contexts = args.contexts or [256]
        Hq, Hkv, D = 8, 2, 64
        copy_bytes, layers_budget, runs, repeats = 64 * MiB, 0, 2, 3
    else:
        batches = args.batches or [1, 8, 32]
        contexts = args.contexts or [1024, 8192, 32768]
        Hq, Hkv, D = args.q_heads, args.kv_heads, args.head_dim
        copy_bytes, layers_budget, runs, repeats = 2 * GiB, 512 * MiB, args.runs, args.repeats

    print(
        f"device: {device} ({device.device_kind}); jax {jax.__version__}; "
        f"{'smoke run' if smoke else 'benchmark'}"
    )
    copy_bw = copy_bandwidth(device, copy_bytes)
    print(
        f"floor first: measured copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write); "
        f"floor of a config = live KV bytes / {copy_bw / 1e9:.0f} GB/s"
    )
    configs = [(B, T, Hq, Hkv, "full") for B in batches for T in contexts]
    if not smoke and not args.no_extra:
        configs += [
            (32, 8192, Hq, Hkv, "ragged"),
            (32, 32768, Hq, Hkv, "quarter"),
            (32, 8192, 8 * Hkv, Hkv, "full"),
            (32, 8192, Hkv, Hkv, "full"),
        ]
    elif smoke:
        configs += [
            (batches[0], contexts[0], Hq, Hkv, "ragged"),
            (batches[0], contexts[0], Hq, Hkv, "quarter"),
        ]
    rows = []
    for B, T, hq, hkv, mode in configs:
        kv_mb = 2 * B * T * hkv * D * dtype.itemsize / MiB
        print(
            f"  B={B} ctx={T} Hq={hq} Hkv={hkv} lengths {mode}: {kv_mb:.0f} MiB KV per layer ...",
            flush=True,
        )
        rows.append(
            run_config(
                device,
                B,
                T,
                hq,
                hkv,
                D,
                dtype,
                mode,
                copy_bw,
                runs,
                repeats,
                layers_budget,
                with_pallas=on_gpu,
            )
        )
    print_table(rows, copy_bw)
    if args.json:
        write_json(
            args.json,
            dict(
                device=str(device),
                device_kind=device.device_kind,
                jax=jax.__version__,
                copy_bandwidth=copy_bw,
                rows=rows,
            ),
        )
    bad = [r for r in rows if r.get("ours_s") is None or not r["rel_err_vs_xla"] < 2e-2]
    if bad:
        print(
            f"FAILED: {len(bad)} configuration(s) without a correct result of ours", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
