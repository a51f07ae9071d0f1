"""jax_vmm's cuDNN attention backend side by side with cuDNN through JAX and with
jax_vmm.decode_attention, in one process, over arena views (bf16, H_q 32, H_kv 8, D 128).

Per configuration, one timed call runs --steps decode steps in a ``lax.fori_loop`` (as a
decode block of the serving engine does), each step R layers (layer i reads kv.k[i],
kv.v[i] of one kv_arena, so repeated runs do not hit in L2); each layer's output is the
next layer's query, as in a model. So at small shapes the time is the device's (one
dispatch per steps x R calls), not the host's. Times are per attention call (median over
repeats of N back-to-back calls / (steps x R)); --steps 1 is one step per dispatch:

  vmm_cudnn   jax_vmm.ops.cudnn_attention.cudnn_attention over the views: cuDNN SDPA graph
              in our custom call (bottom-right causal, padding by lengths / q_lengths),
              workspace in the graph-safe scratch, plus the kernel that zeroes rows cuDNN
              leaves unwritten
  no_zero     the same without that kernel (zero_rows=False): the kernel's cost
  vmm_layer   what a user calls: jax_vmm.decode_attention(q, cache[l], lengths) (S = 1) or
              jax_vmm.attention(q, cache[l], lengths) over the arena layer of kv.cache(),
              which the routing sends to the same cuDNN graph, with the lengths clamped to
              the tokens ensured first (one more small kernel)
  jax_cudnn   jax.nn.dot_product_attention(..., implementation="cudnn") over the same
              views: decode with key_value_seq_lengths=lengths (what a JAX user picks);
              several queries with query_seq_lengths=S and key_value_seq_lengths=lengths and
              NO causal mask: JAX's causal mask is aligned top-left, so it cannot express
              "S new queries at the end of each cached sequence"; padding-only is the
              closest mask it has. It does more work than ours (S x len scores against
              our S x (len - S/2)), so the S > 1 ratios flatter jax_vmm, by up to that
              factor (about 1.5x at S 2048, T 4k; 1.1x at S 512)
  jax_split   S > 1: the same scores as ours through JAX's cuDNN call: a padding-only call
              over each sequence's prefix and a causal one over its last S tokens (copied
              out), joined by their log-sum-exps (bench/_split_causal.py)
  vmm_kernel  jax_vmm.decode_attention(q, k, v, lengths) over the views: jax_vmm's own
              split-K CUDA kernel (the array form is not routed to cuDNN; decode only)
  vmm_fp8     decode only (not with --no-fp8): jax_vmm.decode_attention(q, cache[l],
              lengths) over the same tokens in an fp8 (float8_e4m3fn) arena, which runs
              jax_vmm's streaming kernel; "fp8" = its time over jax_cudnn's bf16 time

"ratio" = vmm_cudnn / jax_cudnn and "layer" = vmm_layer / jax_cudnn (goal <= 1.0 for
decode); for S > 1 "best" = vmm_layer / the faster of jax_cudnn and jax_split (goal <=
1.1), "fp8" = vmm_fp8 / jax_cudnn (goal <= 0.55). "floor" = the live bf16 K/V bytes over
the copy bandwidth measured first in the same process (bytes read + written per second by
a device-to-device copy), "hbm" the same over the device's nominal HBM bandwidth
(_common.HBM_TBPS); "%copy" = floor / vmm_layer. Decode lengths are full (T) unless
--ragged; the S > 1 rows draw lengths uniformly from [S, T]. Every ratio of a row comes
from the same process, the same arena and the same lengths.

  python bench/cudnn_attention.py                         # decode, fp8, multi-query
  python bench/cudnn_attention.py --batches 8 --contexts 8192 --multi-q 0
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the arena needs the GPU too

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_vmm  # noqa: E402
from _attention_goals import goal_lines  # noqa: E402
from _common import copy_bandwidth, hbm_tbps, median_time, parse_list, write_json  # noqa: E402
from _split_causal import cudnn_attend, split_causal_attention  # noqa: E402
from jax_vmm.base.fp8 import FP8_DTYPE, quantize_fp8  # noqa: E402
from jax_vmm.ops import cudnn_attention as ca  # noqa: E402

HQ, HKV, D = 32, 8, 128
DTYPE = jnp.bfloat16


def _copy_into(buf: jax_vmm.Buffer, src: jax.Array) -> None:
    import cupy

    src = jax.block_until_ready(src)
    cupy.cuda.runtime.memcpy(
        buf.address, src.unsafe_buffer_pointer(), src.nbytes, cupy.cuda.runtime.memcpyDeviceToDevice
    )


def _err(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {' | '.join(lines)[:600]}"


def _layers_arena(dev, layers: int, B: int, T: int, dtype: Any, **scales: Any):
    """A KV arena of ``layers`` per-sequence layers, every sequence backed to T tokens."""
    return jax_vmm.kv_arena(
        num_layers=layers,
        num_kv_heads=HKV,
        head_dim=D,
        max_tokens=T,
        dtype=dtype,
        device=dev,
        max_seqs=B,
        initial_tokens=T,
        **scales,
    )


def _time_into(row: dict, name: str, call: Any, calls_each: int, repeats: int, runs: int) -> None:
    """row[name_us]: the median time of ``call`` per layer call (it makes ``calls_each``);
    None and row[name_error] if it fails."""
    try:
        row[f"{name}_us"] = median_time(call, repeats, runs) / calls_each * 1e6
    except Exception as exc:  # noqa: BLE001 - report and keep going
        row[f"{name}_us"] = None
        row[f"{name}_error"] = _err(exc)


def over_layers(attend: Any, layers: int, steps: int) -> Any:
    """A jitted ``run(q, lengths, cache)``: ``steps`` decode steps (a ``fori_loop`` when
    > 1), each running ``attend(q, layer_index, lengths, cache)`` over ``layers`` layers
    with each output the next query, so no call can be hoisted or skipped. ``cache`` (the
    views, or a ``kv.cache()``) is an argument, never a constant of the trace."""

    def one_step(q, lengths, cache):
        for layer in range(layers):
            q = attend(q, layer, lengths, cache).reshape(q.shape)
        return q

    @jax.jit
    def run(q, lengths, cache):
        if steps == 1:
            return one_step(q, lengths, cache)
        return jax.lax.fori_loop(0, steps, lambda _, x: one_step(x, lengths, cache), q)

    return run


def run_config(
    dev,
    B: int,
    T: int,
    S: int,
    ragged: bool,
    layers_budget: int,
    runs: int,
    repeats: int,
    steps: int,
    copy_bps: float,
    fp8: bool,
    seed: int = 0,
) -> dict:
    rng = np.random.default_rng(seed)
    layer_bytes = 2 * B * T * HKV * D * 2
    R = int(min(8, max(2, math.ceil(layers_budget / layer_bytes))))
    if S == 1:
        n = rng.integers(1, T + 1, size=B) if ragged else np.full(B, T)
    else:
        n = rng.integers(S, T + 1, size=B)
    n = n.astype(np.int32)
    live = int(2 * n.sum() * HKV * D * 2)
    row: dict[str, Any] = dict(
        B=B,
        T=T,
        S=S,
        layers=R,
        steps=steps,
        live_kv_bytes=live,
        floor_us=live / copy_bps * 1e6,
        hbm_floor_us=live / (hbm_tbps(dev) * 1e12) * 1e6,
    )
    kv = _layers_arena(dev, R, B, T, DTYPE)
    try:
        key = jax.random.PRNGKey(seed)
        # Random data in layer 0 (checked); the other layers keep the arena's zeros (timing
        # does not depend on the values).
        for buf in (kv.k_buffers[0], kv.v_buffers[0]):
            key, sub = jax.random.split(key)
            _copy_into(buf, jax.random.normal(sub, (B, T, HKV, D), DTYPE))
        key, sub = jax.random.split(key)
        q0 = jax.device_put(jax.random.normal(sub, (B, S, HQ, D), DTYPE), dev)
        lens = jax.device_put(jnp.asarray(n), dev)
        qlens = jax.device_put(jnp.full((B,), S, jnp.int32), dev)
        ks = [kv.k[l] for l in range(R)]
        vs = [kv.v[l] for l in range(R)]

        def jax_cudnn(q, k, v, n):
            if S == 1:
                return jax.nn.dot_product_attention(
                    q, k, v, key_value_seq_lengths=n, implementation="cudnn"
                )
            return jax.nn.dot_product_attention(
                q,
                k,
                v,
                query_seq_lengths=qlens,
                key_value_seq_lengths=n,
                implementation="cudnn",
            )

        def vmm_layer(q, layer, n):
            if S == 1:
                return jax_vmm.decode_attention(q[:, 0], layer, n)[:, None]
            return jax_vmm.attention(q, layer, n)

        impls = {
            "vmm_cudnn": lambda q, k, v, n: ca.cudnn_attention(q, k, v, n),
            "no_zero": lambda q, k, v, n: ca.cudnn_attention(q, k, v, n, zero_rows=False),
            "vmm_layer": None,  # over kv.cache(), below
            "jax_cudnn": jax_cudnn,
        }
        if S == 1:
            impls["vmm_kernel"] = lambda q, k, v, n: jax_vmm.decode_attention(q[:, 0], k, v, n)[
                :, None
            ]
        else:
            impls["jax_split"] = lambda q, k, v, n: split_causal_attention(q, k, v, n, cudnn_attend)

        # layer 0: ours against JAX's cuDNN with the same mask (S > 1: the split)
        same_mask = jax_cudnn if S == 1 else impls["jax_split"]
        try:
            a = ca.cudnn_attention(q0, ks[0], vs[0], lens).astype(jnp.float32)
            b = same_mask(q0, ks[0], vs[0], lens).astype(jnp.float32)
            row["max_abs_diff_vs_jax_cudnn" if S == 1 else "max_abs_diff_vs_jax_split"] = float(
                jnp.max(jnp.abs(a - b))
            )
        except Exception as exc:  # noqa: BLE001 - report and keep going
            row["check_error"] = _err(exc)

        views, cache = (ks, vs), kv.cache()
        for name, attend in impls.items():
            if attend is None:
                state = cache
                run = over_layers(lambda q, l, n, c: vmm_layer(q, c[l], n), R, steps)
            else:
                state = views
                run = over_layers(lambda q, l, n, c, a=attend: a(q, c[0][l], c[1][l], n), R, steps)
            _time_into(row, name, lambda: run(q0, lens, state), R * steps, repeats, runs)
        if fp8 and S == 1:
            _time_fp8_layer(row, dev, q0, lens, B, T, R, runs, repeats, steps, key)
        return row
    finally:
        kv.close()


def _time_fp8_layer(
    row: dict, dev, q0, lens, B: int, T: int, R: int, runs: int, repeats: int, steps: int, key
) -> None:
    """vmm_fp8_us: decode over the same lengths in an fp8 arena of R layers, as a model
    calls it (decode_attention over kv.cache()[l]). Layer 0 holds random tokens quantized
    with per-head scales, the others the arena's zeros, as in the bf16 arena (the time
    does not depend on the values; tests/ops check the fp8 results)."""
    scales = jnp.full((R, HKV), 0.05, jnp.float32)
    kv8 = _layers_arena(dev, R, B, T, FP8_DTYPE, k_scales=scales, v_scales=scales)
    try:
        k_key, v_key = jax.random.split(key)
        for buf, sub in ((kv8.k_buffers[0], k_key), (kv8.v_buffers[0], v_key)):
            x = jax.random.normal(sub, (B, T, HKV, D), jnp.float32)
            _copy_into(buf, quantize_fp8(x, scales[0]))
        cache = kv8.cache()
        run = over_layers(
            lambda q, l, n, c: jax_vmm.decode_attention(q[:, 0], c[l], n)[:, None], R, steps
        )
        _time_into(row, "vmm_fp8", lambda: run(q0, lens, cache), R * steps, repeats, runs)
    finally:
        kv8.close()


def _fmt(x: Any, t: str = "{:8.1f}") -> str:
    return t.format(x) if isinstance(x, (int, float)) else f"{'n/a':>8}"


def _ratio(a: Any, b: Any) -> Any:
    return a / b if isinstance(a, float) and isinstance(b, float) and b > 0 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=parse_list(int), default="1,4,8,32,64")
    p.add_argument("--contexts", type=parse_list(int), default="1024,2048,8192,32768")
    p.add_argument("--multi-q", type=parse_list(int), default="512,2048")
    p.add_argument("--multi-contexts", type=parse_list(int), default="4096,8192,32768")
    p.add_argument("--multi-batch", type=int, default=4)
    p.add_argument("--ragged", action="store_true", help="ragged decode lengths in [1, T]")
    p.add_argument("--layers-budget", type=int, default=1 << 30, help="bytes of K/V per step")
    p.add_argument("--steps", type=int, default=16, help="decode steps per timed call (fori_loop)")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-fp8", action="store_true", help="skip the fp8 arena's decode column")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    gpus = [d for d in jax.devices() if d.platform in ("gpu", "cuda")]
    if not gpus:
        sys.exit("needs a CUDA GPU")
    if args.steps < 1:
        sys.exit(f"--steps must be >= 1, got {args.steps}")
    dev = gpus[0]
    print(f"jax {jax.__version__}, device {dev.device_kind}")
    print(f"cudnn backend: {ca.cudnn_info()}")
    if not ca.cudnn_available():
        sys.exit("the cuDNN backend is not available (see above)")
    copy_bps = copy_bandwidth(dev, 1 << 30)
    print(
        f"copy bandwidth {copy_bps / 1e9:,.0f} GB/s (read + write, 1 GiB device-to-device); "
        f"nominal HBM {hbm_tbps(dev) * 1e3:,.0f} GB/s"
    )
    configs = [(B, T, 1) for B in args.batches for T in args.contexts]
    configs += [
        (args.multi_batch, T, S)
        for S in args.multi_q
        if S > 0
        for T in args.multi_contexts
        if T > S
    ]
    rows = []
    t0 = time.perf_counter()
    head = (
        f"{'B':>3} {'T':>6} {'S':>5} {'vmm_cudnn':>9} {'no_zero':>8} {'vmm_layer':>9} "
        f"{'jax_cudnn':>9} {'jax_split':>9} {'vmm_kernel':>10} {'ratio':>6} {'layer':>6} "
        f"{'best':>6} {'kern/jax':>8} {'vmm_fp8':>8} {'fp8':>6} {'floor':>8} {'hbm':>8} "
        f"{'%copy':>6}  (us per layer call)"
    )
    print(head)
    for B, T, S in configs:
        try:
            row = run_config(
                dev,
                B,
                T,
                S,
                args.ragged,
                args.layers_budget,
                args.runs,
                args.repeats,
                args.steps,
                copy_bps,
                not args.no_fp8,
            )
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory at the largest sizes
            traceback.print_exc()
            row = dict(B=B, T=T, S=S, error=_err(exc))
            print(f"{B:>3} {T:>6} {S:>5} failed: {row['error']}")
            rows.append(row)
            continue
        rows.append(row)
        r = _ratio(row.get("vmm_cudnn_us"), row.get("jax_cudnn_us"))
        rl = _ratio(row.get("vmm_layer_us"), row.get("jax_cudnn_us"))
        rk = _ratio(row.get("vmm_kernel_us"), row.get("jax_cudnn_us"))
        jax_times = [row.get(f"{n}_us") for n in ("jax_cudnn", "jax_split")]
        jax_times = [t for t in jax_times if isinstance(t, float)]
        rb = _ratio(row.get("vmm_layer_us"), min(jax_times)) if S > 1 and jax_times else None
        row["best_ratio"] = rb
        row["layer_ratio"] = rl
        r8 = row["fp8_ratio"] = _ratio(row.get("vmm_fp8_us"), row.get("jax_cudnn_us"))
        pct = _ratio(row["floor_us"], row.get("vmm_layer_us"))
        print(
            f"{B:>3} {T:>6} {S:>5} {_fmt(row.get('vmm_cudnn_us'), '{:9.1f}')} "
            f"{_fmt(row.get('no_zero_us'))} {_fmt(row.get('vmm_layer_us'), '{:9.1f}')} "
            f"{_fmt(row.get('jax_cudnn_us'), '{:9.1f}')} "
            f"{_fmt(row.get('jax_split_us'), '{:9.1f}')} "
            f"{_fmt(row.get('vmm_kernel_us'), '{:10.1f}')} {_fmt(r, '{:6.3f}')} "
            f"{_fmt(rl, '{:6.3f}')} {_fmt(rb, '{:6.3f}')} {_fmt(rk, '{:8.3f}')} "
            f"{_fmt(row.get('vmm_fp8_us'))} {_fmt(r8, '{:6.3f}')} {_fmt(row['floor_us'])} "
            f"{_fmt(row['hbm_floor_us'])} {_fmt(pct and 100 * pct, '{:6.1f}')}",
            flush=True,
        )
        for k, v in row.items():
            if k.endswith("error") or k.startswith("max_abs"):
                print(f"      {k}: {v}")
    print(f"total {time.perf_counter() - t0:.0f} s; graph cache: {ca.cudnn_attention_stats()}")
    for line in goal_lines(rows):
        print(line)
    if args.json:
        write_json(
            args.json,
            dict(rows=rows, cudnn=ca.cudnn_info(), copy_bytes_per_s=copy_bps, argv=sys.argv),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
