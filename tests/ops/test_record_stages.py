"""The choice between a target and its recorded variant (jax_vmm/base/record_stages.py),
on any platform: the CPU lowering always names the plain target, the recorded name is
used only once the core reports "registered", and JAX_VMM_RECORD_STAGES=off keeps the
plain targets. (tests/integration/test_record_stage_gpu.py runs the recorded check.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jax_vmm
from jax_vmm.base import record_stages
from jax_vmm.base.loader import core as _core

PLAIN = "jax_vmm_kv_cache_check_views"


def test_the_cpu_lowering_names_the_plain_check(cpu_device):
    kv = jax_vmm.kv_arena(
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        max_tokens=16,
        max_seqs=1,
        dtype=jnp.float32,
        device=cpu_device,
    )
    step = jax.jit(lambda c, k, v: jax_vmm.ordered_views(c[0], k, v)[0].sum())
    text = step.lower(kv.cache(), kv.k[0], kv.v[0]).as_text()
    assert PLAIN in text and PLAIN + "_recorded" not in text
    kv.close()


def test_the_status_says_why_there_is_no_record_stage():
    """Without CUDA targets or a CUDA backend the status says so ("pending" would read as
    if the bootstrap were still to run)."""
    jax_vmm.base.ffi.register()
    if _core.built_with_cuda_kernels and jax_vmm.base.ffi._has_cuda_backend():
        pytest.skip("a GPU process: tests/integration/test_record_stage_gpu.py checks it")
    assert record_stages.status().startswith("unavailable: "), record_stages.status()
    assert record_stages.target_for(PLAIN) == PLAIN


def test_the_recorded_name_needs_a_registration(monkeypatch):
    monkeypatch.setattr(record_stages, "_no_backend", "")
    monkeypatch.setattr(_core, "built_with_cuda_kernels", True)
    monkeypatch.setattr(record_stages._core, "record_stage_status", lambda: "pending")
    assert record_stages.target_for(PLAIN) == PLAIN
    monkeypatch.setattr(record_stages._core, "record_stage_status", lambda: "registered")
    assert record_stages.target_for(PLAIN) == PLAIN + "_recorded"
    assert record_stages.target_for("jax_vmm_kv_write") == "jax_vmm_kv_write"  # none recorded
    monkeypatch.setenv("JAX_VMM_RECORD_STAGES", "off")
    assert record_stages.status().startswith("off")
    assert record_stages.target_for(PLAIN) == PLAIN
