"""Decode on threads of this process (``worker.decode_mode: thread``, the default).

:class:`DecodeThreads` are the decode threads every pipeline of the process shares, resizable at
run time by the decode sizer. :class:`ThreadDecoder` decodes one lane's batches on them, one task
per thread over a contiguous slice of rows, or inline on the lane's dispatcher thread, as the
lane's route says (:mod:`streamproc.decode.route`). The hand-off costs next to nothing, so
threads suit light payloads (JSON trades, sensor windows), and they scale wherever decode
releases the GIL (Pillow's JPEG decoder does).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np

from streamproc.decode.protocol import DecodeSample, DecodeSlab, Failures, OnSample
from streamproc.decode.route import DecodeRoutePolicy, Route
from streamproc.decode.rows import decode_rows, oversized, row_slices
from streamproc.logs import get_logger
from streamproc.records import Record
from streamproc.routes import observe_logged
from streamproc.workloads import Workload

log = get_logger(__name__)

T = TypeVar("T")

_Task = tuple["Future[Any]", Callable[..., Any], tuple[Any, ...]]


class DecodeThreads:
    """The decode threads shared by every pipeline of this consumer, resizable at run time.

    Threads are named ``decode_<n>`` and started on the first :meth:`submit` (a pipeline that
    fails to build leaves none behind). :meth:`resize` starts threads at once, or queues one
    retire marker per surplus thread behind the tasks already queued: a thread that takes one
    finishes and exits, so no task is dropped and a shrink never waits.

    Args:
        workers: threads at start (>= 1).

    Raises:
        ValueError: ``workers`` < 1 (here and in :meth:`resize`).
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
        is left running into interpreter shutdown, where a daemon thread still decoding can
        abort the process (idempotent)."""
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
    :class:`DecodeThreads`, one task per thread over a contiguous slice of rows (as many slices
    as there are decode threads when the batch is split).

    Which way is ``route``'s: a fixed way, or a :class:`DecodeRoutePolicy` that this decoder
    owns from now on (only the lane's dispatcher calls :meth:`decode`, so it needs no lock).
    Both ways fill the same rows and report the same per-row errors (oversized values are
    never decoded); only batches decoded on the threads are reported to the decode sizer
    (inline ones do not use them).

    Args:
        workload: the pipeline's decoder.
        threads: the process-wide decode threads.
        max_message_bytes: larger values fail with a :class:`DecodeError` without decoding.
        lane: this pipeline's input topic (names its samples and logs).
        on_sample: called with the :class:`DecodeSample` of each batch decoded on the
            threads (the decode sizer).
        route: ``"pool"`` (the decode threads; the default), ``"inline"``, or a policy
            choosing per batch.
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
        self.hold_probes = False  # the lane's dispatcher holds the route's probes (Decoder)
        if on_route is not None:
            on_route(self._fixed)

    @property
    def probing(self) -> bool:
        """The decode route is being measured now (batches alternate inline and pool)."""
        return self._policy is not None and self._policy.probing

    @property
    def route(self) -> Route:
        """The way this lane decodes outside probes."""
        return self._fixed if self._policy is None else self._policy.settled

    def decode(self, records: Sequence[Record], slab: DecodeSlab) -> Failures:
        """:meth:`Decoder.decode <streamproc.decode.protocol.Decoder.decode>`, inline or on
        the decode threads as the route says."""
        started_s = time.perf_counter()
        cpu_start_s = time.thread_time()
        route = self._fixed if self._policy is None else self._policy.route(self.hold_probes)
        failed = oversized(records, self._max_message_bytes)
        workers = 0  # inline: no decode thread
        threads_cpu_s = 0.0  # CPU of the decode threads on this batch
        if route == "inline":
            failed.update(decode_rows(self._workload, records, slab.array, 0, failed))
        else:
            workers = self._threads.workers
            threads_cpu_s = self._decode_on_threads(records, slab.array, failed, workers)
        decode_s = time.perf_counter() - started_s
        if route == "pool" and self._on_sample is not None:
            self._on_sample(DecodeSample(self._lane, len(records), decode_s, workers))
        if self._policy is not None:
            cpu_s = time.thread_time() - cpu_start_s + threads_cpu_s
            self._observe(self._policy, route, len(records), decode_s, cpu_s)
        return failed

    def _decode_on_threads(
        self, records: Sequence[Record], rows: np.ndarray, failed: Failures, workers: int
    ) -> float:
        """Decode one slice per thread into ``rows``, skipping the rows in ``failed`` and adding
        each slice's failures to it; returns the CPU seconds the threads spent."""
        futures = [
            self._threads.submit(
                _timed_decode_rows, self._workload, records[start:stop], rows, start, failed
            )
            for start, stop in row_slices(len(records), workers)
        ]
        threads_cpu_s = 0.0
        for future in futures:
            found, cpu_s = future.result()
            failed.update(found)
            threads_cpu_s += cpu_s
        return threads_cpu_s

    def _observe(
        self, policy: DecodeRoutePolicy, route: Route, items: int, decode_s: float, cpu_s: float
    ) -> None:
        """Tell the route policy what a batch cost (logged; a change goes to ``on_route``)."""
        observe_logged(
            policy, route, items, decode_s, cpu_s, topic=self._lane, on_change=self._on_route
        )


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
