"""The dispatcher: cut a batch when a device slot is free, decode it into a staging slab, submit.

One dispatcher thread per pipeline (input topic)::

    wait for an in-flight slot -> ask the Batcher (under the rings' lock) -> take records
      -> lease a staging slab -> the Decoder fills it (threads or processes, straight into the
         slab) -> DeviceWorker.submit

The in-flight slot is released by the result handler once the batch's results were handed to the
sink, so at most ``max_in_flight_batches`` batches per pipeline are between cut and produce.
Decode failures (and oversized values) travel with the batch as per-row errors and are
dead-lettered by the result handler, in order with the other results.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from streamproc.batcher import Batcher, Cut
from streamproc.buffers import FlowControl
from streamproc.decoders import Decoder
from streamproc.metrics import Metrics
from streamproc.records import Batch
from streamproc.source import TopicLane
from streamproc.worker import DeviceJob, DeviceWorker, StagingPool


class Dispatcher:
    """Feeds one pipeline's device worker.

    Args:
        topic: the input topic.
        lane: the topic's rings and their condition.
        batcher: cut policy.
        decoder: fills a leased slab from the batch's records.
        pool: staging slabs.
        worker: the device worker.
        slots: in-flight bound, released by the result handler.
        apply_flow: hands resume decisions to the source thread.
        metrics: process metrics.
        clock: monotonic clock in seconds (injected for tests).
    """

    def __init__(
        self,
        topic: str,
        lane: TopicLane,
        batcher: Batcher,
        decoder: Decoder,
        pool: StagingPool,
        worker: DeviceWorker,
        slots: threading.Semaphore,
        apply_flow: Callable[[FlowControl], None],
        metrics: Metrics,
        on_fatal: Callable[[BaseException], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.topic = topic
        self._lane = lane
        self._batcher = batcher
        self._decoder = decoder
        self._pool = pool
        self._worker = worker
        self._slots = slots
        self._apply_flow = apply_flow
        self._metrics = metrics
        self._on_fatal = on_fatal
        self._clock = clock
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
        consumed_s = np.fromiter((r.consumed_at_s for r in records), np.float64, n)
        self._queue_wait.observe_many(now_s - consumed_s)
        self._batcher.cut(consumed_s)
        return Batch(self._next_batch_id, tuple(records), now_s, decision.reason)

    def _decode(self, batch: Batch) -> DeviceJob:
        slab = self._pool.lease()
        assert slab is not None
        self._pool_in_use.set(self._pool.in_use)
        return DeviceJob(batch, slab, self._decoder.decode(batch.records, slab))
