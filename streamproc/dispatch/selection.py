"""Which devices a lane runs on: ``worker.devices`` (or the single ``worker.device``) resolved
against the CUDA devices this process sees, into labelled :class:`DeviceSpec` values.

Every lane runs one :class:`~streamproc.device.DeviceWorker` per selected device; where each
cut batch goes among them is :mod:`streamproc.dispatch.placement`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from streamproc.errors import ConfigError


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One device a lane runs a worker on.

    Attributes:
        label: its name in metrics, logs and thread names: ``cuda:N``, or ``cpu:K`` for the
            K-th ``cpu`` entry (logical CPU devices share the cores).
        device: the torch device.
    """

    label: str
    device: torch.device


def visible_cuda_devices() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def select_devices(
    device: str,
    devices: str | Sequence[str] | None,
    cuda_count: int | None = None,
) -> tuple[DeviceSpec, ...]:
    """The devices of every lane, from ``worker.devices`` (when set) or else ``worker.device``.

    Args:
        device: ``worker.device``: ``auto`` (cuda:0 when CUDA is visible, else cpu), ``cpu``
            or ``cuda`` (cuda:0). Used only when ``devices`` is None.
        devices: ``worker.devices``: None, ``auto`` (every visible CUDA device, else one
            cpu), or validated entries ``cpu`` / ``cuda:N``.
        cuda_count: visible CUDA devices (default: asked from torch; tests pass it).

    Raises:
        ConfigError: a CUDA device is asked for that this process does not see (the message
            names the key and the devices allowed here).
    """
    count = visible_cuda_devices() if cuda_count is None else cuda_count
    visible = ", ".join(f"cuda:{i}" for i in range(count)) or "none"
    if devices is None:
        if device == "cuda" and count == 0:
            raise ConfigError(
                "worker.device: cuda, but this process sees no CUDA device; allowed here: auto, cpu"
            )
        names: Sequence[str] = ["cuda:0" if count and device in ("auto", "cuda") else "cpu"]
    elif devices == "auto":
        names = [f"cuda:{i}" for i in range(count)] or ["cpu"]
    else:
        names = [devices] if isinstance(devices, str) else devices
    specs: list[DeviceSpec] = []
    cpus = 0
    for name in names:
        if name == "cpu":
            specs.append(DeviceSpec(f"cpu:{cpus}", torch.device("cpu")))
            cpus += 1
            continue
        index_text = name.removeprefix("cuda").removeprefix(":") or "0"
        if not name.startswith("cuda") or not index_text.isdigit():
            raise ConfigError(f"worker.devices: unknown device {name!r}; allowed: cpu, cuda:N")
        index = int(index_text)
        if index >= count:
            raise ConfigError(
                f"worker.devices: {name} is not visible to this process (CUDA devices: "
                f"{visible}); allowed here: auto, or a list of cpu"
                + (f" and cuda:0..cuda:{count - 1}" if count else "")
            )
        specs.append(DeviceSpec(f"cuda:{index}", torch.device("cuda", index)))
    return tuple(specs)
