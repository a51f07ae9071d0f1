"""Memory budgets on 4 host devices, run in one child process (tests/sharding/multidevice.py
says why): a budget of one host device given to an arena of another, and sharded KV arenas
with one budget per device. The oracle for what each device's arena holds is the blocks of
its memfd (tests/oracles/maps_oracle.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable

import jax
import multidevice
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from multidevice import raises

import jax_vmm
from conftest import mo
from jax_vmm.base.devices import resolve_device

SCENARIOS: dict[str, Callable[[], None]] = {}
L, S, H, D = 2, 4, 4, 16  # layers, sequences (one per device), KV heads, head dim


def scenario(fn: Callable[[], None]) -> Callable[[], None]:
    SCENARIOS[fn.__name__] = fn
    return fn


def _chunk() -> int:
    return jax_vmm.Arena(1, device=jax.devices()[0]).chunk_bytes


def _sharded(budget, tokens: int):
    """Sequences over 4 devices: one sequence per device."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
    return jax_vmm.kv_arena(
        num_layers=L,
        num_kv_heads=H,
        head_dim=D,
        max_tokens=tokens,
        max_seqs=S,
        dtype=np.float32,
        commit_ahead_tokens=0,
        sharding=NamedSharding(mesh, P("dp")),
        budget=budget,
    )


@scenario
def a_budget_of_another_host_device_is_refused():
    d0, d1 = jax.devices()[:2]
    budget = jax_vmm.MemoryBudget(1 << 24, device=d1)
    before = mo.jax_vmm_memfds()
    raises(
        ValueError,
        lambda: jax_vmm.Arena(1 << 20, device=d0, budget=budget),
        "the budget is on",
        str(d1),
        str(d0),
        "create one per device",
    )
    assert mo.jax_vmm_memfds() == before and budget.stats()["arenas"] == []


@scenario
def one_budget_for_several_devices_is_refused():
    budget = jax_vmm.MemoryBudget(1 << 24, device=jax.devices()[0])
    before = mo.jax_vmm_memfds()
    raises(ValueError, lambda: _sharded(budget, 64), "one MemoryBudget per device")
    raises(ValueError, lambda: _sharded([budget, budget], 64), "given twice")
    raises(TypeError, lambda: _sharded("1G", 64), "sequence of jax_vmm.MemoryBudget")
    raises(TypeError, lambda: _sharded([1 << 24] * 4, 64), "got int")
    assert mo.jax_vmm_memfds() == before and budget.stats()["arenas"] == []


@scenario
def each_device_of_a_sharded_arena_draws_from_its_own_budget():
    c = _chunk()
    tpc = c // (H * D * 4)
    budgets = [jax_vmm.MemoryBudget(2 * L * 2 * c, device=d) for d in jax.devices()[:4]]
    kv = _sharded(list(reversed(budgets)), 4 * tpc)  # any order: matched by device
    others = [
        jax_vmm.kv_arena(
            num_layers=L,
            num_kv_heads=H,
            head_dim=D,
            max_tokens=4 * tpc,
            dtype=np.float32,
            device=b.device,
            commit_ahead_tokens=0,
            budget=b,
        )
        for b in budgets
    ]
    for b, shard in zip(budgets, kv.shards):
        assert [a["uid"] for a in b.stats()["arenas"]][0] == shard.arena.uid
    kv.ensure(2 * tpc, 1)  # device 1: 2 chunks per buffer, its whole budget
    others[0].ensure(2 * tpc)  # device 0's budget is its own
    # named by its own device: the host driver's ordinal is 0 for every CPU device
    name = resolve_device(budgets[1].device).name
    assert name.endswith(":1"), name
    raises(
        jax_vmm.OutOfMemoryError,
        lambda: others[1].ensure(1),
        f"memory budget of {budgets[1].bytes} bytes on {name}:",
    )
    raises(jax_vmm.OutOfMemoryError, lambda: kv.ensure(3 * tpc, 1), "memory budget of")
    for b in budgets:
        s = b.stats()
        assert s["used_bytes"] <= s["cap_bytes"]
        assert s["used_bytes"] == sum(a["held_bytes"] for a in s["arenas"])
    assert budgets[1].stats()["used_bytes"] == 2 * L * 2 * c
    kv.release(1)
    others[1].ensure(2 * tpc)  # device 1's room came back
    kv.close()
    for o in others:
        o.close()
    assert all(b.stats()["used_bytes"] == 0 for b in budgets)


if __name__ == "__main__":
    sys.exit(multidevice.main(SCENARIOS, sys.argv[1:]))
