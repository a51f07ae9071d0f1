"""Serve a batch of requests with a small transformer whose KV cache lives in jax_vmm.

    python examples/decode.py                     # CPU-sized, jax_vmm cache
    python examples/decode.py --backend prealloc  # the plain-JAX preallocated baseline
    python examples/decode.py --preset gpu        # realistic size (default on a GPU)

`--help` lists every option. The engine, model and caches are `jax_vmm.serving`
(`pip install '.[example]'`); this script is its command line, `jax_vmm.serving.cli.decode`.
"""

from jax_vmm.serving.cli import decode

if __name__ == "__main__":
    decode.main()
