"""The device backend: what a device worker asks of the device's runtime, one class per kind.

A :class:`~streamproc.device.DeviceWorker` runs the same code on every device and never asks
which kind it is; streams, events, host buffer pinning and synchronisation are the backend's::

                      CpuBackend                          CudaBackend
    streams           1                                   ``streams`` (>= 1)
    launch()          nothing (the calling thread)        next of ``streams`` streams current
    record(mark)      an event fired at once (its time)   ``torch.cuda.Event`` on that stream
                                                          (blocking sync: a wait sleeps)
    synchronous       True: the device thread completes   False: a completion thread waits
                      each batch itself                   on the events (``synchronize()``)
    host_empty()      pageable memory                     page-locked in place, exact size
    synchronize()     nothing to wait for                 ``torch.cuda.synchronize(device)``
    release_memory()  nothing                             ``torch.cuda.empty_cache()``
    set_yielding()    half the intra-op threads           nothing (the GPU schedules kernels)
    close()           nothing                             synchronise, unregister host_empty's
    register_host()   (not needed)                        ``cudaHostRegister`` (portable)

Per batch the worker records three marks inside one :meth:`DeviceBackend.launch`::

    start --copy in (non_blocking)--> copied --model, copy out (non_blocking)--> done

``copied`` firing means the staging slab may be reused; ``done`` firing means the host output
buffers hold the batch's results. A batch's device (service) time is
``done_i - max(start_i, done_{i-1})`` (:func:`service_s`): with two streams, ``start -> done``
also covers time the batch shared the device with the other stream's batch.

Pinned memory is allocated pageable and page-locked in place at its exact size
(``cudaHostRegister``, portable to every device): ``pin_memory=True`` goes through the caching
host allocator, which rounds each block up to a power of two (a 9.6 MB slab pins 16 MB, and
pinned memory cannot be swapped).

The device specifics the rest of the package needs outside a worker are functions here too: a
version's memory check (:func:`free_memory_bytes`), its loading and warm-up off the serving
streams (:func:`side_stream`, :func:`on_stream`, :func:`settle`), and a shadowed call's timing
(:class:`Stopwatch`); outside this module only the precision's capability checks
(``models/precision.py``) and the device count (``dispatch/selection.py``) ask ``torch.cuda``.

Ownership: a backend belongs to one device worker. :meth:`~DeviceBackend.launch`,
:meth:`~DeviceBackend.record`, :meth:`~DeviceBackend.host_empty` and
:meth:`~DeviceBackend.set_yielding` run on its device thread (warm-up and calibration too);
events are queried and waited on by whichever thread completes the batch; :meth:`close` runs on
the closing thread once the device thread stopped (the list of pinned buffers: its lock).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import psutil  # type: ignore[import-untyped]  # no stubs in the lock
import torch

from streamproc.device.intra_op import IntraOpThreads

Mark = Literal["start", "copied", "done"]
"""Where in a batch's launch an event is recorded: ``start`` before the copy in, ``copied``
after it, ``done`` after the copy out."""

CUDA_HOST_REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable``: the page-locked memory counts as pinned for every CUDA device
(one staging pool serves all of a lane's devices)."""


class Event(Protocol):
    """A point on a device's work queue: ``query()`` is True once the work before it is done;
    ``synchronize()`` waits (sleeping, the GIL released) until then."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


def service_s(busy_s: float, since_previous_done_s: float | None) -> float:
    """A batch's device service time, ``done_i - max(start_i, done_{i-1})``, in seconds.

    Args:
        busy_s: ``done_i - start_i``, from the batch's own events.
        since_previous_done_s: ``done_i - done_{i-1}``, the previous batch of the same worker
            (None for the first; negative where batch ``i`` finished first, on another stream).

    Returns:
        The time the device spent on batch ``i`` alone: ``busy_s`` less the part it overlapped
        the previous batch; never negative.
    """
    if since_previous_done_s is None:
        return max(0.0, busy_s)
    return max(0.0, min(busy_s, since_previous_done_s))


def _cudart() -> Any:
    """The CUDA runtime bindings torch ships (``cudaHostRegister``, ``cudaHostUnregister``)."""
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]  # unannotated in torch


def register_host(tensor: torch.Tensor) -> None:
    """Page-lock ``tensor``'s memory in place, exactly its bytes, portable to every device
    (``cudaHostRegister``); a tensor of 0 bytes is left as it is.

    Raises:
        RuntimeError: CUDA refused (the CUDA error code is in the message).
    """
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return
    code = _cudart().cudaHostRegister(tensor.data_ptr(), nbytes, CUDA_HOST_REGISTER_PORTABLE)
    if int(code) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {code}")


def unregister_host(tensor: torch.Tensor) -> None:
    """Undo :func:`register_host` (``cudaHostUnregister``); only once no copy from or to the
    memory is in flight, and before the memory is freed."""
    if tensor.numel() * tensor.element_size() == 0:
        return
    _cudart().cudaHostUnregister(tensor.data_ptr())


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor page-locked at its exact size (:func:`register_host`);
    the caller unregisters it (:func:`unregister_host`) before it is freed.

    Raises:
        RuntimeError: CUDA refused to page-lock it.
    """
    tensor = torch.empty(shape, dtype=dtype)
    register_host(tensor)
    return tensor


class DeviceBackend(Protocol):
    """What a device worker needs of its device (see the module)."""

    @property
    def device(self) -> torch.device:
        """The torch device the worker's model runs on."""
        ...

    @property
    def streams(self) -> int:
        """Streams launches rotate over (1 on a CPU): warm-up runs every size on each."""
        ...

    @property
    def synchronous(self) -> bool:
        """True when a launch returns with its work done (every event it recorded has
        normally fired): the device thread completes each batch itself. False: the slab and
        completion threads wait on the events (``synchronize()``, sleeping)."""
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
        """Give cached, unused device memory back (before a re-run after an out-of-memory
        error). CUDA: ``torch.cuda.empty_cache()`` releases every GPU's and every stream's
        unused blocks (torch has no per-device release)."""

    def set_yielding(self, yielding: bool) -> None:
        """Run the calling thread's next model calls yielding compute to more urgent lanes
        (``True``) or not (see :mod:`streamproc.dispatch.admission`)."""

    def close(self) -> None:
        """Release what :meth:`host_empty` holds (CUDA: wait for the device, then unregister
        the pinned buffers); call once no launch can follow."""


@dataclass(frozen=True, slots=True)
class Fired:
    """An event that fired when it was recorded, at ``at_s`` (monotonic seconds)."""

    at_s: float

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Fired already: nothing to wait for."""


class CpuBackend:
    """The CPU: launches run on the calling thread and return when the work is done.

    Args:
        device: a CPU torch device.
    """

    synchronous = True
    streams = 1

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self._threads = threading.local()  # each launching thread's IntraOpThreads

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
        """Half the calling thread's intra-op threads (at least one) while ``yielding``, else
        all (the device thread's, or a fused lane's: each thread keeps its own count)."""
        intra_op = getattr(self._threads, "intra_op", None)
        if intra_op is None:
            intra_op = self._threads.intra_op = IntraOpThreads()
        intra_op.use(yielding)

    def close(self) -> None:
        """Nothing held: pageable buffers are freed with their tensors."""


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
        self._pinned: list[torch.Tensor] = []  # host_empty's buffers, unregistered at close
        self._pinned_lock = threading.Lock()

    @property
    def streams(self) -> int:
        return len(self._streams)

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
        """A CUDA event on the launch's stream; ``start`` and ``done`` with timing; blocking
        sync (a thread waiting on it sleeps instead of spinning)."""
        timing = mark != "copied"
        event = torch.cuda.Event(  # type: ignore[no-untyped-call]  # as Stream
            enable_timing=timing, blocking=True
        )
        event.record(self._stream)
        return event

    def elapsed_s(self, start: Event, done: Event) -> float:
        if not isinstance(start, torch.cuda.Event) or not isinstance(done, torch.cuda.Event):
            raise TypeError(f"CUDA timing needs torch.cuda.Event values: {start!r}, {done!r}")
        return float(start.elapsed_time(done)) / 1000.0

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Pinned host memory of the exact size (:func:`pinned_empty`): the copy back from
        the device is asynchronous only into it; unregistered at :meth:`close`."""
        tensor = pinned_empty(shape, dtype)
        with self._pinned_lock:
            self._pinned.append(tensor)
        return tensor

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def release_memory(self) -> None:
        torch.cuda.empty_cache()

    def set_yielding(self, yielding: bool) -> None:
        """Nothing to yield: the device schedules the kernels of every lane."""

    def close(self) -> None:
        """Wait until the device is idle (no copy into a pinned buffer still in flight), then
        unregister every buffer :meth:`host_empty` page-locked (idempotent)."""
        with self._pinned_lock:
            pinned, self._pinned = self._pinned, []
        if not pinned:
            return
        self.synchronize()
        for tensor in pinned:
            unregister_host(tensor)

    register_host = staticmethod(register_host)
    unregister_host = staticmethod(unregister_host)


def cuda_free_bytes(driver_free: int, reserved: int, allocated: int) -> int:
    """Bytes free for a new version on a GPU: what the driver reports free plus the blocks
    PyTorch's caching allocator reserved and holds no tensor in (it hands those out before
    asking the driver for more).

    Args:
        driver_free: ``torch.cuda.mem_get_info(device)[0]``, bytes.
        reserved: ``torch.cuda.memory_reserved(device)``, bytes held by the caching allocator.
        allocated: ``torch.cuda.memory_allocated(device)``, bytes of live tensors in them.
    """
    return driver_free + max(0, reserved - allocated)


def free_memory_bytes(device: torch.device) -> int:
    """Bytes free for a new version on ``device``: on CUDA the driver's free memory plus the
    caching allocator's cached-but-free blocks (:func:`cuda_free_bytes`; a predecessor let go
    leaves its blocks cached, and the driver counts them as used), else the host's available
    memory."""
    if device.type == "cuda":
        return cuda_free_bytes(
            int(torch.cuda.mem_get_info(device)[0]),
            int(torch.cuda.memory_reserved(device)),
            int(torch.cuda.memory_allocated(device)),
        )
    return int(psutil.virtual_memory().available)


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A new stream on a CUDA ``device`` (None elsewhere) that first waits for the work this
    thread queued on its current stream there (the version's weights copied and converted
    while it was loaded): PyTorch's streams do not wait for one another by themselves."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # unannotated in torch
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


def settle(device: torch.device) -> None:
    """Wait until the work this thread queued on a CUDA ``device``'s current stream is done
    (nothing elsewhere): a loaded version is handed to the device threads, which run it on
    their own streams, only once its weights are in place."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[Any]:
    """Work queued inside goes to ``stream`` (None: where it would go anyway)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class Stopwatch:
    """Elapsed seconds between marks: CUDA timing events on a CUDA device (read once the
    stream passed them), else the host clock (the CPU calls are synchronous).

    Args:
        device: where the timed calls run.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list[object] = []

    def mark(self) -> None:
        """A mark now (on the device's current stream for CUDA)."""
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def seconds(self, first: int, second: int) -> float:
        """Seconds from mark ``first`` to mark ``second`` (indexes in order of marking;
        waits for the second on CUDA)."""
        a, b = self._marks[first], self._marks[second]
        if self._cuda:
            assert isinstance(a, torch.cuda.Event) and isinstance(b, torch.cuda.Event)
            b.synchronize()
            return float(a.elapsed_time(b)) / 1000.0
        assert isinstance(a, float) and isinstance(b, float)
        return b - a


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
