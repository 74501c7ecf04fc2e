"""The dispatcher: cut a batch when a device slot is free, decode it into a staging slab, submit.

One dispatcher thread per pipeline (input topic)::

    wait for an in-flight slot -> ask the Batcher (under the rings' lock) -> take records
      -> lease a staging slab -> decode rows on the decode pool, straight into the slab
      -> DeviceWorker.submit

The in-flight slot is released by the result handler once the batch's results were handed to the
sink, so at most ``max_in_flight_batches`` batches per pipeline are between cut and produce.
Decode failures (and oversized values) travel with the batch as per-row errors and are
dead-lettered by the result handler, in order with the other results.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor

import numpy as np

from streamproc.batcher import Batcher, Cut
from streamproc.buffers import FlowControl
from streamproc.errors import DecodeError, RecordError
from streamproc.metrics import Metrics
from streamproc.records import Batch, Record
from streamproc.source import TopicLane
from streamproc.worker import DeviceJob, DeviceWorker, StagingPool
from streamproc.workloads import Workload


class Dispatcher:
    """Feeds one pipeline's device worker.

    Args:
        topic: the input topic.
        lane: the topic's rings and their condition.
        batcher: cut policy.
        workload: decoder.
        pool: staging slabs.
        worker: the device worker.
        decode_pool: executor running ``workload.decode``.
        slots: in-flight bound, released by the result handler.
        apply_flow: hands resume decisions to the source thread.
        max_message_bytes: larger values are dead-lettered without decoding.
        metrics: process metrics.
        clock: monotonic clock in seconds (injected for tests).
        decode_chunks: a batch is decoded as this many contiguous slices in parallel (the
            decode pool's size).
    """

    def __init__(
        self,
        topic: str,
        lane: TopicLane,
        batcher: Batcher,
        workload: Workload,
        pool: StagingPool,
        worker: DeviceWorker,
        decode_pool: Executor,
        slots: threading.Semaphore,
        apply_flow: Callable[[FlowControl], None],
        max_message_bytes: int,
        metrics: Metrics,
        on_fatal: Callable[[BaseException], None],
        clock: Callable[[], float] = time.monotonic,
        decode_chunks: int = 1,
    ) -> None:
        self.topic = topic
        self._lane = lane
        self._batcher = batcher
        self._workload = workload
        self._pool = pool
        self._worker = worker
        self._decode_pool = decode_pool
        self._slots = slots
        self._apply_flow = apply_flow
        self._max_message_bytes = max_message_bytes
        self._metrics = metrics
        self._on_fatal = on_fatal
        self._clock = clock
        self._decode_chunks = max(1, decode_chunks)
        self._batch_size = metrics.batch_size.labels(topic)
        self._queue_wait = metrics.queue_wait.labels(topic)
        self._pool_in_use = metrics.pool_in_use.labels(topic)
        self._stop = threading.Event()
        self._next_batch_id = 0
        self.batch_sizes: dict[int, int] = {}
        self._thread = threading.Thread(target=self._run, name=f"dispatch-{topic}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Stop cutting batches (rings keep their records, uncommitted) and join."""
        self._stop.set()
        with self._lane.cond:
            self._lane.cond.notify_all()
        self._slots.release()  # wake a dispatcher blocked on a slot
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._slots.acquire()
                if self._stop.is_set():
                    return
                batch = self._next_batch()
                if batch is None:
                    self._slots.release()
                    return
                self._worker.submit(self._decode(batch))
        except BaseException as exc:
            self._on_fatal(exc)

    def _next_batch(self) -> Batch | None:
        cond = self._lane.cond
        with cond:
            while not self._stop.is_set():
                now_s = self._clock()
                decision = self._batcher.decide(self._lane.buffers.views(), now_s)
                if isinstance(decision, Cut):
                    records, flow = self._lane.buffers.take(
                        decision.count, self._batcher.max_batch_bytes, self._batcher.max_wait_s
                    )
                    break
                cond.wait(None if decision.until_s is None else decision.until_s - now_s)
            else:
                return None
        self._apply_flow(flow)
        self._next_batch_id += 1
        n = len(records)
        self.batch_sizes[n] = self.batch_sizes.get(n, 0) + 1
        self._batch_size.observe(n)
        for record in records:
            self._queue_wait.observe(now_s - record.consumed_at_s)
        return Batch(self._next_batch_id, tuple(records), now_s, decision.reason)

    def _decode(self, batch: Batch) -> DeviceJob:
        slab = self._pool.lease()
        assert slab is not None
        self._pool_in_use.set(self._pool.in_use)
        records = batch.records
        # One task per decode worker over a contiguous slice of rows, not one per message.
        step = -(-len(records) // self._decode_chunks)
        futures = [
            self._decode_pool.submit(self._decode_rows, records, slab.array, start, step)
            for start in range(0, len(records), step)
        ]
        failed: dict[int, RecordError] = {}
        for future in futures:
            failed.update(future.result())
        return DeviceJob(batch, slab, failed)

    def _decode_rows(
        self, records: tuple[Record, ...], rows: np.ndarray, start: int, count: int
    ) -> dict[int, RecordError]:
        """Decode ``records[start:start+count]`` into the same rows of the slab."""
        failed: dict[int, RecordError] = {}
        for row in range(start, min(start + count, len(records))):
            record = records[row]
            if record.value is not None and len(record.value) > self._max_message_bytes:
                failed[row] = DecodeError(
                    f"value of {len(record.value)} bytes exceeds "
                    f"worker.max_message_bytes={self._max_message_bytes}"
                )
                continue
            try:
                self._workload.decode(record, rows[row])
            except RecordError as exc:
                failed[row] = exc
            except Exception as exc:  # a workload bug must not stop the stream
                failed[row] = DecodeError(f"{type(exc).__name__}: {exc}")
        return failed
