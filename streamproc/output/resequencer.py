"""The resequencer: one lane's completed batches, from any of its devices, back in cut order.

Two devices finish batches out of order (a fast one overtakes a slow one). Per input partition,
results must still be produced in offset order, and the batcher cuts a partition's records in
offset order into batches with increasing ids (``1, 2, 3, ...`` per lane). So the lane hands
results to its result handler in batch-id order, which is offset order within every partition::

    completion-<device> threads (device-<cpu:K> on CPU) --put(result, release)--> held {id: result}
        results-<topic> thread: waits for the next id -> on_result (encode, produce)
                                -> release (output buffers back) -> on_released (in-flight slot)

A result that arrives early waits here, holding its device's output buffer set; a device with
all its sets held waits too, so the wait is bounded by the devices' in-flight limits (no queue
grows). The dispatcher places each batch on the device expected to finish it first, so results
mostly arrive in order already and little is held. With one device nothing is ever held.

A batch whose every record expired at the cut (``Batch.records`` empty) was never placed on a
device: it is handed over in its turn like the others, but ``on_released`` is not called for it.

Ownership: the held results and the next id belong to the resequencer (its condition; a leaf
lock: nothing else is taken while it is held, and callbacks run outside it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from streamproc.device.jobs import DeviceResult, Release
from streamproc.logs import get_logger
from streamproc.metrics import Metrics

log = get_logger(__name__)


class Resequencer:
    """Hands one lane's :class:`DeviceResult` values to ``on_result`` in batch-id order.

    Args:
        topic: the lane's input topic (thread name, logs).
        on_result: the result handler, called on the ``results-<topic>`` thread, one batch at a
            time, ids ``first_batch_id, first_batch_id + 1, ...`` without gaps.
        on_released: called with the batch id after ``on_result`` returned and the batch's
            output buffers were released (the lane's in-flight accounting); not for a batch
            that ran on no device (every record expired).
        on_fatal: called with an exception raised by ``on_result`` (the thread then stops; what
            it holds is released at :meth:`close`).
        first_batch_id: the id of the lane's first batch (the dispatcher counts from 1).
        metrics: where ``streamproc_results_waiting_batches{topic}`` is kept (optional).
    """

    def __init__(
        self,
        topic: str,
        on_result: Callable[[DeviceResult], None],
        on_released: Callable[[int], None],
        on_fatal: Callable[[BaseException], None],
        first_batch_id: int = 1,
        metrics: Metrics | None = None,
    ) -> None:
        self._waiting = None if metrics is None else metrics.results_waiting.labels(topic)
        self._reported = -1  # the gauge's value (set on the first report)
        self.topic = topic
        self._on_result = on_result
        self._on_released = on_released
        self._on_fatal = on_fatal
        self._cond = threading.Condition()
        self._held: dict[int, tuple[DeviceResult, Release]] = {}
        self._next = first_batch_id
        self._handed = first_batch_id - 1  # the last batch whose hand-over returned
        self._closing = False
        self._closed = False
        self.max_waiting = 0  # most results ever waiting for an earlier batch (tests, benches)
        self._thread = threading.Thread(target=self._run, name=f"results-{topic}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def thread_ident(self) -> int | None:
        """The ``results-<topic>`` thread (``threading.get_ident``; None before :meth:`start`)."""
        return self._thread.ident

    @property
    def held(self) -> int:
        """Completed results not handed over yet (the next one included, if here)."""
        with self._cond:
            return len(self._held)

    @property
    def next_batch_id(self) -> int:
        """The batch whose result goes out next."""
        with self._cond:
            return self._next

    def put(self, result: DeviceResult, release: Release) -> None:
        """A device completed ``result`` (completion threads). Its outputs stay valid until the
        resequencer calls ``release``, after the handler, or at :meth:`close` if dropped.

        Raises:
            ValueError: the batch id was already handed over or is held (a device reported a
                batch twice).
        """
        batch_id = result.batch.batch_id
        with self._cond:
            if batch_id < self._next or batch_id in self._held:
                raise ValueError(f"batch {batch_id} completed twice (next is {self._next})")
            closed = self._closed
            if not closed:
                self._held[batch_id] = result, release
                waiting = self._waiting_now()
                self.max_waiting = max(self.max_waiting, waiting)
                if batch_id == self._next:
                    self._cond.notify_all()
        if not closed:
            self._report(waiting)
            return
        # closed: nobody hands it over any more (a device that outlived the drain)
        log.warning("result after close dropped", topic=self.topic, batch_id=batch_id)
        release()
        self._released(result)

    def caught_up(self, batch_id: int, stop: threading.Event, timeout_s: float = 0.5) -> bool:
        """Wait until every batch before ``batch_id`` was handed over, its ``on_result``
        returned (a fused lane's switch from its staged route: the results in flight are
        produced first, so a partition's results stay in offset order); False once ``stop`` is
        set first. Wakes every ``timeout_s`` to look at ``stop``."""
        with self._cond:
            while self._handed < batch_id - 1:
                if stop.is_set():
                    return False
                self._cond.wait(timeout_s)
            if self._next != batch_id or self._handed != batch_id - 1:
                raise ValueError(f"batch {batch_id} already handed over (next is {self._next})")
            return True

    def hand_over_here(self, result: DeviceResult, release: Release) -> bool:
        """Hand ``result`` over on the calling thread (a fused lane: the batch was cut,
        decoded and run on this thread): ``on_result``, then ``release`` and
        ``on_released``, as the results thread would. The batch must be the
        next one, with nothing held (:meth:`caught_up` returned True for it). Returns False
        (nothing produced; ``release`` and ``on_released`` called, a warning logged) once the
        resequencer is closed: the drain gave up on the batch, its inputs stay uncommitted.

        Raises:
            ValueError: the batch is not the next one, or results are held.
            Exception: what ``on_result`` raised (after ``release`` and ``on_released``).
        """
        batch_id = result.batch.batch_id
        with self._cond:
            closed = self._closed
            if not closed and (batch_id != self._next or self._held):
                raise ValueError(
                    f"batch {batch_id} handed over here while {self._next} is next and "
                    f"{sorted(self._held)} are held"
                )
        if closed:  # the drain gave up on this batch: as put() does, it is not produced
            log.warning("result after close dropped", topic=self.topic, batch_id=batch_id)
            release()
            self._released(result)
            return False
        self._hand_over(result, release, taken=False)
        return True

    def _waiting_now(self) -> int:
        """Held results behind the first batch id not completed yet (under the condition);
        results merely queued for the results thread do not count."""
        first_missing = self._next
        while first_missing in self._held:
            first_missing += 1
        return len(self._held) - (first_missing - self._next)

    def _report(self, waiting: int) -> None:
        """Set the waiting gauge when the count changed (twice per batch it mostly did not)."""
        if self._waiting is not None and waiting != self._reported:
            self._reported = waiting
            self._waiting.set(waiting)

    def _run(self) -> None:
        try:
            while (item := self._take()) is not None:
                self._hand_over(*item, taken=True)
        except BaseException as exc:
            self._on_fatal(exc)

    def _hand_over(self, result: DeviceResult, release: Release, taken: bool) -> None:
        """``on_result``, then (also when it raised) ``release``, ``on_released``, and the
        batch counted as handed over; ``taken``: :meth:`_take` moved the next batch id already
        (the results thread), else it moves here (a fused lane's own thread)."""
        try:
            self._on_result(result)
        finally:
            release()
            self._released(result)
            with self._cond:
                self._handed = result.batch.batch_id
                if taken:
                    self._cond.notify_all()  # a fused lane waiting to catch up
                else:  # a fused lane's own batch: no one waits for it, the results thread
                    self._next += 1  # least of all (a wake-up per batch, measured)

    def _take(self) -> tuple[DeviceResult, Release] | None:
        """The next batch's result, once here; None when closing and it is not here."""
        with self._cond:
            self._cond.wait_for(lambda: self._next in self._held or self._closing)
            item = self._held.pop(self._next, None)
            if item is not None:
                self._next += 1
            waiting = self._waiting_now()
        self._report(waiting)
        return item

    def close(self, timeout_s: float) -> None:
        """Hand over every result that can go in order, then stop (idempotent; call after the
        lane's device workers closed, so no result is still coming but from a stuck device).

        Results still waiting behind a batch that never completed are dropped (their inputs
        stay uncommitted and are consumed again after a restart) and their output buffers
        released; a warning names the batch they waited for.
        """
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        with self._cond:
            self._closed = True
            dropped = sorted(self._held.items())
            self._held.clear()
            waiting_for = self._next
        if dropped:
            log.warning(
                "results dropped at close: they waited for an earlier batch that never "
                "completed (their inputs stay uncommitted)",
                topic=self.topic,
                waiting_for_batch=waiting_for,
                dropped_batches=[batch_id for batch_id, _ in dropped],
            )
        for _, (result, release) in dropped:
            release()
            self._released(result)

    def _released(self, result: DeviceResult) -> None:
        """``on_released`` for a batch that held a device slot (one with rows to run)."""
        if result.batch.records:
            self._on_released(result.batch.batch_id)
