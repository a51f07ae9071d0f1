"""Maps a jax.Device to the driver that backs arenas on it and to its DLPack device."""

from __future__ import annotations

import dataclasses

import jax

# DLPack device types (dlpack.h): kDLCPU = 1, kDLCUDA = 2.
_DLPACK_CPU = 1
_DLPACK_CUDA = 2


@dataclasses.dataclass(frozen=True)
class DeviceTarget:
    device: jax.Device
    driver: str  # "host" or "cuda"
    ordinal: int  # CUDA device ordinal (0 for the host)
    dlpack_device_type: int

    @property
    def platform(self) -> str:
        return self.device.platform

    @property
    def name(self) -> str:
        """How errors name the device: ``cpu:1``, ``cuda:0``."""
        return f"{'cpu' if self.driver == 'host' else 'cuda'}:{xla_device_ordinal(self.device)}"

    @property
    def dlpack_device_id(self) -> int:
        """The DLPack device id of views: JAX places a DLPack tensor on the device of that
        local hardware id (on the CPU the host device's index, so an arena of ``cpu:1``
        gets its views on ``cpu:1``; on a GPU the CUDA ordinal)."""
        return xla_device_ordinal(self.device) if self.driver == "host" else self.ordinal


def resolve_device(device: jax.Device | None) -> DeviceTarget:
    if device is None:
        device = jax.devices()[0]
    if not isinstance(device, jax.Device):
        raise TypeError(
            "device must be a jax.Device (e.g. jax.devices()[0]) or None, got "
            f"{type(device).__name__}"
        )
    platform = device.platform
    if platform == "cpu":
        return DeviceTarget(device, "host", 0, _DLPACK_CPU)
    if platform in ("gpu", "cuda"):
        kind = getattr(device, "device_kind", "")
        if "rocm" in str(getattr(device.client, "platform_version", "")).lower():
            raise ValueError(
                f"device {device} is a ROCm GPU; jax_vmm supports CUDA GPUs and the CPU"
            )
        ordinal = getattr(device, "local_hardware_id", None)
        if ordinal is None:
            ordinal = device.id
        del kind
        return DeviceTarget(device, "cuda", int(ordinal), _DLPACK_CUDA)
    raise ValueError(
        f"jax_vmm does not support devices of platform {platform!r} ({device}); "
        "use a CUDA GPU or the CPU (jax.devices('cpu')[0])"
    )


def xla_device_ordinal(device: jax.Device) -> int:
    """The device ordinal XLA hands FFI handlers running on ``device`` (its local hardware
    id: on the CPU the host device's index, on a GPU the CUDA ordinal)."""
    ordinal = getattr(device, "local_hardware_id", None)
    return int(device.id if ordinal is None else ordinal)
