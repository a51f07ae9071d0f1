"""cuDNN decode attention over a token-interleaved layout of every layer, against dense arrays.

Why: the memory goals (issue 29's equal memory, issue 32's shared prefix at <= 1.1x) miss
by the chunk granularity: one 2 MiB chunk per layer buffer repeats a sequence's partial
last chunk in each of the 2L buffers. tools/gpu/spanning_layout_probe.py measured a page
that holds P tokens of every layer laid out layer-major inside the page ([2L][P][H][D]),
which cuDNN can only read through its paged mode (1-15% over dense).

Laid out token-major instead, one buffer of "wide tokens" (B, T, 2L, H, D), a 2 MiB chunk
still holds P = 2 MiB / (2L x H x D x bytes) tokens of every layer (64 at 8 layers, 16 at
32, for 8 x 128 bf16), so a sequence wastes less than P tokens, and layer l's K is
``wide[:, :, 2l]``: one strided array (token stride 2L x H x D elements), which cuDNN's
dense mode reads without a page table. This measures that read against the same tokens in
per-layer compact arrays (what jax_vmm's arena layers are today), side by side.

Per point, in one process, best of ``--repeats`` rounds (the variants interleaved), each
round ``--calls`` passes over ``--layers-timed`` layers (distinct memory per layer, so a
layer is not read from L2 again), us per layer call:

  compact      K, V of each layer as (B, T, H, D) arrays
  interleaved  K, V of layer l as wide[:, :, 2l], wide[:, :, 2l + 1]

The outputs of the two are compared (same tokens). torch and cuDNN's Python frontend
(the nvidia-cudnn-frontend wheel in .whl/; the build step unpacks it), no jax_vmm.

    python3 tools/gpu/interleaved_layout_probe.py [--layers 8 32] [--json FILE]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _common import hbm_tbps_of_kind  # noqa: E402  (the bench helpers; imports JAX, no GPU)

PAGE_BYTES = 2 << 20
POINTS = {
    8: (
        (1, 1024),
        (1, 32768),
        (4, 8192),
        (16, 4096),
        (32, 8192),
        (8, 32768),
        (64, 2048),
        (64, 4096),
    ),
    32: ((1, 1024), (4, 8192), (16, 4096), (32, 4096), (64, 2048)),
}


def import_cudnn():
    """cuDNN's Python frontend: installed, or unpacked by tools/gpu/run.sh's build step."""
    target = os.path.join(os.environ.get("TMPDIR", "/tmp"), "jax_vmm_cudnn_frontend")
    if os.path.isdir(target):
        sys.path.insert(0, target)
    try:
        import cudnn
    except ImportError:
        wheels = glob.glob(
            str(Path(__file__).resolve().parents[2] / ".whl/nvidia_cudnn_frontend-*.whl")
        )
        if not wheels:
            raise
        import subprocess

        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--target",
                target,
                wheels[0],
            ],
            check=True,
        )
        sys.path.insert(0, target)
        import cudnn
    return cudnn


class Sdpa:
    """One cuDNN SDPA graph (padding mask, S_q = 1) for K/V views of one stride pattern;
    run() executes it on any K/V views with those strides."""

    def __init__(self, cudnn, handle, q, k, v, lengths_q, lengths_kv, out, scale):
        import torch

        self.cudnn, self.handle = cudnn, handle
        g = cudnn.pygraph(
            io_data_type=cudnn.data_type.BFLOAT16,
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
            handle=handle,
        )
        self.q, self.k, self.v = g.tensor_like(q), g.tensor_like(k), g.tensor_like(v)
        self.sq, self.skv = g.tensor_like(lengths_q), g.tensor_like(lengths_kv)
        o, _ = g.sdpa(
            name="sdpa",
            q=self.q,
            k=self.k,
            v=self.v,
            generate_stats=False,
            attn_scale=scale,
            use_padding_mask=True,
            seq_len_q=self.sq,
            seq_len_kv=self.skv,
        )
        o.set_output(True).set_dim(list(out.shape)).set_stride(list(out.stride()))
        self.o = o
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.graph = g
        self.workspace = torch.empty(
            max(1, g.get_workspace_size()), device="cuda", dtype=torch.uint8
        )
        self.fixed = {self.q: q, self.sq: lengths_q, self.skv: lengths_kv, self.o: out}

    def run(self, k, v):
        pack = dict(self.fixed)
        pack[self.k], pack[self.v] = k, v
        self.graph.execute(pack, self.workspace, handle=self.handle)


def capture_pass(cudnn, handle, sdpa, views):
    """(a function running one pass over the layers, whether it replays a CUDA graph)."""
    import torch

    def eager():
        for k, v in views:
            sdpa.run(k, v)

    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    try:
        cudnn.set_stream(handle=handle, stream=side.cuda_stream)
        with torch.cuda.graph(graph, stream=side):
            eager()
        graph.replay()
        torch.cuda.synchronize()
        return graph.replay, True
    except Exception as e:  # noqa: BLE001 (a probe: time it eagerly instead)
        print(f"  capture failed, timed eagerly: {type(e).__name__}: {str(e)[:200]}")
        return eager, False
    finally:
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)


def run_point(cudnn, handle, layers, batch, tokens, args) -> dict:
    import torch

    H, D, Hq = args.kv_heads, args.head_dim, args.q_heads
    P = PAGE_BYTES // (2 * layers * H * D * 2)
    timed = [l * layers // args.layers_timed for l in range(args.layers_timed)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    # wide: (B, T, 2L, H, D); compact copies of the timed layers hold the same values.
    wide = torch.empty(batch, tokens, 2 * layers, H, D, device="cuda", dtype=torch.bfloat16)
    for j in range(2 * layers):  # per slot: no float32 temporary of the whole buffer
        wide[:, :, j].normal_(generator=gen)
    compact = [(wide[:, :, 2 * l].contiguous(), wide[:, :, 2 * l + 1].contiguous()) for l in timed]
    interleaved = [(wide[:, :, 2 * l], wide[:, :, 2 * l + 1]) for l in timed]

    def bhsd(x):  # (B, T, H, D) memory -> cuDNN's logical (B, H, T, D)
        return x.permute(0, 2, 1, 3)

    q = torch.randn(batch, 1, Hq, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.empty(batch, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
    lq = torch.ones(batch, 1, 1, 1, device="cuda", dtype=torch.int32)
    lkv = torch.full((batch, 1, 1, 1), tokens, device="cuda", dtype=torch.int32)
    scale = D**-0.5
    row = {"layers": layers, "batch": batch, "tokens": tokens, "P": P}
    variants, outs = {}, {}
    for name, kvs in (("compact", compact), ("interleaved", interleaved)):
        try:
            sdpa = Sdpa(
                cudnn, handle, bhsd(q), bhsd(kvs[0][0]), bhsd(kvs[0][1]), lq, lkv, bhsd(out), scale
            )
            views = [(bhsd(k), bhsd(v)) for k, v in kvs]
            sdpa.run(*views[0])
            torch.cuda.synchronize()
            outs[name] = out.float().clone()
            variants[name] = (sdpa, views)
        except Exception as e:  # noqa: BLE001 (a probe: report and go on)
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    # Each pass over the layers is captured in a CUDA graph, so that the host's cost per
    # execute() (a few us of Python) does not hide a 10 us kernel; eager where capture fails.
    passes = {}
    for name, (sdpa, views) in variants.items():
        passes[name] = capture_pass(cudnn, handle, sdpa, views)
        row[f"{name}_graph"] = passes[name][1]
    best = dict.fromkeys(variants, float("inf"))
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(args.repeats):  # rounds interleaved: a drifting clock slows both alike
        for name, (run_pass, _) in passes.items():
            run_pass()
            start.record()
            for _ in range(args.calls):
                run_pass()
            stop.record()
            stop.synchronize()
            us = start.elapsed_time(stop) * 1e3 / (args.calls * len(timed))
            best[name] = min(best[name], us)
    for name in ("compact", "interleaved"):
        row[name] = best[name] if name in variants else None
    if row["compact"] and row["interleaved"]:
        row["ratio"] = row["interleaved"] / row["compact"]
    if len(outs) == 2:
        row["max_abs_diff"] = float((outs["interleaved"] - outs["compact"]).abs().max())
    row["floor_us"] = 2 * batch * tokens * H * D * 2 / (args.hbm_tbps * 1e12) * 1e6
    del wide, compact, interleaved, variants, passes
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--points", help="BxT,... (default: a grid per layer count)")
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers-timed", type=int, default=8, help="layers per pass")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import torch

    cudnn = import_cudnn()
    kind = torch.cuda.get_device_name()
    args.hbm_tbps = hbm_tbps_of_kind(kind)
    print(
        f"device: {kind}, torch {torch.__version__}, cuDNN {cudnn.backend_version()}, "
        f"floor at {args.hbm_tbps} TB/s"
    )
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    print(
        "L | P | B | T | compact us | interleaved us | interleaved/compact | floor us | max|diff|"
    )
    rows = []
    for layers in args.layers:
        points = (
            [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
            if args.points
            else POINTS.get(layers, POINTS[8])
        )
        for b, t in points:
            t0 = time.perf_counter()
            try:
                row = run_point(cudnn, handle, layers, b, t, args)
            except torch.cuda.OutOfMemoryError as e:
                print(f"{layers} | B{b} T{t}: does not fit ({str(e).splitlines()[0][:80]})")
                torch.cuda.empty_cache()
                continue
            rows.append(row)

            def f(x, p=1):
                return "-" if x is None else f"{x:.{p}f}"

            print(
                f"{layers} | {row['P']} | {b} | {t} | {f(row['compact'])} | "
                f"{f(row['interleaved'])} | {f(row.get('ratio'), 3)} | {f(row['floor_us'])} | "
                f"{f(row.get('max_abs_diff'), 4)}  ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
            for name in ("compact", "interleaved"):
                if row.get(f"{name}_error"):
                    print(f"  {name}: {row[f'{name}_error']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
