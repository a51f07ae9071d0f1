"""``python -m jax_vmm info``: what this machine offers to jax_vmm."""

from __future__ import annotations

import os
import platform
from typing import Any

import jax

from .base.loader import core as _core

_ALLOCATOR_ENV = (
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_ALLOCATOR",
    "XLA_FLAGS",
)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def collect() -> dict[str, Any]:
    """Machine facts as a plain dict (what ``info`` prints)."""
    cuda_devices, cuda_error = _core.query_cuda_devices()
    host = _core.create_arena("host", 0, 1, 0)
    host_stats = host.stats()
    host.close()
    devices, jax_error = _jax_devices()
    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jax_vmm_cuda_kernels": bool(_core.built_with_cuda_kernels),
        "jax_vmm_cudnn": bool(getattr(_core, "built_with_cudnn", False)),
        "jax_devices": [f"{d.platform}:{d.id} {getattr(d, 'device_kind', '')}" for d in devices],
        "jax_error": jax_error,
        "host": {
            "granularity": host_stats["granularity"],
            "chunk_bytes": host_stats["chunk_bytes"],
            "free_bytes": host_stats["device_free_bytes"],
            "total_bytes": host_stats["device_total_bytes"],
        },
        "cuda_devices": list(cuda_devices),
        "cuda_error": cuda_error,
        "allocator_env": {k: os.environ.get(k) for k in _ALLOCATOR_ENV},
    }


def _jax_devices() -> tuple[list, str | None]:
    """JAX's devices, or none and why: a misconfigured JAX (JAX_PLATFORMS naming a backend
    that is missing) is what this report is for, so it is reported, not raised."""
    try:
        return list(jax.devices()), None
    except Exception as e:  # noqa: BLE001 - any backend failure is part of the report
        why = f"{type(e).__name__}: {e}".strip().rstrip(":")
        return [], f"{why}; JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '<unset>')}"


def main() -> int:
    info = collect()
    print(
        f"jax_vmm {__import__('jax_vmm').__version__}  python {info['python']}  jax {info['jax']}"
    )
    print(f"CUDA kernels compiled in: {'yes' if info['jax_vmm_cuda_kernels'] else 'no'}")
    print(
        "cuDNN attention compiled in: "
        + ("yes" if info["jax_vmm_cudnn"] else "no (docs/cudnn_attention.md says how)")
    )
    if info["jax_error"] is not None:
        print(f"JAX devices: none ({info['jax_error']})")
    else:
        print("JAX devices: " + ", ".join(info["jax_devices"]))
    h = info["host"]
    print(
        f"host driver (cpu): VMM yes, granularity {h['granularity']} B, "
        f"chunk {h['chunk_bytes']} B, "
        f"free {_gib(h['free_bytes'])} of {_gib(h['total_bytes'])}"
    )
    if info["cuda_devices"]:
        for d in info["cuda_devices"]:
            print(
                f"cuda:{d['ordinal']} {d['name']}: VMM {'yes' if d['vmm_supported'] else 'NO'}, "
                f"granularity {d['granularity_min']} B "
                f"(recommended {d['granularity_recommended']} B), "
                f"free {_gib(d['free_bytes'])} of {_gib(d['total_bytes'])}"
            )
    else:
        print(f"CUDA driver: not available ({info['cuda_error'] or 'no devices'})")
    print("JAX allocator settings (they decide how much GPU memory an arena can get):")
    for k, v in info["allocator_env"].items():
        print(f"  {k}={v if v is not None else '<unset>'}")
    if (
        any(d.startswith("gpu:") for d in info["jax_devices"])
        and info["allocator_env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] != "false"
    ):
        print(
            "  note: JAX preallocates 75% of GPU memory by default; arenas get only the rest. "
            "Set XLA_PYTHON_CLIENT_PREALLOCATE=false before importing jax."
        )
    return 0
