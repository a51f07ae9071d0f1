"""Sharded KV arenas on GPUs, in this process (the GPU machine's devices are what they are).

One GPU: the sharded code on a 1-device mesh against the unsharded arena (kv_write bytes
in the arena by a device-to-host memcpy, attention outputs) and the example's ``--tp 1``
logits against one device. Two GPUs (``nvidia-h200-x2``): heads over 2 devices against one
GPU, no collective in the compiled step, the example's ``--tp 2`` logits; each skips with
fewer than 2 GPUs. The scenarios are the CPU child's (tests/sharding/sharded_scenarios.py,
tp_scenarios.py), run here on the GPUs. tokens/s of ``--tp 2`` against ``--tp 1``:
``bench/tensor_parallel.py`` (a benchmark, not a test: no timing thresholds in tests).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

# This folder's modules, imported by name: pytest puts a test's folder on sys.path.
import sharded_scenarios
import tp_scenarios
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

pytestmark = pytest.mark.gpu


def _gpus(n: int, gpu_device: jax.Device) -> list[jax.Device]:
    gpus = jax.devices(gpu_device.platform)
    if len(gpus) < n:
        pytest.skip(f"needs {n} GPUs, this machine has {len(gpus)} (nvidia-h200-x{n})")
    return gpus[:n]


def test_a_one_gpu_mesh_equals_the_unsharded_arena(gpu_device):
    _gpus(1, gpu_device)
    sharded_scenarios.run_equal_to_single_device("one_device")


def test_tp1_example_logits_equal_one_gpu(gpu_device):
    _gpus(1, gpu_device)
    with jax.default_matmul_precision("highest"):  # float32 matmuls, not TF32
        tp_scenarios.tp_logits_equal_single_device(1, gpu_device.platform)


def test_heads_over_two_gpus_equal_one_gpu(gpu_device):
    _gpus(2, gpu_device)
    sharded_scenarios.run_equal_to_single_device("heads_over_two")


def test_two_gpu_step_moves_no_cache(gpu_device):
    gpus = _gpus(2, gpu_device)
    sharded_scenarios.check_no_collectives(Mesh(np.array(gpus), ("tp",)), P(None, None, "tp"))


def test_tp2_example_logits_equal_one_gpu(gpu_device):
    _gpus(2, gpu_device)
    with jax.default_matmul_precision("highest"):
        tp_scenarios.tp_logits_equal_single_device(2, gpu_device.platform, tol=1e-4)
