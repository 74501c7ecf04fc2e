"""Decode in processes of their own (``worker.decode_mode: process``): the consumer's side.

:class:`DecodeProcesses` are the decode processes every pipeline of the consumer shares,
resizable by the decode sizer; :class:`ProcessDecoder` decodes one lane's batches in them, one
task per process over a contiguous slice of rows. The processes write straight into the lane's
staging slabs, which then live in POSIX shared memory (a shared
:class:`~streamproc.device.StagingPool`). Each batch costs one pickle of its records to the
processes and of the per-row errors back; in exchange decode scales past the GIL, and a decoder
that crashes its process (a hostile JPEG hitting a native bug) dead-letters that slice instead
of killing the consumer. What runs in the processes: :mod:`streamproc.decode.process_child`.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from streamproc.decode import process_child
from streamproc.decode.process_child import DecodeSpec
from streamproc.decode.protocol import DecodeSample, DecodeSlab, Failures, OnSample
from streamproc.decode.rows import oversized, row_slices
from streamproc.errors import DecodeError
from streamproc.logs import get_logger
from streamproc.records import Record

log = get_logger(__name__)


class DecodeProcesses:
    """The decode worker processes shared by every pipeline of this consumer, resizable.

    Each worker is a process of its own (a one-process ``ProcessPoolExecutor``): a process that
    dies breaks only the slices it held, it alone is replaced, and the count can grow or shrink
    one process at a time. Lanes are registered while the pipeline is built; :meth:`start`
    spawns ``workers`` processes (``spawn``: the consumer process runs librdkafka and torch
    threads, which must not be forked) and returns once each has built its workloads and mapped
    the slabs (its first task, :func:`~streamproc.decode.process_child.ready`, ran: one process
    per executor, so that proves this process is up).

    Args:
        workers: processes at start.

    Raises:
        ValueError: ``workers`` < 1.
    """

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"decode processes: need at least 1, got {workers}")
        self._start_count = workers
        self.generation = 0  # bumped by every restart of a process that died
        self._lanes: dict[str, DecodeSpec] = {}
        self._executors: list[ProcessPoolExecutor] = []
        self._pids: dict[int, int] = {}  # id(executor) -> pid of its process
        self._lock = threading.Lock()  # a leaf: dispatchers of several pipelines share this
        self._closed = False

    @property
    def workers(self) -> int:
        """Processes running now (before :meth:`start`: the count it will start)."""
        with self._lock:
            return len(self._executors) or self._start_count

    def pids(self) -> list[int]:
        """Process ids of the running decode processes."""
        with self._lock:
            return [self._pids[id(e)] for e in self._executors]

    def register(self, lane: str, spec: DecodeSpec) -> None:
        """Serve ``lane`` as ``spec`` says, in every process started from now on.

        Raises:
            RuntimeError: after :meth:`start`.
        """
        if self._executors:
            raise RuntimeError("register every lane before start()")
        self._lanes[lane] = spec

    def start(self, timeout_s: float = 120.0) -> None:
        """Spawn the processes and wait until every one is ready.

        Raises:
            TimeoutError: a process did not get ready within ``timeout_s``.
            BrokenProcessPool: a process died while starting (e.g. its workload failed to load,
                or the main module has no ``if __name__ == "__main__":`` guard).
        """
        spawned = self._spawn(self._start_count, timeout_s)
        with self._lock:
            self._executors = list(spawned)
            self._pids.update({id(e): pid for e, pid in spawned.items()})

    def resize(self, workers: int, timeout_s: float = 120.0) -> int:
        """Go to ``workers`` processes (>= 1) and return the count running. New processes
        are started (outside the lock: slices keep going to the running ones) and join once
        ready; surplus ones take no new slice and exit after the slices they hold.

        Raises:
            TimeoutError, BrokenProcessPool: a new process did not start (the running ones
                are kept).
        """
        if workers < 1:
            raise ValueError(f"decode processes: need at least 1, got {workers}")
        with self._lock:
            running = len(self._executors)
            retired = self._executors[workers:]
            del self._executors[workers:]
            for executor in retired:
                self._pids.pop(id(executor), None)
        for executor in retired:
            executor.shutdown(wait=False, cancel_futures=False)
        if workers > running:
            spawned = self._spawn(workers - running, timeout_s)
            with self._lock:
                closed = self._closed
                if not closed:
                    self._executors.extend(spawned)
                    self._pids.update({id(e): pid for e, pid in spawned.items()})
            if closed:  # closed while these started: they never serve
                for executor in spawned:
                    executor.shutdown(wait=False, cancel_futures=True)
        return self.workers

    def _spawn(self, count: int, timeout_s: float) -> dict[ProcessPoolExecutor, int]:
        """``count`` new processes, each ready; returns them with their pids."""
        context = multiprocessing.get_context("spawn")
        executors = [
            ProcessPoolExecutor(
                1,
                mp_context=context,
                initializer=process_child.init_process,
                initargs=(self._lanes, os.getpid()),
            )
            for _ in range(count)
        ]
        try:
            # The executor spawns its process for the first task: all of them start at once.
            ready = [executor.submit(process_child.ready) for executor in executors]
            pids = [future.result(timeout=timeout_s) for future in ready]
        except BaseException as exc:
            for executor in executors:
                executor.shutdown(wait=False, cancel_futures=True)
            if isinstance(exc, FutureTimeout):
                raise TimeoutError(f"decode processes not ready within {timeout_s:.0f} s") from exc
            raise
        return dict(zip(executors, pids, strict=True))

    def submit(
        self,
        lane: str,
        slab_index: int,
        start: int,
        records: list[Record],
        skip: set[int],
        slot: int = 0,
    ) -> tuple[ProcessPoolExecutor, Future[Failures]]:
        """Queue one slice on process ``slot`` (modulo the count); returns that process's
        executor (for :meth:`restart`) and the slice's future."""
        args = (lane, slab_index, start, records, skip)
        executor = self._pick(slot)
        try:
            return executor, executor.submit(process_child.decode_slice, *args)
        except (BrokenProcessPool, RuntimeError):
            # Broken by an earlier slice (any pipeline), or retired by a shrink since: nothing
            # of ours ran yet. Replace it if it is still ours, then queue on the running set.
            self.restart(executor)
        executor = self._pick(slot)
        return executor, executor.submit(process_child.decode_slice, *args)

    def _pick(self, slot: int) -> ProcessPoolExecutor:
        with self._lock:
            if not self._executors:
                raise RuntimeError("decode processes not started")
            return self._executors[slot % len(self._executors)]

    def restart(self, broken: ProcessPoolExecutor) -> None:
        """Replace ``broken`` (its process died) with a fresh process; a no-op when it was
        replaced or retired already."""
        with self._lock:
            if broken not in self._executors:
                return
            index = self._executors.index(broken)
            log.error("a decode process died; starting a new one")
            broken.shutdown(wait=False, cancel_futures=True)
            self._pids.pop(id(broken), None)
            self.generation += 1
            ((fresh, pid),) = self._spawn(1, 120.0).items()
            self._executors[index] = fresh
            self._pids[id(fresh)] = pid

    def close(self) -> None:
        """Stop every process after the slices it holds, cancelling queued ones (idempotent);
        a :meth:`resize` under way shuts its new processes down."""
        with self._lock:
            self._closed = True
            executors, self._executors = self._executors, []
            self._pids.clear()
        for executor in executors:
            executor.shutdown(wait=True, cancel_futures=True)


@dataclass(frozen=True, slots=True)
class _Slice:
    """Rows ``start:stop`` of a batch (``records``) into slab ``slab_index``, skipping the rows
    in ``skip``, on decode process ``slot`` (modulo their count)."""

    slab_index: int
    start: int
    stop: int
    records: list[Record]
    skip: set[int]
    slot: int


class ProcessDecoder:
    """Decodes in :class:`DecodeProcesses`, one task per process over a contiguous slice.

    The slab must come from a shared :class:`~streamproc.device.StagingPool` registered for
    ``lane``. When a decode process dies mid-batch it is replaced and its slice is decoded again
    once; a slice that kills its process twice is dead-lettered as a whole (:class:`DecodeError`
    "decode process died": we cannot tell which of its records did it; slices of other batches
    queued on that process at both moments share that fate; nothing is lost).

    Args:
        processes: the shared decode processes.
        lane: this pipeline's lane name (its input topic).
        max_message_bytes: larger values fail with a :class:`DecodeError` without decoding.
        on_sample: called with each batch's :class:`DecodeSample` (the decode sizer).
    """

    def __init__(
        self,
        processes: DecodeProcesses,
        lane: str,
        max_message_bytes: int,
        on_sample: OnSample | None = None,
    ) -> None:
        self._processes = processes
        self._lane = lane
        self.hold_probes = False  # no route to probe: decode processes are never bypassed
        self._max_message_bytes = max_message_bytes
        self._on_sample = on_sample

    @property
    def probing(self) -> bool:
        """Never: decode processes have one route."""
        return False

    def decode(self, records: Sequence[Record], slab: DecodeSlab) -> Failures:
        """:meth:`Decoder.decode <streamproc.decode.protocol.Decoder.decode>` in the decode
        processes (``slab`` is one of the lane's shared slabs)."""
        started_s = time.monotonic()
        workers = self._processes.workers
        failed = oversized(records, self._max_message_bytes)
        skip = set(failed)
        parts = [
            _Slice(slab.index, start, stop, list(records[start:stop]), skip, slot)
            for slot, (start, stop) in enumerate(row_slices(len(records), workers))
        ]
        tasks = [(part, *self._submit(part)) for part in parts]
        for part, executor, future in tasks:
            try:
                failed.update(future.result())
                continue
            except BrokenProcessPool:
                # Its process died: by this slice, or by another slice queued there. Retry once.
                self._processes.restart(executor)
            failed.update(self._retry(part))
        if self._on_sample is not None:
            self._on_sample(
                DecodeSample(self._lane, len(records), time.monotonic() - started_s, workers)
            )
        return failed

    def _submit(self, part: _Slice) -> tuple[ProcessPoolExecutor, Future[Failures]]:
        return self._processes.submit(
            self._lane, part.slab_index, part.start, part.records, part.skip, part.slot
        )

    def _retry(self, part: _Slice) -> Failures:
        """Decode ``part`` again after its process died; if it kills a process again, every
        row of it not in ``part.skip`` fails with the reason."""
        executor, future = self._submit(part)
        try:
            return future.result()
        except BrokenProcessPool as exc:
            # Twice: we cannot tell which record of the slice kills the process, so the
            # whole slice is dead-lettered with the reason (never decoded in the consumer).
            self._processes.restart(executor)
            return {
                row: DecodeError(f"decode process died: {exc}")
                for row in range(part.start, part.stop)
                if row not in part.skip
            }
