"""The dispatcher: cut a batch when a device slot is free, decode it into a staging slab, submit.

One dispatcher thread per lane (input topic)::

    wait for an in-flight slot -> Lane.next_cut (the batcher decides, under the lane's lock)
      -> lease a staging slab -> the Decoder fills it (threads or processes, straight into the
         slab) -> DeviceWorker.submit

The in-flight slot is released by the result handler once the batch's results were handed to the
sink, so at most ``max_in_flight_batches`` batches per pipeline are between cut and produce.
Decode failures (and oversized values) travel with the batch as per-row errors and are
dead-lettered by the result handler, in order with the other results.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from streamproc.buffers import FlowControl
from streamproc.decoders import Decoder
from streamproc.lane import Lane
from streamproc.metrics import Metrics
from streamproc.records import Batch
from streamproc.worker import DeviceJob, DeviceWorker, StagingPool


class Dispatcher:
    """Feeds one lane's device worker.

    Args:
        lane: the lane whose cuts it takes.
        decoder: fills a leased slab from the batch's records.
        pool: staging slabs.
        worker: the device worker.
        slots: in-flight bound, released by the result handler.
        apply_flow: hands resume decisions to the source thread.
        metrics: process metrics.
        on_fatal: called with an exception that stops the dispatcher.
    """

    def __init__(
        self,
        lane: Lane,
        decoder: Decoder,
        pool: StagingPool,
        worker: DeviceWorker,
        slots: threading.Semaphore,
        apply_flow: Callable[[FlowControl], None],
        metrics: Metrics,
        on_fatal: Callable[[BaseException], None],
    ) -> None:
        topic = self.topic = lane.topic
        self._lane = lane
        self._decoder = decoder
        self._pool = pool
        self._worker = worker
        self._slots = slots
        self._apply_flow = apply_flow
        self._metrics = metrics
        self._on_fatal = on_fatal
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
        self._lane.wake()
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
        cut = self._lane.next_cut(self._stop)
        if cut is None:
            return None
        self._apply_flow(cut.flow)
        self._next_batch_id += 1
        n = len(cut.records)
        self.batch_sizes[n] = self.batch_sizes.get(n, 0) + 1
        self._batch_size.observe(n)
        self._queue_wait.observe_many(cut.cut_at_s - cut.consumed_s)
        return Batch(self._next_batch_id, tuple(cut.records), cut.cut_at_s, cut.reason)

    def _decode(self, batch: Batch) -> DeviceJob:
        slab = self._pool.lease()
        assert slab is not None
        self._pool_in_use.set(self._pool.in_use)
        return DeviceJob(batch, slab, self._decoder.decode(batch.records, slab))
