"""Processing guarantees: how results and input offsets become durable together.

One strategy is chosen at start-up (``processing_guarantee`` in the config) and handed to the
source and the sink, which never branch on the mode themselves:

======================  ==================================  ==================================
                        :class:`AtLeastOnce`                :class:`ExactlyOnce`
======================  ==================================  ==================================
consumer settings       (none)                              ``isolation.level=read_committed``
produce                 at once                             inside the open transaction, only
                                                            while the input's assignment is
                                                            current
an input is done        on its record's delivery report     once its record is in the
                                                            transaction
a record refused        the sink recovers it: sent again    the transaction aborts; the source
for good                alone, or dead-lettered             rewinds to the committed offsets
commits                 :class:`AtLeastOnceCommitter`       :class:`TransactionalCommitter`
======================  ==================================  ==================================
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from confluent_kafka import KafkaError

from streamproc.commit import (
    AtLeastOnceCommitter,
    Committer,
    OffsetTracker,
    TransactionalCommitter,
)
from streamproc.config import Scalar
from streamproc.logs import get_logger
from streamproc.metrics import Metrics
from streamproc.records import Record
from streamproc.transactions import Transactions

log = get_logger(__name__)


class Guarantee(Protocol):
    """What the source and the sink need of a processing guarantee."""

    name: str
    consumer_settings: dict[str, Scalar]
    committer: Committer

    def send(self, record: Record, produce: Callable[..., None], *args: Any) -> bool:
        """Produce the output (or dead-letter) record of input ``record`` with
        ``produce(*args)`` (arguments, not a closure: no allocation per record).

        Returns:
            False when nothing was produced (the input's assignment is gone; it will be
            consumed again by its next owner).
        """
        ...

    def send_batch(
        self, records: Sequence[Record], produce: Callable[[Sequence[int]], Sequence[int]]
    ) -> Sequence[int]:
        """Produce the output records of a batch of inputs with one call,
        ``produce(rows)``: it produces the output record of each ``records[row]`` for ``row``
        in ``rows`` and returns the rows the producer refused before sending (their delivery
        is already reported). One call per batch, not per record: the light workloads' produce
        loop has no layer per message.

        Returns:
            The rows not produced because their input's assignment is gone (exactly-once; it
            will be consumed again by its next owner); empty for at-least-once.
        """
        ...

    def acknowledged(self, records: Sequence[Record]) -> None:
        """The broker acknowledged the records produced for these inputs."""
        ...

    def sink_recovers(self, record: Record, err: KafkaError) -> bool:
        """The broker refused the record produced for ``record`` for good: True when the sink
        should recover it (send it again alone, dead-letter it); False when the guarantee
        handles it (the transaction aborts)."""
        ...


class AtLeastOnce:
    """Results are produced at once; an input is done when its record is acknowledged.

    Args:
        tracker: the offset tracker.
        metrics: commit counters.
    """

    name = "at_least_once"

    def __init__(self, tracker: OffsetTracker, metrics: Metrics) -> None:
        self._tracker = tracker
        self.consumer_settings: dict[str, Scalar] = {}
        self.committer: Committer = AtLeastOnceCommitter(tracker, metrics)

    def send(self, record: Record, produce: Callable[..., None], *args: Any) -> bool:
        produce(*args)
        return True

    def send_batch(
        self, records: Sequence[Record], produce: Callable[[Sequence[int]], Sequence[int]]
    ) -> Sequence[int]:
        produce(range(len(records)))
        return ()

    def acknowledged(self, records: Sequence[Record]) -> None:
        self._tracker.done_many(records)

    def sink_recovers(self, record: Record, err: KafkaError) -> bool:
        return True


class ExactlyOnce:
    """Results, dead-letter records and input offsets in one Kafka transaction.

    Args:
        tracker: the offset tracker.
        metrics: commit counters.
        transactions: the transactional producer's state (see ``streamproc.transactions``).
    """

    name = "exactly_once"

    def __init__(
        self, tracker: OffsetTracker, metrics: Metrics, transactions: Transactions
    ) -> None:
        self._tracker = tracker
        self.transactions = transactions
        self.consumer_settings: dict[str, Scalar] = {"isolation.level": "read_committed"}
        self.committer: Committer = TransactionalCommitter(tracker, metrics, transactions)

    def send(self, record: Record, produce: Callable[..., None], *args: Any) -> bool:
        with self.transactions.lock:
            if not self._tracker.is_current(record.tp, record.generation):
                self._tracker.late(record.tp, record.generation)
                return False
            self.transactions.produce(produce, *args)
            self._tracker.done(record.tp, record.offset, record.generation)
            return True

    def send_batch(
        self, records: Sequence[Record], produce: Callable[[Sequence[int]], Sequence[int]]
    ) -> Sequence[int]:
        """Produce the rows whose assignment is current inside the open transaction (one lock
        hold for the batch) and mark them done; count the others late."""
        tracker = self._tracker
        with self.transactions.lock:
            current: list[int] = []
            gone: list[int] = []
            for row, record in enumerate(records):
                if tracker.is_current(record.tp, record.generation):
                    current.append(row)
                else:
                    tracker.late(record.tp, record.generation)
                    gone.append(row)
            if current:
                refused = set(self.transactions.produce_many(produce, current))
                for row in current:
                    if row not in refused:
                        record = records[row]
                        tracker.done(record.tp, record.offset, record.generation)
        return gone

    def acknowledged(self, records: Sequence[Record]) -> None:
        """Nothing to do: inputs were done when their records joined the transaction."""

    def sink_recovers(self, record: Record, err: KafkaError) -> bool:
        log.warning(
            "record failed inside the transaction; it will abort",
            topic=record.tp.topic,
            partition=record.tp.partition,
            offset=record.offset,
            error=str(err),
        )
        return False
