"""A device worker's host output buffer sets: where each batch's outputs are copied back to.

A worker has ``count`` sets (its ``max_in_flight``). The device thread takes a free set before it
launches a batch (waiting while all are held), the model's outputs are copied into rows
``0..n-1`` of the set's buffers (one ``(rows, *output_shape)`` tensor per model output, made by
the backend: pinned on CUDA), and the set is given back once the batch's results were handled
(the ``release`` handed over with them). Every set is allocated at warm-up
(:meth:`OutputSets.prepare`) and again only when the model's output shapes or dtypes change, so
:attr:`OutputSets.allocations` stays flat after warm-up.

Ownership: the free sets and the batch holding each belong to :class:`OutputSets` (its
condition; a leaf lock). The buffers of a held set belong to the batch holding it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch

from streamproc.device.staging import PoolLeak

HostEmpty = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
"""Makes an uninitialised host tensor of a shape and dtype (``DeviceBackend.host_empty``)."""


class OutputSets:
    """``count`` output buffer sets of ``rows`` rows.

    Args:
        count: sets (>= 1): batches between launch and release.
        rows: rows per buffer (the staging slab's rows: the largest batch).
        host_empty: allocates one buffer.
        name: the sets' name in leak reports (``output <device label>``).
    """

    def __init__(self, count: int, rows: int, host_empty: HostEmpty, name: str) -> None:
        self.count = count
        self.rows = rows
        self.name = name
        self.allocations = 0
        self._host_empty = host_empty
        self._buffers: list[tuple[torch.Tensor, ...] | None] = [None] * count
        self._arrays: list[tuple[np.ndarray, ...]] = [()] * count  # numpy views of the buffers
        self._cond = threading.Condition()
        self._free = list(range(count))
        self._held: dict[int, int] = {}  # set index -> batch id holding it

    def take(self, batch_id: int) -> int:
        """Wait for a free set, hold it for ``batch_id`` and return its index."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._free))
            index = self._free.pop()
            self._held[index] = batch_id
            return index

    def give_back(self, index: int) -> None:
        """The set's batch no longer reads it: it is free again."""
        with self._cond:
            self._held.pop(index, None)
            self._free.append(index)
            self._cond.notify_all()

    def buffers(self, index: int, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The buffers of set ``index`` for model ``outputs`` (each ``(n, *shape)``): the
        set's own when their shapes and dtypes match, else newly allocated ones."""
        bufs = self._buffers[index]
        if (
            bufs is None
            or len(bufs) != len(outputs)
            or any(
                b.shape[1:] != o.shape[1:] or b.dtype != o.dtype
                for b, o in zip(bufs, outputs, strict=False)
            )
        ):
            # plain tensors even when called under inference mode (the launch): written in
            # place by every later batch, read through numpy
            with torch.inference_mode(False):
                bufs = tuple(self._host_empty((self.rows, *o.shape[1:]), o.dtype) for o in outputs)
            self.allocations += len(bufs)
            self._buffers[index] = bufs
            self._arrays[index] = tuple(b.numpy() for b in bufs)
        return bufs

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer allocated now (pinned on CUDA)."""
        return sum(
            b.numel() * b.element_size() for bufs in self._buffers if bufs is not None for b in bufs
        )

    def prepare(self, outputs: tuple[torch.Tensor, ...]) -> None:
        """Allocate every set's buffers for model ``outputs`` (each ``(n, *shape)``) now, on
        the calling thread (the device thread, at warm-up), rather than at each set's first
        batch."""
        for index in range(self.count):
            self.buffers(index, outputs)

    def views(self, index: int, n: int) -> tuple[np.ndarray, ...]:
        """Numpy views of rows ``0..n-1`` of set ``index`` (made once per set, sliced here)."""
        return tuple(array[:n] for array in self._arrays[index])

    def leak(self) -> PoolLeak:
        """The sets not given back now and the batches holding them (the leak check at
        close, when ``missing`` must be 0)."""
        with self._cond:
            return PoolLeak(
                self.name,
                self.count,
                self.count - len(self._free),
                tuple(sorted(self._held.values())),
            )
