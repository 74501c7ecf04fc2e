"""The device worker: copy, compute and copy back, with a completion thread polling events.

Per batch, on CUDA (stream ``k mod N``, N >= 2 so copy and compute of consecutive batches
overlap)::

    slab (pinned, uint8) --H2D non_blocking--> x --model--> outputs --D2H non_blocking--> pinned
                     copy_event.record()                               done_event.record()

The completion thread polls ``copy_event.query()`` to return the slab to the pool, and
``done_event.query()`` to hand the host outputs, in submission order, to ``on_complete`` with a
``release`` callable that gives the pinned output buffer set back. A lane's
:class:`~streamproc.device.resequencer.Resequencer` takes them from every device of the lane and
calls the result handler in cut order on its own thread, then ``release``. No thread ever
synchronises a stream, and event polling and slab release never wait on a slow encode or a
full producer queue: only the output buffers (``max_in_flight`` sets) wait for the result
thread. On CPU the same code runs with ``device="cpu"``: the "copy" is a view,
the model runs synchronously on the device thread and the events are already complete, so the
device thread completes each batch itself (slab back, ``on_complete``) and no completion thread
is started: handing a finished batch to a second thread only cost a notify, a wake-up and a
thread switch per batch (issue 15). Tests that pass controllable copy events keep the
completion thread.

A model call that raises is handled at launch, on the device thread, by the worker's
:class:`~streamproc.device.recovery.PartRunner` (one code path on CPU and CUDA: on CUDA the
re-runs are queued on the batch's stream, in place of the one call, before its done event):
out-of-memory errors re-run the batch in smaller parts and lower the worker's
:class:`~streamproc.device.recovery.BatchCap` (the lane cuts no larger batches until it rises
again); other errors are narrowed down to the rows that fail alone. Each part writes its outputs
into its own rows of the host output buffers, so the batch's results keep their rows.

In-flight batches are bounded by the caller (the lane's
:class:`~device.devices.DeviceLoad` counts a batch from placement until ``release``), and by
:attr:`DeviceWorker.max_in_flight` output buffer sets; :meth:`DeviceWorker.output_leak` names
the batches still holding one (the leak check at close).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from streamproc.device.admission import AdmissionGate
from streamproc.device.intra_op import IntraOpThreads
from streamproc.device.recovery import (
    BatchCap,
    DeviceOutOfMemoryError,
    OnModelFailure,
    Outcome,
    PartRunner,
    is_out_of_memory,
)
from streamproc.device.staging import PoolLeak, Slab, StagingPool
from streamproc.errors import FatalPipelineError, ModelError, RecordError
from streamproc.logs import get_logger
from streamproc.records import Batch
from streamproc.workloads.base import ModelFn

log = get_logger(__name__)


@dataclass
class DeviceJob:
    """A decoded batch: rows ``0..len(batch)-1`` of ``slab`` hold the inputs.

    ``failed`` maps row index -> error for rows whose decode failed (their slab row holds
    whatever the slab held before; the model runs over it and those outputs are never encoded).
    """

    batch: Batch
    slab: Slab
    failed: dict[int, RecordError] = field(default_factory=dict)


@dataclass
class DeviceResult:
    """Host outputs of one batch, handed to ``on_complete`` in submission order.

    ``outputs`` are numpy views (n, ...) of the worker's output buffer set, valid until the
    ``release`` handed over with them is called; ``failed`` maps row -> error for rows whose
    decode failed or that the model failed on alone (a :class:`ModelError`, stage ``model``);
    ``error`` is set when no row of the batch ran (then ``outputs`` is empty). ``model_calls``
    is the model calls the batch took (1 unless a call raised and it was re-run in parts; its
    ``inference_s`` then covers them all). ``inference_s`` is the batch's device time:
    copy in, model, copy out (CUDA: between timing events on its stream; CPU: the synchronous
    call), not the time it then waited for the completion thread (that would bias the adaptive
    batch size towards large batches).
    """

    batch: Batch
    outputs: tuple[np.ndarray, ...]
    failed: dict[int, RecordError]
    error: ModelError | None
    inference_s: float
    model_calls: int = 1


class Event(Protocol):
    """What the completion thread needs of an event: ``query()`` is True once it fired."""

    def query(self) -> bool: ...


class _Done:
    """An event that has already completed (CPU)."""

    @staticmethod
    def query() -> bool:
        return True


@dataclass
class _InFlight:
    job: DeviceJob
    copy_event: Event
    done_event: Event
    outputs: tuple[torch.Tensor, ...]
    out_slot: int
    started_s: float
    error: ModelError | None = None
    slab_released: bool = False
    model_calls: int = 1
    failed: dict[int, RecordError] = field(default_factory=dict)
    service_s: float | None = None  # CPU: known when the launch returns
    start_event: torch.cuda.Event | None = None  # CUDA: timing event recorded before the copy in


Release = Callable[[], None]
"""Gives a completed batch's output buffer set back to its worker (call once)."""


class DeviceWorker:
    """Runs ``model`` over submitted jobs on ``device``.

    Args:
        model: batch function from the workload.
        device: torch device (cpu or cuda).
        pool: the staging pool the job slabs come from (may serve other workers too).
        max_in_flight: batches between submit and ``release`` (>= 1): output buffer sets,
            and the bound of the job queue.
        streams: CUDA streams to rotate over (ignored on CPU).
        on_complete: called on the completion thread with each :class:`DeviceResult`, in
            submission order, and the ``release`` to call once its outputs are no longer read.
        on_fatal: called with an exception that stops the worker.
        event_factory: on CPU, where copies are synchronous, tests pass a factory of
            controllable copy events to prove a slab is only reused after its event fired.
        label: the device's name in thread names, metrics and leak reports (``cpu:1``,
            ``cuda:0``); default ``str(device)``.
        gate: the lane's admission to a device shared with other lanes (None: launch at
            once): :meth:`submit` announces each batch, the device thread waits (bounded)
            while a more urgent lane's batch is pending and, on a CPU, runs a call told to
            yield with half its intra-op threads (see :mod:`streamproc.device.admission`).
        on_model_failure: ``worker.on_model_failure`` (``dead_letter`` or ``stop``: what a
            model judged broken does; see :mod:`streamproc.device.recovery`).
        oom_recovery_s: quiet seconds after an out-of-memory error before the batch cap
            doubles again (``worker.oom_recovery_s``).
        on_cap: called with the worker's batch cap (rows) whenever it moves (warm-up, an
            out-of-memory error, recovery); the lane cuts no larger batches.
        on_outcome: called on the device thread with the :class:`Outcome` of each batch whose
            model call raised (metrics).
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
        event_factory: Callable[[], Event] | None = None,
        label: str | None = None,
        gate: AdmissionGate | None = None,
        on_model_failure: OnModelFailure = "dead_letter",
        oom_recovery_s: float = 30.0,
        on_cap: Callable[[int], None] | None = None,
        on_outcome: Callable[[Outcome], None] | None = None,
    ) -> None:
        self._event_factory = event_factory
        self._gate = gate
        self._intra_op = IntraOpThreads() if device.type == "cpu" else None
        self.model = model
        self.device = device
        self.label = label or str(device)
        self.pool = pool
        self.max_in_flight = max_in_flight
        self.on_complete = on_complete
        self.on_fatal = on_fatal
        self.cuda = device.type == "cuda"
        self._on_cap = on_cap or (lambda limit: None)
        self._on_outcome = on_outcome
        self.cap = BatchCap(pool.rows, oom_recovery_s)
        self.runner = PartRunner(
            self.cap,
            pool.rows,
            on_model_failure,
            release_memory=self._release_memory,
            on_cap=self._on_cap,
            label=self.label,
        )
        self._streams = [_cuda_stream(device) for _ in range(streams)] if self.cuda else []
        # Unbounded and C-level (no Python condition per put/get): the caller bounds what is
        # queued (DeviceLoad counts a batch from placement to release, <= max_in_flight).
        self._jobs: queue.SimpleQueue[DeviceJob | None] = queue.SimpleQueue()
        self._inflight: deque[_InFlight] = deque()
        self._cond = threading.Condition()
        self._out_bufs: list[tuple[torch.Tensor, ...] | None] = [None] * max_in_flight
        self._out_arrays: list[tuple[np.ndarray, ...]] = [()] * max_in_flight  # numpy views
        self._out_free = list(range(max_in_flight))
        self._out_held: dict[int, int] = {}  # output slot -> batch id holding it (under _cond)
        self._unfinished = 0  # batches submitted and not yet released (under _cond)
        self.output_allocations = 0
        self.batches = 0
        self._stopping = False
        # CPU without test events: every event has fired when the launch returns
        self._completes_inline = not self.cuda and event_factory is None
        self._threads = [
            threading.Thread(
                target=self._guard(self._launch_loop), name=f"device-{self.label}", daemon=True
            )
        ]
        if not self._completes_inline:
            self._threads.append(
                threading.Thread(
                    target=self._guard(self._completion_loop),
                    name=f"completion-{self.label}",
                    daemon=True,
                )
            )

    def _guard(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                self.on_fatal(exc)

        return run

    def start(self) -> None:
        """Warm the model up (first-call allocations and kernel selection happen here, not on
        the first real batch), then start the device and completion threads."""
        self.warm_up()
        for thread in self._threads:
            thread.start()

    def warm_up(self) -> None:
        """Run the model once per batch size the adaptive batcher may try (powers of two up
        to the slab's rows, and the rows), on zeros, synchronously: the first call of a new
        shape pays one-off costs (oneDNN primitives, cuDNN autotuning) that would otherwise
        skew the batcher's first measurements and the first batches' latency.

        A size that runs out of device memory ends the warm-up there: the largest batch that
        fits is found by bisection between the last size that ran and that one, the worker's
        batch cap is set to it (its ceiling for the process's life; ``on_cap`` tells the
        lane) and one warning says so.

        Raises:
            DeviceOutOfMemoryError: not even one row fits on the device.
            Exception: whatever the model raised on the largest size tried (on zeros: the
                model is unusable).
        """
        slab = self.pool.lease()
        assert slab is not None
        rows = self.pool.rows
        sizes = sorted({*(2**i for i in range(rows.bit_length()) if 2**i <= rows), rows})
        try:
            slab.array[...] = 0
            with torch.inference_mode():
                fits = 0
                for size in sizes:
                    try:
                        self.model(slab.tensor[:size].to(self.device))
                    except Exception as exc:
                        if is_out_of_memory(exc):
                            break
                        if size == rows:
                            raise  # the full batch fails on zeros: the model is unusable
                        log.warning("model warm-up failed", batch_size=size, error=repr(exc))
                    fits = size
                else:
                    return
                self._release_memory()
                largest = self._largest_fit(slab, fits, size)
            self.cap.fit(largest)
            log.warning(
                "batch size capped: the device ran out of memory at warm-up",
                device=self.label,
                out_of_memory_at=size,
                batch_size_cap=largest,
            )
            self._on_cap(largest)
        finally:
            if self.cuda:
                torch.cuda.synchronize(self.device)
            self.pool.release(slab)

    def _largest_fit(self, slab: Slab, fits: int, fails: int) -> int:
        """The largest batch in ``fits..fails-1`` that runs without running out of memory
        (``fits`` rows ran, ``fails`` rows did not), by bisection on zeros."""
        while fails - fits > 1:
            size = (fits + fails) // 2
            try:
                self.model(slab.tensor[:size].to(self.device))
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                fails = size
                out_of_memory = True
            else:
                fits = size
                out_of_memory = False
            if out_of_memory:
                self._release_memory()
        if fits == 0:
            raise DeviceOutOfMemoryError(
                f"device {self.label} is out of memory at warm-up for a batch of one row: "
                "the model does not fit"
            )
        return fits

    def _release_memory(self) -> None:
        """Hand the device's cached, unused memory back (CUDA) before a re-run."""
        if self.cuda:
            torch.cuda.empty_cache()

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
        if not 1 <= size <= self.pool.rows:
            raise ValueError(f"batch size {size} outside 1..{self.pool.rows}")
        slab = self.pool.lease()
        assert slab is not None
        try:
            slab.array[:size] = 0
            with torch.inference_mode():
                started_s = time.perf_counter()
                x = slab.tensor[:size].to(self.device)
                outcome = self.runner.run(size, lambda lo, hi: _discard(self.model(x[lo:hi])))
                if self.cuda:
                    torch.cuda.synchronize(self.device)
                seconds = time.perf_counter() - started_s
            if outcome.failed:
                raise ModelError(f"model failed on zeros: {next(iter(outcome.failed.values()))}")
            return seconds
        finally:
            self.pool.release(slab)

    def submit(self, job: DeviceJob) -> None:
        """Queue a decoded batch for the device (never blocks: the caller keeps at most
        ``max_in_flight`` batches between submit and ``release``, as
        :class:`~streamproc.device.devices.DeviceLoad` does; the device thread waits for a free
        output buffer set before it launches one)."""
        with self._cond:
            self._unfinished += 1
        if self._gate is not None:
            self._gate.announce(job.batch.priority)
        self._jobs.put(job)

    # -- device thread ---------------------------------------------------------------------
    def _launch_loop(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)
        stopped = False
        while (job := self._jobs.get()) is not None:
            if stopped:  # after a fatal error: later batches are dropped, buffers given back
                self.pool.release(job.slab)
                if self._gate is not None:  # announced at submit, never launched
                    self._gate.finish(job.batch.priority)
                with self._cond:
                    self._unfinished -= 1
                continue
            with self._cond:  # bounded in-flight batches: wait for an output slot
                self._cond.wait_for(lambda: bool(self._out_free))
                slot = self._out_free.pop()
                self._out_held[slot] = job.batch.batch_id
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
            if self._completes_inline:
                self.pool.release(job.slab)
                item.slab_released = True
                self._complete(item)
            else:
                self._inflight_append(item)

    def _admitted_launch(self, job: DeviceJob, slot: int) -> _InFlight:
        """:meth:`_launch` once the admission lets this batch onto the shared device; on a
        CPU with the intra-op threads it says (all, or half while a more urgent lane is
        active); the batch leaves the admission when its model call returned."""
        assert self._gate is not None
        priority = job.batch.priority
        admitted = self._gate.admit(priority)
        try:
            if self._intra_op is not None:
                self._intra_op.use(admitted.yield_threads)
            return self._launch(job, slot)
        finally:
            self._gate.finish(priority)

    def _launch(self, job: DeviceJob, slot: int) -> _InFlight:
        item = self._launch_on_device(job, slot)
        if item.start_event is None:  # CPU: the work is done already
            item.service_s = time.monotonic() - item.started_s
        return item

    def _launch_on_device(self, job: DeviceJob, slot: int) -> _InFlight:
        n = len(job.batch)
        started_s = time.monotonic()
        stream = self._streams[self.batches % len(self._streams)] if self.cuda else None
        self.batches += 1
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        copy_event: Event = _Done()
        done_event: Event = _Done()
        start_event: torch.cuda.Event | None = None
        with ctx:
            if stream is not None:
                start_event = _cuda_event(stream, timing=True)
            x = job.slab.tensor[:n].to(self.device, non_blocking=True)
            if stream is not None:
                copy_event = _cuda_event(stream)
            elif self._event_factory is not None:  # tests: a controllable "copy finished"
                copy_event = self._event_factory()
            host: tuple[torch.Tensor, ...] = ()

            def call(lo: int, hi: int) -> None:
                nonlocal host
                outputs = self.model(x[lo:hi] if hi - lo < n else x)
                if any(out.shape[0] != hi - lo for out in outputs):
                    raise ModelError(
                        f"model returned {[tuple(o.shape) for o in outputs]} for {hi - lo} rows"
                    )
                host = self._output_buffers(slot, outputs)
                for dst, src in zip(host, outputs, strict=True):
                    dst[lo:hi].copy_(src, non_blocking=True)

            outcome = self.runner.run(n, call)
            if outcome.calls > 1 and self._on_outcome is not None:
                self._on_outcome(outcome)
            error = None
            failed = job.failed
            if outcome.failed:
                batch_id = job.batch.batch_id
                failed = {
                    row: ModelError(f"model failed on batch {batch_id}: {text}")
                    for row, text in outcome.failed.items()
                }
                failed.update(job.failed)  # a row whose decode failed keeps that error
                if len(outcome.failed) == n:  # no row ran: no outputs at all
                    error = ModelError(f"model failed on batch {batch_id}: {outcome.failed[0]}")
                    host = ()
            if stream is not None:
                done_event = _cuda_event(stream, timing=True)
        item = _InFlight(
            job, copy_event, done_event, host, slot, started_s, error, start_event=start_event
        )
        item.failed = failed
        item.model_calls = outcome.calls
        return item

    def _output_buffers(
        self, slot: int, outputs: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]:
        rows = self.pool.rows
        bufs = self._out_bufs[slot]
        if (
            bufs is None
            or any(
                b.shape[1:] != o.shape[1:] or b.dtype != o.dtype
                for b, o in zip(bufs, outputs, strict=False)
            )
            or len(bufs) != len(outputs)
        ):
            bufs = tuple(
                torch.empty((rows, *o.shape[1:]), dtype=o.dtype, pin_memory=self.cuda)
                for o in outputs
            )
            self.output_allocations += len(bufs)
            self._out_bufs[slot] = bufs
            self._out_arrays[slot] = tuple(b.numpy() for b in bufs)
        return bufs

    def _inflight_append(self, item: _InFlight) -> None:
        with self._cond:
            self._inflight.append(item)
            self._cond.notify_all()

    # -- completion thread -----------------------------------------------------------------
    def _completion_loop(self) -> None:
        if self.cuda:  # event queries and timings on this worker's device, not cuda:0
            torch.cuda.set_device(self.device)
        while True:
            with self._cond:
                while not self._inflight:
                    if self._stopping:
                        return
                    self._cond.wait(0.1)
                items = list(self._inflight)
            for item in items:
                if not item.slab_released and item.copy_event.query():
                    self.pool.release(item.job.slab)
                    item.slab_released = True
            head = items[0]
            if not head.slab_released or not head.done_event.query():
                time.sleep(0.0002)  # event polling period: never a stream synchronize
                continue
            with self._cond:
                self._inflight.popleft()
            self._complete(head)

    def _complete(self, item: _InFlight) -> None:
        """Hand a finished batch (events fired, slab back) to ``on_complete``: numpy views of
        its rows in the slot's output buffers (made once per buffer set, sliced per batch)."""
        n = len(item.job.batch)
        arrays = self._out_arrays[item.out_slot] if item.outputs else ()
        result = DeviceResult(
            batch=item.job.batch,
            outputs=tuple(array[:n] for array in arrays),
            failed=item.failed,
            error=item.error,
            inference_s=_service_s(item),
            model_calls=item.model_calls,
        )
        self.on_complete(result, self._releaser(item.out_slot))

    def _releaser(self, slot: int) -> Release:
        """The ``release`` of one completed batch: its output buffer set goes back (once)."""
        released = False

        def release() -> None:
            nonlocal released
            with self._cond:
                if released:
                    return
                released = True
                self._out_held.pop(slot, None)
                self._out_free.append(slot)
                self._unfinished -= 1
                self._cond.notify_all()

        return release

    def idle(self) -> bool:
        """True when no batch is queued, in flight or awaiting its ``release``."""
        with self._cond:
            return self._unfinished == 0

    def output_leak(self) -> PoolLeak:
        """The output buffer sets not given back now, and the batches holding them; call it
        once the worker is closed and its results handled (at close), when ``missing`` must
        be 0."""
        with self._cond:
            return PoolLeak(
                f"output {self.label}",
                self.max_in_flight,
                self.max_in_flight - len(self._out_free),
                tuple(sorted(self._out_held.values())),
            )

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


def _discard(outputs: tuple[torch.Tensor, ...]) -> None:
    """A timing run's outputs are not kept."""


def _service_s(item: _InFlight) -> float:
    """Device time of a completed batch, in seconds."""
    if item.service_s is not None:
        return item.service_s
    assert item.start_event is not None and isinstance(item.done_event, torch.cuda.Event)
    return float(item.start_event.elapsed_time(item.done_event)) / 1000.0


# torch ships the constructors of torch.cuda.Stream and torch.cuda.Event without annotations.
def _cuda_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # unannotated in torch


def _cuda_event(stream: torch.cuda.Stream, timing: bool = False) -> torch.cuda.Event:
    """A CUDA event recorded on ``stream`` now (``timing``: usable with ``elapsed_time``)."""
    event = torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]  # see above
    event.record(stream)
    return event
