"""One GPU call that checks and times every decode-attention and kv_write variant of
issue 13 side by side, in one process, with the baselines measured in the same run.

  bash tools/gpu/run.sh build probe:kernels       (writes $OUT/kernels.json)
  python3 bench/kernels_probe.py --smoke      (tiny shapes on any device: checks the script)

Sections (each variant in its own try/except: one failure never loses the rest):
  ceilings   device-to-device copy bandwidth (read + write bytes / s) and read bandwidth
             (a max-reduction over a 4 GiB bf16 array); the physical floor of each row is
             live KV bytes / 4.8 TB/s (datasheet), printed beside the measured ones
  check      every attention kernel on small shapes (bf16/fp16, head_dim 64/128/256, GQA
             1/2/4/8, lengths 0, 1, non-multiples of 16, T) against a float64 reference,
             output buffer prefilled with NaN; fp8 against float64 on the dequantized cache
  attention  per shape: cuDNN (jax.nn.dot_product_attention(..., implementation="cudnn")),
             ours v1 (split-K, the current default), v2 "stream" (fused combine) and
             "stream_combine" and, at B32 T8k, ring depths / CTA counts / fp8. R layers of
             distinct K/V buffers per step so that repeats never hit in L2; time per layer
             = median over repeats of (N steps) / (N R). Errors: vs a float64 reference on
             three sequences of layer 0, and vs v1 over the whole output.
  kv_write   decode-size (n = 1, 8, 64) and prefill-size (n = 4096, 32768) writes into a
             1 GiB cache: ours (the tiled kernel) vs XLA's donated .at[].set, as time
             ratios and as a share of the copy bandwidth; the token kernel (production's
             fallback for huge tokens, forced by jax_vmm.testing.token_kernel_kv_writes)
             beside it; kv_write_fp8 prefill.

Prints a table last; --json writes every number. Expected runtime 2-4 minutes.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the scratch allocates outside XLA

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_vmm  # noqa: E402
import jax_vmm.info  # noqa: E402
import jax_vmm.testing  # noqa: E402
from _common import (  # noqa: E402
    Table,
    copy_bandwidth,
    fmt,
    looped_writes,
    median_time,
    ratio,
    write_json,
)
from _common import rel_err as rel  # noqa: E402
from jax_vmm import dequantize_fp8, quantize_fp8  # noqa: E402
from jax_vmm.ops.attention import decode_attention_tuned  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20
DATASHEET_BPS = 4.8e12
BF16, F16, FP8 = jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn
T0 = time.time()
RESULTS: dict[str, Any] = {"errors": []}


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def guarded(section: str, name: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - report and keep going
        first = str(exc).splitlines()[0][:300] if str(exc) else ""
        msg = f"{section}/{name}: {type(exc).__name__}: {first}"
        log("FAILED " + msg)
        RESULTS["errors"].append(
            dict(section=section, name=name, error=msg, trace=traceback.format_exc()[-3000:])
        )
        return None


# -- ceilings -----------------------------------------------------------------------------


def ceilings(dev, smoke=False) -> dict:
    """Copy bandwidth (read + write bytes / s, bench/_common.py) and read bandwidth (a
    max-reduction over twice the bytes)."""
    n = 64 * MiB if smoke else 2 * GiB
    red = jax.jit(lambda a: jnp.max(a))
    y = jax.device_put(jnp.ones((n,), BF16), dev)  # 2 n bytes read
    t_read = median_time(lambda: red(y), 5, 5)
    return dict(
        copy_bps=copy_bandwidth(dev, n, runs=5, repeats=5),
        read_bps=2 * n / t_read,
        datasheet_bps=DATASHEET_BPS,
    )


# -- references ---------------------------------------------------------------------------


def reference64(q, k, v, lengths, seqs, scale=None) -> np.ndarray:
    """float64 decode attention for the sequences `seqs` (arrays already float64)."""
    B, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = np.zeros((len(seqs), Hq, D))
    for i, b in enumerate(seqs):
        n = int(lengths[b])
        if n == 0:
            continue
        for h in range(Hq):
            s = k[b, :n, h // G] @ q[b, h] * scale
            p = np.exp(s - s.max())
            out[i, h] = p @ v[b, :n, h // G] / p.sum()
    return out


# -- attention variants ----------------------------------------------------------------------


def variants_for(fp8: bool, extra: str) -> dict[str, Callable]:
    sms = getattr(jax.devices()[0], "core_count", 0) or 132
    if fp8:
        v = {
            "fp8_stream": lambda q, k, v, n, ks, vs: decode_attention_tuned(
                q, k, v, n, k_scale=ks, v_scale=vs, impl="stream"
            ),
            "fp8_stream_combine": lambda q, k, v, n, ks, vs: decode_attention_tuned(
                q, k, v, n, k_scale=ks, v_scale=vs, impl="stream_combine"
            ),
            "fp8_stream_tma": lambda q, k, v, n, ks, vs: decode_attention_tuned(
                q, k, v, n, k_scale=ks, v_scale=vs, impl="stream_tma"
            ),
        }
        if extra == "big":  # CTAs per SM and ring depth (a 32-token fp8 slot is 32 KiB)
            for per, stages in ((1, 0), (2, 0), (3, 0), (1, 4), (2, 2), (2, 3), (3, 2)):
                v[f"fp8_stream_c{per}" + (f"s{stages}" if stages else "")] = (
                    lambda c, s: (
                        lambda q, k, v, n, ks, vs: decode_attention_tuned(
                            q, k, v, n, k_scale=ks, v_scale=vs, impl="stream", ctas=c, stages=s
                        )
                    )
                )(per * sms, stages)
        return v
    v = {  # v1 first: every later row reports its difference from it
        "v1": lambda q, k, v, n: decode_attention_tuned(q, k, v, n),
        "cudnn": lambda q, k, v, n: jax.nn.dot_product_attention(
            q[:, None], k, v, key_value_seq_lengths=n, implementation="cudnn"
        )[:, 0],
        "stream": lambda q, k, v, n: decode_attention_tuned(q, k, v, n, impl="stream"),
        "stream_combine": lambda q, k, v, n: decode_attention_tuned(
            q, k, v, n, impl="stream_combine"
        ),
        "stream_tma": lambda q, k, v, n: decode_attention_tuned(q, k, v, n, impl="stream_tma"),
    }
    if extra == "big":  # ring depth and CTAs per SM at the main shape
        for s in (2, 4):
            v[f"stream_s{s}"] = (
                lambda s: (
                    lambda q, k, v, n: decode_attention_tuned(q, k, v, n, impl="stream", stages=s)
                )
            )(s)
        for per in (1, 3):
            v[f"stream_c{per}"] = (
                lambda c: (
                    lambda q, k, v, n: decode_attention_tuned(q, k, v, n, impl="stream", ctas=c)
                )
            )(per * sms)
    if extra == "splitk":  # split-K chunk sizes where the automatic plan cuts 64-token chunks
        for ch in (128, 256, 512):
            v[f"v1_c{ch}"] = (
                lambda c: lambda q, k, v, n: decode_attention_tuned(q, k, v, n, chunk=c)
            )(ch)
    if extra == "small":  # how many tiles a CTA gets at launch-bound shapes
        for mt in (4, 64):
            v[f"stream_mt{mt}"] = (
                lambda m: (
                    lambda q, k, v, n: decode_attention_tuned(
                        q, k, v, n, impl="stream", min_tiles=m
                    )
                )
            )(mt)
    return v


def attention_shape(
    dev,
    name,
    B,
    T,
    Hq,
    Hkv,
    D,
    lengths,
    dtype=BF16,
    fp8=False,
    extra="",
    budget=1536 * MiB,
    runs=10,
    repeats=5,
) -> list[dict]:
    itemsize = 1 if fp8 else 2
    layer_bytes = 2 * B * T * Hkv * D * itemsize
    R = int(min(16, max(2, math.ceil(budget / layer_bytes))))
    live = int(2 * int(np.sum(lengths)) * Hkv * D * itemsize)
    key = jax.random.PRNGKey(B * 7 + T)
    ks_ = jax.random.split(key, 4)
    with jax.default_device(dev):
        qs = jax.random.normal(ks_[0], (R, B, Hq, D), jnp.float32).astype(dtype)
        scales = None
        if fp8:
            ksc = jnp.full((Hkv,), 0.01, jnp.float32) * (1 + jnp.arange(Hkv) / Hkv)
            vsc = jnp.full((Hkv,), 0.008, jnp.float32) * (1 + jnp.arange(Hkv) / Hkv)
            ks = [
                quantize_fp8(
                    jax.random.normal(jax.random.fold_in(ks_[1], i), (B, T, Hkv, D), BF16), ksc
                )
                for i in range(R)
            ]
            vs = [
                quantize_fp8(
                    jax.random.normal(jax.random.fold_in(ks_[2], i), (B, T, Hkv, D), BF16), vsc
                )
                for i in range(R)
            ]
            scales = (ksc, vsc)
        else:
            ks = [
                jax.random.normal(jax.random.fold_in(ks_[1], i), (B, T, Hkv, D), dtype)
                for i in range(R)
            ]
            vs = [
                jax.random.normal(jax.random.fold_in(ks_[2], i), (B, T, Hkv, D), dtype)
                for i in range(R)
            ]
    lens = jax.device_put(jnp.asarray(lengths, jnp.int32), dev)
    jax.block_until_ready((qs, ks, vs))

    # float64 reference on three sequences of layer 0
    seqs = sorted({0, B // 2, B - 1})
    q64 = np.asarray(qs[0].astype(jnp.float32), np.float64)
    if fp8:
        k64 = np.asarray(jnp.stack([dequantize_fp8(ks[0][b], scales[0]) for b in seqs]), np.float64)
        v64 = np.asarray(jnp.stack([dequantize_fp8(vs[0][b], scales[1]) for b in seqs]), np.float64)
    else:
        k64 = np.asarray(ks[0][np.array(seqs)].astype(jnp.float32), np.float64)
        v64 = np.asarray(vs[0][np.array(seqs)].astype(jnp.float32), np.float64)
    ref = reference64(
        q64[np.array(seqs)], k64, v64, np.asarray(lengths)[np.array(seqs)], range(len(seqs))
    )

    rows = []
    base = None
    for vname, attend in variants_for(fp8, extra).items():

        def one(vname=vname, attend=attend):
            extra_args = scales if fp8 else ()

            @jax.jit
            def step(qs, ks, vs, lens, *sc):
                return jnp.stack([attend(qs[i], ks[i], vs[i], lens, *sc) for i in range(R)])

            out0 = np.asarray(attend(qs[0], ks[0], vs[0], lens, *extra_args).astype(jnp.float32))
            t = median_time(lambda: step(qs, ks, vs, lens, *extra_args), repeats, runs) / R
            return t, out0

        res = guarded("attention", f"{name}/{vname}", one)
        row = dict(
            shape=name,
            variant=vname,
            B=B,
            T=T,
            Hq=Hq,
            Hkv=Hkv,
            D=D,
            dtype="fp8" if fp8 else np.dtype(dtype).name,
            layers=R,
            live_kv_bytes=live,
            floor_datasheet_s=live / DATASHEET_BPS,
        )
        if res is not None:
            t, out0 = res
            row.update(time_s=t, kv_gbps=live / t / 1e9, err_ref=rel(out0[np.array(seqs)], ref))
            if vname == "v1":
                base = out0
            if base is not None and vname != "v1":
                row["err_vs_v1"] = rel(out0, base)
        rows.append(row)
        log(
            f"  {name:18s} {vname:20s} "
            + (
                f"{row['time_s'] * 1e6:9.1f} us {row['kv_gbps']:7.0f} GB/s err {row['err_ref']:.1e}"
                if "time_s" in row
                else "failed"
            )
        )
    return rows


def check_small(dev, smoke=False) -> list[dict]:
    """Every kernel on small shapes vs float64, NaN-prefilled outputs."""
    rows = []
    rng = np.random.default_rng(0)
    shapes = [
        (3, 200, 8, 8, 64),
        (3, 300, 8, 4, 128),
        (4, 257, 8, 2, 64),
        (3, 77, 32, 4, 128),
        (2, 130, 8, 1, 128),
        (2, 70, 16, 8, 256),
        (2, 40, 16, 1, 256),
        (5, 1000, 32, 8, 128),
    ]
    if smoke:
        shapes = shapes[:2]
    for si, (B, T, Hq, Hkv, D) in enumerate(shapes):
        impls = ["v1", "stream", "stream_combine", "stream_tma", "fp8_stream", "fp8_stream_tma"]
        if si < 2:  # the other kernels on two shapes
            impls += ["tensor_core_u1", "simple", "fp8_stream_combine"]
        lengths = np.array(
            ([0, 1, min(T, 37), T] + list(rng.integers(0, T + 1, size=B)))[:B], np.int32
        )
        for dtype in (BF16, F16):
            q = jnp.asarray(rng.standard_normal((B, Hq, D), np.float32)).astype(dtype)
            kf = rng.standard_normal((B, T, Hkv, D)).astype(np.float32)
            vf = rng.standard_normal((B, T, Hkv, D)).astype(np.float32)
            for impl in impls:

                def one(impl=impl):
                    fp8 = impl.startswith("fp8")
                    if fp8:
                        ksc = jnp.asarray(rng.uniform(0.002, 0.02, Hkv), jnp.float32)
                        vsc = jnp.asarray(rng.uniform(0.002, 0.02, Hkv), jnp.float32)
                        k, v = (
                            quantize_fp8(jnp.asarray(kf), ksc),
                            quantize_fp8(jnp.asarray(vf), vsc),
                        )
                        k64 = np.asarray(dequantize_fp8(k, ksc), np.float64)
                        v64 = np.asarray(dequantize_fp8(v, vsc), np.float64)
                        kw = dict(
                            k_scale=jax.device_put(ksc, dev),
                            v_scale=jax.device_put(vsc, dev),
                            impl=impl[4:],
                        )
                    else:
                        k, v = jnp.asarray(kf).astype(dtype), jnp.asarray(vf).astype(dtype)
                        k64 = np.asarray(k.astype(jnp.float32), np.float64)
                        v64 = np.asarray(v.astype(jnp.float32), np.float64)
                        kw = dict(impl="auto" if impl == "v1" else impl)
                    qq, kk, vv, ll = (
                        jax.device_put(x, dev) for x in (q, k, v, jnp.asarray(lengths))
                    )
                    poison = jax.device_put(jnp.full(q.shape, jnp.nan, dtype), dev)
                    out = jax_vmm.testing.decode_attention(qq, kk, vv, ll, out_init=poison, **kw)
                    out = np.asarray(out.astype(jnp.float32), np.float64)
                    ref = reference64(
                        np.asarray(q.astype(jnp.float32), np.float64), k64, v64, lengths, range(B)
                    )
                    zeros_ok = bool((out[lengths == 0] == 0).all())
                    return dict(
                        err=rel(out, ref), finite=bool(np.isfinite(out).all()), zeros=zeros_ok
                    )

                r = guarded("check", f"{impl} {(B, T, Hq, Hkv, D)} {np.dtype(dtype).name}", one)
                tol = 1e-2 if dtype == BF16 else 3e-3
                row = dict(impl=impl, shape=(B, T, Hq, Hkv, D), dtype=np.dtype(dtype).name, tol=tol)
                if r is not None:
                    row.update(r, ok=r["finite"] and r["zeros"] and r["err"] < tol)
                else:
                    row["ok"] = False
                rows.append(row)
    bad = [r for r in rows if not r["ok"]]
    log(
        f"check: {len(rows) - len(bad)}/{len(rows)} ok"
        + ("" if not bad else f"; failing: {bad[:6]}")
    )
    return rows


# -- kv_write --------------------------------------------------------------------------------


def kv_write_section(dev, copy_bps, smoke=False) -> list[dict]:
    H, D = 8, 128
    tb = H * D * 2
    slots_total = ((16 * MiB) if smoke else GiB) // (2 * tb)
    rows = []

    def make(kind, n, loop, dtype=BF16):
        rng = np.random.default_rng(n)
        src_dtype = BF16
        nk = jax.device_put(jnp.asarray(rng.standard_normal((n, H, D)), src_dtype), dev)
        nv = jax.device_put(jnp.asarray(rng.standard_normal((n, H, D)), src_dtype), dev)
        cache_dtype = FP8 if kind == "ours_fp8" else BF16
        k = jax.device_put(jnp.zeros((slots_total, H, D), cache_dtype), dev)
        v = jax.device_put(jnp.zeros((slots_total, H, D), cache_dtype), dev)
        sc = jax.device_put(jnp.full((H,), 0.01, jnp.float32), dev)

        def update(k, v, slots):
            if kind == "xla":
                return k.at[slots].set(nk, mode="drop"), v.at[slots].set(nv, mode="drop")
            if kind == "ours_fp8":
                return jax_vmm.kv_write_fp8(k, v, nk, nv, slots, sc, sc)
            if kind == "ours_token":  # traced inside: the call binds the token-kernel target
                with jax_vmm.testing.token_kernel_kv_writes():
                    return jax_vmm.kv_write(k, v, nk, nv, slots)
            return jax_vmm.kv_write(k, v, nk, nv, slots)

        exe = jax.jit(looped_writes(update, n, loop, slots_total), donate_argnums=(0, 1, 2))
        state = [k, v, jax.device_put(jnp.int32(0), dev)]

        def step():
            state[0], state[1], state[2] = exe(*state)
            return state[2]

        return step

    sizes = [(1, "decode"), (8, "decode"), (64, "decode"), (4096, "prefill"), (32768, "prefill")]
    for n, mode in sizes[:4] if smoke else sizes:
        loop = 64 if mode == "decode" else max(1, min(16, slots_total // n))
        times = {}
        kinds = ["ours", "ours_token", "xla"] + (["ours_fp8"] if mode == "prefill" else [])
        for kind in kinds:
            t = guarded(
                "kv_write",
                f"{kind} n={n}",
                lambda kind=kind: median_time(make(kind, n, loop), 7, 3) / loop,
            )
            if t is not None:
                times[kind] = t
        moved = 2 * 2 * n * tb  # K and V, read once and written once
        row = dict(n=n, mode=mode, loop=loop, **{f"{k}_us": t * 1e6 for k, t in times.items()})
        if "ours" in times and "xla" in times:
            row["ours_over_xla"] = times["ours"] / times["xla"]
        if "ours" in times and "ours_token" in times:
            row["token_over_tiled"] = times["ours_token"] / times["ours"]
        if "ours" in times:
            row["ours_gbps"] = moved / times["ours"] / 1e9
            row["ours_pct_copy"] = 100 * moved / times["ours"] / copy_bps
        if "ours_fp8" in times:
            fp8_moved = 2 * n * (tb + tb // 2)  # read bf16, write fp8
            row["fp8_gbps"] = fp8_moved / times["ours_fp8"] / 1e9
            row["fp8_pct_copy"] = 100 * fp8_moved / times["ours_fp8"] / copy_bps
        rows.append(row)
        log(
            f"  kv_write {mode} n={n}: "
            + ", ".join(f"{k}={v:.3g}" for k, v in row.items() if isinstance(v, float))
        )
    return rows


# -- main ---------------------------------------------------------------------------------


def table(res: dict) -> None:
    c = res.get("ceilings", {})
    gbs = {k: c.get(k, 0) / 1e9 for k in ("copy_bps", "read_bps")}
    print("\n==== issue 13 kernels probe ====")
    print(
        f"device {res.get('device')}; jax {jax.__version__}; copy {gbs['copy_bps']:.0f} GB/s "
        f"(read+write), read {gbs['read_bps']:.0f} GB/s, datasheet {DATASHEET_BPS / 1e9:.0f} GB/s"
    )
    checks = res.get("check", [])
    if checks:
        bad = [r for r in checks if not r.get("ok")]
        print(
            f"correctness: {len(checks) - len(bad)}/{len(checks)} ok "
            "(float64 ref, NaN-prefilled outputs)"
        )
        worst = {}
        for r in checks:
            if "err" in r:
                worst[r["impl"]] = max(worst.get(r["impl"], 0), r["err"])
        print("  worst rel err: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
        for r in bad[:10]:
            print(f"  FAIL {r}")
    attention_table(res.get("attention", []), c.get("read_bps"))
    kv_write_table(res.get("kv_write", []))
    if res["errors"]:
        print(f"\n{len(res['errors'])} variant(s) failed:")
        for e in res["errors"][:20]:
            print("  " + e["error"])
    print(f"\ntotal {time.time() - T0:.0f} s")


def attention_table(rows: list[dict], read_bps: float | None) -> None:
    t = Table(
        ("shape", 18, "<"),
        ("variant", 20, "<"),
        ("us", 9),
        ("GB/s", 7),
        ("/cudnn", 7),
        ("%read", 6),
        ("floor", 7),
        ("err_ref", 8),
        ("err_v1", 8),
    )
    print("\n" + t.header())
    cud = {r["shape"]: r.get("time_s") for r in rows if r["variant"] == "cudnn"}
    for r in rows:
        s = r.get("time_s")
        base = cud.get(r["shape"].removesuffix("_fp8"))  # fp8 rows: bf16 cuDNN at the same tokens
        pct = 100 * r["kv_gbps"] * 1e9 / read_bps if s and read_bps else None
        print(
            t.row(
                r["shape"],
                r["variant"],
                fmt(s and s * 1e6, "{:.1f}", "fail"),
                fmt(r.get("kv_gbps"), "{:.0f}", ""),
                fmt(ratio(s, base), "{:.3f}"),
                fmt(pct, "{:.1f}"),
                f"{r['floor_datasheet_s'] * 1e6:.1f}",
                fmt(r.get("err_ref"), "{:.1e}"),
                fmt(r.get("err_vs_v1"), "{:.1e}"),
            )
        )
    print(
        "  (/cudnn: time over cuDNN's at the same shape; fp8 rows over bf16 cuDNN at the same "
        "tokens; goals <= 0.95 for B x T >= 64k, fp8 <= 0.6; %read: KV bytes/s over the read "
        "ceiling)"
    )


def kv_write_table(rows: list[dict]) -> None:
    if not rows:
        return
    t = Table(
        ("kv_write", 8, "<"),
        ("n", 6),
        ("ours us", 9),
        ("token us", 9),
        ("xla us", 9),
        ("ours/xla", 9),
        ("GB/s", 7),
        ("%copy", 6),
        ("fp8 GB/s", 9),
    )
    print("\n" + t.header())
    for r in rows:
        print(
            t.row(
                r["mode"],
                r["n"],
                fmt(r.get("ours_us"), "{:.2f}"),
                fmt(r.get("ours_token_us"), "{:.2f}"),
                fmt(r.get("xla_us"), "{:.2f}"),
                fmt(r.get("ours_over_xla"), "{:.3f}"),
                fmt(r.get("ours_gbps"), "{:.0f}"),
                fmt(r.get("ours_pct_copy"), "{:.1f}"),
                fmt(r.get("fp8_gbps"), "{:.0f}"),
            )
        )
    print(
        "  (ours: the tiled kernel; token: its fallback for huge tokens; goals: prefill >= 85% "
        "of copy; decode ours/xla <= 1.0)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default="all", choices=["all", "kv_write"])
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument(
        "--shapes",
        default=None,
        help="comma-separated attention shape names (e.g. B32_T8k,B32_T8k_fp8); skips the "
        "small-shape check and kv_write",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="tiny shapes: checks the script itself, on any device"
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=300.0,
        help="seconds after which the remaining spot-check shapes are skipped",
    )
    args = ap.parse_args()
    dev = jax.devices()[0]
    RESULTS["device"] = f"{dev.device_kind} ({dev.platform})"
    log(
        f"device {RESULTS['device']}, jax {jax.__version__}, built with CUDA kernels: "
        f"{jax_vmm.info.collect()['jax_vmm_cuda_kernels']}"
    )
    c = guarded("ceilings", "copy/read", lambda: ceilings(dev, smoke=args.smoke)) or {}
    RESULTS["ceilings"] = c
    copy_bps = c.get("copy_bps", 4.3e12)
    if args.only == "kv_write":
        RESULTS["kv_write"] = (
            guarded("kv_write", "all", lambda: kv_write_section(dev, copy_bps, smoke=args.smoke))
            or []
        )
        table(RESULTS)
        if args.json:
            write_json(args.json, RESULTS)
        return 0
    log(f"ceilings: {c}")
    RESULTS["check"] = []
    if not args.shapes:
        RESULTS["check"] = guarded("check", "all", lambda: check_small(dev, smoke=args.smoke)) or []

    rng = np.random.default_rng(1)
    shapes = [
        ("B32_T8k", 32, 8192, 32, 8, 128, np.full(32, 8192), dict(extra="big")),
        ("B32_T8k_fp8", 32, 8192, 32, 8, 128, np.full(32, 8192), dict(fp8=True, extra="big")),
        ("B64_T16k_6000", 64, 16384, 32, 8, 128, rng.integers(5500, 6501, 64), {}),
        ("B8_T32k", 8, 32768, 32, 8, 128, np.full(8, 32768), {}),
        ("B8_T32k_fp8", 8, 32768, 32, 8, 128, np.full(8, 32768), dict(fp8=True, extra="big")),
        ("B32_T8k_ragged", 32, 8192, 32, 8, 128, rng.integers(1, 8193, 32), {}),
        ("B1_T1k", 1, 1024, 32, 8, 128, np.full(1, 1024), dict(extra="small")),
        ("B4_T256", 4, 256, 32, 8, 128, np.full(4, 256), dict(extra="small")),
        ("B1_T8k", 1, 8192, 32, 8, 128, np.full(1, 8192), dict(extra="splitk")),
        ("B1_T32k", 1, 32768, 32, 8, 128, np.full(1, 32768), dict(extra="splitk")),
        ("B4_T8k", 4, 8192, 32, 8, 128, np.full(4, 8192), dict(extra="splitk")),
        ("B8_T8k", 8, 8192, 32, 8, 128, np.full(8, 8192), dict(extra="splitk")),
        ("B16_T1k", 16, 1024, 32, 8, 128, np.full(16, 1024), dict(extra="splitk")),
        ("B32_T1k", 32, 1024, 32, 8, 128, np.full(32, 1024), dict(extra="splitk")),
        ("B64_T2k", 64, 2048, 32, 8, 128, np.full(64, 2048), dict(extra="splitk")),
        ("B32_T8k_D64", 32, 8192, 32, 8, 64, np.full(32, 8192), {}),
        ("B16_T8k_D256", 16, 8192, 32, 8, 256, np.full(16, 8192), {}),
        ("B32_T8k_GQA1", 32, 8192, 8, 8, 128, np.full(32, 8192), {}),
        ("B32_T8k_GQA8", 32, 8192, 64, 8, 128, np.full(32, 8192), {}),
        ("B32_T8k_f16", 32, 8192, 32, 8, 128, np.full(32, 8192), dict(dtype=F16)),
    ]
    if args.quick:
        shapes = shapes[:2] + shapes[6:8]
    if args.smoke:
        shapes = [
            ("tiny", 2, 256, 8, 2, 64, np.array([256, 100]), dict(extra="big")),
            ("tiny_fp8", 2, 256, 8, 2, 64, np.array([256, 100]), dict(fp8=True, extra="big")),
        ]
    if args.shapes:
        wanted = args.shapes.split(",")
        unknown = sorted(set(wanted) - {x[0] for x in shapes})
        if unknown:
            ap.error(f"unknown shapes {unknown}; known: {[x[0] for x in shapes]}")
        shapes = [x for x in shapes if x[0] in wanted]
    RESULTS["attention"] = []

    def run_shapes(chosen, guard):
        for name, B, T, Hq, Hkv, D, lengths, kw in chosen:
            if guard and time.time() - T0 > args.budget:
                log(f"attention {name}: skipped (past the {args.budget:.0f} s budget)")
                RESULTS["errors"].append(
                    dict(section="attention", name=name, error=f"{name}: skipped (budget)")
                )
                continue
            log(f"attention {name}")
            if args.smoke:
                kw = dict(kw, budget=1 * MiB, runs=2, repeats=2)
            rows = guarded(
                "attention",
                name,
                lambda: attention_shape(
                    dev, name, B, T, Hq, Hkv, D, np.asarray(lengths, np.int32), **kw
                ),
            )
            RESULTS["attention"] += rows or []

    main_names = {
        "B32_T8k",
        "B32_T8k_fp8",
        "B64_T16k_6000",
        "B8_T32k",
        "B1_T1k",
        "B4_T256",
        "tiny",
        "tiny_fp8",
    }
    run_shapes([x for x in shapes if x[0] in main_names], guard=False)

    RESULTS["kv_write"] = []
    if not args.shapes:
        log("kv_write (tiled kernel, token kernel, XLA)")
        RESULTS["kv_write"] = (
            guarded("kv_write", "all", lambda: kv_write_section(dev, copy_bps, smoke=args.smoke))
            or []
        )

    run_shapes([x for x in shapes if x[0] not in main_names], guard=True)

    table(RESULTS)
    if args.json:
        write_json(args.json, RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
