"""The base layer: the compiled core (``loader``), FFI target registration (``ffi``),
device resolution (``devices``, ``compute_streams``), the error types (``errors``), the
fp8 format (``fp8``) and the argument checks every layer shares (``args``). Imports
nothing else of jax_vmm."""
