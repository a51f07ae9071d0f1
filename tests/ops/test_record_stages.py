"""The choice between a target and its recorded variant (jax_vmm/base/record_stages.py),
on any platform: it is made when a call is traced (so it is part of the jaxpr), only once
the core reports "registered"; the CPU lowering always names the plain target;
JAX_VMM_RECORD_STAGES=off and jax_vmm.testing.record_stages_off() keep the plain one; the
bootstrap runs whatever the caller traces. (tests/integration/test_record_stage_gpu.py
runs the recorded check on a GPU.)"""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import pytest

import jax_vmm
import jax_vmm.testing
from conftest import child_env
from jax_vmm.base import record_stages
from jax_vmm.base.loader import core as _core

PLAIN = "jax_vmm_kv_cache_check_views"


def _one_layer_kv(device):
    return jax_vmm.kv_arena(
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        max_tokens=16,
        max_seqs=1,
        dtype=jnp.float32,
        device=device,
    )


def _step():
    """A new function each time: JAX reuses the trace of a function it traced before."""
    return lambda c, k, v: jax_vmm.ordered_views(c[0], k, v)[0].sum()


def _check_eqn(jaxpr):
    return next(e for e in jaxpr.eqns if e.primitive.name == PLAIN)


@pytest.fixture
def registered(monkeypatch):
    """The core as it reports on a GPU whose bootstrap registered the recorded targets."""
    monkeypatch.setattr(record_stages, "_unavailable", "")
    monkeypatch.setattr(_core, "built_with_cuda_kernels", True)
    monkeypatch.setattr(_core, "record_stage_status", lambda: "registered", raising=False)


def test_the_cpu_lowering_names_the_plain_check(cpu_device):
    kv = _one_layer_kv(cpu_device)
    text = jax.jit(_step()).lower(kv.cache(), kv.k[0], kv.v[0]).as_text()
    assert PLAIN in text and PLAIN + "_recorded" not in text
    kv.close()


def test_the_choice_is_made_when_the_call_is_traced(cpu_device, registered):
    """Registered: the traced call carries recorded=True (the CPU lowering still names the
    plain target); traced inside record_stages_off() or with the variable off: False."""
    kv = _one_layer_kv(cpu_device)
    args = (kv.cache(), kv.k[0], kv.v[0])
    assert _check_eqn(jax.make_jaxpr(_step())(*args)).params["recorded"] is True
    text = jax.jit(_step()).lower(*args).as_text()
    assert PLAIN in text and PLAIN + "_recorded" not in text
    with jax_vmm.testing.record_stages_off():
        assert _check_eqn(jax.make_jaxpr(_step())(*args)).params["recorded"] is False
    with pytest.MonkeyPatch.context() as m:
        m.setenv("JAX_VMM_RECORD_STAGES", "off")
        assert _check_eqn(jax.make_jaxpr(_step())(*args)).params["recorded"] is False
    kv.close()


def test_the_recorded_name_needs_a_registration(monkeypatch, registered):
    assert record_stages.use_recorded(PLAIN)
    assert not record_stages.use_recorded("jax_vmm_kv_write")  # no recorded variant
    assert record_stages.target_for(PLAIN, True) == PLAIN + "_recorded"
    assert record_stages.target_for(PLAIN, False) == PLAIN
    monkeypatch.setattr(_core, "record_stage_status", lambda: "pending")
    assert not record_stages.use_recorded(PLAIN)
    monkeypatch.setattr(_core, "record_stage_status", lambda: "registered")
    monkeypatch.setenv("JAX_VMM_RECORD_STAGES", "off")
    assert record_stages.status().startswith("off")
    assert not record_stages.use_recorded(PLAIN)


def test_the_status_says_why_there_is_no_record_stage():
    """Without CUDA targets or a CUDA backend the status says so ("pending" would read as
    if the bootstrap were still to run)."""
    jax_vmm.base.ffi.register()
    if _core.built_with_cuda_kernels and jax_vmm.base.ffi._has_cuda_backend():
        pytest.skip("a GPU process: tests/integration/test_record_stage_gpu.py checks it")
    assert record_stages.status().startswith("unavailable: "), record_stages.status()
    assert not record_stages.use_recorded(PLAIN)


_UNDER_A_MESH = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp
    import jax_vmm.testing
    from jax_vmm.base import ffi, record_stages
    ffi.register()
    # ensure() as on a GPU, its bootstrap replaced by a side-effecting CPU call (the
    # testing host gate, open) on the CPU device.
    gate = jax.ffi.ffi_call(
        "jax_vmm_testing_host_gate", jax.ShapeDtypeStruct((), jnp.int32), has_side_effect=True
    )
    record_stages._bootstrap_call = lambda: gate(jnp.int32(0))
    cpu = jax.devices()[0]
    jax.local_devices = lambda backend=None, **kw: [cpu]
    if sys.argv[1] == "control":  # the bootstrap run from the tracing thread
        def in_this_thread(fn, device):
            with jax.ensure_compile_time_eval(), jax.default_device(device):
                jax.block_until_ready(jax.jit(fn)())
        record_stages._run_eagerly = in_this_thread
    record_stages._tried, record_stages._unavailable = False, ""

    def first_op(x):  # the first jax_vmm op of the process, traced under the mesh
        record_stages.ensure(True)
        return x + 1

    with jax.set_mesh(jax.make_mesh((4,), ("x",))):
        jax.jit(first_op)(jnp.ones(8))
    print("UNAVAILABLE", repr(record_stages._unavailable))
    """
)


@pytest.mark.parametrize("how", ["helper_thread", "control"])
def test_the_bootstrap_runs_inside_a_jit_trace_under_a_mesh_of_several_devices(how):
    """ensure() first called from a step traced under jax.set_mesh of 4 devices: its
    bootstrap runs (in a helper thread, no failure recorded). The control runs it from
    the tracing thread, as ensure() once did: XLA's partitioner refuses the unsharded
    side-effecting call, and the bootstrap is recorded as failed."""
    import subprocess
    import sys

    env = child_env(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    out = subprocess.run(
        [sys.executable, "-c", _UNDER_A_MESH, how],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    line = next((x for x in out.stdout.splitlines() if x.startswith("UNAVAILABLE")), None)
    assert line is not None, out.stdout + out.stderr[-2000:]
    if how == "helper_thread":
        assert line == "UNAVAILABLE ''", line
    else:
        assert "failed: the bootstrap call raised" in line, line
