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
* asynchronous (CUDA): ``completion-<label>`` polls the events (``query()``); no thread ever
  synchronises a stream, and event polling and slab release never wait on a slow encode or a
  full producer queue: only the output buffer sets wait for the result thread.

A lane's :class:`~streamproc.device.resequencer.Resequencer` takes the results of every device of
the lane and calls the result handler in cut order on its own thread, then ``release``.

A model call that raises is handled at launch, on the device thread, by the worker's
:class:`~streamproc.device.recovery.PartRunner` (one code path on every backend): out-of-memory
errors re-run the batch in smaller parts and lower the worker's
:class:`~streamproc.device.recovery.BatchCap` (the lane cuts no larger batches until it rises
again); other errors are narrowed down to the rows that fail alone.

In-flight batches are bounded by the caller (the lane's
:class:`~streamproc.device.placement.DeviceLoad` counts a batch from placement until
``release``), and by the ``max_in_flight`` output buffer sets; :meth:`DeviceWorker.output_leak`
names the batches still holding one (the leak check at close).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from streamproc.device import warmup
from streamproc.device.admission import AdmissionGate
from streamproc.device.backend import EVENT_POLL_S, DeviceBackend, backend_for, wait_for
from streamproc.device.jobs import DeviceJob, DeviceResult, Release
from streamproc.device.launch import Launched, Launcher
from streamproc.device.outputs import OutputSets
from streamproc.device.recovery import BatchCap, OnModelFailure, Outcome, PartRunner
from streamproc.device.staging import PoolLeak, StagingPool
from streamproc.errors import FatalPipelineError
from streamproc.workloads.base import ModelFn


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
            :mod:`streamproc.device.admission`).
        on_model_failure: ``worker.on_model_failure`` (``dead_letter`` or ``stop``: what a
            model judged broken does; see :mod:`streamproc.device.recovery`).
        oom_recovery_s: quiet seconds after an out-of-memory error before the batch cap
            doubles again (``worker.oom_recovery_s``).
        on_cap: called with the worker's batch cap (rows) whenever it moves (warm-up, an
            out-of-memory error, recovery); the lane cuts no larger batches.
        on_outcome: called on the device thread with the :class:`Outcome` of each batch whose
            model call raised (metrics).

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
        gate: AdmissionGate | None = None,
        on_model_failure: OnModelFailure = "dead_letter",
        oom_recovery_s: float = 30.0,
        on_cap: Callable[[int], None] | None = None,
        on_outcome: Callable[[Outcome], None] | None = None,
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
        self._jobs: queue.SimpleQueue[DeviceJob | None] = queue.SimpleQueue()
        self._inflight: deque[Launched] = deque()  # asynchronous backends (under _cond)
        self._cond = threading.Condition()
        self._unfinished = 0  # batches submitted and not yet released (under _cond)
        self._stopping = False
        self._threads = [self._thread(self._launch_loop, "device")]
        if self.backend.synchronous:
            self._hand_over = self._complete_now
        else:
            self._hand_over = self._inflight_append
            self._threads.append(self._thread(self._completion_loop, "completion"))

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

    def start(self) -> None:
        """Warm the model up (first-call allocations and kernel selection happen here, not on
        the first real batch), then start the device thread (and, on an asynchronous backend,
        the completion thread)."""
        self.warm_up()
        for thread in self._threads:
            thread.start()

    def warm_up(self) -> None:
        """Run the model on zeros once per batch size the adaptive batcher may try
        (:func:`streamproc.device.warmup.warm_up`). Where a size runs out of device memory,
        the worker's batch cap is set to the largest batch that fits (its ceiling for the
        process's life) and ``on_cap`` tells the lane.

        Raises:
            DeviceOutOfMemoryError: not even one row fits on the device.
            Exception: whatever the model raised on the largest size tried.
        """
        largest = warmup.warm_up(self.model, self.backend, self.pool, self.label)
        if largest is not None:
            self.cap.fit(largest)
            self._on_cap(largest)

    def time_batch(self, size: int) -> float:
        """Device seconds of the model on one batch of ``size`` zero rows (copy in, model,
        synchronised), run synchronously on the calling thread; call after :meth:`start`
        (which warms the model up) and before the first :meth:`submit`.

        The start-up calibration of the adaptive batch size is built on this: the lane asks
        for the sizes it needs measured, instead of exploring on live traffic (where messages
        queue behind the exploration). A batch that runs out of memory runs in parts (as a
        live batch would, lowering the cap); the time covers them all.

        Raises:
            ValueError: ``size`` is not within 1..the staging slab's rows.
            ModelError: the model raised on zeros.
        """
        return warmup.time_batch(self.model, self.backend, self.pool, self.runner, size)

    def submit(self, job: DeviceJob) -> None:
        """Queue a decoded batch for the device (never blocks: the caller keeps at most
        ``max_in_flight`` batches between submit and ``release``, as
        :class:`~streamproc.device.placement.DeviceLoad` does; the device thread waits for a
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
            if stopped:  # after a fatal error: later batches are dropped, buffers given back
                self._drop(job)
                continue
            slot = self.outputs.take(job.batch.batch_id)  # bounded: waits for a free set
            launch = self._launch if self._gate is None else self._admitted_launch
            try:
                item = launch(job, slot)
            except FatalPipelineError as exc:
                # the pipeline stops (a model judged broken under ``stop``, or not one row
                # fits): the batch is neither produced nor dead-lettered (its offsets stay
                # uncommitted) and its buffers go back
                self.pool.release(job.slab)
                self._releaser(slot)()
                stopped = True
                self.on_fatal(exc)
                continue
            self._hand_over(item)

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

    def _complete_now(self, item: Launched) -> None:
        """A synchronous backend: the batch's events have fired when its launch returned (a
        test's backend may fire them later: wait for them here), so the device thread gives
        the slab back and completes the batch itself."""
        wait_for(item.copied)
        self.pool.release(item.job.slab)
        item.slab_released = True
        wait_for(item.done)
        self._complete(item)

    def _inflight_append(self, item: Launched) -> None:
        """An asynchronous backend: the completion thread takes it from here."""
        with self._cond:
            self._inflight.append(item)
            self._cond.notify_all()

    # -- completion thread (asynchronous backends) -----------------------------------------
    def _completion_loop(self) -> None:
        self.backend.bind_thread()
        while True:
            with self._cond:
                while not self._inflight:
                    if self._stopping:
                        return
                    self._cond.wait(0.1)
                items = list(self._inflight)
            for item in items:
                if not item.slab_released and item.copied.query():
                    self.pool.release(item.job.slab)
                    item.slab_released = True
            head = items[0]
            if not head.slab_released or not head.done.query():
                time.sleep(EVENT_POLL_S)  # polling, never a stream synchronize
                continue
            with self._cond:
                self._inflight.popleft()
            self._complete(head)

    def _complete(self, item: Launched) -> None:
        """Hand a finished batch (events fired, slab back) to ``on_complete``: numpy views of
        its rows in its output buffer set."""
        n = len(item.job.batch)
        result = DeviceResult(
            batch=item.job.batch,
            outputs=self.outputs.views(item.out_slot, n) if item.has_outputs else (),
            failed=item.failed,
            error=item.error,
            inference_s=self.backend.elapsed_s(item.start, item.done),
            model_calls=item.model_calls,
        )
        self.on_complete(result, self._releaser(item.out_slot))

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
        self._jobs.put(None)
        if self._threads[0].ident is not None:
            self._threads[0].join(timeout_s)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads[1:]:
            if thread.ident is not None:
                thread.join(max(0.0, deadline_s - time.monotonic()))
