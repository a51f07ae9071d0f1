"""What ``ensure`` backs for a reader that reads whole tiles (jax_vmm/kv/backing.py,
``READ_TILE_TOKENS``): on a CUDA arena that has handed out no view, the chunks up to the
end of the tile that holds a sequence's last token, so cuDNN's last key/value tile never
reads an unmapped chunk (zeros deferred) or a zero piece that a commit is swapping
without a device wait (eager zeros); on the host, and after a view (commits then wait
for the device), only the asked tokens' chunks.

The interleaved layout here holds 32 tokens per chunk on every device, so a 128-token
tile spans four chunks. On the host, unbacked reads never fault; the tests that pin the
faulting state there say so and check the same bookkeeping against the host's own
oracle (the kernel's page mappings). tests/ops/test_deferred_zeros_cudnn.py shows the
fault itself on a GPU."""

from __future__ import annotations

import numpy as np
import pytest

import jax_vmm
from conftest import eager_zeros, unbacked_kind
from jax_vmm import testing
from jax_vmm.kv import backing

TILE = backing.READ_TILE_TOKENS
PER_CHUNK = 32


def interleaved_kv(vm, **kw) -> jax_vmm.KVArena:
    """Two sequences of 512 tokens, 32 tokens per chunk (2 layers of K and V, 64-wide
    heads, bfloat16: the number of heads makes a token 1/32 of a chunk)."""
    heads = vm.chunk // (PER_CHUNK * 2 * 2 * 64 * 2)
    args = dict(
        num_layers=2,
        num_kv_heads=heads,
        head_dim=64,
        max_tokens=512,
        max_seqs=2,
        dtype="bfloat16",
        layout="interleaved",
    )
    kv = vm.kv(**(args | kw))
    assert kv.arena.chunk_bytes // kv.token_bytes == PER_CHUNK
    return kv


def faulting(kv: jax_vmm.KVArena, monkeypatch) -> None:
    """Make ``kv`` behave as a CUDA arena without a view (where it is not one)."""
    monkeypatch.setattr(kv, "_tile_tail_unsafe", lambda: True)


def tokens_backed(vm, kv: jax_vmm.KVArena, per_seq: list[int]) -> None:
    """Exactly tokens [0, per_seq[q]) of each sequence are backed: by the arena's page
    table and by the independent oracle (the host's mappings, or the CUDA driver)."""
    ranges = [
        (q * kv.seq_bytes, q * kv.seq_bytes + n * kv.token_bytes) for q, n in enumerate(per_seq)
    ]
    vm.assert_backed(kv.arena, [r for r in ranges if r[1] > r[0]])
    assert [kv.backed_tokens(q) for q in range(len(per_seq))] == per_seq


@pytest.mark.parametrize("eager", [False, True], ids=["deferred_zeros", "eager_zeros"])
def test_ensure_backs_the_whole_tile_on_a_gpu(vm, eager: bool) -> None:
    """The natural call on the real arena of each device: a GPU arena backs the tile,
    zeros deferred or not; the host (which reads zeros there) only the asked tokens'
    chunks."""
    with eager_zeros(eager):
        kv = interleaved_kv(vm)
    assert unbacked_kind(kv.arena) == ("hole" if not (eager or vm.is_host) else "zero")
    kv.ensure(5, seq=0)
    kv.ensure(PER_CHUNK + 1, seq=1)
    if not vm.is_host:
        tokens_backed(vm, kv, [TILE, TILE])
    else:
        tokens_backed(vm, kv, [PER_CHUNK, 2 * PER_CHUNK])
    # Kernels may still touch only the asked tokens either way.
    assert kv._ensured.tolist() == [5, PER_CHUNK + 1]


@pytest.mark.parametrize("eager", [False, True], ids=["deferred_zeros", "eager_zeros"])
def test_a_view_turns_the_rounding_off(vm, eager: bool) -> None:
    """After a view, unbacked bytes read zeros and commits wait for the device."""
    with eager_zeros(eager):
        kv = interleaved_kv(vm)
    view = kv.buffers[0].view((kv.buffers[0].nbytes,), "uint8")
    assert unbacked_kind(kv.arena) == "zero"  # the first view mapped zeros under every hole
    assert kv.arena.stats()["views_exported"]
    del view
    kv.ensure(5, seq=0)
    tokens_backed(vm, kv, [PER_CHUNK, 0])


@pytest.fixture
def host_kv(host_vm, monkeypatch):
    kv = interleaved_kv(host_vm)
    faulting(kv, monkeypatch)
    return host_vm, kv


def test_each_way_to_grow_backs_to_the_tile_end(host_kv) -> None:
    vm, kv = host_kv
    assert kv.ensure(1, seq=0) == (TILE // PER_CHUNK) * kv.arena.chunk_bytes
    tokens_backed(vm, kv, [TILE, 0])
    # Within the tile: no commit, and is_backed says so.
    assert kv.is_backed(TILE, seq=0)
    assert kv.ensure(TILE, seq=0) == 0
    # One token past it: the next whole tile.
    assert not kv.is_backed(TILE + 1, seq=0)
    kv.ensure(TILE + 1, seq=0)
    tokens_backed(vm, kv, [2 * TILE, 0])
    # ensure_all, the decode loop's call.
    kv.ensure_all(np.array([2 * TILE + 1, 3], np.int64))
    tokens_backed(vm, kv, [3 * TILE, TILE])
    # The last tile stops at the sequence's end (max_tokens), not in the next sequence.
    kv.ensure(500, seq=1)
    tokens_backed(vm, kv, [3 * TILE, 512])


def test_a_prefetch_backs_the_tile_the_ensure_will_need(host_kv) -> None:
    vm, kv = host_kv
    kv.prefetch(40, seq=0)
    assert kv.wait_prefetch(0, timeout=60)
    tokens_backed(vm, kv, [TILE, 0])
    assert kv.ensure(40, seq=0) == 0  # no driver call left for the ensure


def test_a_kept_prefix_is_topped_up_to_its_tile(host_kv) -> None:
    """release(keep_tokens=) keeps the kept tokens' chunks; the next sequence's ensure of
    them backs the rest of their tile."""
    vm, kv = host_kv
    kv.ensure(TILE, seq=0)
    kv.release(0, keep_tokens=40, wait=True)
    tile = [(0, TILE * kv.token_bytes)]  # one allocation: its released chunks stay parked
    vm.assert_backed(kv.arena, [(0, 2 * PER_CHUNK * kv.token_bytes)], held=tile)
    kv.ensure(40, seq=0)
    vm.assert_backed(kv.arena, tile)


def test_a_shared_prefix_backs_the_sharers_tile(host_kv) -> None:
    vm, kv = host_kv
    kv.ensure_shareable(2 * PER_CHUNK, seq=0)
    kv.share_prefix(0, 1, 2 * PER_CHUNK)
    assert kv.backed_tokens(1) >= TILE


def test_without_the_rounding_the_test_sees_the_unbacked_tile(host_kv) -> None:
    """The protection off (testing.untiled_reads): ensure backs the asked tokens' chunks
    only, which the checks above would catch."""
    vm, kv = host_kv
    with testing.untiled_reads():
        kv.ensure(1, seq=0)
    tokens_backed(vm, kv, [PER_CHUNK, 0])
    assert kv.backed_tokens(0) < TILE
