"""Model repositories for the versioned-model tests: versions of the iot workload's packaged
autoencoder (TorchScript), one with other weights, and ones that fail on purpose.

* :func:`iot_module`: the packaged autoencoder (``streamproc/workloads/weights``) as a
  ``torch.export`` program; ``scale`` multiplies its last layer's weights (another version
  whose scores differ);
* plug-in versions (``version.json``): :func:`fails_on_live` runs the autoencoder on the
  warm-up's zeros (every row the same) and raises on live batches (rows that differ): a
  version that loads and warms up, then fails; :func:`raises_always` fails its warm-up;
  :func:`breaks_on_signal` serves as the autoencoder until :data:`BREAK` is set, then raises
  on every call (a version that served well, then broke: its weights' storage went away);
* :func:`write_version`: ``<repository>/<model>/<version>/`` written as a model repository is
  updated live (a ``.tmp`` folder renamed into place).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import torch

from streamproc.workloads.iot import IotWorkload


def iot_module(scale: float = 1.0) -> torch.export.ExportedProgram:
    """The iot autoencoder as a ``torch.export`` program with a dynamic batch dimension;
    ``scale`` != 1 multiplies its output layer's weights."""
    module = IotWorkload().load_module(torch.device("cpu"))
    if scale != 1.0:
        with torch.no_grad():
            last = module.decoder[-1]
            assert isinstance(last, torch.nn.Linear)
            last.weight.mul_(scale)
    features = module.encoder[0].in_features
    return torch.export.export(
        module,
        (torch.zeros(2, features),),
        dynamic_shapes={"x": {0: torch.export.Dim("batch")}},
    )


class FailsOnLive(torch.nn.Module):
    """The autoencoder, raising on a batch whose rows differ (live data; the warm-up's zero
    rows are all equal)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1 and bool((x != x[0:1]).any()):
            raise RuntimeError("this version fails on live data")
        out: torch.Tensor = self.inner(x)
        return out


class RaisesAlways(torch.nn.Module):
    """A version that raises on every call, the warm-up's included."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this version is broken")


BREAK = threading.Event()
"""Set: every :class:`BreaksOnSignal` raises on every call (the tests clear it)."""


class BreaksOnSignal(torch.nn.Module):
    """The autoencoder, raising on every call while :data:`BREAK` is set."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if BREAK.is_set():
            raise RuntimeError("this version broke: its weights are gone")
        out: torch.Tensor = self.inner(x)
        return out


def breaks_on_signal(device: torch.device) -> torch.nn.Module:
    """Plug-in factory (``version.json``): :class:`BreaksOnSignal` around the autoencoder."""
    return BreaksOnSignal(IotWorkload().load_module(device))


def fails_on_live(device: torch.device) -> torch.nn.Module:
    """Plug-in factory (``version.json``): :class:`FailsOnLive` around the autoencoder."""
    return FailsOnLive(IotWorkload().load_module(device))


def raises_always(device: torch.device) -> torch.nn.Module:
    """Plug-in factory (``version.json``): :class:`RaisesAlways`."""
    return RaisesAlways()


def write_version(
    repository: Path,
    version: str,
    model: torch.export.ExportedProgram | str | None,
    name: str = "iot",
) -> Path:
    """Write a version folder the way a repository is updated live (a ``.tmp`` folder renamed
    into place): ``model`` a program (``model.pt2``), a plug-in factory's name (``version.json``)
    or None (a ``model.pt2`` that is not a model at all)."""
    final = repository / name / version
    partial = repository / name / f"{version}.tmp"
    partial.mkdir(parents=True)
    if model is None:
        (partial / "model.pt2").write_bytes(b"not a torch.export archive")
    elif isinstance(model, str):
        (partial / "version.json").write_text(json.dumps({"plugin": model, "note": "test"}))
    else:
        torch.export.save(model, str(partial / "model.pt2"))
    os.rename(partial, final)
    return final
