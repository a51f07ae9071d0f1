"""Equal KV memory: at a fixed budget, the largest batch each backend serves with the
example's request mix, and the tokens/s the example's engine gets from it.

prealloc holds max_tokens for every slot, so its batch is budget // (max_tokens x bytes
per token). jax_vmm holds what the live sequences need, rounded up to chunks: its batch
is the largest whose peak backed memory over the run stays within the budget. That peak
is first predicted by replaying the engine's schedule on the host (`simulated_peak`:
no model, the same admissions, blocks and release lag), then measured by the real run;
a run over the budget is repeated with a smaller batch. Both backends serve the same
requests (the example's preset mix, `per_slot` requests per jax_vmm slot).

The same replay puts a floor under the ratio (`decode_floor_seconds`): each decode step
reads the weights once and the KV of every generating sequence at the HBM bandwidth. A
larger batch reads the weights fewer times but the same KV, so once the KV reads weigh
as much as the weights, no KV backend gets the batch's ratio in tokens/s.
"""

from __future__ import annotations

import collections
import gc
from typing import Any

import jax

from jax_vmm.kv.backing import READ_TILE_TOKENS, tile_end
from jax_vmm.serving import engine as E
from jax_vmm.serving import model as M
from jax_vmm.serving.attention import choose_attention
from jax_vmm.serving.cache import make_cache
from jax_vmm.serving.cli.decode import SERVING
from jax_vmm.serving.report import fmt_bytes


def chunk_tokens(
    cfg: M.ModelConfig, device: jax.Device, chunk_bytes: int | None, kv_layout: str = "per_layer"
) -> int:
    """Tokens per arena chunk (the unit memory follows) of one layer buffer, or of the
    one buffer of every layer (kv_layout "interleaved")."""
    import jax_vmm

    with jax_vmm.Arena(1, device=device, chunk_bytes=chunk_bytes) as probe:  # the driver's
        chunk = probe.chunk_bytes  # chunk for chunk_bytes=None, else chunk_bytes checked
    row = cfg.num_kv_heads * cfg.head_dim * cfg.jnp_dtype.itemsize
    if kv_layout == "interleaved":
        row *= 2 * cfg.num_layers
    return max(1, chunk // row)


def schedule(requests: list[E.Request], batch: int, block: int):
    """The engine's schedule replayed on the host: yields, for each decode block, the
    (request, blocks dispatched before this one) of every occupied slot. Free slots take
    requests before each block; a slot that finished in block k is released after block
    k+1 is dispatched (so it still holds its memory during k+1)."""
    queue = collections.deque(requests)
    slots: list[list | None] = [None] * batch  # [request, blocks dispatched]
    finishing: list[int] = []
    while queue or any(s is not None for s in slots):
        for seq in range(batch):
            if slots[seq] is None and queue:
                slots[seq] = [queue.popleft(), 0]
        yield [(s[0], s[1]) for s in slots if s is not None]
        for s in slots:
            if s is not None:
                s[1] += 1
        for seq in finishing:  # read after this block's dispatch: released now
            slots[seq] = None
        finishing = [
            seq
            for seq, s in enumerate(slots)
            if s is not None and s[1] * block >= s[0].max_new_tokens - 1
        ]


def simulated_peak(
    requests: list[E.Request],
    batch: int,
    block: int,
    chunk: int,
    ahead: int,
    read_tile: int = 1,
    max_tokens: int | None = None,
) -> int:
    """Peak tokens backed (chunk-rounded, per sequence) under the engine's schedule: each
    block ensures what it can write, rounded up to ``read_tile`` tokens (at most
    ``max_tokens``) where ``ensure`` backs cuDNN's whole tile (a GPU arena without a view:
    jax_vmm/kv/backing.py); commit ahead backs the next chunk once a sequence is within
    `ahead` tokens of its backed end."""
    peak = 0
    for occupied in schedule(requests, batch, block):
        backed = 0
        for req, blocks in occupied:
            need = len(req.prompt) + min((blocks + 1) * block, req.max_new_tokens - 1)
            covered = tile_end(tile_end(need, read_tile, max_tokens), chunk)
            if covered - need <= ahead and covered < len(req.prompt) + req.max_new_tokens:
                covered += chunk
            backed += covered
        peak = max(peak, backed)
    return int(peak)


def decode_floor_seconds(
    requests: list[E.Request],
    batch: int,
    block: int,
    weight_bytes: int,
    bytes_per_token: int,
    bytes_per_s: float,
) -> float:
    """Seconds the schedule's decode steps take at the memory-bandwidth floor: every step
    reads the weights once and the cached tokens of every sequence still generating.
    Prefill is left out (both backends prefill the same prompts)."""
    total = 0
    for occupied in schedule(requests, batch, block):
        # A block runs while any slot is occupied, also one whose sequence finished in the
        # block before (the engine reads that after dispatching this one).
        for step in range(block):
            live = sum(
                len(req.prompt) + blocks * block + step
                for req, blocks in occupied
                if blocks * block + step < req.max_new_tokens - 1
            )
            total += weight_bytes + live * bytes_per_token
    return total / bytes_per_s


def serve(
    backend: str,
    cfg: M.ModelConfig,
    params: M.Params,
    requests: list[E.Request],
    *,
    batch: int,
    max_tokens: int,
    block: int,
    device: jax.Device,
    chunk_bytes: int | None,
    kv_layout: str = "per_layer",
) -> dict[str, Any]:
    cache = make_cache(
        backend, cfg, max_seqs=batch, max_tokens=max_tokens, device=device,
        chunk_bytes=chunk_bytes, kv_layout=kv_layout if backend == "jax_vmm" else "per_layer",
    )  # fmt: skip
    try:
        name, attend = choose_attention(
            "auto",
            backend=backend,
            platform=device.platform,
            tail_may_be_garbage=cache.tail_may_be_garbage,
            dtype=cfg.dtype,
        )
        report = E.Generator(params, cfg, cache, attend, block=block).run(requests)
        stats = cache.stats()
        peak = max(
            max((r.backed_bytes for r in report.trace), default=0),
            int(stats.get("peak_backed_bytes", 0)),
        )
        return {
            "backend": backend,
            "attention": name,
            "batch": batch,
            "tokens_per_second": report.generated_tokens / max(report.seconds, 1e-9),
            "seconds": report.seconds,
            "generated_tokens": report.generated_tokens,
            "peak_backed_bytes": peak,
            "host_memory_seconds": report.ensure_seconds,
        }
    finally:
        cache.close()
        gc.collect()


def run(
    preset: str,
    cfg: M.ModelConfig,
    device: jax.Device,
    budget: int,
    *,
    block: int | None,
    seed: int,
    quick: bool,
    chunk_bytes: int | None = None,
    peak_bytes_per_s: float = 4.8e12,
    kv_layout: str = "per_layer",
) -> dict[str, Any]:
    serving = SERVING[preset]
    max_tokens = serving["max_tokens"]
    chunk_bytes = chunk_bytes or serving["chunk_bytes"]
    block = block or E.DEFAULT_BLOCK
    per_slot = 1 if quick else serving["requests"] // serving["batch"]
    bpt = cfg.kv_bytes_per_token
    out: dict[str, Any] = {
        "budget_bytes": budget,
        "max_tokens": max_tokens,
        "block": block,
        "mix": {"prompt_len": serving["prompt_len"], "new_tokens": serving["new_tokens"]},
        "requests_per_jax_vmm_slot": per_slot,
        "kv_layout": kv_layout,
    }
    pre_batch = budget // (max_tokens * bpt)
    if pre_batch < 1:
        out["error"] = (
            f"the budget {fmt_bytes(budget)} holds no preallocated sequence of {max_tokens} "
            f"tokens ({fmt_bytes(max_tokens * bpt)})"
        )
        return out
    chunk = chunk_tokens(cfg, device, chunk_bytes, kv_layout)
    ahead = max(1, chunk // 8)  # kv_arena's default commit_ahead_tokens
    # The engine reads the arena through jax_vmm's calls only (no view), so a GPU
    # arena's ensure backs cuDNN's whole key/value tile.
    tile = READ_TILE_TOKENS if device.platform != "cpu" else 1

    def mix(batch: int) -> list[E.Request]:
        return E.make_requests(
            cfg,
            num=per_slot * batch,
            prompt_len=serving["prompt_len"],
            new_tokens=serving["new_tokens"],
            seed=seed + 1,
        )

    def fits(batch: int) -> bool:
        peak = simulated_peak(mix(batch), batch, block, chunk, ahead, tile, max_tokens)
        return peak * bpt <= budget

    lo, hi = pre_batch, 2 * pre_batch  # lo fits (it holds less than max_tokens per slot)
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # the peak grows with the batch: bisect
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    vmm_batch = lo
    out["jax_vmm_predicted_batch"] = vmm_batch
    params = M.init_params(cfg, seed=seed)
    with jax.default_device(device):
        for _ in range(4):  # the prediction is checked by the run itself
            requests = mix(vmm_batch)
            vmm = serve(
                "jax_vmm",
                cfg,
                params,
                requests,
                batch=vmm_batch,
                max_tokens=max_tokens,
                block=block,
                device=device,
                chunk_bytes=chunk_bytes,
                kv_layout=kv_layout,
            )
            if vmm["peak_backed_bytes"] <= budget:
                break
            scaled = int(vmm_batch * budget / vmm["peak_backed_bytes"])
            vmm_batch = max(pre_batch, min(vmm_batch - 1, scaled))
        out["jax_vmm"] = vmm
        out["jax_vmm"]["within_budget"] = vmm["peak_backed_bytes"] <= budget
        out["prealloc"] = serve(
            "prealloc",
            cfg,
            params,
            requests,
            batch=pre_batch,
            max_tokens=max_tokens,
            block=block,
            device=device,
            chunk_bytes=None,
        )
    out["requests"] = len(requests)
    out["speedup"] = out["jax_vmm"]["tokens_per_second"] / out["prealloc"]["tokens_per_second"]
    weight_bytes = cfg.num_params() * cfg.jnp_dtype.itemsize
    floor = {
        key: decode_floor_seconds(
            requests, out[key]["batch"], block, weight_bytes, bpt, peak_bytes_per_s
        )
        for key in ("prealloc", "jax_vmm")
    }
    out["decode_floor_seconds"] = floor
    out["floor_speedup"] = floor["prealloc"] / floor["jax_vmm"]
    return out


def print_result(r: dict[str, Any]) -> None:
    print(
        f"\nequal KV memory: budget {fmt_bytes(r['budget_bytes'])}, {r['max_tokens']} tokens "
        f"per slot, the example's mix (prompts {r['mix']['prompt_len']}, new tokens "
        f"{r['mix']['new_tokens']}), block {r['block']}"
    )
    if "error" in r:
        print(f"  not run: {r['error']}")
        return
    for key in ("prealloc", "jax_vmm"):
        c = r[key]
        note = (
            ""
            if key == "prealloc"
            else (
                f" (predicted {r['jax_vmm_predicted_batch']})"
                + ("" if c["within_budget"] else " OVER BUDGET")
            )
        )
        print(
            f"  {key:8s} batch {c['batch']:4d}{note}: {c['tokens_per_second']:9.0f} tokens/s "
            f"({c['generated_tokens']} tokens of {r['requests']} requests in {c['seconds']:.2f} "
            f"s, attention {c['attention']}), backed peak {fmt_bytes(c['peak_backed_bytes'])}"
        )
    print(f"  jax_vmm / prealloc tokens/s: {r['speedup']:.2f}x (goal >= 2)")
    f = r["decode_floor_seconds"]
    print(
        f"  at the bandwidth floor (weights + live KV read per decode step, prefill left out) "
        f"the same schedules take {f['prealloc'] * 1e3:.1f} ms and {f['jax_vmm'] * 1e3:.1f} ms: "
        f"{r['floor_speedup']:.2f}x, the most any KV backend gets from this batch and mix"
    )
