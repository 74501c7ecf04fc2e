"""Which devices a lane runs on: ``worker.devices`` / ``worker.device`` against the CUDA devices
visible (passed in; no CUDA needed)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from streamproc.dispatch.selection import DeviceSpec, select_devices
from streamproc.errors import ConfigError


def labels(specs: Sequence[DeviceSpec]) -> list[str]:
    return [s.label for s in specs]


def test_devices_from_config() -> None:
    assert labels(select_devices("auto", None, cuda_count=0)) == ["cpu:0"]
    assert labels(select_devices("auto", None, cuda_count=2)) == ["cuda:0"]
    assert labels(select_devices("cpu", None, cuda_count=2)) == ["cpu:0"]
    assert labels(select_devices("auto", "auto", cuda_count=0)) == ["cpu:0"]
    assert labels(select_devices("auto", "auto", cuda_count=3)) == ["cuda:0", "cuda:1", "cuda:2"]
    # devices overrides device; cpu entries are logical devices numbered in order
    specs = select_devices("cuda", ("cpu", "cpu"), cuda_count=0)
    assert labels(specs) == ["cpu:0", "cpu:1"]
    assert all(s.device == torch.device("cpu") for s in specs)
    mixed = select_devices("auto", ("cuda:1", "cpu", "cuda:0"), cuda_count=2)
    assert labels(mixed) == ["cuda:1", "cpu:0", "cuda:0"]
    assert mixed[0].device == torch.device("cuda", 1)


@pytest.mark.parametrize(
    ("device", "devices", "key"),
    [("auto", ("cuda:1",), "worker.devices"), ("cuda", None, "worker.device")],
)
def test_a_device_this_process_does_not_see_fails_naming_the_key(
    device: str, devices: tuple[str, ...] | None, key: str
) -> None:
    with pytest.raises(ConfigError) as err:
        select_devices(device, devices, cuda_count=1 if devices else 0)
    assert str(err.value).startswith(key) and "allowed" in str(err.value)
