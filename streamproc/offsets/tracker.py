"""Offset tracking per assignment: contiguous watermarks, never past a gap.

An input offset is *done* when its result (or its dead-letter record) was acknowledged by the
broker. Per partition the committable offset is the first not-done offset among those consumed,
or the last consumed offset + 1 when all are done (offsets need not be contiguous: transaction
markers and compaction leave holes, so we track the offsets we actually consumed).

Each assignment of a partition gets a new :class:`PartitionTrack` with a higher ``generation``;
a completion carrying an older generation (a late result for a partition we no longer own, or
owned again since) is counted in :attr:`OffsetTracker.late_results`, reported to the
``on_late`` hook as it happens (the pipeline moves ``streamproc_late_results_total`` and logs
one line per revoked partition), and ignored. Thread-safe.

The committers turn watermarks into commits, on the source thread (the consumer's owner):
:class:`AtLeastOnceCommitter` with ``Consumer.commit``, :class:`TransactionalCommitter` inside
the producer's transaction. The guarantee (``streamproc.offsets.guarantees``) picks one at start-up.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka import TopicPartition as KafkaTopicPartition

from streamproc.errors import FatalPipelineError
from streamproc.kafka.protocols import ConsumerClient, ktp
from streamproc.logs import get_logger
from streamproc.metrics import Metrics
from streamproc.offsets.refusals import Refusals
from streamproc.offsets.transactions import Transactions
from streamproc.records import Record, TopicPartition

log = get_logger(__name__)


class PartitionTrack:
    """Consumed and done offsets of one partition within one assignment.

    Contract checks: consumed offsets strictly increase; a done offset must have been consumed.
    """

    __slots__ = ("_done", "_pending", "committed", "generation", "last_consumed")

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self._pending: deque[int] = deque()
        self._done: set[int] = set()
        self.last_consumed: int | None = None
        self.committed: int | None = None

    def consumed(self, offset: int) -> None:
        if self.last_consumed is not None and offset <= self.last_consumed:
            raise ValueError(f"offset {offset} consumed after {self.last_consumed}")
        self.last_consumed = offset
        self._pending.append(offset)

    def done(self, offset: int) -> None:
        if offset in self._done or not self._pending or offset < self._pending[0]:
            return  # already done (duplicate acknowledgement) or below the watermark
        self._done.add(offset)
        pending, done = self._pending, self._done
        while pending and pending[0] in done:
            done.discard(pending.popleft())

    @property
    def watermark(self) -> int | None:
        """The offset to commit: first not-done consumed offset, or last consumed + 1."""
        if self._pending:
            return self._pending[0]
        return None if self.last_consumed is None else self.last_consumed + 1

    @property
    def pending(self) -> int:
        """Consumed offsets not yet done."""
        return len(self._pending) - len(self._done)


LateHook = Callable[[TopicPartition, int, bool], None]
"""``(partition, late results, first for this assignment)``, called outside the lock."""


class OffsetTracker:
    """Per-partition tracks for the current assignment.

    Args:
        on_late: called as late results happen (see :data:`LateHook`), from the thread that
            reported them (a delivery report or the completion thread), never under the lock.
    """

    def __init__(self, on_late: LateHook | None = None) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._tracks: dict[TopicPartition, PartitionTrack] = {}
        self._next_generation = 1
        self._on_late = on_late
        # per partition, the last generation whose late results were reported as "first"
        self._late_reported: dict[TopicPartition, int] = {}
        self.late_results = 0

    def assign(self, tps: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """Start a fresh track for each partition; return their generations."""
        with self._lock:
            out = {}
            for tp in tps:
                self._tracks[tp] = PartitionTrack(self._next_generation)
                out[tp] = self._next_generation
                self._next_generation += 1
            return out

    def generation(self, tp: TopicPartition) -> int | None:
        with self._lock:
            track = self._tracks.get(tp)
            return None if track is None else track.generation

    def is_current(self, tp: TopicPartition, generation: int) -> bool:
        """True when ``tp`` is assigned under ``generation`` (not revoked, not rewound)."""
        with self._lock:
            track = self._tracks.get(tp)
            return track is not None and track.generation == generation

    def consumed(self, tp: TopicPartition, offset: int) -> None:
        """Record that ``offset`` of ``tp`` entered the pipeline."""
        with self._lock:
            self._tracks[tp].consumed(offset)

    def consumed_many(self, records: Iterable[Record]) -> None:
        """:meth:`consumed` for each record, under one lock acquisition."""
        with self._lock:
            tracks = self._tracks
            for record in records:
                tracks[record.tp].consumed(record.offset)

    def done_many(self, records: Iterable[Record]) -> int:
        """:meth:`done` for each record (its own partition and generation), under one lock
        acquisition; returns how many were current (the rest are counted as late)."""
        current = 0
        late: dict[tuple[TopicPartition, int], int] | None = None
        with self._cond:
            tracks = self._tracks
            for record in records:
                track = tracks.get(record.tp)
                if track is None or track.generation != record.generation:
                    if late is None:
                        late = {}
                    key = (record.tp, record.generation)
                    late[key] = late.get(key, 0) + 1
                    continue
                track.done(record.offset)
                current += 1
            self._cond.notify_all()
        if late:
            for (tp, generation), count in late.items():
                self.late(tp, generation, count)
        return current

    def done(self, tp: TopicPartition, offset: int, generation: int) -> bool:
        """Mark ``offset`` done; False (and counted) when ``generation`` is not current."""
        with self._cond:
            track = self._tracks.get(tp)
            if track is not None and track.generation == generation:
                track.done(offset)
                self._cond.notify_all()
                return True
        self.late(tp, generation)
        return False

    def late(self, tp: TopicPartition, generation: int, count: int = 1) -> None:
        """Count ``count`` results of ``tp`` under a generation that is no longer current."""
        with self._lock:
            self.late_results += count
            first = self._late_reported.get(tp, 0) < generation
            if first:
                self._late_reported[tp] = generation
        if self._on_late is not None:
            self._on_late(tp, count, first)

    def commit_candidates(self) -> dict[TopicPartition, int]:
        """Watermarks that moved past the last committed offset, per partition."""
        with self._lock:
            return {
                tp: wm
                for tp, track in self._tracks.items()
                if (wm := track.watermark) is not None and wm != track.committed
            }

    def watermarks(self, tps: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """Current watermarks of ``tps`` that consumed anything."""
        with self._lock:
            return {
                tp: wm
                for tp in tps
                if (track := self._tracks.get(tp)) is not None
                and (wm := track.watermark) is not None
            }

    def mark_committed(self, offsets: dict[TopicPartition, int]) -> None:
        """Remember offsets sent for commit (same assignment only); see :meth:`forget_committed`."""
        with self._lock:
            for tp, offset in offsets.items():
                track = self._tracks.get(tp)
                if track is not None:
                    track.committed = offset

    def forget_committed(self, offsets: dict[TopicPartition, int]) -> None:
        """Undo :meth:`mark_committed` for a commit that failed, so it is retried."""
        with self._lock:
            for tp, offset in offsets.items():
                track = self._tracks.get(tp)
                if track is not None and track.committed == offset:
                    track.committed = None

    def pending(self, tp: TopicPartition) -> int:
        with self._lock:
            track = self._tracks.get(tp)
            return 0 if track is None else track.pending

    def total_pending(self) -> int:
        with self._lock:
            return sum(t.pending for t in self._tracks.values())

    def wait_until(self, tp_limits: dict[TopicPartition, int], timeout_s: float) -> bool:
        """Wait until each ``tp``'s pending count is <= its limit; False on timeout."""

        def settled() -> bool:
            return all(
                (t := self._tracks.get(tp)) is None or t.pending <= limit
                for tp, limit in tp_limits.items()
            )

        with self._cond:
            return self._cond.wait_for(settled, timeout=timeout_s)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is pending anywhere; False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: all(t.pending == 0 for t in self._tracks.values()), timeout=timeout_s
            )

    def retire(self) -> None:
        """End every partition's current generation, keeping its offsets (an aborted
        transaction: no result of the aborted work may join the next transaction, and until
        the rewind starts fresh tracks the pipeline must not look idle)."""
        with self._cond:
            for track in self._tracks.values():
                track.generation = self._next_generation
                self._next_generation += 1
            self._cond.notify_all()

    def revoke(self, tps: Iterable[TopicPartition]) -> None:
        """Forget ``tps``; later completions for them count as late results."""
        with self._cond:
            for tp in tps:
                self._tracks.pop(tp, None)
            self._cond.notify_all()


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
        self._tracker.mark_committed(candidates)
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

    def __init__(
        self,
        tracker: OffsetTracker,
        metrics: Metrics,
        transactions: Transactions,
        refusals: Refusals,
        max_aborts: int = 5,
    ) -> None:
        self._tracker = tracker
        self._metrics = metrics
        self._transactions = transactions
        self._refusals = refusals
        self._max_aborts = max_aborts
        self._fruitless = 0  # source thread only
        self._gave_up: FatalPipelineError | None = None

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
                    self._tracker.mark_committed(candidates)
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
        with self._transactions.lock:
            if not self._transactions.open:
                return False  # nothing sent since the last commit
            self._tracker.retire()
            self._transactions.abandon(LOST)
        self._metrics.transaction_aborts.labels(LOST).inc()
        return True
