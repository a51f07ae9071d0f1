"""bench/decode.py's step (bench/_stack.py): every variant reads the same tokens, so the
checksums of their outputs agree; the cuDNN variants run through XLA's implementation of
the same call on the CPU (what they do on a GPU apart from the kernel), including cuDNN
over the arena's views ordered after the loop's writes."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import jax_vmm
from jax_vmm.serving import model as M
from jax_vmm.serving.attention import cudnn_decode_attention
from scripts import load_script

ST = load_script("bench/_stack.py")

CFG = M.ModelConfig(
    vocab=64, d_model=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=64
)


def _run(variant: str, device: jax.Device) -> dict:
    lengths = np.array([5, 30, 17], np.int32)
    return ST.time_variant(
        variant, CFG, device, lengths, context=64, steps=4, repeats=1, chunk_bytes=4096
    )


def test_every_variant_reads_the_same_tokens(cpu_device, monkeypatch) -> None:
    monkeypatch.setattr(
        ST,
        "cudnn_decode_attention",
        functools.partial(cudnn_decode_attention, implementation="xla"),
    )
    sums = {v: _run(v, cpu_device)["checksum"] for v in ST.VARIANTS}
    ref = sums[ST.BASELINE]
    assert abs(ref) > 1e-3, sums  # the fill makes the outputs nonzero
    for v, c in sums.items():
        assert c == pytest.approx(ref, rel=1e-4), (v, sums)
    # A variant reading one token too few per sequence is told apart.
    read = ST._read
    monkeypatch.setattr(
        ST, "_read", lambda kind, q, layer, views, n: read(kind, q, layer, views, n - 1)
    )
    assert _run("vmm+kernel", cpu_device)["checksum"] != pytest.approx(ref, rel=1e-4)


def test_the_reads_alone_agree_and_differ_from_the_whole_step(cpu_device) -> None:
    """writes=False (tools/gpu/profile_step.py's ablation): the stack without kv_write
    reads the same tokens on either cache, and not what the whole step reads."""
    lengths = np.array([5, 30, 17], np.int32)
    run = functools.partial(
        ST.time_variant, cfg=CFG, device=cpu_device, lengths=lengths, context=64, steps=4
    )
    reads = {
        v: run(variant=v, repeats=1, writes=False)["checksum"]
        for v in ("prealloc+kernel", "vmm+kernel")
    }
    assert reads["vmm+kernel"] == pytest.approx(reads["prealloc+kernel"], rel=1e-4)
    whole = run(variant="vmm+kernel", repeats=1)["checksum"]
    assert whole != pytest.approx(reads["vmm+kernel"], rel=1e-4)


def test_a_variant_that_does_not_fit_is_reported_not_raised(cpu_device) -> None:
    # bench/decode.py's 32-layer grid is sized for an H200: on an 80 GB card its largest
    # point ran out of memory and the traceback ended the whole run.
    def arena_full():
        raise jax_vmm.OutOfMemoryError("commit of buffer(s) 'k0': out of physical memory")

    def xla_full():
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 2 GiB")

    def other():
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    for full, says in ((arena_full, "commit of buffer(s)"), (xla_full, "RESOURCE_EXHAUSTED")):
        got = ST.if_it_fits(full)
        assert isinstance(got, str) and got.startswith("does not fit: " + says), got
    with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
        ST.if_it_fits(other)
    lengths = np.array([5, 30], np.int32)
    got = ST.if_it_fits(
        lambda: ST.time_variant(
            "vmm+kernel",
            CFG,
            cpu_device,
            lengths,
            context=64,
            steps=2,
            repeats=1,
            chunk_bytes=4096,
        )  # fmt: skip
    )
    assert isinstance(got, dict) and got["step_ms"] > 0


def test_a_pair_runs_its_calls_in_alternating_rounds(cpu_device, monkeypatch) -> None:
    """bench/decode.py's ratios come from time_pair: both sides alive at once, one call of
    each per round, the order swapped every round (timed apart, the small points moved by
    up to 0.3 between runs)."""
    order: list[str] = []
    call = ST.VariantRun.call

    def logged(self):
        order.append(self.variant)
        return call(self)

    monkeypatch.setattr(ST.VariantRun, "call", logged)
    lengths = np.array([5, 30, 17], np.int32)
    pre, vmm, ratios = ST.time_pair(
        ("prealloc+kernel", "vmm+kernel"), CFG, cpu_device, lengths, context=64, steps=2,
        repeats=4, chunk_bytes=4096,
    )  # fmt: skip
    p, v = "prealloc+kernel", "vmm+kernel"
    assert order == [p, v, v, p, p, v, v, p]
    assert (pre["variant"], vmm["variant"]) == (p, v)
    assert vmm["checksum"] == pytest.approx(pre["checksum"], rel=1e-4)
    assert len(ratios) == 4 and all(r > 0 for r in ratios)
    assert vmm["held_bytes"] > 0 and pre["held_bytes"] > 0


def test_time_all_pairs_what_it_can_and_times_the_rest_alone(cpu_device, monkeypatch) -> None:
    lengths = np.array([5, 30], np.int32)
    timing = dict(context=64, steps=2, repeats=2, chunk_bytes=4096)
    variants = ("prealloc+kernel", "vmm+kernel", "prealloc+xla", "vmm+cudnn")
    cases, skipped, paired = ST.time_all(
        variants, CFG, cpu_device, lengths, skip={"vmm+cudnn": "no GPU"}, **timing
    )
    assert set(cases) == {"prealloc+kernel", "vmm+kernel", "prealloc+xla"}
    assert skipped == {"vmm+cudnn": "no GPU"}
    assert set(paired) == {"kernel"} and paired["kernel"]["rounds"] == 2
    assert paired["kernel"]["q1"] <= paired["kernel"]["median"] <= paired["kernel"]["q3"]

    # A pair that does not fit together is timed apart, and says so; no paired entry.
    def too_big(*args, **kwargs):
        raise jax_vmm.OutOfMemoryError("commit of buffer(s) 'k0': out of physical memory")

    monkeypatch.setattr(ST, "time_pair", too_big)
    said: list[str] = []
    cases, skipped, paired = ST.time_all(
        variants[:2], CFG, cpu_device, lengths, log=said.append, **timing
    )
    assert set(cases) == {"prealloc+kernel", "vmm+kernel"} and not skipped and not paired
    assert len(said) == 1 and "timed apart" in said[0], said
