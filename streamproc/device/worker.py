"""The device worker: launches a device's batches and completes them in submission order.

Threads: ``device-<label>`` takes the submitted jobs in order, waits for a free output buffer
set (:class:`~streamproc.device.outputs.OutputSets`, ``max_in_flight`` of them) and launches
each batch (:class:`~streamproc.device.launch.Launcher`: copy in, model, copy out, and the
backend's ``start``/``copied``/``done`` events). A batch's staging slab goes back to its pool
once ``copied`` fired; the batch completes once ``done`` fired: its host outputs go, in
submission order, to ``on_complete`` with a ``release`` that gives the output buffer set back.
Who waits for the events is the backend's one choice
(:attr:`~streamproc.device.backend.DeviceBackend.synchronous`):

* synchronous (CPU: a launch returns with its work done and its events fired): the device
  thread completes each batch itself, right after its launch; there is no other thread;
* asynchronous (CUDA): ``slabs-<label>`` and ``completion-<label>`` sleep on the ``copied`` and
  ``done`` events in launch order (:mod:`~streamproc.device.completion`); no thread synchronises
  a stream or polls, and neither waits on a slow encode or a full producer queue: only the
  output buffer sets wait for the result thread.

Start-up runs on the device thread too: :meth:`DeviceWorker.start` (warm-up) and
:meth:`DeviceWorker.time_batch` (calibration) queue their work ahead of any batch and wait.

A batch's device time (``DeviceResult.inference_s``) is its service time,
``done_i - max(start_i, done_{i-1})`` (:func:`~streamproc.device.backend.service_s`): what the
busy gauge, placement and the adaptive batcher learn from, never more than the wall time the
device worked.

A lane's :class:`~streamproc.output.resequencer.Resequencer` takes the results of every device of
the lane and calls the result handler in cut order on its own thread, then ``release``.

A fused lane (:mod:`streamproc.dispatch.fusion`; a synchronous backend) launches on its dispatcher
thread instead (:meth:`DeviceWorker.run_here`): admission, part runner, output set and the
previous ``done`` are then that thread's, handed over at a batch boundary with nothing in
flight; ``on_complete`` is not called.

A model call that raises is handled at launch, on the launching thread, by the worker's
:class:`~streamproc.device.recovery.PartRunner` (one code path on every backend): out-of-memory
errors re-run the batch in smaller parts and lower the worker's
:class:`~streamproc.device.recovery.BatchCap` (the lane cuts no larger batches until it rises
again); other errors are narrowed down to the rows that fail alone. A model judged broken under
``worker.on_model_failure: hold`` (the default) fails no row: the launching thread keeps the
batch and tries it again with backoff, rebound to the version serving now, until a try runs
(:mod:`streamproc.device.hold`); a close ends the wait at once (the batch abandoned,
uncommitted).

In-flight batches are bounded by the caller (the lane's
:class:`~streamproc.dispatch.placement.DeviceLoad` counts a batch from placement until
``release``), and by the ``max_in_flight`` output buffer sets; :meth:`DeviceWorker.output_leak`
names the batches still holding one (the leak check at close).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from streamproc.device import warmup
from streamproc.device.backend import DeviceBackend, Event, backend_for, service_s
from streamproc.device.completion import EventWaiters
from streamproc.device.gate import LaunchGate
from streamproc.device.hold import HoldAbandoned, ModelHold
from streamproc.device.jobs import DeviceJob, DeviceResult, Release
from streamproc.device.launch import Launched, Launcher
from streamproc.device.outputs import OutputSets
from streamproc.device.recovery import BatchCap, ModelHeld, OnModelFailure, PartRunner, RunOutcome
from streamproc.device.staging import PoolLeak, StagingPool
from streamproc.errors import FatalPipelineError
from streamproc.logs import get_logger
from streamproc.workloads.base import ModelFn

log = get_logger(__name__)
T = TypeVar("T")
Task = Callable[[], None]
"""Start-up work queued for the device thread (:meth:`DeviceWorker._on_device`)."""


class DeviceWorker:
    """Runs ``model`` over submitted jobs on ``device``.

    Args:
        model: batch function from the workload.
        device: torch device (cpu or cuda).
        pool: the staging pool the job slabs come from (may serve other workers too).
        max_in_flight: batches between submit and ``release`` (>= 1): output buffer sets,
            and the bound of the job queue.
        streams: CUDA streams to rotate over (ignored on CPU, and when ``backend`` is given).
        on_complete: called with each :class:`DeviceResult`, in submission order, and the
            ``release`` to call once its outputs are no longer read; on the device thread
            with a synchronous backend (CPU), on the completion thread otherwise (CUDA).
        on_fatal: called with an exception that stops the worker.
        backend: the device's backend (default: :func:`~streamproc.device.backend.backend_for`
            ``device`` and ``streams``); tests pass one whose events they control.
        label: the device's name in thread names, metrics and leak reports (``cpu:1``,
            ``cuda:0``); default ``str(device)``.
        gate: the lane's admission to a device shared with other lanes (None: launch at
            once): :meth:`submit` announces each batch, the device thread waits (bounded)
            while a more urgent lane's batch is pending and runs a call told to yield as the
            backend yields (a CPU: half its intra-op threads; see
            :mod:`streamproc.dispatch.admission`).
        on_model_failure: ``worker.on_model_failure`` (``hold``, ``dead_letter`` or ``stop``:
            what a model judged broken does; see :mod:`streamproc.device.recovery`).
        oom_recovery_s: quiet seconds after an out-of-memory error before the batch cap
            doubles again (``worker.oom_recovery_s``).
        on_cap: called with the worker's batch cap (rows) whenever it moves (warm-up, an
            out-of-memory error, recovery); the lane cuts no larger batches.
        on_outcome: called on the device thread with the :class:`RunOutcome` of each batch whose
            model call raised (metrics).
        hold: what a batch held under ``hold`` does (its hooks: metrics, rollback, rebind;
            default: a :class:`~streamproc.device.hold.ModelHold` without hooks).

    Raises:
        ValueError: ``backend`` runs on another device than ``device``.
    """

    def __init__(
        self,
        model: ModelFn,
        device: torch.device,
        pool: StagingPool,
        max_in_flight: int,
        streams: int,
        on_complete: Callable[[DeviceResult, Release], None],
        on_fatal: Callable[[BaseException], None],
        backend: DeviceBackend | None = None,
        label: str | None = None,
        gate: LaunchGate | None = None,
        on_model_failure: OnModelFailure = "hold",
        oom_recovery_s: float = 30.0,
        on_cap: Callable[[int], None] | None = None,
        on_outcome: Callable[[RunOutcome], None] | None = None,
        hold: ModelHold | None = None,
    ) -> None:
        self.backend = backend if backend is not None else backend_for(device, streams)
        if self.backend.device != device:
            raise ValueError(f"a backend of {self.backend.device} for a worker on {device}")
        self._gate = gate
        self.model = model
        self.device = device
        self.label = label or str(device)
        self.pool = pool
        self.max_in_flight = max_in_flight
        self.on_complete = on_complete
        self.on_fatal = on_fatal
        self._on_cap = on_cap or (lambda limit: None)
        self.cap = BatchCap(pool.rows, oom_recovery_s)
        self.runner = PartRunner(
            self.cap,
            pool.rows,
            on_model_failure,
            release_memory=self.backend.release_memory,
            on_cap=self._on_cap,
            label=self.label,
        )
        self.outputs = OutputSets(
            max_in_flight, pool.rows, self.backend.host_empty, f"output {self.label}"
        )
        self._launcher = Launcher(self.backend, self.outputs, self.runner, on_outcome)
        # Unbounded and C-level (no Python condition per put/get): the caller bounds what is
        # queued (DeviceLoad counts a batch from placement to release, <= max_in_flight).
        self._jobs: queue.SimpleQueue[DeviceJob | Task | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._unfinished = 0  # batches submitted and not yet released (under _cond)
        self._stopping = False
        self.hold = hold or ModelHold(self.label)
        self._halt = threading.Event()  # set by halt()/close(): a held batch stops waiting
        self._last_done: Event | None = None  # the thread completing batches owns it
        self._threads = [self._thread(self._launch_loop, "device")]
        self._waiters: EventWaiters | None = None
        if self.backend.synchronous:
            self._hand_over = self._complete_now
        else:
            self._waiters = EventWaiters(
                pool, self._complete, self.backend.bind_thread, self._thread
            )
            self._hand_over = self._waiters.hand_over
            self._threads.extend(self._waiters.threads)

    @property
    def thread_idents(self) -> tuple[int | None, ...]:
        """The worker's threads (``threading.get_ident`` values; None before :meth:`start`)."""
        return tuple(thread.ident for thread in self._threads)

    @property
    def output_allocations(self) -> int:
        """Output buffers allocated so far (flat after warm-up)."""
        return self.outputs.allocations

    def _thread(self, fn: Callable[[], None], role: str) -> threading.Thread:
        """A daemon thread ``<role>-<label>`` running ``fn``; what it raises goes to
        ``on_fatal``."""

        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                self.on_fatal(exc)

        return threading.Thread(target=run, name=f"{role}-{self.label}", daemon=True)

    def start(self, timeout_s: float | None = None) -> None:
        """Start the worker's threads and warm the model up on the device thread before any
        batch (:func:`streamproc.device.warmup.warm_up`: every batch size the adaptive batcher
        may try, on every stream, on zeros; the output buffer sets allocated). Where a size
        runs out of device memory, the batch cap is set to the largest batch that fits (its
        ceiling for the process's life) and ``on_cap`` tells the lane.

        Args:
            timeout_s: the most seconds to wait for the warm-up (None: no limit).

        Raises:
            DeviceOutOfMemoryError: not even one row fits on the device.
            TimeoutError: the warm-up took longer than ``timeout_s``.
            Exception: whatever the model raised on the largest size tried.
            (The worker is closed before any of these is raised.)
        """
        for thread in self._threads:
            thread.start()
        try:
            self._on_device(self._warm_up_here, timeout_s)
        except BaseException:
            self.close()
            raise

    def _warm_up_here(self) -> None:
        """The warm-up, on the device thread."""
        largest = warmup.warm_up(
            self.model, self.backend, self.pool, self.label, self.outputs.prepare
        )
        if largest is not None:
            self.cap.fit(largest)
            self._on_cap(largest)

    def _on_device(self, task: Callable[[], T], timeout_s: float | None = None) -> T:
        """Run ``task`` on the device thread, after what is queued before it, and return what
        it returned (or raise what it raised).

        Raises:
            RuntimeError: the worker is not started, is closed, or its device thread died
                (``on_fatal`` has its error) before answering.
            TimeoutError: no answer within ``timeout_s``.
        """
        device_thread = self._threads[0]
        if device_thread.ident is None or self._stopping:
            raise RuntimeError(f"device worker {self.label} is not running (start() it first)")
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(task())
            except BaseException as exc:  # raised in the waiting thread
                future.set_exception(exc)

        self._jobs.put(run)
        deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
        while True:  # a device thread that died (or a close) never answers: look every second
            left_s = 1.0 if deadline_s is None else min(1.0, deadline_s - time.monotonic())
            try:
                return future.result(max(0.0, left_s))
            except TimeoutError:
                if not device_thread.is_alive():
                    raise RuntimeError(
                        f"device worker {self.label}: the device thread ended before answering"
                    ) from None
                if deadline_s is not None and time.monotonic() >= deadline_s:
                    raise

    def time_batch(self, size: int, timeout_s: float | None = None) -> float:
        """Device seconds of the model on one batch of ``size`` zero rows, run on the device
        thread through the live launch (copy in, model, copy out; its ``start`` to ``done``
        events, the scale of live device times); call after :meth:`start` (which warms the
        model up) and before the first :meth:`submit`.

        The start-up calibration of the adaptive batch size is built on this: the lane asks
        for the sizes it needs measured, instead of exploring on live traffic (where messages
        queue behind the exploration). A batch that runs out of memory runs in parts (as a
        live batch would, lowering the cap); the time covers them all.

        Raises:
            ValueError: ``size`` is not within 1..the staging slab's rows.
            ModelError: the model raised on zeros.
            RuntimeError: the worker is not started.
            TimeoutError: no answer within ``timeout_s`` (None: no limit).
        """
        return self._on_device(
            lambda: warmup.time_batch(
                self.model, self.backend, self._launcher, self.pool, self.outputs, size
            ),
            timeout_s,
        )

    def submit(self, job: DeviceJob) -> None:
        """Queue a decoded batch for the device (never blocks: the caller keeps at most
        ``max_in_flight`` batches between submit and ``release``, as
        :class:`~streamproc.dispatch.placement.DeviceLoad` does; the device thread waits for a
        free output buffer set before it launches one)."""
        with self._cond:
            self._unfinished += 1
        if self._gate is not None:
            self._gate.announce(job.batch.priority)
        self._jobs.put(job)

    # -- device thread ---------------------------------------------------------------------
    def _launch_loop(self) -> None:
        self.backend.bind_thread()
        stopped = False
        while (job := self._jobs.get()) is not None:
            if not isinstance(job, DeviceJob):  # start-up work (_on_device)
                job()
                continue
            if stopped:  # after a fatal error: later batches are dropped, buffers given back
                self._drop(job)
                continue
            try:
                item = self._launch_one(job)
            except HoldAbandoned:
                stopped = True  # closing: what is queued behind it is dropped too
                continue
            except FatalPipelineError as exc:
                stopped = True
                self.on_fatal(exc)
                continue
            self._hand_over(item)

    def _launch_one(self, job: DeviceJob) -> Launched:
        """Take an output buffer set (waits for a free one) and launch ``job`` into it,
        through the admission where there is one.

        Raises:
            FatalPipelineError: the pipeline stops (a model judged broken under ``stop``, or
                not one row fits): the batch is neither produced nor dead-lettered (its offsets
                stay uncommitted) and its buffers are back, given once no copy of it can be in
                flight.
            HoldAbandoned: the batch was held and the worker closes (buffers back as above).
        """
        slot = self.outputs.take(job.batch.batch_id)
        try:
            return self._launch_until_it_runs(job, slot)
        except (FatalPipelineError, HoldAbandoned):
            with contextlib.suppress(Exception):  # a broken device: give them back anyway
                self.backend.synchronize()
            self.pool.release(job.slab)
            self._releaser(slot)()
            raise

    def _launch_until_it_runs(self, job: DeviceJob, slot: int) -> Launched:
        """Launch ``job`` into output set ``slot``; while the model is judged broken under
        ``hold`` (:class:`ModelHeld`), wait the hold's backoff, rebind and launch it again.

        Raises:
            FatalPipelineError: see :meth:`_launch_one`.
            HoldAbandoned: :meth:`halt` (or :meth:`close`) ended the wait.
        """
        launch = self._launch if self._gate is None else self._admitted_launch
        while True:
            try:
                item = launch(job, slot)
            except ModelHeld as exc:
                if self._halt.wait(self.hold.failed(job, exc.error)):
                    raise HoldAbandoned(f"device worker {self.label} closed") from None
                self.hold.retry(job)
                if self._gate is not None:  # each try is announced, admitted and finished
                    self._gate.announce(job.batch.priority)
                continue
            self.hold.ran(job)
            return item

    def halt(self) -> None:
        """A batch held now (or later) stops waiting for the model: it is abandoned,
        uncommitted (the pipeline drains; any thread, idempotent)."""
        self._halt.set()

    def _drop(self, job: DeviceJob) -> None:
        """A batch queued after a fatal error: never launched, its slab given back."""
        self.pool.release(job.slab)
        if self._gate is not None:  # announced at submit, never launched
            self._gate.finish(job.batch.priority)
        with self._cond:
            self._unfinished -= 1

    def _admitted_launch(self, job: DeviceJob, slot: int) -> Launched:
        """:meth:`_launch` once the admission lets this batch onto the shared device,
        yielding as it says (all intra-op threads, or half while a more urgent lane is active,
        on a CPU); the batch leaves the admission when its model call returned."""
        assert self._gate is not None
        priority = job.batch.priority
        admitted = self._gate.admit(priority)
        try:
            self.backend.set_yielding(admitted.yield_threads)
            return self._launch(job, slot)
        finally:
            self._gate.finish(priority)

    def _launch(self, job: DeviceJob, slot: int) -> Launched:
        return self._launcher.launch(self.model, job, slot)

    def run_here(self, job: DeviceJob) -> tuple[DeviceResult, Release]:
        """Run one decoded batch on the calling thread, for a fused lane (a synchronous
        backend: the CPU): launch it as the device thread would (admission, part runner,
        output buffer set), give its slab back and return its result with the ``release``
        that gives the output buffer set back; ``on_complete`` is not called. The caller
        keeps the batches in order: none of the lane's batches is queued on the device thread
        meanwhile.

        Raises:
            RuntimeError: the backend is not synchronous (CUDA keeps its device thread).
            FatalPipelineError: the pipeline must stop (see :class:`PartRunner`); the batch's
                slab and output buffer set are back.
            HoldAbandoned: the batch was held (a model judged broken under ``hold``) and
                :meth:`halt` ended the wait; its buffers are back.
        """
        if not self.backend.synchronous:
            raise RuntimeError(f"device worker {self.label}: run_here needs a synchronous backend")
        with self._cond:
            self._unfinished += 1
        if self._gate is not None:
            self._gate.announce(job.batch.priority)
        item = self._launch_one(job)  # a free output set: nothing else is in flight
        return self._finish_here(item), self._releaser(item.out_slot)

    def _complete_now(self, item: Launched) -> None:
        """A synchronous backend: the device thread completes each batch itself, right after
        its launch (:meth:`_finish_here`)."""
        self.on_complete(self._finish_here(item), self._releaser(item.out_slot))

    def _finish_here(self, item: Launched) -> DeviceResult:
        """A synchronous backend: the batch's events have fired when its launch returned (a
        test's backend may fire them later: wait for them here); the slab goes back and the
        batch's result is made on the calling thread."""
        item.copied.synchronize()
        self.pool.release(item.job.slab)
        item.slab_released = True
        item.done.synchronize()
        return self._result(item)

    def _complete(self, item: Launched) -> None:
        """Hand a finished batch (events fired, slab back) to ``on_complete``."""
        self.on_complete(self._result(item), self._releaser(item.out_slot))

    def _result(self, item: Launched) -> DeviceResult:
        """A finished batch's result: numpy views of its rows in its output buffer set (the
        batch's ``device`` stage ends here)."""
        clock = item.job.batch.clock
        if clock is not None:
            clock.lap("device")
        n = len(item.job.batch)
        versioned = _version_of(item)
        shadow = versioned.get("shadow")
        # a shadow candidate's call ran inside the launch: not the serving version's time
        shadow_s = 0.0 if shadow is None else shadow.shadow_s
        return DeviceResult(
            batch=item.job.batch,
            outputs=self.outputs.views(item.out_slot, n) if item.has_outputs else (),
            failed=item.failed,
            error=item.error,
            inference_s=max(0.0, self._service_s(item) - shadow_s),
            model_calls=item.model_calls,
            **versioned,
        )

    def _service_s(self, item: Launched) -> float:
        """The batch's device service time (:func:`service_s`; batches complete in launch
        order, so the previous ``done`` is the one completed before)."""
        busy_s = self.backend.elapsed_s(item.start, item.done)
        previous, self._last_done = self._last_done, item.done
        since = None if previous is None else self.backend.elapsed_s(previous, item.done)
        return service_s(busy_s, since)

    def _releaser(self, slot: int) -> Release:
        """The ``release`` of one completed batch: its output buffer set goes back (once)."""
        released = threading.Lock()

        def release() -> None:
            if not released.acquire(blocking=False):
                return  # called before
            self.outputs.give_back(slot)
            with self._cond:
                self._unfinished -= 1

        return release

    def idle(self) -> bool:
        """True when no batch is queued, in flight or awaiting its ``release``."""
        with self._cond:
            return self._unfinished == 0

    def output_leak(self) -> PoolLeak:
        """The output buffer sets not given back now, and the batches holding them; call it
        once the worker is closed and its results handled (at close), when ``missing`` must
        be 0."""
        return self.outputs.leak()

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish queued batches and hand over their results (``on_complete``), then stop the
        device and completion threads (idempotent). Outputs not yet released stay out: the
        caller (the resequencer) releases them."""
        if self._stopping:
            return
        deadline_s = time.monotonic() + timeout_s
        self.halt()
        self._jobs.put(None)
        if self._threads[0].ident is not None:
            self._threads[0].join(timeout_s)
        with self._cond:
            self._stopping = True
        if self._waiters is not None:
            self._waiters.stop()
        for thread in self._threads[1:]:
            if thread.ident is not None:
                thread.join(max(0.0, deadline_s - time.monotonic()))
        if any(thread.is_alive() for thread in self._threads):
            # a batch may still be in flight: its pinned buffers stay registered (freed with
            # the process), never unregistered under a copy
            return
        try:
            self.backend.close()
        except Exception as exc:  # a sticky device error: the rest of the close goes on
            log.warning("device backend close failed", device=self.label, error=repr(exc))


def _version_of(item: Launched) -> dict[str, Any]:
    """The version fields of a finished batch's :class:`DeviceResult` (none: the worker's own
    model made it)."""
    bound = item.bound
    if bound is None:
        return {}
    return {
        "version": bound.version,
        "bound_version": bound.bound_version,
        "raised": bound.raised,
        "shadow": bound.shadow_outcome(),
    }
