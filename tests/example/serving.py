"""Serve requests through the example's engine on one fresh cache: what the example
tests share (imported as `serving`: pytest puts this folder on sys.path; not to be
confused with `jax_vmm.serving`)."""

from __future__ import annotations

import dataclasses

import jax

from jax_vmm.serving import engine as E
from jax_vmm.serving import model as M
from jax_vmm.serving.attention import choose_attention, chunk_attention
from jax_vmm.serving.cache import make_cache


def serve(
    backend: str,
    cfg: M.ModelConfig,
    requests: list[E.Request],
    *,
    batch: int,
    max_tokens: int,
    device: jax.Device,
    attention: str = "auto",
    chunk_bytes: int | None = None,
    block: int = E.DEFAULT_BLOCK,
    stop_tokens: tuple[int, ...] = (),
    prefill_chunk: int | None = None,
    kv_layout: str = "per_layer",
    **run_kwargs,
) -> tuple[E.RunReport, dict]:
    """Seed-0 weights, a `backend` cache of batch x max_tokens, `Generator.run(requests,
    **run_kwargs)`; prompts prefilled whole or in chunks of `prefill_chunk` over the
    cache (requests that follow another always are). Returns (report, the cache's stats
    at the end)."""
    with jax.default_device(device):
        params = M.init_params(cfg, seed=0)
        cache = make_cache(
            backend,
            cfg,
            max_seqs=batch,
            max_tokens=max_tokens,
            device=device,
            chunk_bytes=chunk_bytes,
            kv_layout=kv_layout,
        )
        try:
            name, attend = choose_attention(
                attention,
                backend=backend,
                platform=device.platform,
                tail_may_be_garbage=cache.tail_may_be_garbage,
                dtype=cfg.dtype,
            )
            gen = E.Generator(
                params,
                cfg,
                cache,
                attend,
                block=block,
                stop_tokens=stop_tokens,
                attend_chunk=chunk_attention(name),
                prefill_chunk=prefill_chunk,
            )
            report = gen.run(requests, **run_kwargs)
            return report, cache.stats()
        finally:
            cache.close()


# Two small models for the example's tests: Llama-like, and the same shape with Gemma 2's
# options (a window of 6 on layer 0, shorter than the prompts and prefixes, soft-capped
# attention and logits, a query scale other than 1/sqrt(head_dim)).
SMALL = M.ModelConfig(
    vocab=256, d_model=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=128
)
GEMMA_LIKE = dataclasses.replace(
    SMALL,
    norm_plus_one=True,
    embed_scale=True,
    post_norms=True,
    mlp_act="gelu_tanh",
    attn_scale=0.2,
    attn_softcap=5.0,
    final_softcap=20.0,
    layer_windows=(6, None),
)
CONFIGS = {"llama": SMALL, "gemma2": GEMMA_LIKE}
