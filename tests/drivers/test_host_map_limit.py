"""The host driver against the process's memory-mapping limit (vm.max_map_count): a host
arena can need one mapping per committed chunk, and past the limit every mmap of the
process fails (malloc's too: the process aborts). The driver refuses the commit first,
with a clear MemoryError, and the arena rolls back. jax_vmm.testing.host_map_limit puts
the limit within reach of a small arena; /proc/self/maps is the oracle."""

from __future__ import annotations

import jax.numpy as jnp

import maps_oracle as mo
from jax_vmm.testing import host_map_limit

SEQS, CHUNKS = 32, 16


def _kv(host_vm):
    tpc = host_vm.chunk // (2 * 64 * 4)
    kv = host_vm.kv(
        num_layers=1,
        num_kv_heads=2,
        head_dim=64,
        max_tokens=CHUNKS * tpc,
        max_seqs=SEQS,
        dtype=jnp.float32,
    )
    return kv, tpc


def _grow_interleaved(kv, tpc):
    """Every sequence one chunk further, round after round: neighbouring chunks of a
    buffer get file ranges far apart, so the kernel cannot merge their mappings."""
    for step in range(1, CHUNKS + 1):
        for q in range(SEQS):
            yield lambda step=step, q=q: kv.ensure(step * tpc, q)


def test_a_commit_past_the_mapping_limit_is_refused_and_changes_nothing(host_vm):
    room = 300  # mappings the arena may add before the limit's margin
    limit = len(mo.read_maps()) + 4096 + room
    kv, tpc = _kv(host_vm)
    with host_map_limit(limit):
        refused = None
        for i, grow in enumerate(_grow_interleaved(kv, tpc)):
            before = host_vm.snapshot(kv.arena, kv.buffers)
            try:
                grow()
            except MemoryError as e:
                refused = (i, str(e))
                break
        assert refused is not None, "the arena grew past the limit without a refusal"
        assert "vm.max_map_count" in refused[1] and "chunk_bytes" in refused[1]
        assert host_vm.snapshot(kv.arena, kv.buffers) == before  # rolled back
        assert len(mo.read_maps()) < limit
        # Still usable: releases give mappings back, and the arena commits again.
        for q in range(SEQS // 2):
            kv.release(q, wait=True)
        assert kv.ensure(tpc, 0) > 0
    assert refused[0] > room // 8  # refused near the limit, not at the first commit


def test_without_the_budget_the_same_growth_passes_that_limit(host_vm):
    """The control: with the real (large) limit the same growth adds more mappings than
    the room the test above left, so it was the budget that refused there."""
    room = 300
    start = len(mo.read_maps())
    kv, tpc = _kv(host_vm)
    for grow in _grow_interleaved(kv, tpc):
        grow()
        if len(mo.read_maps()) - start > room:
            break
    assert len(mo.read_maps()) - start > room
