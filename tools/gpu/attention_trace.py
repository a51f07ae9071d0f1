"""Device time of decode attention inside bench/kernels_probe.py's timed step (issue 28).

The probe times a jitted step of R = 3 layers (one attention call per layer, outputs
stacked) over 10 back-to-back calls. This runs the same step for the fp8 streaming
kernel, bf16 cuDNN and the bf16 streaming kernel at B32 T8k and B8 T32k (H_q 32, H_kv 8,
D 128), traces 10 more calls with jax.profiler and prints, per layer, the wall time, the
device's busy time and gaps, and the kernels by name (tools/gpu/trace_summary.py): what
share of the probe's number is the attention kernel itself.

    python3 tools/gpu/attention_trace.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import trace_summary  # noqa: E402

from jax_vmm import quantize_fp8  # noqa: E402
from jax_vmm.ops.attention import decode_attention_tuned  # noqa: E402

HQ, HKV, D, LAYERS, CALLS = 32, 8, 128, 3, 10


def steps() -> dict:
    """name -> a jitted step over LAYERS layers: (qs, ks, vs, lengths, *scales)."""

    def stacked(attend):
        return jax.jit(
            lambda q, k, v, n, *sc: jnp.stack(
                [attend(q[i], k[i], v[i], n, *sc) for i in range(LAYERS)]
            )
        )

    return {
        "fp8_stream": stacked(
            lambda q, k, v, n, ks, vs: decode_attention_tuned(
                q, k, v, n, k_scale=ks, v_scale=vs, impl="stream"
            )
        ),
        "cudnn_bf16": stacked(
            lambda q, k, v, n: jax.nn.dot_product_attention(
                q[:, None], k, v, key_value_seq_lengths=n, implementation="cudnn"
            )[:, 0]
        ),
        "stream_bf16": stacked(
            lambda q, k, v, n: decode_attention_tuned(q, k, v, n, impl="stream")
        ),
    }


def measure(step, args) -> dict:
    for _ in range(3):
        jax.block_until_ready(step(*args))
    walls = []
    for _ in range(5):
        t0 = time.perf_counter()
        out = None
        for _ in range(CALLS):
            out = step(*args)
        jax.block_until_ready(out)
        walls.append((time.perf_counter() - t0) / CALLS / LAYERS * 1e6)
    log_dir = tempfile.mkdtemp()
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        out = None
        for _ in range(CALLS):
            out = step(*args)
        jax.block_until_ready(out)
    s = trace_summary.summarize(
        trace_summary.load(trace_summary.trace_file(log_dir)), steps=CALLS, layers=LAYERS
    )
    return {
        "wall_us_per_layer": sorted(walls)[len(walls) // 2],
        "busy_us_per_layer": s["busy_us_per_layer"],
        "gap_us_per_layer": s["gap_us_per_layer"],
        "kernels": [
            {"name": k["name"][:80], "per_call": k["per_step"], "us_each": k["us_each"]}
            for k in s["kernels"][:6]
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    report = {"device": jax.devices()[0].device_kind}
    for B, T in ((32, 8192), (8, 32768)):
        key = jax.random.PRNGKey(B)
        q = jax.random.normal(key, (LAYERS, B, HQ, D), jnp.float32).astype(jnp.bfloat16)
        n = jnp.full((B,), T, jnp.int32)
        ksc = jnp.full((HKV,), 0.01, jnp.float32)
        vsc = jnp.full((HKV,), 0.008, jnp.float32)
        kb = [
            jax.random.normal(jax.random.fold_in(key, i), (B, T, HKV, D), jnp.bfloat16)
            for i in range(LAYERS)
        ]
        vb = [
            jax.random.normal(jax.random.fold_in(key, 10 + i), (B, T, HKV, D), jnp.bfloat16)
            for i in range(LAYERS)
        ]
        k8 = [quantize_fp8(x, ksc) for x in kb]
        v8 = [quantize_fp8(x, vsc) for x in vb]
        operands = {
            "fp8_stream": (q, k8, v8, n, ksc, vsc),
            "cudnn_bf16": (q, kb, vb, n),
            "stream_bf16": (q, kb, vb, n),
        }
        for name, step in steps().items():
            r = measure(step, operands[name])
            report[f"B{B}_T{T}_{name}"] = r
            print(
                f"B{B} T{T} {name}: wall {r['wall_us_per_layer']:.1f} us/layer, busy "
                f"{r['busy_us_per_layer']:.1f}, gaps {r['gap_us_per_layer']:.1f}",
                flush=True,
            )
            for k in r["kernels"]:
                print(f"    {k['us_each']:8.1f} us x {k['per_call']:.0f}  {k['name']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
