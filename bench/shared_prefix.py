"""Shared prefixes (issue 32): what a request that starts with a common prefix costs when
the prefix is shared into its slot (``kv.share_prefix`` + a prefill of the rest of its
prompt) against prefilling its whole prompt, and the memory a batch of such requests holds.

Side by side in one process, on the example's model (``jax_vmm.serving``):

* time to first token: the whole prompt's prefill (waited for) after ``ensure``, against
  ``share_prefix`` + ``ensure`` + the prefill of the rest over the cache; both through
  ``steps.prefill_chunk_slot`` with ``jax_vmm.attention`` (cuDNN on a GPU), so the two
  sides differ only in the tokens they prefill; median over ``--repeats``, each followed
  by a release (not timed). Goal: <= 0.3x.
* memory: ``--batch`` requests sharing the prefix, each holding its rest, with room for
  ``--new-tokens`` more in its slot: physical KV memory (backed - alias + parked) once
  the background commits are done, against one copy of the prefix plus each request's
  own tokens (``token_bytes``, K and V of all layers, each). Goal: <= 1.1x. Two floors
  beside it: what any layout holds where a chunk takes one layer's K or V
  (``--kv-layout per_layer``), and where one chunk takes every layer's K and V of its
  tokens (``--kv-layout interleaved``, the default).

    python bench/shared_prefix.py                       # GPU preset: 4k prefix, batch 16
    python bench/shared_prefix.py --device cpu --preset cpu --prefix 256 --suffix 16 --batch 4
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import _common as C
import jax_vmm
from jax_vmm.serving import model as M
from jax_vmm.serving import steps as S
from jax_vmm.serving.cache import make_cache


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    p.add_argument("--preset", choices=tuple(M.PRESETS), default="gpu")
    p.add_argument("--prefix", type=int, default=4096, help="shared prefix tokens")
    p.add_argument("--suffix", type=int, default=64, help="each request's own prompt tokens")
    p.add_argument("--batch", type=int, default=16, help="requests sharing the prefix")
    p.add_argument(
        "--new-tokens",
        type=int,
        default=256,
        help="tokens each request may decode after its prompt: room in its slot, as a "
        "serving engine leaves (a slot full at its prompt gets no commit ahead)",
    )
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument(
        "--kv-layout",
        choices=jax_vmm.KV_LAYOUTS,
        default="interleaved",
        help="the arena's layout (kv_arena(layout=...))",
    )
    p.add_argument(
        "--commit-ahead",
        type=int,
        default=None,
        metavar="N",
        help="kv_arena's commit_ahead_tokens (default: the arena's; 0: none, so that "
        "nothing is backed past the chunks each request's tokens touch)",
    )
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    device = C.pick_device(args.device)
    cfg = M.PRESETS[args.preset]
    total = args.prefix + args.suffix + args.new_tokens
    slots = args.batch + 1  # the prefix's own slot
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, cfg.vocab, args.prefix).astype(np.int32)
    rests = rng.integers(0, cfg.vocab, (args.batch, args.suffix)).astype(np.int32)
    with jax.default_device(device):
        params = M.init_params(cfg, seed=0)
        kw = dict(
            max_seqs=slots,
            device=device,
            kv_layout=args.kv_layout,
            commit_ahead_tokens=args.commit_ahead,
        )
        cache = make_cache("jax_vmm", cfg, max_tokens=total, **kw)
        # Sequences a whole number of chunks apart: each prefix chunk can be shared.
        per_chunk = cache.kv.arena.chunk_bytes // cache.kv.token_bytes
        if total % per_chunk:
            cache.close()
            aligned = -(-total // per_chunk) * per_chunk
            cache = make_cache("jax_vmm", cfg, max_tokens=aligned, **kw)
        try:
            return _run(args, cfg, params, cache, prefix, rests, device)
        finally:
            cache.close()


def chunk_floor(prefix: int, suffix: int, batch: int, chunk_bytes: int, row_bytes: int) -> int:
    """The least memory a buffer of ``row_bytes`` per token holds when physical memory
    comes in chunks of ``chunk_bytes``: the prefix's chunks once, and per request the
    chunks its own tokens touch (the prefix's partial last chunk is a copy)."""
    per_chunk = max(chunk_bytes // row_bytes, 1)
    own = -(-(prefix + suffix) // per_chunk) - prefix // per_chunk
    return chunk_bytes * (-(-prefix // per_chunk) + batch * own)


def backed_ahead(kv, ensured: dict[int, int]) -> int:
    """Bytes backed past the chunks that each sequence's ensured tokens (``ensured``:
    {sequence: tokens}) need: what commit ahead (kv_arena's commit_ahead_tokens) holds
    for tokens the sequences will decode next, and, while zeros are deferred, the rest of
    the 128-token tile cuDNN reads past a sequence's length (READ_TILE_TOKENS)."""
    per_chunk = max(kv.arena.chunk_bytes // kv.token_bytes, 1)
    tokens = sum(
        max(0, kv.backed_tokens(q) - -(-n // per_chunk) * per_chunk) for q, n in ensured.items()
    )
    return tokens * kv.token_bytes * len(kv.buffers)


def _run(args, cfg, params, cache, prefix, rests, device) -> dict:
    state = S.idle_state(cache.max_seqs)
    # One prefill program for both sides (the same attention): a prompt from position 0,
    # or the rest of one after its shared prefix.
    rest = jax.jit(
        functools.partial(
            S.prefill_chunk_slot,
            cfg=cfg,
            write=cache.write,
            attend_chunk=jax_vmm.attention,
            stop_tokens=(),
        ),
        donate_argnums=(1, 2),
    )
    src = cache.max_seqs - 1
    cache.ensure_shareable(src, args.prefix)
    _, _, out, state = rest(
        params, cache.cache(), state, jnp.asarray(prefix), jnp.int32(0),
        jnp.int32(len(prefix)), jnp.int32(src), jnp.int32(1),
    )  # fmt: skip
    cache.update(out)
    jax.block_until_ready(state)

    def run_full(seq: int) -> float:
        nonlocal state
        prompt = np.concatenate([prefix, rests[seq]])
        t0 = time.perf_counter()
        cache.ensure(seq, len(prompt))
        first, _, out, state = rest(
            params, cache.cache(), state, jnp.asarray(prompt), jnp.int32(0),
            jnp.int32(len(prompt)), jnp.int32(seq), jnp.int32(1),
        )  # fmt: skip
        jax.block_until_ready(first)
        dt = time.perf_counter() - t0
        cache.update(out)
        return dt

    def run_shared(seq: int) -> float:
        nonlocal state
        t0 = time.perf_counter()
        cache.share_prefix(src, seq, args.prefix)
        cache.ensure(seq, args.prefix + args.suffix)
        first, _, out, state = rest(
            params, cache.cache(), state, jnp.asarray(rests[seq]), jnp.int32(args.prefix),
            jnp.int32(args.suffix), jnp.int32(seq), jnp.int32(1),
        )  # fmt: skip
        jax.block_until_ready(first)
        dt = time.perf_counter() - t0
        cache.update(out)
        return dt

    times: dict[str, list[float]] = {"full": [], "shared": []}
    for i in range(args.repeats + 2):  # 2 warm-ups (compile)
        for name, fn in (("full", run_full), ("shared", run_shared)):
            dt = fn(0)
            jax.block_until_ready(state)
            cache.release(0)
            cache.kv.reclaim()
            if i >= 2:
                times[name].append(dt)
    t_full = float(np.median(times["full"]))
    t_shared = float(np.median(times["shared"]))

    # Memory: every request shares the prefix and holds its rest.
    for seq in range(args.batch):
        run_shared(seq)
    jax.block_until_ready(state)
    for seq in range(cache.max_seqs):  # the commits ahead that the ensures scheduled
        cache.kv.wait_prefetch(seq)
    cache.check()
    physical = cache.backed_bytes()
    ensured = {seq: args.prefix + args.suffix for seq in range(args.batch)}
    ahead = backed_ahead(cache.kv, {**ensured, cache.max_seqs - 1: args.prefix})
    per_token = cache.token_bytes  # K and V of every layer (serving/cache.py)
    ideal = (args.prefix + args.batch * args.suffix) * per_token
    stats = cache.stats()
    chunk = stats["chunk_bytes"]
    layer_token = cache.kv.layer_token_bytes  # one layer's K (or V) of one token
    floor_layers = chunk_floor(args.prefix, args.suffix, args.batch, chunk, layer_token)
    floor_layers *= cache.token_bytes // layer_token  # one such floor per layer buffer
    floor_spanning = chunk_floor(args.prefix, args.suffix, args.batch, chunk, per_token)
    table = C.Table(("measure", 34, "<"), ("value", 14), ("goal", 8))
    print(
        f"shared prefix: {args.prefix} tokens, {args.batch} requests of {args.suffix} more "
        f"(room for {args.new_tokens} new), "
        f"{M.config_summary(cfg)}, KV layout {args.kv_layout}, commit ahead "
        f"{cache.kv.commit_ahead_tokens} tokens, {device.platform}"
    )
    print(table.header())
    print(table.rule())
    print(table.row("prefill of the whole prompt", f"{t_full * 1e3:.2f} ms", ""))
    print(table.row("share + prefill of the rest", f"{t_shared * 1e3:.2f} ms", ""))
    print(table.row("time to first token, ratio", f"{t_shared / t_full:.3f}x", "<= 0.3"))
    print(table.row("physical KV memory", f"{physical / C.MiB:.1f} MiB", ""))
    print(table.row("one prefix + own tokens", f"{ideal / C.MiB:.1f} MiB", ""))
    print(table.row("memory, ratio", f"{physical / ideal:.3f}x", "<= 1.1"))
    print(table.row("of which past the tokens' chunks", f"{ahead / ideal:.3f}x", ""))
    print(table.row("floor, a chunk per layer's K or V", f"{floor_layers / ideal:.3f}x", ""))
    print(table.row("floor, a chunk over every layer", f"{floor_spanning / ideal:.3f}x", ""))
    print(
        table.row("shared bytes (physical, once)", f"{stats['shared_bytes'] / C.MiB:.1f} MiB", "")
    )
    result = dict(
        prefix=args.prefix,
        suffix=args.suffix,
        batch=args.batch,
        new_tokens=args.new_tokens,
        ttft_full_s=t_full,
        ttft_shared_s=t_shared,
        ttft_ratio=t_shared / t_full,
        physical_bytes=physical,
        ideal_bytes=ideal,
        memory_ratio=physical / ideal,
        backed_ahead_bytes=ahead,
        floor_ratio_chunk_per_buffer=floor_layers / ideal,
        floor_ratio_chunk_over_layers=floor_spanning / ideal,
        chunk_bytes=stats["chunk_bytes"],
        kv_layout=args.kv_layout,
        commit_ahead_tokens=cache.kv.commit_ahead_tokens,
        command=C.command_line("shared_prefix.py", argv=None),
    )
    if args.json:
        C.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
