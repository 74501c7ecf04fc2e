"""Decoders: turn a batch's records into rows of its staging slab, off the consumer thread.

Two interchangeable implementations, selected by ``worker.decode_mode``:

``thread`` (default)
    A thread pool in this process (:class:`DecodeThreads`) decodes contiguous slices of the
    batch. The hand-off costs next to nothing, so it wins for light payloads (JSON trades,
    sensor windows), and it scales wherever decode releases the GIL (Pillow's JPEG decoder
    does).
``process``
    Spawned processes (:class:`DecodeProcesses`) decode straight into the same staging slabs,
    which then live in POSIX shared memory (registered as pinned memory when CUDA is present,
    see :class:`~streamproc.device.StagingPool`). Each batch costs one pickle of its records
    to the workers and of the per-row errors back; in exchange decode scales past the GIL, and a
    decoder that crashes its process (a hostile JPEG hitting a native bug) dead-letters that
    slice instead of killing the consumer.

With ``thread``, each lane decodes either on the pool or **inline**, on its own dispatcher
thread, as its measured decode costs per record say (CPU, and the dispatcher's wait)
(:class:`~streamproc.decode.sizing.DecodeRoutePolicy`; ``worker.decode_inline``): for light
payloads the pool adds only hand-offs (a submit, a future, a wake-up per slice, and GIL
contention between slices), while JPEG decode, which releases the GIL, gains from the split.
``process`` always decodes in the processes: a decoder that crashes must not take the consumer
with it.

Both check ``worker.max_message_bytes`` in this process first, so an oversized value is never
decoded (nor shipped to a worker). Both split a batch into as many slices as the pool has workers
at that moment, and report each batch's decode time (:class:`DecodeSample`) to the decode sizer,
which resizes the pool between ``worker.decode_workers_min`` and ``decode_workers_max``
(``streamproc/decode/sizing.py``; it starts at ``worker.decode_workers``). Measured trade-offs:
``docs/benchmarks.md``.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any, Protocol, TypeVar

import numpy as np

from streamproc.decode.sizing import DecodeRoutePolicy, DecodeSample, Route
from streamproc.device import Slab
from streamproc.errors import DecodeError, RecordError
from streamproc.logs import get_logger
from streamproc.records import Record
from streamproc.workloads import Workload, load_workload

log = get_logger(__name__)

Failures = dict[int, RecordError]
T = TypeVar("T")


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
    """``min(count, chunks)`` contiguous slices of ``range(count)`` whose lengths differ by at
    most one (so ``chunks`` workers finish a batch in ``ceil(count / chunks)`` rows' time)."""
    parts = max(1, min(count, chunks))
    base, extra = divmod(count, parts)
    bounds = [0]
    for part in range(parts):
        bounds.append(bounds[-1] + base + (1 if part < extra else 0))
    return list(itertools.pairwise(bounds))


OnSample = Callable[[DecodeSample], None]
"""Where a decoder reports each batch's decode time (the :class:`DecodeSizer`)."""


# -- worker threads ---------------------------------------------------------------------------
_Task = tuple["Future[Any]", Callable[..., Any], tuple[Any, ...]]


class DecodeThreads:
    """The decode threads shared by every pipeline of this consumer, resizable at run time.

    Threads are named ``decode_<n>`` and started on the first :meth:`submit` (a pipeline that
    fails to build leaves none behind). :meth:`resize` starts threads at once, or queues one
    retire marker per surplus thread behind the tasks already queued: a thread that takes one
    finishes and exits, so no task is dropped and a shrink never waits.

    Args:
        workers: threads at start (>= 1).
    """

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"decode threads: need at least 1, got {workers}")
        self._target = workers
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # a leaf: guards the counts below
        self._live = 0  # threads started and not asked to retire
        self._started = False
        self._closed = False
        self._names = itertools.count()
        self._threads: list[threading.Thread] = []  # every thread started (for the final join)

    @property
    def workers(self) -> int:
        """The thread count wanted now (what decoders split batches for)."""
        return self._target

    def submit(self, fn: Callable[..., T], /, *args: Any) -> Future[T]:
        """Queue ``fn(*args)`` for a decode thread.

        Raises:
            RuntimeError: after :meth:`shutdown`.
        """
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("decode threads shut down")
            self._started = True
            self._top_up()
            self._tasks.put((future, fn, args))
        return future

    def resize(self, workers: int) -> int:
        """Go to ``workers`` threads (>= 1); returns it."""
        if workers < 1:
            raise ValueError(f"decode threads: need at least 1, got {workers}")
        with self._lock:
            self._target = workers
            if self._closed or not self._started:
                return workers
            while self._live > workers:
                self._tasks.put(None)  # retire marker, behind the queued tasks
                self._live -= 1
            self._top_up()
        return workers

    def shutdown(
        self, wait: bool = False, cancel_futures: bool = True, timeout_s: float = 10.0
    ) -> None:
        """Stop every thread after its current task; with ``cancel_futures`` queued tasks are
        cancelled; with ``wait`` the threads are joined (at most ``timeout_s`` in all), so none
        is left running into interpreter shutdown (idempotent).

        A daemon thread still alive when the interpreter finalises is ended with
        ``pthread_exit``, whose forced unwinding through native frames aborts the process
        ("terminate called without an active exception", exit -6): measured on SIGTERM with
        batches in flight before this join existed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending: list[_Task] = []
            if cancel_futures:
                while True:
                    try:
                        item = self._tasks.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        pending.append(item)
            for _ in range(self._live):
                self._tasks.put(None)
            self._live = 0
        for future, _, _ in pending:
            future.cancel()
        if wait:
            deadline_s = time.monotonic() + timeout_s
            for thread in self._threads:
                thread.join(max(0.0, deadline_s - time.monotonic()))

    def _top_up(self) -> None:
        while self._live < self._target:
            thread = threading.Thread(
                target=self._work, name=f"decode_{next(self._names)}", daemon=True
            )
            thread.start()
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
            self._live += 1

    def _work(self) -> None:
        while (item := self._tasks.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)


class ThreadDecoder:
    """Decodes one lane's batches inline (on the calling dispatcher thread) or on the shared
    :class:`DecodeThreads`, one task per worker over a contiguous slice of rows (as many slices
    as the pool has threads when the batch is split).

    Which way is ``route``'s: a fixed way, or a :class:`DecodeRoutePolicy` that this decoder
    owns from now on (only the lane's dispatcher calls :meth:`decode`, so it needs no lock).
    Both ways fill the same rows and report the same per-row errors (oversized values are
    never decoded); only batches decoded on the pool are reported to the decode sizer (inline
    ones do not use the pool).

    Args:
        workload: the pipeline's decoder.
        threads: the process-wide decode threads.
        max_message_bytes: larger values fail with a :class:`DecodeError` without decoding.
        lane: this pipeline's input topic (names its samples and logs).
        on_sample: called with each pool-decoded batch's :class:`DecodeSample` (the sizer).
        route: ``"pool"`` (the default), ``"inline"``, or a policy choosing per batch.
        on_route: called with the way the lane now decodes, at start and after each change
            (the ``streamproc_decode_inline`` gauge).
    """

    def __init__(
        self,
        workload: Workload,
        threads: DecodeThreads,
        max_message_bytes: int,
        lane: str = "",
        on_sample: OnSample | None = None,
        route: Route | DecodeRoutePolicy = "pool",
        on_route: Callable[[Route], None] | None = None,
    ) -> None:
        self._workload = workload
        self._threads = threads
        self._max_message_bytes = max_message_bytes
        self._lane = lane
        self._on_sample = on_sample
        self._policy = route if isinstance(route, DecodeRoutePolicy) else None
        self._fixed: Route = route if isinstance(route, str) else route.settled
        self._on_route = on_route
        if on_route is not None:
            on_route(self._fixed)

    @property
    def route(self) -> Route:
        """The way this lane decodes outside probes."""
        return self._fixed if self._policy is None else self._policy.settled

    def decode(self, records: Sequence[Record], slab: Slab) -> Failures:
        started_s = time.perf_counter()
        cpu_start_s = time.thread_time()
        route = self._fixed if self._policy is None else self._policy.route()
        failed = oversized(records, self._max_message_bytes)
        workers = 0  # inline: no pool worker
        pool_cpu_s = 0.0  # CPU of the decode threads on this batch
        if route == "inline":
            failed.update(decode_rows(self._workload, records, slab.array, 0, failed))
        else:
            workers = self._threads.workers
            futures = [
                self._threads.submit(
                    _timed_decode_rows,
                    self._workload,
                    records[start:stop],
                    slab.array,
                    start,
                    failed,
                )
                for start, stop in _slices(len(records), workers)
            ]
            for future in futures:
                found, cpu_s = future.result()
                failed.update(found)
                pool_cpu_s += cpu_s
        decode_s = time.perf_counter() - started_s
        if route == "pool" and self._on_sample is not None:
            self._on_sample(DecodeSample(self._lane, len(records), decode_s, workers))
        if self._policy is not None:
            cpu_s = time.thread_time() - cpu_start_s + pool_cpu_s
            probing = self._policy.probing
            change = self._policy.observe(route, len(records), decode_s, cpu_s)
            if change is None and probing and not self._policy.probing:
                log.debug("decode route kept", topic=self._lane, reason=self._policy.last_probe)
            if change is not None:
                log.info(
                    "decode route changed", topic=self._lane, to=change.route, reason=change.reason
                )
                if self._on_route is not None:
                    self._on_route(change.route)
        return failed


def _timed_decode_rows(
    workload: Workload,
    records: Sequence[Record],
    rows: np.ndarray,
    start: int,
    skip: Collection[int],
) -> tuple[Failures, float]:
    """:func:`decode_rows` on a decode thread, with the CPU seconds it took there."""
    cpu_start_s = time.thread_time()
    failed = decode_rows(workload, records, rows, start, skip)
    return failed, time.thread_time() - cpu_start_s


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


def _init_process(lanes: dict[str, LaneSpec], parent_pid: int) -> None:
    """Decode-process initializer: detach from terminal signals, watch the parent, build each
    lane's workload and map its slabs."""
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


def _exit_with_parent(parent_pid: int, period_s: float = 0.5) -> None:
    """Exit once the consumer process is gone (kill -9, or a second signal's immediate exit):
    a decode process must never outlive it, holding its memory and the shared slabs."""
    while os.getppid() == parent_pid:
        time.sleep(period_s)  # a liveness poll, not synchronisation
    os._exit(0)


def _ready() -> int:
    """Warm-up task: proves the process finished its initializer; answers its pid."""
    return os.getpid()


def _decode_in_process(
    lane: str, slab_index: int, start: int, records: list[Record], skip: set[int]
) -> Failures:
    workload, views = _LANES[lane]
    return decode_rows(workload, records, views[slab_index], start, skip)


class DecodeProcesses:
    """The decode worker processes shared by every pipeline of this consumer, resizable.

    Each worker is a process of its own (a one-process ``ProcessPoolExecutor``): a process that
    dies breaks only the slices it held, it alone is replaced, and the count can grow or shrink
    one process at a time. Lanes are registered while the pipeline is built; :meth:`start`
    spawns ``workers`` processes (``spawn``: the consumer process runs librdkafka and torch
    threads, which must not be forked) and returns once each has built its workloads and mapped
    the slabs (its first task, :func:`_ready`, ran: one process per executor, so that proves
    this process is up).

    Args:
        workers: processes at start.
    """

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"decode processes: need at least 1, got {workers}")
        self._start_count = workers
        self.generation = 0  # bumped by every restart of a process that died
        self._lanes: dict[str, LaneSpec] = {}
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

    def register(self, lane: str, spec: LaneSpec) -> None:
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
                initializer=_init_process,
                initargs=(self._lanes, os.getpid()),
            )
            for _ in range(count)
        ]
        try:
            # The executor spawns its process for the first task: all of them start at once.
            ready = [executor.submit(_ready) for executor in executors]
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
            return executor, executor.submit(_decode_in_process, *args)
        except (BrokenProcessPool, RuntimeError):
            # Broken by an earlier slice (any pipeline), or retired by a shrink since: nothing
            # of ours ran yet. Replace it if it is still ours, then queue on the running set.
            self.restart(executor)
        executor = self._pick(slot)
        return executor, executor.submit(_decode_in_process, *args)

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
        with self._lock:
            self._closed = True
            executors, self._executors = self._executors, []
            self._pids.clear()
        for executor in executors:
            executor.shutdown(wait=True, cancel_futures=True)


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
        self._max_message_bytes = max_message_bytes
        self._on_sample = on_sample

    def decode(self, records: Sequence[Record], slab: Slab) -> Failures:
        started_s = time.monotonic()
        workers = self._processes.workers
        failed = oversized(records, self._max_message_bytes)
        skip = set(failed)
        tasks = [
            (start, stop, slot, *self._submit(records, slab, start, stop, skip, slot))
            for slot, (start, stop) in enumerate(_slices(len(records), workers))
        ]
        for start, stop, slot, executor, future in tasks:
            try:
                failed.update(future.result())
                continue
            except BrokenProcessPool:
                # Its process died: by this slice, or by another slice queued there. Retry once.
                self._processes.restart(executor)
            executor, future = self._submit(records, slab, start, stop, skip, slot)
            try:
                failed.update(future.result())
            except BrokenProcessPool as exc:
                # Twice: we cannot tell which record of the slice kills the process, so the
                # whole slice is dead-lettered with the reason (never decoded in the consumer).
                for row in range(start, stop):
                    failed.setdefault(row, DecodeError(f"decode process died: {exc}"))
                self._processes.restart(executor)
        if self._on_sample is not None:
            self._on_sample(
                DecodeSample(self._lane, len(records), time.monotonic() - started_s, workers)
            )
        return failed

    def _submit(
        self,
        records: Sequence[Record],
        slab: Slab,
        start: int,
        stop: int,
        skip: set[int],
        slot: int,
    ) -> tuple[ProcessPoolExecutor, Future[Failures]]:
        return self._processes.submit(
            self._lane, slab.index, start, list(records[start:stop]), skip, slot
        )
