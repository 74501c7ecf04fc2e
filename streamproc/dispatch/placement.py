"""Placement: which of a lane's devices gets each cut batch.

Every lane runs one :class:`~streamproc.device.DeviceWorker` per device (the devices are chosen by
:mod:`streamproc.dispatch.selection`). Its dispatcher places
each cut batch on the device **expected to finish it first**, not round-robin::

    finish(d, n) = now + (what is left of d's running batch)
                       + sum of t_d(size) over d's other uncompleted batches
                       + t_d(n)

``t_d(size)`` is device ``d``'s measured device time (copy in, model, copy out) for a batch of
that size: an exponentially weighted mean per size, updated from every completed batch (and
one timing per device at start-up); a size not measured yet on ``d`` is scaled linearly from
``d``'s nearest measured size; a device with no measurement at all is assumed as fast as the
mean of those that have one (or 0 s: it is tried first, which measures it). Only devices below
their in-flight limit (``worker.max_in_flight_batches``, counted from placement until the
batch's results were produced) are candidates; ties go to the device with fewer batches in
flight, then to the lower index.

So a device twice as fast takes about two thirds of a saturated stream, a device that is busy
loses the next batch to an idle slower one when the slower one would still finish first, and a
device that stops completing keeps only the batches it already has (at most its in-flight
limit): after ``worker.device_stall_timeout_s`` without completing its oldest batch it is
reported stalled (an error log and ``streamproc_device_stalled{topic,device}``).

:class:`Placement` is the pure policy (time passed in, no lock, no threads);
:class:`DeviceLoad` owns one lane's placement state behind its lock and offers the verbs the
threads use. Result order across devices is restored by the lane's
:class:`~streamproc.device.Resequencer`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from streamproc.logs import get_logger
from streamproc.metrics import Metrics

log = get_logger(__name__)


@dataclass(slots=True)
class _Placed:
    batch_id: int
    size: int
    placed_s: float
    completed: bool = False


@dataclass(slots=True)
class _Device:
    outstanding: list[_Placed] = field(default_factory=list)  # placement order
    times_s: dict[int, float] = field(default_factory=dict)  # batch size -> smoothed seconds
    last_completed_s: float = -math.inf
    batches: int = 0


class Placement:
    """Pure placement policy over ``devices`` devices (indices ``0..devices-1``).

    Args:
        devices: number of devices (>= 1).
        max_in_flight: batches a device may hold between placement and release (>= 1).
        stall_timeout_s: a device whose oldest uncompleted batch has been running (since its
            placement or the device's previous completion, whichever is later) this long is
            stalled.
        smoothing: weight of a new measurement in the per-size mean (0 < smoothing <= 1).

    Raises:
        ValueError: a non-positive count, limit, timeout or smoothing.
    """

    def __init__(
        self,
        devices: int,
        max_in_flight: int,
        stall_timeout_s: float,
        smoothing: float = 0.2,
    ) -> None:
        if devices < 1 or max_in_flight < 1 or stall_timeout_s <= 0 or not 0 < smoothing <= 1:
            raise ValueError(
                f"Placement({devices}, {max_in_flight}, {stall_timeout_s}, {smoothing}): "
                "devices and max_in_flight must be >= 1, stall_timeout_s > 0, "
                "0 < smoothing <= 1"
            )
        self.max_in_flight = max_in_flight
        self.stall_timeout_s = stall_timeout_s
        self._smoothing = smoothing
        self._devices = [_Device() for _ in range(devices)]
        self._where: dict[int, int] = {}  # batch id -> device index

    @property
    def devices(self) -> int:
        return len(self._devices)

    def in_flight(self, device: int) -> int:
        """Batches placed on ``device`` and not yet released."""
        return len(self._devices[device].outstanding)

    def batches(self, device: int) -> int:
        """Batches ever placed on ``device``."""
        return self._devices[device].batches

    def has_capacity(self) -> bool:
        """Some device is below its in-flight limit."""
        return any(len(d.outstanding) < self.max_in_flight for d in self._devices)

    def estimate_s(self, device: int, size: int) -> float:
        """Expected device seconds of a ``size``-row batch on ``device`` (see the module)."""
        own = self._own_estimate_s(device, size)
        if own is not None:
            return own
        others = [
            e
            for e in (self._own_estimate_s(i, size) for i in range(len(self._devices)))
            if e is not None
        ]
        return sum(others) / len(others) if others else 0.0

    def _own_estimate_s(self, device: int, size: int) -> float | None:
        times = self._devices[device].times_s
        exact = times.get(size)
        if exact is not None:
            return exact
        if not times:
            return None
        nearest = min(times, key=lambda measured: abs(math.log(measured / size)))
        return times[nearest] * size / nearest

    def expected_finish_s(self, device: int, size: int, now_s: float) -> float:
        """When a ``size``-row batch placed on ``device`` now is expected to be done."""
        dev = self._devices[device]
        pending = [p for p in dev.outstanding if not p.completed]
        finish_s = now_s + self.estimate_s(device, size)
        if not pending:
            return finish_s
        head = pending[0]
        running_s = now_s - max(head.placed_s, dev.last_completed_s)
        finish_s += max(0.0, self.estimate_s(device, head.size) - running_s)
        return finish_s + sum(self.estimate_s(device, p.size) for p in pending[1:])

    def choose(self, size: int, now_s: float) -> int | None:
        """The device below its in-flight limit expected to finish a ``size``-row batch
        first (ties: fewer in flight, then lower index); None when every device is full."""
        candidates = [
            i for i, d in enumerate(self._devices) if len(d.outstanding) < self.max_in_flight
        ]
        if not candidates:
            return None
        return min(
            candidates,
            key=lambda i: (
                self.expected_finish_s(i, size, now_s),
                len(self._devices[i].outstanding),
                i,
            ),
        )

    def placed(self, device: int, batch_id: int, size: int, now_s: float) -> None:
        """Record that ``batch_id`` (``size`` rows) went to ``device`` at ``now_s``.

        Raises:
            ValueError: the batch is already placed, or the device is at its limit.
        """
        dev = self._devices[device]
        if batch_id in self._where:
            raise ValueError(f"batch {batch_id} placed twice")
        if len(dev.outstanding) >= self.max_in_flight:
            raise ValueError(f"device {device} already holds {self.max_in_flight} batches")
        dev.outstanding.append(_Placed(batch_id, size, now_s))
        dev.batches += 1
        self._where[batch_id] = device

    def observe(self, device: int, size: int, service_s: float) -> None:
        """One ``size``-row batch took ``service_s`` device seconds on ``device``."""
        times = self._devices[device].times_s
        old = times.get(size)
        times[size] = service_s if old is None else old + self._smoothing * (service_s - old)

    def completed(self, batch_id: int, service_s: float, now_s: float) -> int:
        """The device finished ``batch_id`` in ``service_s`` device seconds; returns the
        device index.

        Raises:
            KeyError: the batch was never placed (or already released).
        """
        device = self._where[batch_id]
        dev = self._devices[device]
        for placed in dev.outstanding:
            if placed.batch_id == batch_id:
                placed.completed = True
                self.observe(device, placed.size, service_s)
                break
        dev.last_completed_s = max(dev.last_completed_s, now_s)
        return device

    def released(self, batch_id: int) -> int:
        """The batch's results were handled: the device's in-flight slot is free again;
        returns the device index.

        Raises:
            KeyError: the batch was never placed (or already released).
        """
        device = self._where.pop(batch_id)
        dev = self._devices[device]
        dev.outstanding = [p for p in dev.outstanding if p.batch_id != batch_id]
        return device

    def waiting(self, device: int) -> tuple[int, ...]:
        """Ids of the batches placed on ``device`` that it has not completed yet."""
        return tuple(p.batch_id for p in self._devices[device].outstanding if not p.completed)

    def running_s(self, device: int, now_s: float) -> float:
        """How long the device has been on its oldest uncompleted batch (0 if none)."""
        dev = self._devices[device]
        pending = [p for p in dev.outstanding if not p.completed]
        if not pending:
            return 0.0
        return now_s - max(pending[0].placed_s, dev.last_completed_s)

    def stalled(self, now_s: float) -> tuple[int, ...]:
        """Devices on their oldest uncompleted batch for longer than ``stall_timeout_s``."""
        return tuple(
            i for i in range(len(self._devices)) if self.running_s(i, now_s) > self.stall_timeout_s
        )


class DeviceLoad:
    """One lane's placement state, its lock, and its per-device metrics and stall reports.

    ==========================  =====================  ========================================
    method                      called by              does
    ==========================  =====================  ========================================
    :meth:`wait_capacity`       dispatcher thread      wait until a device is below its limit
    :meth:`place`               dispatcher thread      choose the device for a batch, count it
    :meth:`completed`           completion threads     a device finished a batch (its time)
    :meth:`released`            results thread         the batch's results were produced
    :meth:`observe`             start-up (main)        a timing of each device before traffic
    :meth:`check_stalls`        lag thread, dispatcher report devices that stopped completing
    :meth:`wake`                main (close)           wake a dispatcher waiting for capacity
    ==========================  =====================  ========================================

    Its lock is a leaf: metrics and logs are touched after it is released.

    Args:
        topic: the lane's input topic (metric label, logs).
        labels: the devices' labels, in worker order.
        max_in_flight: batches per device between placement and release.
        stall_timeout_s: see :class:`Placement`.
        metrics: process metrics (per-device series labelled ``topic``, ``device``).
        clock: monotonic seconds (injected in tests).
    """

    def __init__(
        self,
        topic: str,
        labels: Sequence[str],
        max_in_flight: int,
        stall_timeout_s: float,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.topic = topic
        self.labels = tuple(labels)
        self._placement = Placement(len(self.labels), max_in_flight, stall_timeout_s)
        self._clock = clock
        self._cond = threading.Condition()
        self._stalled: set[int] = set()
        self._batches = [metrics.device_batches.labels(topic, label) for label in self.labels]
        self._in_flight = [metrics.device_in_flight.labels(topic, label) for label in self.labels]
        self._busy = [metrics.device_busy.labels(topic, label) for label in self.labels]
        self._stall_gauge = [metrics.device_stalled.labels(topic, label) for label in self.labels]
        for gauge in self._stall_gauge:
            gauge.set(0)

    def wait_capacity(self, stop: threading.Event) -> bool:
        """Block until some device is below its in-flight limit (True) or ``stop`` is set and
        :meth:`wake` was called (False)."""
        with self._cond:
            self._cond.wait_for(lambda: stop.is_set() or self._placement.has_capacity())
            return not stop.is_set()

    def wake(self) -> None:
        """Wake a dispatcher in :meth:`wait_capacity` (after its ``stop`` was set)."""
        with self._cond:
            self._cond.notify_all()

    def place(self, batch_id: int, size: int) -> int:
        """Choose the device for ``batch_id`` (``size`` rows) and count it there; returns the
        device index. Only the dispatcher places, so capacity seen by :meth:`wait_capacity`
        is still there.

        Raises:
            RuntimeError: every device is at its in-flight limit (call :meth:`wait_capacity`).
        """
        with self._cond:
            now_s = self._clock()
            device = self._placement.choose(size, now_s)
            if device is None:
                raise RuntimeError("place() with every device at its in-flight limit")
            self._placement.placed(device, batch_id, size, now_s)
            in_flight = self._placement.in_flight(device)
        self._batches[device].inc()
        self._in_flight[device].set(in_flight)
        return device

    def completed(self, batch_id: int, service_s: float) -> None:
        """A device finished ``batch_id`` after ``service_s`` device seconds."""
        with self._cond:
            device = self._placement.completed(batch_id, service_s, self._clock())
        self._busy[device].inc(service_s)

    def released(self, batch_id: int) -> None:
        """The batch's results were handed to the sink: its device may take another batch."""
        with self._cond:
            device = self._placement.released(batch_id)
            in_flight = self._placement.in_flight(device)
            self._cond.notify_all()
        self._in_flight[device].set(in_flight)

    def observe(self, device: int, size: int, service_s: float) -> None:
        """A timing of ``device`` outside traffic (start-up), to place the first batches."""
        with self._cond:
            self._placement.observe(device, size, service_s)

    def check_stalls(self) -> tuple[str, ...]:
        """Report devices that stopped completing (error log and gauge 1 once per stall;
        gauge 0 and a warning when they complete again); returns the stalled labels."""
        with self._cond:
            now_s = self._clock()
            stalled = set(self._placement.stalled(now_s))
            started = stalled - self._stalled
            ended = self._stalled - stalled
            self._stalled = stalled
            details = {
                i: (self._placement.waiting(i), self._placement.running_s(i, now_s))
                for i in started
            }
        for i in sorted(started):
            waiting, running_s = details[i]
            self._stall_gauge[i].set(1)
            log.error(
                "device stalled: no batch completed within worker.device_stall_timeout_s; "
                "it gets no new batch until it completes one",
                topic=self.topic,
                device=self.labels[i],
                running_s=round(running_s, 3),
                waiting_batches=list(waiting),
            )
        for i in sorted(ended):
            self._stall_gauge[i].set(0)
            log.warning("device completes batches again", topic=self.topic, device=self.labels[i])
        return tuple(self.labels[i] for i in sorted(stalled))

    def batches(self) -> dict[str, int]:
        """Batches placed per device label so far."""
        with self._cond:
            return {label: self._placement.batches(i) for i, label in enumerate(self.labels)}

    def in_flight(self) -> dict[str, int]:
        """Batches per device label between placement and release now."""
        with self._cond:
            return {label: self._placement.in_flight(i) for i, label in enumerate(self.labels)}
