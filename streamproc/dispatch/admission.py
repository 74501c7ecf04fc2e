"""Device admission: lanes that share a device take it in priority order, not by thread
scheduling.

Every lane runs its own device thread per device (``device-<d>``), so two lanes on one device
call their models concurrently, and on a CPU every ``cpu:K`` shares the same cores. Left to the
OS scheduler, a low-priority backlog (video: EfficientNet on every core, one batch after the
other) takes the cores as often as a high-priority stream (trades: a small call per message),
and the high-priority rows wait for cores at every step of their way. :class:`DeviceAdmission`
orders the lanes per physical device (``cpu``: all logical CPU devices; ``cuda:N``: each GPU):

* a batch is *pending* on its device from :meth:`AdmissionGate.announce` (the dispatcher
  submits it to the device worker) until :meth:`AdmissionGate.finish` (its model call returned
  on the device thread);
* **defer**: before launching a batch, a device thread asks :meth:`AdmissionGate.admit`; while a
  batch of a more urgent class (:class:`~streamproc.records.Priority`) is pending on the same
  device, the launch waits, at most ``max_defer_s`` (a bound, so a continuous high-priority
  stream slows a low-priority lane down but never starves it);
* **yield**: a launch admitted while a more urgent class was pending on the device within the
  last ``active_s`` is told to yield: on a CPU the device thread runs that call with half its
  intra-op threads (:class:`~streamproc.device.intra_op.IntraOpThreads`; at least one), so the
  high-priority calls and threads that arrive during a long low-priority call find a core
  free. torch's ``set_num_threads`` is process-wide; the cap is the OpenMP thread count of the
  calling thread only.

A more urgent class is never made to wait for a less urgent one; lanes of the same class do not
wait for each other. :class:`AdmissionPolicy` is the pure rule (time passed in, no lock);
:class:`DeviceAdmission` owns the state of every device behind one condition (a leaf lock:
nothing else is taken while it is held) and hands each device worker its
:class:`AdmissionGate`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from streamproc.device.gate import Admitted
from streamproc.metrics import Metrics
from streamproc.records import Priority

MAX_DEFER_S = 0.25
"""Default bound of a launch's wait for more urgent batches (``worker.priority_max_defer_ms``)."""

ACTIVE_S = 1.0
"""A more urgent class pending on the device within this many seconds makes less urgent calls
yield intra-op threads."""


def device_key(device: torch.device) -> str:
    """The physical device a worker runs on: ``cpu`` for every CPU device (they share the
    cores), ``cuda:N`` for a GPU."""
    if device.type == "cuda":
        return f"cuda:{device.index or 0}"
    return device.type


class AdmissionPolicy:
    """The admission rule over devices named by key (see the module); pure: no lock, the
    time is passed in.

    Args:
        active_s: how long after its last pending batch a class still makes less urgent calls
            yield (>= 0).

    Raises:
        ValueError: a negative ``active_s``.
    """

    def __init__(self, active_s: float = ACTIVE_S) -> None:
        if active_s < 0:
            raise ValueError(f"active_s must be >= 0, got {active_s}")
        self.active_s = active_s
        self._pending: dict[str, list[int]] = {}  # per device: batches pending per class
        self._active_s: dict[str, list[float]] = {}  # per device: last time each class pended

    def _device(self, key: str) -> tuple[list[int], list[float]]:
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = [0] * len(Priority)
            self._active_s[key] = [-float("inf")] * len(Priority)
        return pending, self._active_s[key]

    def announce(self, key: str, priority: Priority, now_s: float) -> None:
        """A batch of class ``priority`` is waiting for device ``key``."""
        pending, active = self._device(key)
        pending[priority] += 1
        active[priority] = now_s

    def finish(self, key: str, priority: Priority, now_s: float) -> None:
        """A batch announced on ``key`` left the device (its model call returned).

        Raises:
            ValueError: no batch of that class is pending there.
        """
        pending, active = self._device(key)
        if pending[priority] <= 0:
            raise ValueError(f"finish without announce: {priority.label} on {key}")
        pending[priority] -= 1
        active[priority] = now_s

    def blocked(self, key: str, priority: Priority) -> bool:
        """A batch of a more urgent class than ``priority`` is pending on ``key``."""
        pending, _ = self._device(key)
        return any(pending[:priority])

    def yields(self, key: str, priority: Priority, now_s: float) -> bool:
        """A more urgent class than ``priority`` is pending on ``key``, or was within the last
        ``active_s`` seconds."""
        pending, active = self._device(key)
        return any(pending[:priority]) or any(
            now_s - seen_s <= self.active_s for seen_s in active[:priority]
        )

    def pending(self, key: str) -> dict[Priority, int]:
        """Batches pending on ``key`` per class (tests, logs)."""
        pending, _ = self._device(key)
        return {p: pending[p] for p in Priority if pending[p]}


class DeviceAdmission:
    """The admission state of every device of the process; one instance shared by every
    lane's device workers (each gets its :meth:`gate`).

    ==========================  =====================  ========================================
    method (on the gate)        called by              does
    ==========================  =====================  ========================================
    :meth:`AdmissionGate.announce`  dispatcher thread   a batch waits for the device (submit)
    :meth:`AdmissionGate.admit`     device thread*      wait out more urgent batches (bounded)
    :meth:`AdmissionGate.finish`    device thread*      the batch's model call returned
    ==========================  =====================  ========================================

    * or, on a fused lane (:mod:`streamproc.dispatch.fusion`), the lane's dispatcher thread,
      which launches there itself

    Args:
        max_defer_s: the longest a launch waits for more urgent batches (>= 0).
        active_s: see :class:`AdmissionPolicy`.
        clock: monotonic seconds (injected in tests).

    Raises:
        ValueError: a negative ``max_defer_s`` or ``active_s``.
    """

    @classmethod
    def if_needed(cls, on: bool, lanes: int, max_defer_s: float) -> DeviceAdmission | None:
        """The admission where lanes can compete for a device: ``on``
        (``worker.priority_admission``) and two lanes or more; else None (each lane's launches
        go as they come)."""
        return cls(max_defer_s) if on and lanes > 1 else None

    def __init__(
        self,
        max_defer_s: float = MAX_DEFER_S,
        active_s: float = ACTIVE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_defer_s < 0:
            raise ValueError(f"max_defer_s must be >= 0, got {max_defer_s}")
        self.max_defer_s = max_defer_s
        self._policy = AdmissionPolicy(active_s)
        self._clock = clock
        self._cond = threading.Condition()
        self._waiting: dict[str, int] = {}  # per device: launches waiting in admit() now

    def gate(
        self, device: torch.device, topic: str, label: str, metrics: Metrics | None = None
    ) -> AdmissionGate:
        """The gate of one device worker: lane ``topic`` on ``device`` (``label``: the
        worker's device label in metrics)."""
        return AdmissionGate(self, device_key(device), topic, label, metrics)

    def announce(self, key: str, priority: Priority) -> None:
        with self._cond:
            self._policy.announce(key, priority, self._clock())

    def admit(self, key: str, priority: Priority) -> Admitted:
        """Wait while a more urgent batch is pending on ``key``, at most ``max_defer_s``."""
        policy = self._policy
        with self._cond:
            if not policy.blocked(key, priority):
                return Admitted(0.0, policy.yields(key, priority, self._clock()))
            started_s = time.monotonic()
            self._waiting[key] = self._waiting.get(key, 0) + 1
            try:
                self._cond.wait_for(lambda: not policy.blocked(key, priority), self.max_defer_s)
            finally:
                self._waiting[key] -= 1
            deferred_s = time.monotonic() - started_s
            return Admitted(deferred_s, policy.yields(key, priority, self._clock()))

    def finish(self, key: str, priority: Priority) -> None:
        with self._cond:
            self._policy.finish(key, priority, self._clock())
            self._cond.notify_all()

    def pending(self, key: str) -> dict[Priority, int]:
        """Batches pending on device ``key`` per class now."""
        with self._cond:
            return self._policy.pending(key)

    def waiting(self, key: str) -> int:
        """Launches waiting in :meth:`admit` on device ``key`` now."""
        with self._cond:
            return self._waiting.get(key, 0)


class AdmissionGate:
    """One device worker's view of the :class:`DeviceAdmission` (its device key, its lane's
    metric series), a :class:`~streamproc.device.gate.LaunchGate`. Made by
    :meth:`DeviceAdmission.gate`."""

    def __init__(
        self,
        admission: DeviceAdmission,
        key: str,
        topic: str,
        label: str,
        metrics: Metrics | None,
    ) -> None:
        self.key = key
        self._admission = admission
        self._deferred = None if metrics is None else metrics.device_deferred.labels(topic, label)
        self._yielded = None if metrics is None else metrics.device_yielded.labels(topic, label)

    def announce(self, priority: Priority) -> None:
        """A batch whose most urgent record is of class ``priority`` was submitted."""
        self._admission.announce(self.key, priority)

    def admit(self, priority: Priority) -> Admitted:
        """Before a launch: wait (bounded) while more urgent batches are pending here."""
        admitted = self._admission.admit(self.key, priority)
        if admitted.deferred_s and self._deferred is not None:
            self._deferred.inc()
        if admitted.yield_threads and self._yielded is not None:
            self._yielded.inc()
        return admitted

    def finish(self, priority: Priority) -> None:
        """After the launch's model call returned (also when it raised)."""
        self._admission.finish(self.key, priority)
