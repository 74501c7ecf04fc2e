"""A fixed pool of host staging buffers (pinned when CUDA is present).

Each buffer ("slab") holds one batch: ``(max_batch_size, *item_shape)`` of ``item_dtype``.
With ``shared=True`` the slabs live in POSIX shared memory (``multiprocessing.shared_memory``),
so decode processes can write into them (``worker.decode_mode: process``). With CUDA, shared and
private slabs alike are page-locked in place at their exact size
(:func:`~streamproc.device.backend.register_host`, portable to every device) rather than
allocated with ``pin_memory=True`` (which rounds each up to a power of two).

All slabs are allocated up front; :attr:`StagingPool.allocations` counts every host buffer the
pool ever allocated, so a test or metric can prove nothing is allocated after warm-up.

Ownership: a slab leased by the dispatcher belongs to it while decode writes into it, then to the
device worker, which returns it (:meth:`StagingPool.release`) only after the event recorded
after the slab's host-to-device copy has completed. One lane's pool serves all of the lane's
devices (registered with ``cudaHostRegisterPortable``: page-locked for every CUDA device of
the process).

Leak check: every lease records the batch that holds the slab; :meth:`StagingPool.leak` says, at
close, how many slabs are still out and which batches hold them (:class:`PoolLeak`, also used for
the device worker's output buffer sets).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np
import torch

from streamproc.device.backend import register_host, unregister_host
from streamproc.logs import get_logger
from streamproc.metrics import Metrics

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class PoolLeak:
    """Buffers of one pool that were not back when it was checked (at close).

    Attributes:
        pool: what the pool is, e.g. ``"staging"`` or ``"output cuda:0"``.
        capacity: buffers the pool has.
        missing: buffers not returned (0: nothing leaked).
        batch_ids: the batches holding them, ascending (a lease outside a batch, such as the
            warm-up's, has no batch id, so ``len(batch_ids) <= missing``).
    """

    pool: str
    capacity: int
    missing: int
    batch_ids: tuple[int, ...] = ()


LEAK_EVENT = "pool leak: buffers not back in their pool at close"
"""The error log line of a leak (tests of subprocess runs look for it)."""


def report_leaks(topic: str, checks: Iterable[PoolLeak], metrics: Metrics) -> tuple[PoolLeak, ...]:
    """The leak check's report for one lane: ``streamproc_pool_leaked_buffers{topic,pool}``
    set for every pool (0 when all came back), and one error log per pool missing buffers,
    naming the lane's topic, the pool (and so the device), the count and the batches holding
    them. Returns the checks with something missing."""
    leaks: list[PoolLeak] = []
    for found in checks:
        metrics.pool_leaked.labels(topic, found.pool).set(found.missing)
        if not found.missing:
            continue
        leaks.append(found)
        log.error(
            LEAK_EVENT,
            topic=topic,
            pool=found.pool,
            missing=found.missing,
            capacity=found.capacity,
            batch_ids=list(found.batch_ids),
        )
    return tuple(leaks)


@dataclass(eq=False)
class Slab:
    """One staging buffer.

    Attributes:
        index: position in the pool.
        tensor: torch view (pinned when the pool is pinned), shape (rows, *item_shape).
        array: numpy view of the same memory, written by decode.
    """

    index: int
    tensor: torch.Tensor
    array: np.ndarray


class StagingPool:
    """``count`` slabs of ``(rows, *item_shape)`` elements.

    Args:
        count: number of slabs (bounds batches between decode and copy completion).
        rows: rows per slab (the maximum batch size).
        item_shape: shape of one row.
        dtype: numpy dtype of the rows.
        pin: page-locked memory (needs CUDA).
        shared: allocate the slabs in named shared memory (see :attr:`shared_names`).
        name: the pool's name in leak reports.
    """

    def __init__(
        self,
        count: int,
        rows: int,
        item_shape: tuple[int, ...],
        dtype: np.dtype,
        pin: bool,
        shared: bool = False,
        name: str = "staging",
    ) -> None:
        self.name = name
        torch_dtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
        self.pinned = pin
        self.rows = rows
        self.shape = (rows, *item_shape)
        self.dtype = np.dtype(dtype)
        self.allocations = 0
        self.slab_bytes = rows * int(np.prod(item_shape)) * np.dtype(dtype).itemsize
        self._slabs: list[Slab] = []
        self._shared: list[shared_memory.SharedMemory] = []
        for index in range(count):
            if shared:
                shm = shared_memory.SharedMemory(create=True, size=max(1, self.slab_bytes))
                self._shared.append(shm)
                array = np.ndarray(self.shape, dtype=self.dtype, buffer=shm.buf)
                tensor = torch.from_numpy(array)
                if pin:
                    register_host(tensor)
            else:
                tensor = torch.empty(self.shape, dtype=torch_dtype)
                array = tensor.numpy()
                if pin:
                    register_host(tensor)
            self.allocations += 1
            self._slabs.append(Slab(index, tensor, array))
        self._free = list(reversed(self._slabs))
        self._leased: dict[int, int | None] = {}  # slab index -> batch id holding it
        self._cond = threading.Condition()

    @property
    def shared_names(self) -> tuple[str, ...]:
        """Shared-memory names of the slabs in index order (empty unless ``shared``)."""
        return tuple(shm.name for shm in self._shared)

    def close(self) -> None:
        """Unregister the pinned slabs that are back in the pool, free shared-memory slabs
        (unlink their names). A slab still leased may have a copy in flight: it stays
        page-locked (freed with the process) and a warning names its batch."""
        if self.pinned:
            with self._cond:
                leased = dict(self._leased)
            for slab in self._slabs:
                if slab.index in leased:
                    log.warning(
                        "staging slab still leased at close: left page-locked",
                        pool=self.name,
                        slab=slab.index,
                        batch_id=leased[slab.index],
                    )
                    continue
                with contextlib.suppress(Exception):
                    unregister_host(slab.tensor)
        self._slabs.clear()
        self._free.clear()
        for shm in self._shared:
            with contextlib.suppress(BufferError):  # a view still alive: freed at exit
                shm.close()
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()
        self._shared.clear()

    @property
    def capacity(self) -> int:
        return len(self._slabs)

    @property
    def in_use(self) -> int:
        with self._cond:
            return len(self._leased)

    def lease(self, timeout_s: float | None = None, batch_id: int | None = None) -> Slab | None:
        """Take a free slab, waiting up to ``timeout_s`` (None: forever); None on timeout.

        ``batch_id`` names the batch that will hold it (reported by :meth:`leak`)."""
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free), timeout=timeout_s):
                return None
            slab = self._free.pop()
            self._leased[slab.index] = batch_id
            return slab

    def release(self, slab: Slab) -> None:
        """Return a leased slab.

        Raises:
            ValueError: the slab is not leased from this pool (double release).
        """
        with self._cond:
            if slab.index not in self._leased or self._slabs[slab.index] is not slab:
                raise ValueError(f"slab {slab.index} released but not leased")
            del self._leased[slab.index]
            self._free.append(slab)
            self._cond.notify()

    def leak(self) -> PoolLeak:
        """The slabs leased now and the batches holding them; call it once the pool's users
        are done (at close), when ``missing`` must be 0."""
        with self._cond:
            holders = sorted(b for b in self._leased.values() if b is not None)
            return PoolLeak(self.name, len(self._slabs), len(self._leased), tuple(holders))
