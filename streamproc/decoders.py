"""Decoders: turn a batch's records into rows of its staging slab, off the consumer thread.

Two interchangeable implementations, selected by ``worker.decode_mode``:

``thread`` (default)
    A thread pool in this process decodes contiguous slices of the batch. The hand-off costs
    next to nothing, so it wins for light payloads (JSON trades, sensor windows), and it scales
    wherever decode releases the GIL (Pillow's JPEG decoder does).
``process``
    ``worker.decode_workers`` spawned processes decode straight into the same staging slabs,
    which then live in POSIX shared memory (registered as pinned memory when CUDA is present,
    see :class:`~streamproc.worker.StagingPool`). Each batch costs one pickle of its records
    to the workers and of the per-row errors back; in exchange decode scales past the GIL, and a
    decoder that crashes its process (a hostile JPEG hitting a native bug) dead-letters that
    slice instead of killing the consumer.

Both check ``worker.max_message_bytes`` in this process first, so an oversized value is never
decoded (nor shipped to a worker). Measured trade-offs: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Collection, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.synchronize import Barrier
from typing import Any, Protocol

import numpy as np

from streamproc.errors import DecodeError, RecordError
from streamproc.logs import get_logger
from streamproc.records import Record
from streamproc.worker import Slab
from streamproc.workloads import Workload, load_workload

log = get_logger(__name__)

Failures = dict[int, RecordError]


class Decoder(Protocol):
    """Fills a leased slab from a batch's records."""

    def decode(self, records: Sequence[Record], slab: Slab) -> Failures:
        """Decode ``records[i]`` into ``slab.array[i]``; return the rows that failed."""
        ...


def oversized(records: Sequence[Record], max_message_bytes: int) -> Failures:
    """Rows whose value exceeds ``max_message_bytes`` (they are dead-lettered, not decoded)."""
    return {
        row: DecodeError(
            f"value of {len(record.value)} bytes exceeds "
            f"worker.max_message_bytes={max_message_bytes}"
        )
        for row, record in enumerate(records)
        if record.value is not None and len(record.value) > max_message_bytes
    }


def decode_rows(
    workload: Workload,
    records: Sequence[Record],
    rows: np.ndarray,
    start: int,
    skip: Collection[int],
) -> Failures:
    """Decode ``records[i]`` into ``rows[start + i]`` (skipping rows in ``skip``), one
    :meth:`~streamproc.workloads.Workload.decode_many` call per run of rows between skipped
    ones.

    Returns:
        Per failed row (counted from ``start``), the :class:`RecordError`. If a workload's
        ``decode_many`` itself raises, or answers with anything but a dict of row index (within
        the run) -> :class:`RecordError`, its run is decoded again record by record (the base
        implementation), so one workload bug costs speed, never the stream.
    """
    failed: Failures = {}
    run_start = 0
    stop = start + len(records)
    for index in [*(row - start for row in sorted(skip) if start <= row < stop), len(records)]:
        if index > run_start:
            run = records[run_start:index]
            view = rows[start + run_start : start + index]
            try:
                found = _checked(workload.decode_many(run, view), len(run))
            except Exception:
                found = Workload.decode_many(workload, run, view)
            for offset, error in found.items():
                failed[start + run_start + offset] = error
        run_start = index + 1
    return failed


def _checked(found: object, count: int) -> Failures:
    """``decode_many``'s answer, or TypeError if it is not a dict of row -> RecordError over
    rows ``0..count-1`` (a wrong answer would fail or score the wrong rows)."""
    if not isinstance(found, dict) or not all(
        isinstance(row, int | np.integer)
        and not isinstance(row, bool)
        and 0 <= row < count
        and isinstance(error, RecordError)
        for row, error in found.items()
    ):
        raise TypeError(f"decode_many must return dict[int, RecordError], got {found!r:.200}")
    return {int(row): error for row, error in found.items()}


def _slices(count: int, chunks: int) -> list[tuple[int, int]]:
    step = -(-count // max(1, chunks))
    return [(start, min(start + step, count)) for start in range(0, count, step)]


class ThreadDecoder:
    """Decodes on a shared thread pool, one task per worker over a contiguous slice of rows.

    Args:
        workload: the pipeline's decoder.
        executor: the process-wide decode thread pool.
        chunks: slices per batch (the pool's size).
        max_message_bytes: larger values fail with a :class:`DecodeError` without decoding.
    """

    def __init__(
        self, workload: Workload, executor: Executor, chunks: int, max_message_bytes: int
    ) -> None:
        self._workload = workload
        self._executor = executor
        self._chunks = chunks
        self._max_message_bytes = max_message_bytes

    def decode(self, records: Sequence[Record], slab: Slab) -> Failures:
        failed = oversized(records, self._max_message_bytes)
        futures = [
            self._executor.submit(
                decode_rows, self._workload, records[start:stop], slab.array, start, failed
            )
            for start, stop in _slices(len(records), self._chunks)
        ]
        for future in futures:
            failed.update(future.result())
        return failed


# -- worker processes -------------------------------------------------------------------------
@dataclass(frozen=True)
class LaneSpec:
    """What a decode process needs to serve one pipeline: how to build its workload and where
    its staging slabs live.

    Attributes:
        workload: workload name or spec (``load_workload``'s first argument).
        options: workload options.
        slabs: shared-memory name of each slab, in pool index order.
        shape: shape of one slab, ``(rows, *item_shape)``.
        dtype: numpy dtype string of the rows.
    """

    workload: str
    options: dict[str, Any]
    slabs: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str


_LANES: dict[str, tuple[Workload, list[np.ndarray]]] = {}
_ATTACHED: list[shared_memory.SharedMemory] = []


def _init_process(lanes: dict[str, LaneSpec], parent_pid: int, started: Barrier) -> None:
    """Decode-process initializer: detach from terminal signals, watch the parent, build each
    lane's workload, map its slabs, then wait at ``started`` (a barrier with the parent and
    every other decode process)."""
    # Ctrl-C or a stop signal sent to the whole process group must reach only the consumer,
    # which drains and then shuts these processes down; left to the default handlers, they died
    # mid-batch and good records of that batch were dead-lettered.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    for name, spec in lanes.items():
        views = []
        for shm_name in spec.slabs:
            shm = shared_memory.SharedMemory(name=shm_name)
            _ATTACHED.append(shm)  # keep the mapping alive; the parent owns (unlinks) it
            views.append(np.ndarray(spec.shape, dtype=np.dtype(spec.dtype), buffer=shm.buf))
        _LANES[name] = (load_workload(spec.workload, spec.options), views)
    started.wait()


def _exit_with_parent(parent_pid: int, period_s: float = 0.5) -> None:
    """Exit once the consumer process is gone (kill -9, or a second signal's immediate exit):
    a decode process must never outlive it, holding its memory and the shared slabs."""
    while os.getppid() == parent_pid:
        time.sleep(period_s)  # a liveness poll, not synchronisation
    os._exit(0)


def _ready() -> int:
    """Warm-up task: proves a process finished its initializer."""
    return len(_LANES)


def _decode_in_process(
    lane: str, slab_index: int, start: int, records: list[Record], skip: set[int]
) -> Failures:
    workload, views = _LANES[lane]
    return decode_rows(workload, records, views[slab_index], start, skip)


class DecodeProcesses:
    """The decode worker processes shared by every pipeline of this consumer.

    Lanes are registered while the pipeline is built; :meth:`start` spawns ``workers``
    processes (``spawn``: the consumer process runs librdkafka and torch threads, which must not
    be forked) and waits until each has built its workloads and mapped the slabs.

    Args:
        workers: number of processes.
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.generation = 0  # bumped by every restart
        self._lanes: dict[str, LaneSpec] = {}
        self._executor: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()  # dispatchers of several pipelines share the pool

    def register(self, lane: str, spec: LaneSpec) -> None:
        if self._executor is not None:
            raise RuntimeError("register every lane before start()")
        self._lanes[lane] = spec

    def start(self, timeout_s: float = 120.0) -> None:
        """Spawn the processes and wait until every one is ready.

        Raises:
            TimeoutError: a process did not get ready within ``timeout_s``.
            BrokenProcessPool: a process died while starting (e.g. its workload failed to load,
                or the main module has no ``if __name__ == "__main__":`` guard).
        """
        with self._lock:
            self._start(timeout_s)

    def _start(self, timeout_s: float) -> None:
        context = multiprocessing.get_context("spawn")
        # Every process initialised (signals ignored, slabs mapped) before start() returns: a
        # task finishing proves only that *a* process is up, not all of them.
        started = context.Barrier(self.workers + 1, timeout=timeout_s)
        executor = ProcessPoolExecutor(
            self.workers,
            mp_context=context,
            initializer=_init_process,
            initargs=(self._lanes, os.getpid(), started),
        )
        self._executor = executor
        # The pool spawns a process per task while none is idle: one task per process.
        futures = [executor.submit(_ready) for _ in range(self.workers)]
        try:
            started.wait()
        except threading.BrokenBarrierError as exc:
            executor.shutdown(wait=False, cancel_futures=True)
            raise TimeoutError(
                f"decode processes not ready within {timeout_s:.0f} s (or one failed to start)"
            ) from exc
        for future in futures:
            future.result(timeout=timeout_s)

    def submit(
        self, lane: str, slab_index: int, start: int, records: list[Record], skip: set[int]
    ) -> tuple[int, Future[Failures]]:
        """Queue one slice; returns the pool generation it went to and its future."""
        with self._lock:
            if self._executor is None:
                raise RuntimeError("decode processes not started")
            generation, executor = self.generation, self._executor
        try:
            future = executor.submit(_decode_in_process, lane, slab_index, start, records, skip)
        except BrokenProcessPool:
            # Broken by another pipeline's batch since: nothing of ours ran yet; use a new pool.
            self.restart(generation)
            return self.submit(lane, slab_index, start, records, skip)
        return generation, future

    def restart(self, broken_generation: int) -> None:
        """Replace the pool of ``broken_generation`` (a process died) with fresh processes;
        a no-op when another thread replaced it already."""
        with self._lock:
            if self.generation != broken_generation or self._executor is None:
                return
            log.error("a decode process died; starting new decode processes")
            self._executor.shutdown(wait=False, cancel_futures=True)
            self.generation += 1
            self._start(120.0)

    def close(self) -> None:
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True, cancel_futures=True)
                self._executor = None


class ProcessDecoder:
    """Decodes in :class:`DecodeProcesses`, one task per process over a contiguous slice.

    The slab must come from a shared :class:`~streamproc.worker.StagingPool` registered for
    ``lane``. When a decode process dies mid-batch the pool is restarted and the affected slices
    are decoded again once; a slice that kills its process twice is dead-lettered as a whole
    (:class:`DecodeError` "decode process died": we cannot tell which of its records did it;
    a slice of another pipeline in flight at both moments may share that fate; nothing is lost).

    Args:
        processes: the shared decode processes.
        lane: this pipeline's lane name (its input topic).
        max_message_bytes: larger values fail with a :class:`DecodeError` without decoding.
    """

    def __init__(self, processes: DecodeProcesses, lane: str, max_message_bytes: int) -> None:
        self._processes = processes
        self._lane = lane
        self._max_message_bytes = max_message_bytes

    def decode(self, records: Sequence[Record], slab: Slab) -> Failures:
        failed = oversized(records, self._max_message_bytes)
        skip = set(failed)
        tasks = [
            (start, stop, *self._submit(records, slab, start, stop, skip))
            for start, stop in _slices(len(records), self._processes.workers)
        ]
        for start, stop, generation, future in tasks:
            try:
                failed.update(future.result())
                continue
            except BrokenProcessPool:
                # A process died: this slice's, or one beside it (any pipeline). Retry once.
                self._processes.restart(generation)
            generation, future = self._submit(records, slab, start, stop, skip)
            try:
                failed.update(future.result())
            except BrokenProcessPool as exc:
                # Twice: we cannot tell which record of the slice kills the process, so the
                # whole slice is dead-lettered with the reason (never decoded in the consumer).
                for row in range(start, stop):
                    failed.setdefault(row, DecodeError(f"decode process died: {exc}"))
                self._processes.restart(generation)
        return failed

    def _submit(
        self, records: Sequence[Record], slab: Slab, start: int, stop: int, skip: set[int]
    ) -> tuple[int, Future[Failures]]:
        return self._processes.submit(
            self._lane, slab.index, start, list(records[start:stop]), skip
        )
