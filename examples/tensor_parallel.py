"""Serve with tensor parallelism: examples/decode.py with --tp N (default: the most devices
jax sees that the model's heads and MLP split over evenly). On a CPU,
XLA_FLAGS=--xla_force_host_platform_device_count=N gives N host devices.

    python examples/tensor_parallel.py [--tp N] [decode.py options]

The library side is `jax_vmm.serving.tensor_parallel` (and docs/sharding.md).
"""

import sys

from jax_vmm.serving.cli import decode

if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(a.startswith("--tp") for a in argv):
        import jax

        argv = ["--tp", str(decode.default_tp(argv, len(jax.devices()))), *argv]
    decode.main(argv)
