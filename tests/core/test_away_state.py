"""Reads and writes of memory that is away (the arena asleep, a sequence offloaded) are
dropped or clamped and counted, never silent; a release that raises changes nothing.

* ``decode_attention`` over a sleeping arena or an offloaded sequence: the read is clamped
  to 0 tokens and counted, ``kv.check()`` raises :class:`~jax_vmm.OutOfBoundsRead`; after
  ``wake`` / ``restore`` the same read is right and uncounted.
* A write to an offloaded sequence is dropped and counted, also in the chunk it shares
  with a neighbour (which stays backed and is not part of the host copy), and the bytes
  restored are those offloaded.
* ``release`` / ``shrink`` while asleep raise :class:`~jax_vmm.ArenaAsleepError` and leave
  the table of ensured tokens and an offloaded sequence's host copy as they were.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
from conftest import k_tokens, pattern, raw_bytes, write_bytes, write_one_token

H, D = 2, 64


def _kv(vm, seqs: int = 3):
    """Sequences of 1.5 chunks (neighbours share a chunk), all ensured and filled."""
    tpc = vm.chunk // (H * D * 4)
    t = tpc + tpc // 2
    kv = vm.kv(
        num_layers=1, num_kv_heads=H, head_dim=D, max_tokens=t, max_seqs=seqs, dtype=jnp.float32
    )
    for q in range(seqs):
        kv.ensure(t, seq=q)
        for i, b in enumerate(kv.buffers):
            write_bytes(b, q * kv.seq_bytes, pattern(kv.seq_bytes, seed=10 * q + i) & 0x3F)
    return kv, t


def _attend(kv, lengths) -> jax.Array:
    dev = kv.arena.device
    q = jax.device_put(jnp.ones((kv.max_seqs, H, D), jnp.float32), dev)
    lens = jax.device_put(jnp.asarray(lengths, jnp.int32), dev)
    return jax_vmm.decode_attention(q, kv.cache()[0], lens)


def test_attention_over_a_sleeping_arena_is_clamped_and_counted(vm):
    kv, t = _kv(vm)
    want = np.asarray(_attend(kv, [t] * 3))
    kv.check()
    kv.sleep()
    out = _attend(kv, [t, 5, 0])
    with pytest.raises(jax_vmm.OutOfBoundsRead) as e:
        kv.check(out)
    assert e.value.count == 2  # the sequences asked for tokens; length 0 reads nothing
    assert not np.asarray(out).any()
    kv.wake()
    out = _attend(kv, [t] * 3)
    kv.check(out)
    np.testing.assert_array_equal(np.asarray(out), want)


def test_attention_over_an_offloaded_sequence_is_clamped_and_counted(vm):
    kv, t = _kv(vm)
    want = np.asarray(_attend(kv, [t] * 3))
    kv.offload(1)
    out = _attend(kv, [t] * 3)
    assert kv.dropped_reads(out) == 1
    with pytest.raises(jax_vmm.OutOfBoundsRead):
        kv.check(out)
    np.testing.assert_array_equal(np.asarray(out)[[0, 2]], want[[0, 2]])
    kv.restore(1)
    out = _attend(kv, [t] * 3)
    kv.check(out)
    np.testing.assert_array_equal(np.asarray(out), want)


def test_a_background_restore_opens_the_sequence_once_waited_for(vm):
    kv, t = _kv(vm)
    want = np.asarray(_attend(kv, [t] * 3))
    kv.offload(1)
    kv.restore(1, wait=False).wait()
    out = _attend(kv, [t] * 3)
    kv.check(out)
    np.testing.assert_array_equal(np.asarray(out), want)


@pytest.mark.parametrize("pos", ["shared_chunk", "own_chunk"])
def test_every_write_to_an_offloaded_sequence_is_dropped_and_counted(vm, pos):
    kv, t = _kv(vm)
    tpc = vm.chunk // (H * D * 4)
    # Sequence 1 starts half way into a chunk that sequence 0 holds tokens in.
    p = 0 if pos == "shared_chunk" else t - 1
    assert (pos == "shared_chunk") == (p < tpc - tpc // 2)
    before = k_tokens(kv, 1).copy()
    kv.offload(1)
    write_one_token(kv, 1 * t + p, 7.0)
    assert kv.dropped_writes() == 2  # K and V
    with pytest.raises(jax_vmm.OutOfBoundsWrite):
        kv.check()
    kv.restore(1)
    np.testing.assert_array_equal(k_tokens(kv, 1), before)  # what was offloaded, no more
    write_one_token(kv, 1 * t + p, 7.0)  # back: it lands
    kv.check()
    assert (k_tokens(kv, 1)[p] == 7.0).all()


@pytest.mark.parametrize("op", ["release", "release_wait", "shrink"])
def test_a_release_while_asleep_raises_and_changes_nothing(vm, op):
    kv, t = _kv(vm)
    limits = kv._core_cache.limits()
    ensured = kv._ensured.copy()
    kv.sleep()
    asleep_limits = kv._core_cache.limits()
    with pytest.raises(jax_vmm.ArenaAsleepError, match="asleep.*wake"):
        if op == "shrink":
            kv.shrink(1)
        else:
            kv.release(1, wait=op == "release_wait")
    assert kv._core_cache.limits() == asleep_limits
    np.testing.assert_array_equal(kv._ensured, ensured)
    kv.wake()
    assert kv._core_cache.limits() == limits
    write_one_token(kv, 1 * t + t - 1, 3.0)  # still ensured: no ensure needed
    kv.check()
    assert (k_tokens(kv, 1)[t - 1] == 3.0).all()


def test_releasing_an_offloaded_sequence_while_asleep_keeps_its_host_copy(vm):
    kv, t = _kv(vm)
    before = [raw_bytes(b, kv.seq_bytes, 2 * kv.seq_bytes) for b in kv.buffers]
    kv.offload(1)
    kv.sleep()
    with pytest.raises(jax_vmm.ArenaAsleepError):
        kv.release(1)
    kv.wake()
    assert kv.stats()["offloaded_seqs"] == [1]
    kv.restore(1)
    after = [raw_bytes(b, kv.seq_bytes, 2 * kv.seq_bytes) for b in kv.buffers]
    for got, want in zip(after, before):
        np.testing.assert_array_equal(got, want)
