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
a record refused        the sink recovers it: sent again    remembered (``offsets.refusals``);
for its own sake        alone, or dead-lettered             the transaction aborts, the source
                                                            rewinds; when the input comes back
                                                            its result goes alone, or, at
                                                            fault, is dead-lettered
commits                 :class:`AtLeastOnceCommitter`       :class:`TransactionalCommitter`
                                                            (repeated aborts that teach nothing
                                                            are bounded)
======================  ==================================  ==================================

A refused record's *how* (:data:`How`) says what its refusal proves: ``local`` (the producer
refused it before sending: it alone is at fault, and nothing was sent), ``alone`` (the broker
refused it in a record batch of its own) or ``batch`` (in a record batch it may have shared:
``MSG_SIZE_TOO_LARGE`` and ``INVALID_RECORD`` judge the whole record batch).
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from confluent_kafka import KafkaError

from streamproc.config.sections import PipelineConfig, Scalar
from streamproc.logs import get_logger
from streamproc.metrics import Metrics
from streamproc.offsets.committers import AtLeastOnceCommitter, Committer, TransactionalCommitter
from streamproc.offsets.outcomes import Produced, dead_lettered
from streamproc.offsets.refusals import Refusal, Refusals, record_refusal
from streamproc.offsets.tracker import OffsetTracker
from streamproc.offsets.transactions import Transactions
from streamproc.records import Record, TopicPartition

log = get_logger(__name__)

How = Literal["local", "alone", "batch"]
"""How a refused record was judged (see the module docstring)."""

Handling = Literal["recover", "abort", "fatal"]
"""Who handles a refused record: the sink recovers it (sends it again alone, or dead-letters it
at once), the transaction aborts (the guarantee remembered what it needs), or the pipeline
stops (a dead-letter record refused inside the transaction: nowhere left to put it)."""


@dataclass(frozen=True)
class Plan:
    """How to produce one batch's results (:meth:`Guarantee.plan`).

    Attributes:
        dead: rows to dead-letter (stage ``produce``) instead of producing, with the refusal
            that condemned them.
        alone: rows to produce in a record batch of their own.
    """

    dead: Mapping[int, Refusal] = field(default_factory=dict)
    alone: frozenset[int] = frozenset()


NO_PLAN = Plan()

_PURGED = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})
"""Reports of records an abort purged: they say nothing of the transaction open now."""


class RowProducer(Protocol):
    """One batch's output records, produced by row (:meth:`Guarantee.send_batch`)."""

    def produce_rows(self, rows: Sequence[int]) -> Sequence[int]:
        """Produce the output record of input ``records[row]`` for each ``row`` in ``rows``.

        Returns:
            The rows the producer refused before sending (their delivery is already reported).
        """
        ...


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

    def send_batch(self, records: Sequence[Record], batch: RowProducer) -> Sequence[int]:
        """Produce the output records of a batch of inputs with one call,
        ``batch.produce_rows(rows)``. One call per batch, not per record: the light workloads'
        produce loop has no layer per message.

        Returns:
            The rows not produced because their input's assignment is gone (exactly-once; it
            will be consumed again by its next owner); empty for at-least-once.
        """
        ...

    def acknowledged(self, records: Sequence[Record]) -> None:
        """The broker acknowledged the records produced for these inputs."""
        ...

    def refused(self, record: Record, err: KafkaError, how: How, dead_letter: bool) -> Handling:
        """The record produced for input ``record`` (its result, or its dead-letter record
        when ``dead_letter``) was refused for good with ``err``, judged as ``how`` says: who
        handles it (see :data:`Handling`)."""
        ...

    def plan(self, records: Sequence[Record], at_risk: Collection[int]) -> Plan:
        """Before a batch's results are produced: which rows to dead-letter instead (refused
        before, at fault) and which to produce alone. ``at_risk``: rows whose result may be
        too large for the output topic (compressed, it may still fit)."""
        ...

    def remembered(self, record: Record) -> Refusal | None:
        """An earlier refusal of ``record``'s output, if the guarantee keeps one."""
        ...

    def failed(self) -> bool:
        """True while the open transaction already failed (exactly-once): whatever is produced
        now is purged by the abort and produced again after the rewind."""
        ...

    def producer_error(self, err: KafkaError) -> bool:
        """The producer raised a fatal error ``err`` outside any call of the sink's (from
        ``poll``). True: the guarantee recovers; False: the pipeline stops."""
        ...

    def produced(self, metrics: Metrics, spec: PipelineConfig) -> Produced:
        """What this run produced for ``spec``'s inputs, counted as readers of its output and
        dead-letter topics see it (``offsets.outcomes``)."""
        ...

    def boundary(
        self, request_commit: Callable[[], None], timeout_s: float
    ) -> Callable[[], bool] | None:
        """What a model version switch waits for before the new version's first results, or
        None where results cross no boundary: a call that returns once what was produced
        before it is in no transaction later records join (False: not within ``timeout_s``
        seconds; ``request_commit`` asks the committer's thread to end it now)."""
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

    def send_batch(self, records: Sequence[Record], batch: RowProducer) -> Sequence[int]:
        batch.produce_rows(range(len(records)))
        return ()

    def acknowledged(self, records: Sequence[Record]) -> None:
        self._tracker.done_many(records)

    def refused(self, record: Record, err: KafkaError, how: How, dead_letter: bool) -> Handling:
        return "recover"

    def plan(self, records: Sequence[Record], at_risk: Collection[int]) -> Plan:
        """Nothing ahead: a record the broker refuses is sent again alone, then dead-lettered."""
        return NO_PLAN

    def remembered(self, record: Record) -> Refusal | None:
        return None

    def failed(self) -> bool:
        return False

    def producer_error(self, err: KafkaError) -> bool:
        """An idempotent producer's fatal error (e.g. a sequence gap) ends the pipeline."""
        return False

    def produced(self, metrics: Metrics, spec: PipelineConfig) -> Produced:
        """Every acknowledged record is visible: the results and dead-letter counters."""
        return Produced(
            round(metrics.counter_value(metrics.produced, topic=spec.output_topic)),
            round(dead_lettered(metrics, spec.input_topic)),
        )

    def boundary(
        self, request_commit: Callable[[], None], timeout_s: float
    ) -> Callable[[], bool] | None:
        """None: each result is visible once acknowledged, no transaction to end first."""
        return None


class ShareAcknowledgements(AtLeastOnce):
    """At-least-once over a share group (``kafka.group_type: share``): results are produced at
    once; an input is done when its output record (its result or its dead-letter record) is
    acknowledged, and then, not before, the share source acknowledges it to the group
    (``ACCEPT``, :mod:`streamproc.share`). Nothing is committed by offset: the
    :attr:`committer` is never called.

    Args:
        tracker: the offset tracker.
        metrics: commit counters.

    Attributes:
        done: the inputs done, in the order their outputs were acknowledged (any thread puts;
            the share source's thread takes).
    """

    name = "at_least_once"

    def __init__(self, tracker: OffsetTracker, metrics: Metrics) -> None:
        super().__init__(tracker, metrics)
        self.consumer_settings = {"share.acknowledgement.mode": "explicit"}
        self.done: queue.SimpleQueue[Sequence[Record]] = queue.SimpleQueue()
        # inputs the source dead-letters without a ring (the tracker never saw them), as
        # (partition, offset, generation): the source thread adds, a delivery report removes
        self._untracked: set[tuple[TopicPartition, int, int]] = set()

    def untracked(self, record: Record) -> None:
        """``record`` is dead-lettered by the source itself, never tracked: its acknowledgement
        goes to :attr:`done` only (call on the source thread before it is produced)."""
        self._untracked.add((record.tp, record.offset, record.generation))

    def acknowledged(self, records: Sequence[Record]) -> None:
        untracked = self._untracked
        if untracked:
            tracked: list[Record] = []
            for record in records:
                key = (record.tp, record.offset, record.generation)
                if key in untracked:
                    untracked.discard(key)
                else:
                    tracked.append(record)
            self._tracker.done_many(tracked)
        else:
            self._tracker.done_many(records)
        self.done.put(records)


class ExactlyOnce:
    """Results, dead-letter records and input offsets in one Kafka transaction.

    Args:
        tracker: the offset tracker.
        metrics: commit counters.
        transactions: the transactional producer's state (see ``streamproc.offsets.transactions``).
        max_aborts: consecutive aborted transactions that teach nothing new (no refusal
            learned, nothing committed) before the pipeline stops
            (``kafka.max_transaction_aborts``).
    """

    name = "exactly_once"

    def __init__(
        self,
        tracker: OffsetTracker,
        metrics: Metrics,
        transactions: Transactions,
        max_aborts: int = 5,
    ) -> None:
        self._tracker = tracker
        self.transactions = transactions
        self.refusals = Refusals()
        self.consumer_settings: dict[str, Scalar] = {"isolation.level": "read_committed"}
        self.committer: Committer = TransactionalCommitter(
            tracker, metrics, transactions, self.refusals, max_aborts
        )

    def send(self, record: Record, produce: Callable[..., None], *args: Any) -> bool:
        with self.transactions.lock:
            if not self._tracker.is_current(record.tp, record.generation):
                self._tracker.late(record.tp, record.generation)
                return False
            self.transactions.produce(produce, *args)
            self.transactions.tally.sent(record.tp.topic, "dead_letters")
            self._tracker.done(record.tp, record.offset, record.generation)
            return True

    def send_batch(self, records: Sequence[Record], batch: RowProducer) -> Sequence[int]:
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
                refused = set(self.transactions.produce_many(batch.produce_rows, current))
                # dead rows are among the refused: their dead-letter records count in send
                self.transactions.tally.sent(
                    records[0].tp.topic, "results", len(current) - len(refused)
                )
                for row in current:
                    if row not in refused:
                        record = records[row]
                        tracker.done(record.tp, record.offset, record.generation)
        return gone

    def acknowledged(self, records: Sequence[Record]) -> None:
        """Inputs were done when their records joined the transaction: only their
        acknowledgement is noted (the commit stage, :meth:`OffsetTracker.acked`)."""
        self._tracker.acked(records)

    def refused(self, record: Record, err: KafkaError, how: How, dead_letter: bool) -> Handling:
        """A refusal inside the transaction.

        Refused by the producer before sending (``local``) for the record's own sake: nothing
        was sent, the transaction is intact, the sink dead-letters it now (a dead-letter
        record: again without its value). Refused by the broker: the transaction is doomed; a
        record-level refusal is remembered (:class:`Refusals`) so the input is not refused
        again after the rewind; a dead-letter record refused for its own sake once more (or
        for any reason but its size) stops the pipeline."""
        own = record_refusal(err)
        transactions = self.transactions
        code = err.code()
        if code == KafkaError._STATE or (how != "local" and code not in _PURGED):
            # librdkafka's abortable state: the commit will fail; produce no more into it
            transactions.failed = transactions.failed or err
        elif how == "local" and not own:
            # librdkafka's transaction is fine, but this input's record is missing: committing
            # would leave a gap below results that commit
            transactions.must_abort = transactions.must_abort or err
        if not own:  # collateral: e.g. the erroneous state after the first failure, a purge
            log.debug(
                "record failed inside a failed transaction", offset=record.offset, error=str(err)
            )
            return "abort"
        if how == "local":
            return "recover"
        if dead_letter:
            known = self.refusals.get(record)
            if err.code() != KafkaError.MSG_SIZE_TOO_LARGE or (known and known.omit_value):
                return "fatal"
        self.refusals.refused(record, err, how != "batch", dead_letter)
        log.warning(
            "record refused inside the transaction; it will abort",
            **record.where(),
            error=str(err),
            record_batch="own" if how != "batch" else "shared",
            dead_letter=dead_letter,
        )
        return "abort"

    def plan(self, records: Sequence[Record], at_risk: Collection[int]) -> Plan:
        """Rows refused before in a record batch of their own are dead-lettered; rows refused
        in a shared record batch, and rows at risk, go alone."""
        refusals = self.refusals
        if self.transactions.failed is not None:  # it aborts anyway: nothing to learn from it
            at_risk = ()
        if not refusals:
            return Plan(alone=frozenset(at_risk)) if at_risk else NO_PLAN
        known = refusals.known(records)
        if not known and not at_risk:
            return NO_PLAN
        dead = {row: refusal for row, refusal in known.items() if refusal.alone}
        alone = (set(at_risk) | set(known)) - set(dead)
        return Plan(dead, frozenset(alone))

    def remembered(self, record: Record) -> Refusal | None:
        return self.refusals.get(record) if self.refusals else None

    def failed(self) -> bool:
        return self.transactions.failed is not None

    def producer_error(self, err: KafkaError) -> bool:
        """Recovered: the next commit replaces the producer (see ``offsets.transactions``)."""
        self.transactions.producer_error(err)
        return True

    def produced(self, metrics: Metrics, spec: PipelineConfig) -> Produced:
        """Records of committed transactions are visible to read_committed readers; those of
        aborted ones are counted apart (the acknowledgement counters count both)."""
        return self.transactions.tally.produced(spec.input_topic)

    def boundary(
        self, request_commit: Callable[[], None], timeout_s: float
    ) -> Callable[[], bool] | None:
        """The open transaction ended (:meth:`Transactions.wait_for_boundary`)."""
        transactions = self.transactions
        return lambda: transactions.wait_for_boundary(request_commit, timeout_s)
