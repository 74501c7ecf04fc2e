"""One batch's launch on a device: copy in, model, copy out, with the backend's three events.

::

    with backend.launch(), inference_mode():      # CUDA: the next stream is current
        start   <- record                          # device time starts
        x = slab rows 0..n-1 -> device              # non_blocking (pinned slab on CUDA)
        copied  <- record                          # once fired, the slab may be reused
        model(x), or its parts (PartRunner)        # outputs (n, ...) per model output
        outputs -> output set rows, non_blocking   # host buffers (pinned on CUDA)
        done    <- record                          # once fired, the results are on the host

On a CPU the launch returns with all of it done; on CUDA it returns once the work is queued on
the stream. A model call that raises is re-run in parts by the worker's
:class:`~streamproc.device.recovery.PartRunner` inside the same launch (so on CUDA the re-runs
are queued on the batch's stream, before its done event); each part writes its own rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from streamproc.device.backend import DeviceBackend, Event
from streamproc.device.binding import BoundCall
from streamproc.device.jobs import DeviceJob
from streamproc.device.outputs import OutputSets
from streamproc.device.recovery import PartRunner, RunOutcome
from streamproc.errors import ModelError, RecordError
from streamproc.workloads.base import ModelFn


@dataclass
class Launched:
    """A launched batch until it completes.

    Attributes:
        job: the batch and its staging slab (given back once ``copied`` fired).
        out_slot: the output buffer set its outputs are copied into.
        start, copied, done: the backend's events of the launch (see the module).
        has_outputs: some rows ran: the output set holds their outputs (False: none ran).
        failed: row -> error for rows whose decode failed or that failed alone in the model.
        error: set when no row of the batch ran.
        model_calls: model calls the batch took (1 unless a call raised).
        bound: the batch's bound model call (its version, fallback, shadow), None when it ran
            on the worker's own model.
        slab_released: the slab is back in its pool.
    """

    job: DeviceJob
    out_slot: int
    start: Event
    copied: Event
    done: Event
    has_outputs: bool
    failed: dict[int, RecordError]
    error: ModelError | None
    model_calls: int
    bound: BoundCall | None = None
    slab_released: bool = False


class Launcher:
    """Launches batches of one device worker (on its device thread only).

    Args:
        backend: the worker's device backend.
        outputs: the worker's output buffer sets.
        runner: the worker's part runner (failures, out-of-memory re-runs).
        on_outcome: called with the :class:`RunOutcome` of each batch whose model call raised.
    """

    def __init__(
        self,
        backend: DeviceBackend,
        outputs: OutputSets,
        runner: PartRunner,
        on_outcome: Callable[[RunOutcome], None] | None,
    ) -> None:
        self._backend = backend
        self._outputs = outputs
        self._runner = runner
        self._on_outcome = on_outcome
        self._canary = RowCanary(backend.device)

    def launch(self, model: ModelFn, job: DeviceJob, slot: int) -> Launched:
        """Launch ``job`` through its bound version (:class:`BoundCall`), else ``model`` (the
        worker's at this launch: ``(n, *item_shape)`` on the device -> a tuple of ``(n, ...)``
        tensors), its outputs going to output set ``slot``.

        Raises:
            FatalPipelineError: the pipeline must stop (see :class:`PartRunner`).
        """
        n = len(job.batch)
        bound = None if job.binding is None else BoundCall(job.binding, n)
        ran = self.run(model if bound is None else bound, job.slab.tensor, n, slot, live=True)
        if ran.outcome.calls > 1 and self._on_outcome is not None:
            self._on_outcome(ran.outcome)
        failed, error = _failures(job, ran.outcome)
        return Launched(
            job,
            slot,
            ran.start,
            ran.copied,
            ran.done,
            ran.has_outputs and error is None,
            failed,
            error,
            ran.outcome.calls,
            bound,
        )

    def run(self, model: ModelFn, rows: torch.Tensor, n: int, slot: int, live: bool = False) -> Ran:
        """Copy rows ``0..n-1`` of the host tensor ``rows`` to the device, run ``model`` on
        them under ``torch.inference_mode()`` (no autograd graph, whatever the model does),
        copy the outputs into output set ``slot``, with the backend's three events: one launch,
        the same path for live batches and start-up timings. ``live``: a batch of real input,
        whose rows the part runner may keep as its canary (never the start-up zeros).

        Raises:
            FatalPipelineError: the pipeline must stop (see :class:`PartRunner`).
        """
        backend = self._backend
        with backend.launch(), torch.inference_mode():
            start = backend.record("start")
            x = rows[:n].to(backend.device, non_blocking=True)
            copied = backend.record("copied")
            has_outputs = False

            def call(lo: int, hi: int) -> None:
                nonlocal has_outputs
                outputs = model(x[lo:hi] if hi - lo < n else x)
                if any(out.shape[0] != hi - lo for out in outputs):
                    raise ModelError(
                        f"model returned {[tuple(o.shape) for o in outputs]} for {hi - lo} rows"
                    )
                host = self._outputs.buffers(slot, outputs)
                has_outputs = True
                for dst, src in zip(host, outputs, strict=True):
                    dst[lo:hi].copy_(src, non_blocking=True)

            canary = None
            if live:
                canary = self._canary
                canary.bind(model, rows)
            outcome = self._runner.run(n, call, canary)
            done = backend.record("done")
        return Ran(start, copied, done, outcome, has_outputs)


class RowCanary:
    """The part runner's known-good probe (:class:`~streamproc.device.recovery.Canary`): one
    input row the model ran on, copied from the batch's host staging slab into one host row of
    its own (allocated on the first copy, never again; the part runner copies at most once per
    :data:`~streamproc.device.recovery.CANARY_REFRESH_S`, on a batch that ran). The same path
    on every backend: run, it is copied to the device (a blocking copy: the host row may be
    overwritten by the next keep) and the launch's model runs on it; its outputs are
    discarded. The launching thread only.

    Args:
        device: the worker's device.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._row: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None
        self._model: ModelFn | None = None

    def bind(self, model: ModelFn, rows: torch.Tensor) -> None:
        """The batch launching now: its model (its bound version) and its host rows."""
        self._model, self._rows = model, rows

    def keep(self, row: int) -> None:
        """Copy row ``row`` of the bound batch's host rows (it ran in a call that succeeded)."""
        rows = self._rows
        assert rows is not None, "keep before bind"
        if self._row is None:
            self._row = torch.empty((1, *rows.shape[1:]), dtype=rows.dtype)
        self._row.copy_(rows[row : row + 1])

    def run(self) -> None:
        """Run the bound model on the kept row alone.

        Raises:
            Exception: what the model raised; ModelError: it returned other than one row per
                output.
        """
        assert self._row is not None and self._model is not None, "run before keep"
        outputs = self._model(self._row.to(self._device))
        if any(out.shape[0] != 1 for out in outputs):
            raise ModelError(f"model returned {[tuple(o.shape) for o in outputs]} for 1 row")


@dataclass(frozen=True)
class Ran:
    """What one :meth:`Launcher.run` queued: its three events, the part runner's outcome, and
    whether any rows' outputs were copied into the output set."""

    start: Event
    copied: Event
    done: Event
    outcome: RunOutcome
    has_outputs: bool


def _failures(
    job: DeviceJob, outcome: RunOutcome
) -> tuple[dict[int, RecordError], ModelError | None]:
    """The rows of ``job`` that failed (decode errors kept, model errors of rows that failed
    alone added) and the batch's error when no row ran."""
    if not outcome.failed:
        return job.failed, None
    batch_id = job.batch.batch_id
    failed: dict[int, RecordError] = {
        row: ModelError(f"model failed on batch {batch_id}: {text}")
        for row, text in outcome.failed.items()
    }
    failed.update(job.failed)  # a row whose decode failed keeps that error
    error = None
    if len(outcome.failed) == len(job.batch):  # no row ran: no outputs at all
        error = ModelError(f"model failed on batch {batch_id}: {outcome.failed[0]}")
    return failed, error
