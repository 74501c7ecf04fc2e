"""Delivery accounting of one batch of results: its inputs are done only when every report is in.

:class:`BatchAck` counts a batch's delivery reports down. A success only counts down; when the
batch's last report is in, its acknowledged inputs go to the :class:`DeliveryHandler` in one
call. A failed report is handed to the handler as a :class:`RefusedResult`: the handler either
produces the result again (its next report comes back to the ack, judged ``alone``) or fails it
for good (dead-lettered, or left to the guarantee's aborting transaction); a result failed for
good is left out of the acknowledged inputs. The ack knows the handler only through that
protocol.

Thread ownership: reports arrive on whichever thread polls the producer (the ``sink`` thread, a
sender waiting out a full queue, a flush); ``next()`` on an ``itertools.count`` is atomic under
the GIL, so exactly one report sees the last count, without a lock per record. A failure adds
its row to the failed set before it counts down; a failure that stands for several alike rows
marks them blamed and raises the number of reports to count (under a module-wide lock, as
failures are rare) before any of them counts down, so no report sees the old last count early
and no row is blamed twice. The value -> rows map is built whole before it is published.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, cast

from confluent_kafka import KafkaError

from streamproc.kafka.protocols import DeliveryCallback
from streamproc.offsets.guarantees import How
from streamproc.output.headers import OutputHeaders
from streamproc.records import Laps, Record

Row = int
"""A result's index in its batch."""

_MORE_REPORTS = threading.Lock()
"""Serialises :class:`BatchAck` raising its count of reports (rare: a failure among alike rows)."""


@dataclass(frozen=True, slots=True)
class OutputBatch:
    """One batch's results to one output topic (treated as immutable).

    Attributes:
        topic: the output topic.
        dead_letter_topic: where a result that cannot be produced sends its input instead.
        records: the input of each result, in batch order.
        values: each result's value.
        headers: each result's complete headers.
        clock: the batch's stage clock (None: not timed); its ``produce`` stage ends with the
            batch's last report.
        cut_at_s: when the batch was cut (``Batch.cut_at_s``, monotonic seconds); None for a
            batch that ran on no device (every record expired) or where not known.
    """

    topic: str
    dead_letter_topic: str
    records: Sequence[Record]
    values: Sequence[bytes]
    headers: Sequence[OutputHeaders]
    clock: Laps | None = None
    cut_at_s: float | None = None

    def refused(self, row: Row, error: KafkaError, how: How) -> RefusedResult:
        """Result ``row`` refused with ``error``, judged as ``how`` says."""
        return RefusedResult(
            self.records[row],
            self.topic,
            self.values[row],
            self.headers[row],
            self.dead_letter_topic,
            error,
            how,
        )


@dataclass(frozen=True, slots=True)
class RefusedResult:
    """A result the producer or the broker refused.

    Attributes:
        record: its input.
        topic: the output topic.
        value: the result's value.
        headers: the result's complete headers.
        dead_letter_topic: where its input goes if it cannot be produced.
        error: the refusal.
        how: how the refusal was judged (``local``: by the producer, before sending).
    """

    record: Record
    topic: str
    value: bytes
    headers: OutputHeaders
    dead_letter_topic: str
    error: KafkaError
    how: How


class DeliveryHandler(Protocol):
    """What a batch's acknowledgement needs of the sink that produced the batch."""

    def recover(self, refused: RefusedResult, report: DeliveryCallback) -> bool:
        """Handle a refused result.

        Returns:
            True when it was produced again (its next delivery report goes to ``report``);
            False when it failed for good (dead-lettered, or the transaction aborts).
        """
        ...

    def acknowledged(
        self,
        topic: str,
        records: Sequence[Record],
        exemplar: dict[str, str] | None = None,
        cut_s: float | None = None,
    ) -> None:
        """Every report of a batch to ``topic`` is in: the broker acknowledged the results of
        ``records`` (inputs in batch order; those failed for good are left out); ``exemplar``:
        the batch's sampled trace id, for its latency observations; ``cut_s``: when the batch
        was cut (monotonic seconds; None: not known)."""
        ...


class BatchAck:
    """Delivery accounting for one batch of results.

    One delivery callback serves the whole batch, :meth:`delivered`, not one closure per record
    (under overload a closure per expired result cost 2 of its 12 CPU-µs). A failed report
    carries the record's key and value but not its headers, so the failed row is found by its
    value, then by its key among rows whose values are byte-identical (every expired result is
    empty). Rows alike in both cannot be told apart: each of them is taken as refused (see
    :meth:`delivered`).

    Args:
        handler: recovers refused results and takes acknowledged inputs.
        batch: the results.
        settle: called once, after the last report is handled (the lane's
            :class:`~streamproc.output.window.AckWindow` uncounts the batch's inputs); None: none.

    Attributes:
        batch: the results.
    """

    __slots__ = (
        "_acks",
        "_blamed",
        "_failed",
        "_handler",
        "_rows",
        "_settle",
        "_size",
        "batch",
    )

    def __init__(
        self,
        handler: DeliveryHandler,
        batch: OutputBatch,
        settle: Callable[[], None] | None = None,
    ) -> None:
        self._handler = handler
        self._settle = settle
        self.batch = batch
        self._size = len(batch.records)  # reports to count down (more once rows are alike)
        self._failed: set[Row] = set()
        self._blamed: set[Row] | None = None  # alike rows taken as refused by one report
        self._rows: dict[bytes, list[Row]] | None = None  # value -> rows, at the first failure
        self._acks = itertools.count(1)

    def delivered(self, err: KafkaError | None, msg: Any) -> None:
        """A delivery report from librdkafka for any row of the batch.

        A failed one names its row by value, then by key. Where several rows are alike in both,
        the report cannot say which of them failed: each of them not yet settled is taken as
        refused, once (the handler produces its result again or dead-letters its input), and
        the batch waits for one report more per extra row; a later failed report of the same
        rows is covered by those and only counts. A row that was in fact acknowledged then has
        its result twice, or a result and a dead-letter record: at least once, never none.
        """
        if err is None:
            self._count_down()
            return
        assert msg is not None  # librdkafka passes the message, its key and value included
        rows = self._rows
        if rows is None:  # built whole before it is shared: another thread may read it at once
            built: dict[bytes, list[Row]] = {}
            for row, value in enumerate(self.batch.values):
                built.setdefault(value, []).append(row)
            rows = self._rows = built
        alike = rows[cast(bytes, msg.value())]
        if len(alike) > 1:
            alike = self._unsettled(alike, msg.key())
            if len(alike) != 1:
                for row in alike:
                    self.delivered_row(row, err, msg)
                if not alike:  # each such row failed for good, or is being produced again
                    self._count_down()
                return
        self.delivered_row(alike[0], err, msg)

    def _unsettled(self, alike: list[Row], key: bytes | None) -> list[Row]:
        """The rows of ``alike`` (byte-identical values) with input key ``key`` that neither
        failed for good nor were blamed before. Two or more are blamed now: the count of reports
        due rises by one per extra row before any of them counts down."""
        records, failed = self.batch.records, self._failed
        with _MORE_REPORTS:  # failed reports may arrive on two threads at once
            blamed = self._blamed
            unsettled = [
                row
                for row in alike
                if records[row].key == key
                and row not in failed
                and (blamed is None or row not in blamed)
            ]
            if len(unsettled) > 1:
                if blamed is None:
                    blamed = self._blamed = set()
                blamed.update(unsettled)
                self._size += len(unsettled) - 1
        return unsettled

    def delivered_row(self, row: Row, err: KafkaError | None, msg: Any, how: How = "batch") -> None:
        """The delivery report of result ``row`` (``err`` None on success); ``how`` it was
        judged when refused (``local``: by the producer, before sending)."""
        if err is not None:
            refused = self.batch.refused(row, err, how)
            if self._handler.recover(refused, partial(self.delivered_row, row, how="alone")):
                return  # produced again, alone: its next report decides
            self._failed.add(row)
        self._count_down()

    def skipped(self, row: Row) -> None:
        """Result ``row`` was not produced (dead-lettered instead, or its assignment is gone)."""
        self._failed.add(row)
        self._count_down()

    def _count_down(self) -> None:
        if next(self._acks) != self._size:
            return
        batch = self.batch
        exemplar = None
        if batch.clock is not None:
            batch.clock.lap("produce")
            if batch.clock.trace is not None:
                exemplar = batch.clock.trace.exemplar
        records: Sequence[Record] = batch.records
        if self._failed:
            failed = self._failed
            records = [r for i, r in enumerate(records) if i not in failed]
        try:
            self._handler.acknowledged(batch.topic, records, exemplar, batch.cut_at_s)
        finally:
            if self._settle is not None:
                self._settle()
