"""Plug-in workloads whose model fails on purpose, loaded through config like any user workload.

Input value: ASCII decimal ``x`` (one float per message). Output value: JSON ``{"x", "y"}``
with ``y = 2x``. The row of a message is ``(1,) float32``.

* ``tests.support.faulty:poison``: the model raises ``ValueError`` when a batch holds the
  value ``poison`` (default 666): a row the model cannot handle;
* ``tests.support.faulty:broken``: the model raises for every batch of real input (a batch of
  zeros, the warm-up's, runs: the model loads, then fails on every row it is given);
* ``tests.support.faulty:switchable``: the model raises for every batch of real input while
  :data:`BROKEN` is set (a model that breaks and comes back: a device or a mount that went
  away for a while);
* ``tests.support.faulty:out_of_memory``: the model raises ``torch.OutOfMemoryError`` for
  batches of more than ``fits`` rows, always, or (with ``pressure_file``) only while that
  file exists (memory pressure that comes and goes).
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import orjson
import torch

from streamproc.errors import DecodeError
from streamproc.records import Record
from streamproc.workloads import Encoded, ModelFn, Workload


class Doubling(Workload):
    """``y = 2x`` over one float per message; subclasses make the model fail."""

    name = "doubling"
    item_shape = (1,)
    item_dtype = np.dtype(np.float32)

    def decode(self, record: Record, out: np.ndarray) -> None:
        try:
            out[0] = float(record.value or b"")
        except ValueError as exc:
            raise DecodeError(f"expected an ASCII decimal: {exc!r}") from exc

    def check(self, batch: torch.Tensor) -> None:
        """Raise what the model raises for ``batch`` (nothing here)."""

    def build_model(self, device: torch.device) -> ModelFn:
        def run(batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
            self.check(batch)
            return (batch[:, 0] * 2,)

        return run

    def encode(self, record: Record, outputs: tuple[np.ndarray, ...]) -> Encoded:
        (y,) = outputs
        return Encoded(orjson.dumps({"x": float(record.value or b"0"), "y": float(y)}))


class Poison(Doubling):
    def __init__(self, value: float) -> None:
        self.value = value

    def check(self, batch: torch.Tensor) -> None:
        if bool((batch[:, 0] == self.value).any()):
            raise ValueError(f"cannot handle x={self.value:g}")


class Broken(Doubling):
    def check(self, batch: torch.Tensor) -> None:
        if bool(batch.any()):
            raise RuntimeError("weights missing: the model cannot run")


BROKEN = threading.Event()
"""Set: every :class:`Switchable` model raises on real input (the tests clear it)."""


class Switchable(Doubling):
    def check(self, batch: torch.Tensor) -> None:
        if BROKEN.is_set() and bool(batch.any()):
            raise RuntimeError("device lost: the model cannot run")


class OutOfMemory(Doubling):
    def __init__(self, fits: int, pressure_file: str | None) -> None:
        self.fits = fits
        self.pressure = Path(pressure_file) if pressure_file else None

    def check(self, batch: torch.Tensor) -> None:
        rows = batch.shape[0]
        if rows > self.fits and (self.pressure is None or self.pressure.exists()):
            raise torch.OutOfMemoryError(
                f"CUDA out of memory: a batch of {rows} rows needs more than the device has"
            )


def poison(value: float = 666.0) -> Workload:
    return Poison(value)


def broken() -> Workload:
    return Broken()


def switchable() -> Workload:
    return Switchable()


def out_of_memory(fits: int = 12, pressure_file: str | None = None) -> Workload:
    return OutOfMemory(fits, pressure_file)
