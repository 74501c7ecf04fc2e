"""Committers: turn the offset tracker's watermarks into commits, on the source thread (the
consumer's owner).

:class:`AtLeastOnceCommitter` commits with ``Consumer.commit``; :class:`TransactionalCommitter`
commits inside the producer's transaction. The guarantee (:mod:`streamproc.offsets.guarantees`)
picks one at start-up.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from attrs import define, field
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka import TopicPartition as KafkaTopicPartition

from streamproc.errors import FatalPipelineError
from streamproc.kafka.protocols import ConsumerClient, ktp
from streamproc.logs import get_logger
from streamproc.metrics import Metrics
from streamproc.offsets.refusals import Refusals
from streamproc.offsets.tracker import OffsetTracker
from streamproc.offsets.transactions import Transactions
from streamproc.records import TopicPartition
from streamproc.stages import observe_commits

log = get_logger(__name__)


# The abort reason of a transaction aborted because partitions were lost.
LOST = "partitions_lost"


class Committer(Protocol):
    """Turns the tracker's watermarks into commits; called on the source thread only."""

    def commit(
        self,
        consumer: ConsumerClient,
        synchronous: bool,
        only: set[TopicPartition] | None = None,
    ) -> bool:
        """Commit; False when the caller must rewind (an aborted transaction)."""
        ...

    def on_commit(self, err: KafkaError | None, partitions: list[KafkaTopicPartition]) -> None:
        """The consumer's ``on_commit`` callback."""
        ...

    def forget(self, tps: Iterable[TopicPartition]) -> None:
        """``tps`` were revoked or lost: drop what the committer keeps about them."""
        ...

    def abandon(self) -> bool:
        """Partitions were lost (already forgotten by the tracker): drop uncommitted work of
        theirs that would otherwise commit; True when work of the partitions still assigned
        was dropped with it (the caller must rewind them)."""
        ...


class AtLeastOnceCommitter:
    """Commits every moved watermark with ``Consumer.commit`` (asynchronously on the periodic
    cycle, synchronously on revoke and at close).

    A failed commit (e.g. ``REBALANCE_IN_PROGRESS``) is counted, logged once per distinct
    error, and retried on the next cycle: never fatal, since a later commit of a higher
    watermark covers it.

    Args:
        tracker: where the watermarks come from.
        metrics: ``streamproc_commits_total`` and ``streamproc_commit_failures_total``.
    """

    def __init__(self, tracker: OffsetTracker, metrics: Metrics) -> None:
        self._tracker = tracker
        self._metrics = metrics
        self._last_error: str | None = None

    def commit(
        self,
        consumer: ConsumerClient,
        synchronous: bool,
        only: set[TopicPartition] | None = None,
    ) -> bool:
        """Commit the moved watermarks (of ``only``, when given). Always True: a failure is
        retried next cycle (see the class docstring)."""
        candidates = self._tracker.commit_candidates()
        if only is not None:
            candidates = {tp: o for tp, o in candidates.items() if tp in only}
        if not candidates:
            return True
        offsets = [ktp(tp, offset) for tp, offset in candidates.items()]
        observe_commits(self._metrics, self._tracker.mark_committed(candidates))
        try:
            if synchronous:
                self.on_commit(None, consumer.commit(offsets=offsets, asynchronous=False))
            else:
                consumer.commit(offsets=offsets, asynchronous=True)
        except KafkaException as exc:
            self._failed(candidates, exc)
        return True

    def on_commit(self, err: KafkaError | None, partitions: list[KafkaTopicPartition]) -> None:
        """librdkafka's ``on_commit`` callback (asynchronous commits), and the result of a
        synchronous one."""
        failed = {
            TopicPartition(p.topic, p.partition): p.offset
            for p in partitions
            if err is not None or p.error is not None
        }
        if failed:
            self._failed(failed, err or partitions[0].error)
        if len(failed) < len(partitions):
            self._metrics.commits.inc()
            self._last_error = None

    def forget(self, tps: Iterable[TopicPartition]) -> None:
        """Nothing kept per partition."""

    def abandon(self) -> bool:
        """Nothing to drop: results already sent stay (their inputs come again: duplicates,
        which at-least-once allows). Always False."""
        return False

    def _failed(self, candidates: dict[TopicPartition, int], exc: object) -> None:
        self._metrics.commit_failures.inc()
        self._tracker.forget_committed(candidates)
        reason = str(exc)
        if reason != self._last_error:  # one line per distinct error, not per retry
            log.warning(
                "commit failed; retrying next cycle", error=reason, partitions=len(candidates)
            )
        self._last_error = reason


@define(eq=False)
class TransactionalCommitter:
    """Exactly-once: closes the open transaction with every moved watermark
    (``send_offsets_to_transaction`` + ``commit_transaction``).

    Every abort is counted in ``streamproc_transaction_aborts_total{reason}``: the name of
    the error that refused a record in it (e.g. ``MSG_SIZE_TOO_LARGE``), else of the error
    that failed the commit (e.g. ``_MSG_TIMED_OUT``). An abort is *fruitless* when no refusal
    was learned since the previous one (see ``offsets.refusals``): the rewound inputs will
    meet the same fate. After ``max_aborts`` fruitless aborts in a row (no commit between
    them) the committer raises instead of rewinding once more: never a silent loop.

    Args:
        tracker: where the watermarks come from.
        metrics: commit counters.
        transactions: the sink producer's transaction state.
        refusals: the records refused inside aborted transactions (settled ones are forgotten
            at each commit, revoked partitions' at each revoke).
        max_aborts: fruitless aborts in a row before the pipeline stops.
    """

    _tracker: OffsetTracker
    _metrics: Metrics
    _transactions: Transactions
    _refusals: Refusals
    _max_aborts: int = 5
    _fruitless: int = field(init=False, default=0)  # source thread only
    _gave_up: FatalPipelineError | None = field(init=False, default=None)

    def commit(
        self,
        consumer: ConsumerClient,
        synchronous: bool,
        only: set[TopicPartition] | None = None,
    ) -> bool:
        """Commit the transaction with all moved watermarks (``only`` and ``synchronous`` do
        not apply: a transaction commits all of its records at once, synchronously).

        Returns:
            False when the transaction was aborted: the caller must rewind every assigned
            partition to its committed offset.

        Raises:
            FatalPipelineError: fatal producer error (fenced zombie), or ``max_aborts``
                fruitless aborts in a row (the message names the offsets and the error).
        """
        if self._gave_up is not None:
            # never commit after giving up: the tracker still holds the aborted transaction's
            # done offsets, whose results are gone (the closing commit would lose them); abort
            # what was produced since, so readers are not held at an open transaction
            self._transactions.abort()
            raise self._gave_up
        with self._transactions.lock:  # no record may join between reading offsets and commit
            candidates = self._tracker.commit_candidates()
            if self._transactions.commit(candidates, consumer.consumer_group_metadata()):
                self._fruitless = 0
                if candidates:
                    observe_commits(self._metrics, self._tracker.mark_committed(candidates))
                    self._refusals.committed(candidates)
                    self._metrics.commits.inc()
                return True
            # Aborted. Before any producer takes the lock again, every current generation
            # ends: a result of the aborted work that joined the next transaction would be
            # produced there once more after the rewind (a duplicate, once both commit).
            self._tracker.retire()
        self._metrics.commit_failures.inc()
        self._aborted(candidates)
        return False

    def _aborted(self, candidates: dict[TopicPartition, int]) -> None:
        """Count the abort; stop after ``max_aborts`` fruitless ones in a row."""
        err = self._transactions.abort_error
        learned = self._refusals.learned()
        # a refused record is the reason; the commit's own error then only says the
        # transaction had failed before ("Erroneous state")
        reason = learned or self._transactions.abort_reason
        self._metrics.transaction_aborts.labels(reason).inc()
        if learned:
            self._fruitless = 0
            return
        self._fruitless += 1
        if self._fruitless < self._max_aborts:
            return
        offsets = ", ".join(
            f"{tp.topic}[{tp.partition}] below {offset}"
            for tp, offset in sorted(candidates.items())
        )
        self._gave_up = FatalPipelineError(
            f"transaction aborted {self._fruitless} times in a row with nothing learned "
            f"(kafka.max_transaction_aborts={self._max_aborts}): the same offsets would be "
            f"retried forever; offsets it could not commit: {offsets or 'none ready'}; "
            f"records refused: {self._refusals.described()}; last error: "
            f"{'unknown' if err is None else err.str()} ({reason})"
        )
        raise self._gave_up

    def on_commit(self, err: KafkaError | None, partitions: list[KafkaTopicPartition]) -> None:
        """Never called: the consumer commits nothing itself in this mode."""

    def forget(self, tps: Iterable[TopicPartition]) -> None:
        """Revoked or lost: the refusals remembered for ``tps`` go (their next owner learns
        for itself)."""
        self._refusals.forget(tps)

    def abandon(self) -> bool:
        """Lost partitions: abort the open transaction, which may hold their results (their
        offsets are forgotten, so a commit would carry those results without them: the inputs
        come again from the committed offsets and their results would commit twice). Every
        current generation ends first, as after any abort. Counted as
        ``transaction_aborts_total{reason="partitions_lost"}``, never as a fruitless abort.

        Returns:
            True when a transaction was aborted: the caller rewinds the partitions still
            assigned.
        """
        with self._transactions.lock:  # no producer joins between the abort and the retire
            if not self._transactions.abandon(LOST):
                return False  # nothing sent since the last commit
            self._tracker.retire()
        self._metrics.transaction_aborts.labels(LOST).inc()
        return True
