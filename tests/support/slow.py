"""Test workloads for failure scenarios, loaded through config like any user workload.

* ``tests.support.slow:make_workload``: a built-in workload whose model sleeps ``delay_s`` per
  batch (a slow device);
* ``tests.support.slow:bloated``: trades whose result is ``size_bytes`` long (to overflow the
  broker's or producer's message size limit);
* ``tests.support.slow:bloated_some``: trades whose result carries ``size_bytes`` of random
  (incompressible) bytes for inputs at offsets ``o`` with ``o % every == at`` only.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from streamproc.records import Record
from streamproc.workloads import Encoded, ModelFn, Workload, load_workload


class _Wrapped(Workload):
    def __init__(self, inner: Workload) -> None:
        self.inner = inner
        self.name = inner.name
        self.item_shape = inner.item_shape
        self.item_dtype = inner.item_dtype

    def decode(self, record: Record, out: np.ndarray) -> None:
        self.inner.decode(record, out)

    def build_model(self, device: torch.device) -> ModelFn:
        return self.inner.build_model(device)

    def encode(self, record: Record, outputs: tuple[np.ndarray, ...]) -> Encoded:
        return self.inner.encode(record, outputs)


class Slow(_Wrapped):
    def __init__(self, inner: Workload, delay_s: float) -> None:
        super().__init__(inner)
        self.delay_s = delay_s

    def build_model(self, device: torch.device) -> ModelFn:
        run = self.inner.build_model(device)

        def slow(batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
            time.sleep(self.delay_s)  # stands in for a long device computation
            return run(batch)

        return slow


class Bloated(_Wrapped):
    def __init__(self, inner: Workload, size_bytes: int) -> None:
        super().__init__(inner)
        self.size_bytes = size_bytes

    def encode(self, record: Record, outputs: tuple[np.ndarray, ...]) -> Encoded:
        value = self.inner.encode(record, outputs).value
        return Encoded(value + b" " * max(0, self.size_bytes - len(value)))


class BloatedSome(_Wrapped):
    def __init__(self, inner: Workload, size_bytes: int, every: int, at: int) -> None:
        super().__init__(inner)
        self.size_bytes, self.every, self.at = size_bytes, every, at

    def encode(self, record: Record, outputs: tuple[np.ndarray, ...]) -> Encoded:
        value = self.inner.encode(record, outputs).value
        if record.offset % self.every == self.at:
            value += os.urandom(self.size_bytes)
        return Encoded(value)


def bloated_some(
    base: str = "trades", size_bytes: int = 200_000, every: int = 100, at: int = 50
) -> Workload:
    return BloatedSome(load_workload(base), size_bytes, every, at)


def make_workload(base: str = "trades", delay_s: float = 1.0) -> Workload:
    return Slow(load_workload(base), delay_s)


def bloated(base: str = "trades", size_bytes: int = 100_000) -> Workload:
    return Bloated(load_workload(base), size_bytes)
