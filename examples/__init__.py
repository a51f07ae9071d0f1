"""Example decoding loop on jax_vmm (see examples/decode.py)."""
