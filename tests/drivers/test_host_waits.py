"""On the CPU "wait for the device" waits too: memory goes only after the XLA:CPU work
dispatched before it finished.

XLA:CPU runs a jitted computation on its own threads after the dispatching call returned.
A release, close, sleep or offload right after dispatching a step over the arena must not
take the memory from under it (the contract the GPU keeps by waiting for the compute
stream): the step's result is the one it would have had without the call. With the wait
removed (``jax_vmm.testing.host_device_waits_skipped``) the same scenarios read zeros or
partial sums, which shows the tests catch it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
import jax_vmm.testing
from conftest import write_bytes

TOKENS, HEADS, DIM = 8192, 8, 128  # one sequence of one layer: 32 MiB of float32
REPEATS = 2


def _kv(vm) -> jax_vmm.KVArena:
    """Two sequences; sequence 0's K and V of layer 0 filled with a known pattern."""
    kv = vm.kv(
        num_layers=1,
        num_kv_heads=HEADS,
        head_dim=DIM,
        max_tokens=TOKENS,
        max_seqs=2,
        dtype=jnp.float32,
    )
    kv.ensure(TOKENS, seq=0)
    data = np.linspace(0.5, 1.5, TOKENS * HEADS * DIM, dtype=np.float32)
    for b in (kv.k_buffers[0], kv.v_buffers[0]):
        write_bytes(b, 0, data)
    return kv


def _reduction(kv: jax_vmm.KVArena) -> Callable[[], jax.Array]:
    f = jax.jit(lambda x: jnp.sum(jnp.sin(x[0]) ** 2 + x[0]))
    return lambda: f(kv.k[0])


def _attention(kv: jax_vmm.KVArena) -> Callable[[], jax.Array]:
    """Attention over sequence 0, after a long computation that the query depends on (so
    that the attention itself runs well after the dispatch returned)."""
    dev = kv.arena.device
    busy = jax.device_put(jnp.linspace(0.0, 1.0, TOKENS * HEADS * DIM, dtype=jnp.float32), dev)
    lengths = jax.device_put(jnp.array([TOKENS, 0], jnp.int32), dev)

    def step(c, busy):
        q = jnp.ones((2, 4 * HEADS, DIM), jnp.float32) + 0 * jnp.sum(jnp.sin(busy) ** 2)
        return jax_vmm.decode_attention(q, c[0], lengths)

    f = jax.jit(step)
    return lambda: f(kv.cache(), busy)


#: What gives memory back right after the dispatch.
_RELEASES = {
    "release": lambda kv: kv.release(0),
    "release_wait": lambda kv: kv.release(0, wait=True),
    "shrink": lambda kv: kv.shrink(0),
    "close": lambda kv: kv.close(),
    "sleep": lambda kv: kv.sleep(),
    "sleep_discard": lambda kv: kv.sleep("discard"),
    "offload": lambda kv: kv.offload(0),
    "decommit": lambda kv: kv.k_buffers[0].decommit(wait=True),
    "free": lambda kv: kv.k_buffers[0].free(),
}

_STEPS = {"reduction": _reduction, "attention": _attention}


def _results_after(host_vm, step: str, release: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """(expected, seen) per repeat: the step's result once it ran alone, and its result
    when the release ran right after its dispatch."""
    out = []
    for _ in range(REPEATS):
        kv = _kv(host_vm)
        run = _STEPS[step](kv)
        want = np.asarray(run())
        got = run()  # in flight...
        _RELEASES[release](kv)  # ...when the memory goes
        out.append((want, np.asarray(got)))
        if not kv.closed:
            if kv.asleep:
                kv.wake()
            kv.close()
    return out


@pytest.mark.parametrize("release", sorted(_RELEASES))
def test_a_reduction_in_flight_finishes_before_the_memory_goes(host_vm, release):
    for want, got in _results_after(host_vm, "reduction", release):
        assert want != 0
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("release", ["release", "close", "sleep", "offload"])
def test_an_attention_call_in_flight_finishes_before_the_memory_goes(host_vm, release):
    for want, got in _results_after(host_vm, "attention", release):
        assert np.abs(want[0]).min() > 0
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("step", sorted(_STEPS))
def test_without_the_wait_the_memory_goes_under_the_running_step(host_vm, step):
    """The protection removed: at least one of the repeats reads released memory (the
    check above would fail)."""
    with jax_vmm.testing.host_device_waits_skipped():
        results = _results_after(host_vm, step, "release")
    assert any(not np.array_equal(got, want) for want, got in results)
