"""tools/gpu/trace_summary.py (the parser behind tools/gpu/profile_step.py) on a made-up
trace: only the device's stream lines count, each kernel lands in its part of the step,
and busy time, span and gaps come out per step and per layer."""

from __future__ import annotations

import pytest
from scripts import load_script

TS = load_script("tools/gpu/trace_summary.py")


def _trace() -> dict:
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #13"}},
        {"ph": "M", "pid": 2, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}},
    ]
    kernels = [  # one step of two layers: write, cuDNN, write, cuDNN (us)
        ("void jax_vmm::kv::kernels::KvKernel<Checked>(Params, int)", 0.0, 2.0),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 3.0, 10.0),
        ("void jax_vmm::kv::kernels::KvKernel<Checked>(Params, int)", 14.0, 2.0),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 17.0, 10.0),
    ]
    events = [
        {"ph": "X", "pid": 2, "tid": 7, "ts": ts, "dur": dur, "name": name}
        for name, ts, dur in kernels
    ]
    events.append({"ph": "X", "pid": 2, "tid": 8, "ts": 0.0, "dur": 27.0, "name": "fusion.1"})
    events.append({"ph": "X", "pid": 1, "tid": 1, "ts": 0.0, "dur": 99.0, "name": "Execute"})
    return {"traceEvents": meta + events}


def test_parts_busy_span_and_gaps_per_layer() -> None:
    s = TS.summarize(_trace(), steps=1, layers=2)
    assert s["events"] == 4  # neither the host line nor XLA's derived "XLA Ops" line
    parts = {p["part"]: p for p in s["parts"]}
    assert set(parts) == {"kv_write (arena)", "cuDNN attention"}
    assert parts["kv_write (arena)"]["us_per_layer"] == pytest.approx(2.0)
    assert parts["cuDNN attention"]["per_step"] == 2
    assert s["busy_us"] == pytest.approx(24.0)
    assert s["span_us"] == pytest.approx(27.0)
    assert s["gap_us_per_layer"] == pytest.approx(1.5)


@pytest.mark.parametrize(
    "name, part",
    [
        ("loop_dynamic_update_slice_fusion", "XLA write (DUS/scatter)"),
        ("input_scatter_fusion_3", "XLA write (DUS/scatter)"),
        ("void jax_vmm::kvcache::ClampLengthsKernel(int const*)", "table read (clamp lengths)"),
        ("void jax_vmm::attention::SplitKernelTensorCore<128>(P)", "jax_vmm attention"),
        ("Memset (Device)", "memset/memcpy"),
        ("loop_add_fusion", "other XLA fusions"),
        ("something_else", "other"),
    ],
)
def test_kernel_names_land_in_their_part(name: str, part: str) -> None:
    assert TS.part_of(name) == part


def test_an_empty_trace_has_no_events() -> None:
    assert TS.summarize({"traceEvents": []}, steps=4, layers=2)["events"] == 0


def test_kernels_split_by_the_program_they_ran_in() -> None:
    trace = _trace()
    trace["traceEvents"] += [
        {"ph": "M", "pid": 2, "tid": 9, "name": "thread_name", "args": {"name": "XLA Modules"}},
        {"ph": "X", "pid": 2, "tid": 9, "ts": 0.0, "dur": 12.0, "name": "jit_prefill(11)"},
        {"ph": "X", "pid": 2, "tid": 9, "ts": 13.0, "dur": 15.0, "name": "jit_block(12)"},
    ]
    s = TS.by_module(trace)
    assert s["kernels_outside_modules"] == 0
    prefill, block = s["modules"]["jit_prefill"], s["modules"]["jit_block"]
    assert prefill["executions"] == 1 and prefill["busy_ms"] == pytest.approx(0.012)
    assert prefill["parts"] == {
        "kv_write (arena)": pytest.approx(0.002),
        "cuDNN attention": pytest.approx(0.010),
    }
    assert block["span_ms"] == pytest.approx(0.015) and block["gap_ms"] == pytest.approx(0.003)
    whole = TS.summarize(trace, steps=1, layers=1)  # the totals profile_serving prints
    assert whole["events"] == 4
    assert whole["busy_us"] == pytest.approx(24.0) and whole["span_us"] == pytest.approx(27.0)


def test_idle_gaps_are_grouped_by_the_kernels_around_them() -> None:
    g = TS.idle_gaps(_trace(), min_us=1.0)
    # gaps: write -> cuDNN 1 us, cuDNN -> write 1 us, write -> cuDNN 1 us
    assert g["count"] == 3 and g["ms"] == pytest.approx(0.003)
    top = {(r["before"][:14], r["after"][:14]): r["count"] for r in g["top"]}
    assert top == {("void jax_vmm::", "cudnn_generate"): 2, ("cudnn_generate", "void jax_vmm::"): 1}
    assert TS.idle_gaps(_trace(), min_us=1.5)["count"] == 0
