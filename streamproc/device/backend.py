"""The device backend: what a device worker asks of the device's runtime, one class per kind.

A :class:`~streamproc.device.DeviceWorker` runs the same code on every device and never asks
which kind it is; streams, events, host buffer pinning and synchronisation are the backend's::

                      CpuBackend                          CudaBackend
    launch()          nothing (the calling thread)        next of ``streams`` streams current
    record(mark)      an event fired at once (its time)   ``torch.cuda.Event`` on that stream
    synchronous       True: the device thread completes   False: a completion thread polls
                      each batch itself                   the events (``query()``)
    host_empty()      pageable memory                     page-locked (pinned) memory
    synchronize()     nothing to wait for                 ``torch.cuda.synchronize(device)``
    release_memory()  nothing                             ``torch.cuda.empty_cache()``
    set_yielding()    half the intra-op threads           nothing (the GPU schedules kernels)
    register_host()   (not needed)                        ``cudaHostRegister`` (shared slabs)

Per batch the worker records three marks inside one :meth:`DeviceBackend.launch`::

    start --copy in (non_blocking)--> copied --model, copy out (non_blocking)--> done

``copied`` firing means the staging slab may be reused; ``done`` firing means the host output
buffers hold the batch's results; ``elapsed_s(start, done)`` is the batch's device time.

Ownership: a backend belongs to one device worker. :meth:`~DeviceBackend.launch`,
:meth:`~DeviceBackend.record` and :meth:`~DeviceBackend.set_yielding` run on its device thread;
events are queried on whichever thread completes the batch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from streamproc.device.intra_op import IntraOpThreads

Mark = Literal["start", "copied", "done"]
"""Where in a batch's launch an event is recorded: ``start`` before the copy in, ``copied``
after it, ``done`` after the copy out."""

EVENT_POLL_S = 0.0002
"""Polling period of an event that has not fired yet, in seconds (never a stream synchronise)."""


class Event(Protocol):
    """A point on a device's work queue: ``query()`` is True once the work before it is done."""

    def query(self) -> bool: ...


def wait_for(event: Event) -> None:
    """Poll ``event`` every :data:`EVENT_POLL_S` until it fired (returns at once if it has)."""
    while not event.query():
        time.sleep(EVENT_POLL_S)


class DeviceBackend(Protocol):
    """What a device worker needs of its device (see the module)."""

    @property
    def device(self) -> torch.device:
        """The torch device the worker's model runs on."""
        ...

    @property
    def synchronous(self) -> bool:
        """True when a launch returns with its work done (every event it recorded has
        normally fired): the device thread completes each batch itself. False: a completion
        thread polls the events."""
        ...

    def bind_thread(self) -> None:
        """Make this device the calling thread's current device (device, completion threads)."""

    def launch(self) -> contextlib.AbstractContextManager[None]:
        """The context one batch is launched in (CUDA: the next stream in rotation is
        current); :meth:`record` is called inside it."""
        ...

    def record(self, mark: Mark) -> Event:
        """An event recorded now, in the launch's order of work (see :data:`Mark`)."""
        ...

    def elapsed_s(self, start: Event, done: Event) -> float:
        """Seconds of device work between two fired events of one launch (``start``, ``done``).

        Raises:
            TypeError: the events were not recorded by this kind of backend.
        """
        ...

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor the device copies into asynchronously (output buffers;
        pinned where the device needs it)."""
        ...

    def synchronize(self) -> None:
        """Wait until every stream of the device is idle (warm-up and start-up timings only)."""

    def release_memory(self) -> None:
        """Give the device's cached, unused memory back (before a re-run after an
        out-of-memory error)."""

    def set_yielding(self, yielding: bool) -> None:
        """Run the calling thread's next model calls yielding compute to more urgent lanes
        (``True``) or not (see :mod:`streamproc.device.admission`)."""


@dataclass(frozen=True, slots=True)
class Fired:
    """An event that fired when it was recorded, at ``at_s`` (monotonic seconds)."""

    at_s: float

    def query(self) -> bool:
        return True


class CpuBackend:
    """The CPU: launches run on the calling thread and return when the work is done.

    Args:
        device: a CPU torch device.
    """

    synchronous = True

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self._intra_op = IntraOpThreads()

    def bind_thread(self) -> None:
        """Nothing to bind: CPU work runs on the calling thread."""

    def launch(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def record(self, mark: Mark) -> Event:
        return Fired(time.monotonic())

    def elapsed_s(self, start: Event, done: Event) -> float:
        if not isinstance(start, Fired) or not isinstance(done, Fired):
            raise TypeError(f"CPU timing needs events of CpuBackend.record: {start!r}, {done!r}")
        return done.at_s - start.at_s

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def synchronize(self) -> None:
        """Nothing to wait for: every CPU launch has returned."""

    def release_memory(self) -> None:
        """Nothing cached to give back."""

    def set_yielding(self, yielding: bool) -> None:
        """Half this thread's intra-op threads (at least one) while ``yielding``, else all."""
        self._intra_op.use(yielding)


class CudaBackend:
    """A CUDA device: batches launched on ``streams`` streams in rotation (batch ``k`` on
    stream ``k mod streams``), so the copies of one batch overlap the compute of another.

    Args:
        device: a CUDA torch device (``cuda:N``).
        streams: streams to rotate over (>= 1; >= 2 for double buffering).

    Raises:
        ValueError: ``streams`` < 1.
    """

    synchronous = False

    def __init__(self, device: torch.device, streams: int) -> None:
        if streams < 1:
            raise ValueError(f"CudaBackend({device}, streams={streams}): streams must be >= 1")
        self.device = device
        # torch ships the constructors of Stream and Event without annotations
        self._streams = [
            torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # unannotated in torch
            for _ in range(streams)
        ]
        self._launches = 0
        self._stream = self._streams[0]  # the stream of the launch in progress

    def bind_thread(self) -> None:
        """Event queries, timings and launches on this device, not ``cuda:0``."""
        torch.cuda.set_device(self.device)

    @contextlib.contextmanager
    def launch(self) -> Iterator[None]:
        self._stream = self._streams[self._launches % len(self._streams)]
        self._launches += 1
        with torch.cuda.stream(self._stream):
            yield

    def record(self, mark: Mark) -> Event:
        """A CUDA event on the launch's stream; ``start`` and ``done`` with timing."""
        timing = mark != "copied"
        event = torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]  # as Stream
        event.record(self._stream)
        return event

    def elapsed_s(self, start: Event, done: Event) -> float:
        if not isinstance(start, torch.cuda.Event) or not isinstance(done, torch.cuda.Event):
            raise TypeError(f"CUDA timing needs torch.cuda.Event values: {start!r}, {done!r}")
        return float(start.elapsed_time(done)) / 1000.0

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Pinned host memory: the copy back from the device is asynchronous only into it."""
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def release_memory(self) -> None:
        torch.cuda.empty_cache()

    def set_yielding(self, yielding: bool) -> None:
        """Nothing to yield: the device schedules the kernels of every lane."""

    @staticmethod
    def register_host(tensor: torch.Tensor) -> None:
        """Page-lock existing host memory for asynchronous copies (``cudaHostRegister``;
        shared-memory staging slabs).

        Raises:
            RuntimeError: CUDA refused (the CUDA error code is in the message).
        """
        nbytes = tensor.numel() * tensor.element_size()
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # unannotated in torch
        code = cudart.cudaHostRegister(tensor.data_ptr(), nbytes, 0)
        if int(code) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {code}")

    @staticmethod
    def unregister_host(tensor: torch.Tensor) -> None:
        """Undo :meth:`register_host` (``cudaHostUnregister``) before the memory is freed."""
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # unannotated in torch
        cudart.cudaHostUnregister(tensor.data_ptr())


def backend_for(device: torch.device, streams: int) -> DeviceBackend:
    """The backend of ``device``: :class:`CudaBackend` with ``streams`` streams for a CUDA
    device, :class:`CpuBackend` for the CPU.

    Raises:
        ValueError: another device type (only ``cpu`` and ``cuda`` are supported).
    """
    if device.type == "cuda":
        return CudaBackend(device, streams)
    if device.type == "cpu":
        return CpuBackend(device)
    raise ValueError(f"device {device}: unsupported device type; supported: cpu, cuda")
