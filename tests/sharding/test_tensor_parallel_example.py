"""The example's ``--tp N`` (jax_vmm.serving.tensor_parallel) on 4 host devices: logits equal to
one device's for N = 1, 2, 4, chunked prefill against whole prompts on one device, the CLI
end to end, its refusals. The scenarios
(tests/sharding/tp_scenarios.py) run in one child process (tests/sharding/multidevice.py)."""

from __future__ import annotations

from pathlib import Path

import multidevice  # this folder: pytest puts a test's folder on sys.path
import pytest

HERE = Path(__file__).resolve().parent

NAMES = [
    "tp1_logits_equal_single_device",
    "tp2_logits_equal_single_device",
    "tp4_logits_equal_single_device",
    "tp2_chunked_prefill_equals_whole_prompt",
    "tp4_chunked_prefill_equals_whole_prompt",
    "decode_cli_tp2_serves_the_same_requests",
    "decode_cli_refuses_bad_tp",
    "tensor_parallel_example_picks_a_tp_the_model_splits_over",
]


@pytest.fixture(scope="module")
def results() -> dict:
    return multidevice.child_results(HERE / "tp_scenarios.py")


@pytest.mark.parametrize("name", NAMES)
def test_tp_scenario(results, name):
    multidevice.check(results, name)


def test_every_scenario_is_collected(results):
    ran = {k for k in results if not k.startswith("_")}
    assert ran == set(NAMES), ran ^ set(NAMES)
