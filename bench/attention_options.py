"""jax_vmm's general attention (S query rows, window, softcap) beside cuDNN where cuDNN
can express it through jax.nn.dot_product_attention.

Rows (bf16, H_q 32, H_kv 8, D 128 by default; full lengths):

  decode            S = 1, no option: jax_vmm.decode_attention's path; cuDNN with
                    key_value_seq_lengths (the bench/attention.py comparison)
  decode+window     S = 1, window T/4: a sliding-window decode; cuDNN's jax.nn API aligns
                    its causal / window masks top-left (query 0 at key 0), so it cannot
                    place a decode query at the end: its column shows its plain decode time
                    (reads everything) for scale, marked "*"
  decode+softcap    S = 1, softcap 50: jax.nn has no softcap; "*" as above
  spec S=4 / S=16   the last S tokens (speculative decoding); not expressible in jax.nn
  prefill causal    S = T (smaller B, T): is_causal=True; cuDNN computes the same thing
  prefill window    S = T, window 256: cuDNN local_window_size=(255, 0)

Where both compute the same thing, "maxdiff" is their largest absolute difference. Our
split-K kernels are built for decode; large S is only required to be correct (the cuDNN
backend is for speed).

  python bench/attention_options.py            # GPU (or a CPU smoke run)
  python bench/attention_options.py --smoke
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_vmm
from _common import Table, median_time, pick_device, write_json


def cudnn(q, k, v, *, causal=False, window=None, implementation="cudnn"):
    local = None if window is None else (window - 1, 0)
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, local_window_size=local, implementation=implementation
    )


def rows_for(B: int, T: int, prefill_B: int, prefill_T: int) -> list[dict[str, Any]]:
    return [
        dict(name="decode", B=B, T=T, S=1, opts={}, cudnn="same"),
        dict(name="decode+window", B=B, T=T, S=1, opts=dict(window=T // 4), cudnn="plain"),
        dict(name="decode+softcap", B=B, T=T, S=1, opts=dict(softcap=50.0), cudnn="plain"),
        dict(name="spec S=4", B=B, T=T, S=4, opts={}, cudnn=None),
        dict(name="spec S=16 w", B=B, T=T, S=16, opts=dict(window=T // 4), cudnn=None),
        dict(name="prefill causal", B=prefill_B, T=prefill_T, S=prefill_T, opts={}, cudnn="same"),
        dict(
            name="prefill window",
            B=prefill_B,
            T=prefill_T,
            S=prefill_T,
            opts=dict(window=256),
            cudnn="same",
        ),
    ]


def run_row(row: dict, args: argparse.Namespace, device: jax.Device) -> dict:
    B, T, S = row["B"], row["T"], row["S"]
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)

    def draw(shape):
        return jax.device_put(jnp.asarray(rng.standard_normal(shape), dtype), device)

    q = draw((B, S, args.q_heads, args.head_dim))
    k = draw((B, T, args.kv_heads, args.head_dim))
    v = draw((B, T, args.kv_heads, args.head_dim))
    n = jax.device_put(jnp.full((B,), T, jnp.int32), device)
    ours_fn = jax.jit(lambda q, k, v, n: jax_vmm.attention(q, k, v, n, **row["opts"]))
    out = dict(name=row["name"], B=B, T=T, S=S, opts=row["opts"])
    out["ours_s"] = median_time(lambda: ours_fn(q, k, v, n), args.repeats, args.runs)
    if row["cudnn"] is None or device.platform == "cpu":
        return out
    causal = S > 1
    window = row["opts"].get("window") if row["cudnn"] == "same" else None
    cud_fn = jax.jit(
        lambda q, k, v, n: (
            cudnn(q, k, v, causal=causal, window=window)
            if S > 1
            else jax.nn.dot_product_attention(
                q, k, v, key_value_seq_lengths=n, implementation="cudnn"
            )
        )
    )
    try:
        out["cudnn_s"] = median_time(lambda: cud_fn(q, k, v, n), args.repeats, args.runs)
        out["cudnn_same"] = row["cudnn"] == "same"
        if out["cudnn_same"]:
            diff = jnp.abs(ours_fn(q, k, v, n).astype(jnp.float32) - cud_fn(q, k, v, n))
            out["maxdiff"] = float(jnp.max(diff))
    except Exception as e:  # noqa: BLE001 - report why cuDNN did not run, keep going
        out["cudnn_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, seconds on any device")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--prefill-batch", type=int, default=4)
    p.add_argument("--prefill-context", type=int, default=1024)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = pick_device(args.device)
    if args.smoke or device.platform == "cpu":
        args.batch, args.context, args.prefill_batch, args.prefill_context = 2, 256, 1, 64
        args.q_heads, args.kv_heads, args.runs, args.repeats = 8, 2, 2, 2
    table = Table(
        ("row", 16, "<"), ("B", 4), ("T", 6), ("S", 5), ("ours us", 10), ("cudnn us", 10),
        ("cud/ours", 9), ("maxdiff", 9),
    )  # fmt: skip
    print(f"device: {device.device_kind}; {args.dtype}, H_q {args.q_heads}, H_kv {args.kv_heads}")
    print(table.header())
    print(table.rule())
    results = []
    for row in rows_for(args.batch, args.context, args.prefill_batch, args.prefill_context):
        r = run_row(row, args, device)
        results.append(r)
        cud = r.get("cudnn_s")
        mark = "" if r.get("cudnn_same", True) else "*"
        print(
            table.row(
                r["name"],
                r["B"],
                r["T"],
                r["S"],
                f"{r['ours_s'] * 1e6:.1f}",
                "-" if cud is None else f"{cud * 1e6:.1f}{mark}",
                "-" if cud is None else f"{cud / r['ours_s']:.2f}{mark}",
                f"{r['maxdiff']:.3g}" if "maxdiff" in r else "-",
            )  # fmt: skip
        )
        if "cudnn_error" in r:
            print(f"    cudnn: {r['cudnn_error']}")
    if args.json:
        write_json(args.json, dict(device=device.device_kind, args=vars(args), rows=results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
