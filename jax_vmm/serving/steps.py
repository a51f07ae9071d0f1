"""The device-side programs the engine dispatches: prefill into a slot (a whole prompt, or
a chunk of tokens appended over the cache), and a block of N decode steps in one
`lax.fori_loop`.

Both thread a `DecodeState` (per slot: the next input token, its position, the tokens
still to generate) and the cache through, so that consecutive calls depend on each
other only through device arrays: the host can dispatch block k+1 before it reads block
k's tokens. A slot whose `remaining` is 0 is idle: its writes are dropped (slot -1) and
its attention length is 0. A slot stops inside a block when it has generated its last
token or produced a stop token (EOS): the steps after that are masked the same way.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from . import model as M

# control (per slot, per call, from the host): KEEP the device state, STOP the slot, or
# any value >= 0: feed that token as the slot's next input (tokens chosen on the host).
KEEP, STOP = -1, -2


class DecodeState(NamedTuple):
    tokens: jax.Array  # int32 (B,): the next input token of each slot
    positions: jax.Array  # int32 (B,): its position (= tokens cached)
    remaining: jax.Array  # int32 (B,): decode steps still to run; 0 = idle


def idle_state(batch: int) -> DecodeState:
    z = jnp.zeros(batch, jnp.int32)
    return DecodeState(z, z + 0, z + 0)


def _is_stop(tokens: jax.Array, stop_tokens: tuple[int, ...]) -> jax.Array:
    if not stop_tokens:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(stop_tokens, jnp.int32))


def prefill_slot(
    params: M.Params,
    cache: Any,
    state: DecodeState,
    prompt: jax.Array,
    length: jax.Array,
    seq: jax.Array,
    max_new_tokens: jax.Array,
    *,
    cfg: M.ModelConfig,
    write: M.WriteFn,
    stop_tokens: tuple[int, ...],
) -> tuple[jax.Array, jax.Array, Any, DecodeState]:
    """Prefills `prompt` (padded; `length` real tokens) into slot `seq` and starts the slot
    on the device: its first token (greedy) is the next input at position `length`, with
    max_new_tokens - 1 decode steps to go (none if that token is a stop token). Returns
    (last prompt token's logits (vocab,), first token, cache, state)."""
    logits, cache = M.prefill(params, cache, prompt, length, seq, cfg=cfg, write=write)
    return _start_slot(logits, cache, state, length, seq, max_new_tokens, stop_tokens)


def prefill_chunk_slot(
    params: M.Params,
    cache: Any,
    state: DecodeState,
    tokens: jax.Array,
    start: jax.Array,
    length: jax.Array,
    seq: jax.Array,
    max_new_tokens: jax.Array,
    *,
    cfg: M.ModelConfig,
    write: M.WriteFn,
    attend_chunk: M.ChunkAttendFn,
    stop_tokens: tuple[int, ...],
) -> tuple[jax.Array, jax.Array, Any, DecodeState]:
    """Appends a chunk (tokens padded; `length` real) to slot `seq`, which caches `start`
    tokens, over the cache (`model.prefill_chunk`), and starts the slot as `prefill_slot`
    does from its last token: the engine dispatches a prompt's chunks back to back, so
    only the last chunk's start is ever decoded from."""
    logits, cache = M.prefill_chunk(
        params, cache, tokens, start, length, seq, cfg=cfg, write=write, attend_chunk=attend_chunk
    )
    return _start_slot(logits, cache, state, start + length, seq, max_new_tokens, stop_tokens)


def _start_slot(
    logits: jax.Array,
    cache: Any,
    state: DecodeState,
    cached: jax.Array,
    seq: jax.Array,
    max_new_tokens: jax.Array,
    stop_tokens: tuple[int, ...],
) -> tuple[jax.Array, jax.Array, Any, DecodeState]:
    """The slot's first token (greedy) becomes its next input at position `cached`."""
    first = jnp.argmax(logits).astype(jnp.int32)
    steps = jnp.where(_is_stop(first, stop_tokens), 0, max_new_tokens - 1).astype(jnp.int32)
    state = DecodeState(
        state.tokens.at[seq].set(first),
        state.positions.at[seq].set(cached),
        state.remaining.at[seq].set(steps),
    )
    return logits, first, cache, state


def decode_block(
    params: M.Params,
    cache: Any,
    state: DecodeState,
    control: jax.Array,
    *,
    num_steps: int,
    cfg: M.ModelConfig,
    write: M.WriteFn,
    attend: M.AttendFn,
    stop_tokens: tuple[int, ...],
    with_logits: bool,
) -> tuple[jax.Array, jax.Array | None, Any, DecodeState]:
    """`num_steps` greedy decode steps of every slot in one device loop.

    control (B,) int32: KEEP, STOP, or a token to feed as the slot's next input (applied
    before the first step). Returns (tokens (num_steps, B) int32, -1 where a slot did not
    step; logits (num_steps, B, vocab) fp32 if with_logits else None; cache; state)."""
    remaining = jnp.where(control == STOP, 0, state.remaining)
    tokens = jnp.where(control >= 0, control, state.tokens)
    batch = tokens.shape[0]
    out = jnp.full((num_steps, batch), -1, jnp.int32)
    all_logits = jnp.zeros((num_steps, batch, cfg.vocab), jnp.float32) if with_logits else None

    def body(i, carry):
        cache, tokens, positions, remaining, out, all_logits = carry
        active = remaining > 0
        logits, nxt, cache = M.decode_step(
            params,
            cache,
            tokens,
            jnp.where(active, positions, -1),
            cfg=cfg,
            write=write,
            attend=attend,
        )
        out = out.at[i].set(jnp.where(active, nxt, -1))
        if all_logits is not None:
            all_logits = all_logits.at[i].set(logits)
        left = jnp.where(active, remaining - 1, remaining)
        left = jnp.where(active & _is_stop(nxt, stop_tokens), 0, left)
        return (
            cache,
            jnp.where(active, nxt, tokens),
            jnp.where(active, positions + 1, positions),
            left,
            out,
            all_logits,
        )

    carry = (cache, tokens, state.positions, remaining, out, all_logits)
    cache, tokens, positions, remaining, out, all_logits = jax.lax.fori_loop(
        0, num_steps, body, carry
    )
    return out, all_logits, cache, DecodeState(tokens, positions, remaining)
