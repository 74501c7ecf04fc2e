"""The acknowledgement window: a byte bound on one lane's inputs whose results are produced and
not yet acknowledged.

A batch's results keep their inputs (``OutputBatch.records``, payloads included) until the last
delivery report, because a result refused for good dead-letters its input. The producer's
queue limits count the results' bytes and messages, not the inputs behind them (a 40 kB video
frame behind a result of a few hundred bytes), and a device's in-flight slot is freed when the
batch's results are handed to the sink, not when they are acknowledged. Without this window,
inputs held for acknowledgements that lag grow with the backlog while intake goes on.

The lane's results thread (or its dispatcher, on a fused lane) calls :meth:`AckWindow.hold`
before it hands a batch's results to the sink: while the lane's unacknowledged input bytes are
at ``buffers.max_unacknowledged_bytes`` or above it waits. The batch's last delivery report
(the ``sink`` thread, ``BatchAck``) calls what :meth:`AckWindow.hold` returned. While the results
thread waits, its resequencer holds the next results, their devices' in-flight slots stay taken,
the dispatcher stops cutting and the rings fill and pause: the same back-pressure as a busy
device.

Dead-letter records are not counted here: a dead-letter record carries its input's value (or
leaves an oversized one out), so the producer's queue limit (``queue.buffering.max.kbytes``)
bounds the inputs they keep. A result refused for good leaves the window with its batch's last
report, when its dead-letter record is produced.

The window admits a batch whenever it is below the limit, so the bytes held stay under
``limit + one batch's inputs`` and a batch larger than the limit still goes when it is alone.

A results producer replaced because a transactional call into it never returned (exactly-once,
``ResultsProducer.renew``) is never polled again: the batches it holds never get their last
report, and their transaction is aborted and their inputs consumed again. The sink then calls
:meth:`AckWindow.abandon`, which forgets every hold; a late :meth:`hold`'s settle call of one of
them does nothing. Forgetting a hold whose results still get acknowledged (one produced on the
lone-record producer, or a batch between :meth:`hold` and the transaction lock at that moment)
only loosens the bound by its bytes until then; keeping one that never settles would stop the
lane for ever.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from functools import partial

from prometheus_client import Counter, Gauge


class AckWindow:
    """One lane's unacknowledged input bytes and their limit.

    ======================  =====================================  ============================
    method                  called by                              does
    ======================  =====================================  ============================
    :meth:`hold`            results thread (dispatcher, fused)     wait below the limit, count
    (its return value)      ``sink`` thread (last delivery report) uncount, wake the waiter
    :meth:`abandon`         the thread renewing the producer       forget every hold
    :meth:`close`           main (pipeline drain)                  never wait again
    ======================  =====================================  ============================

    Its lock is a leaf: the gauge is set under it (the gauge's own lock takes no other), the
    wait counter after it is released.

    Args:
        limit_bytes: the lane's bound (``buffers.max_unacknowledged_bytes``), >= 1.
        held_gauge: ``streamproc_unacknowledged_bytes{topic}`` for the lane.
        wait_counter: ``streamproc_unacknowledged_wait_seconds_total{topic}`` for the lane.
        clock: monotonic seconds (injected in tests).

    Raises:
        ValueError: ``limit_bytes`` below 1.
    """

    def __init__(
        self,
        limit_bytes: int,
        held_gauge: Gauge,
        wait_counter: Counter,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if limit_bytes < 1:
            raise ValueError(f"limit_bytes must be >= 1, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self._held_gauge = held_gauge
        self._wait_counter = wait_counter
        self._clock = clock
        self._cond = threading.Condition()
        self._held = 0
        self._holds: dict[int, int] = {}  # hold number -> its bytes, until settled
        self._numbers = itertools.count()
        self._waiting = 0
        self._closed = False

    @property
    def held_bytes(self) -> int:
        """Input bytes whose results are produced and not yet acknowledged, now."""
        with self._cond:
            return self._held

    @property
    def waiting(self) -> int:
        """Threads waiting in :meth:`hold` now."""
        with self._cond:
            return self._waiting

    def hold(self, nbytes: int) -> Callable[[], None]:
        """Count ``nbytes`` of inputs about to be handed to the sink; first wait while the
        lane holds ``limit_bytes`` or more (not once :meth:`close` was called).

        Returns:
            The call that uncounts them, for the batch's last delivery report; a second call,
            or one after :meth:`abandon`, does nothing.
        """
        waited_s = 0.0
        with self._cond:
            if self._held >= self.limit_bytes and not self._closed:
                started_s = self._clock()
                self._waiting += 1
                self._cond.wait_for(lambda: self._closed or self._held < self.limit_bytes)
                self._waiting -= 1
                waited_s = self._clock() - started_s
            number = next(self._numbers)
            self._holds[number] = nbytes
            self._held += nbytes
            self._held_gauge.set(self._held)  # under the lock: in the order of the changes
        if waited_s:
            self._wait_counter.inc(waited_s)
        return partial(self._settle, number)

    def _settle(self, number: int) -> None:
        """Hold ``number``'s inputs were acknowledged (or dead-lettered): uncount them."""
        with self._cond:
            nbytes = self._holds.pop(number, None)
            if nbytes is None:
                return  # settled before, or abandoned
            self._held -= nbytes
            self._held_gauge.set(self._held)
            self._cond.notify_all()

    def abandon(self) -> None:
        """Forget every hold: their results will never be acknowledged (their producer was
        replaced; see the module docstring)."""
        with self._cond:
            self._holds.clear()
            self._held = 0
            self._held_gauge.set(0)
            self._cond.notify_all()

    def close(self) -> None:
        """Stop bounding (the pipeline drains: intake has stopped); wakes a waiting
        :meth:`hold`. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
