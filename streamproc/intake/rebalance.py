"""Rebalances: what the source thread does when partitions are assigned, revoked or lost, and
when an aborted transaction rewinds them.

Cooperative-sticky, incremental:

* assign: fresh tracker generation + fresh ring per partition, then resume them (librdkafka keeps
  a partition's pause state across revoke/re-assign; we never rely on it).
* revoke: drop the revoked rings, wait (bounded by ``revoke_timeout_s``) for their in-flight
  batches, commit their watermarks synchronously, forget them.
* lost: drop and forget without committing; under exactly-once the open transaction, which may
  hold their results, aborts, and the partitions still assigned rewind.
* rewind (exactly-once, after an abort): every assigned partition restarts from its committed
  offset with a fresh ring and generation (results of the old generation are dropped).

Everything here runs on the source thread (librdkafka calls the callbacks from inside
``consume``), and :class:`Assignment`, the per-partition state of the consumer, is owned by that
thread: other threads read only the immutable snapshots it publishes (:attr:`Assignment.assigned`,
:meth:`Assignment.positions`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Literal, NamedTuple

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, KafkaException
from confluent_kafka import TopicPartition as KafkaTopicPartition

from streamproc.intake.lane import Lane
from streamproc.kafka.protocols import ConsumerClient, ktp
from streamproc.kafka.transient import read_committed, retry_transient
from streamproc.logs import get_logger
from streamproc.metrics import Metrics
from streamproc.offsets.committers import Committer
from streamproc.offsets.tracker import OffsetTracker
from streamproc.records import TopicPartition

log = get_logger(__name__)

# How long a rewind keeps asking for the committed offsets through transient errors (the group
# coordinator moving after a broker stalled or died), in seconds; the poll loop waits meanwhile,
# well within max.poll.interval.ms (300 s by default).
REWIND_DEADLINE_S = 120.0


def _names(tps: Iterable[TopicPartition]) -> list[str]:
    return [f"{tp.topic}[{tp.partition}]" for tp in tps]


class Unassigned(NamedTuple):
    """No partition is assigned since ``since_s`` (monotonic seconds), because of ``cause``:
    ``start`` (none assigned yet), ``revoked`` (a rebalance took the last one) or ``lost``
    (the group session ended: the coordinator was unreachable or the poll loop stalled)."""

    since_s: float
    cause: Literal["start", "revoked", "lost"]


class Assignment:
    """One generation of the consumer's assignment: its per-partition state, written by the
    source thread only. Each assign, revoke, loss and rewind makes the next generation's
    (:meth:`started`, :meth:`forgotten`: a new object; the one before is left as it was, so a
    reference kept from before cannot see or change the next generation); within a
    generation the source moves positions, seek floors, flow pauses and ``fetching``.

    Attributes:
        generations: assignment generation per assigned partition (records carry it).
        seek_floors: per partition sought back after a refusal, the offset the next accepted
            message must have (anything fetched before the seek took effect is dropped).
        flow_paused: partitions paused by flow control (at the ring's high watermark).
        fresh: partitions for which the consumer reported no position (-1001) right after
            their generation began (after ``incremental_assign``, or the rewind's ``seek``):
            a position it reports later in this generation comes from this generation's reads,
            even before any record was delivered (a partition of aborted transactions only).
            librdkafka resets the position in both calls before they return (measured); one
            that reported an old position instead is not fresh, and its position counts only
            from its first delivered record.
        fetching: False once the pipeline drains (every partition stays paused).
        unassigned: since when and why no partition is assigned (from creation until the
            first assignment, and from a revoke or loss that took the last one until the next
            assignment); None while one is. One immutable value: safe to read from any thread.
        last_rebalance_s: monotonic seconds of the last assign/revoke/lost/rewind.
        rebalances: counts of ``assigned``, ``revoked`` and ``lost`` callbacks.

    Args:
        clock: monotonic clock in seconds (the source's; tests pass a fake).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.generations: dict[TopicPartition, int] = {}
        self.seek_floors: dict[TopicPartition, int] = {}
        self.flow_paused: set[TopicPartition] = set()
        self.fresh: set[TopicPartition] = set()
        self._positions: dict[TopicPartition, int | None] = {}
        self._assigned: frozenset[TopicPartition] = frozenset()
        self.fetching = True
        self.unassigned: Unassigned | None = Unassigned(clock(), "start")
        self.last_rebalance_s = clock()
        self.rebalances = {"assigned": 0, "revoked": 0, "lost": 0}

    @property
    def assigned(self) -> frozenset[TopicPartition]:
        """The assigned partitions (an immutable snapshot: safe to read from any thread)."""
        return self._assigned

    def positions(self) -> dict[TopicPartition, int | None]:
        """Next offset to deliver per assigned partition (None before its first message); a
        copy, safe to call from any thread."""
        return self._positions.copy()

    def advance(self, tp: TopicPartition, next_offset: int) -> None:
        """``tp`` delivered everything before ``next_offset`` (source thread)."""
        self._positions[tp] = next_offset

    def position(self, tp: TopicPartition) -> int | None:
        return self._positions.get(tp)

    def started(
        self, tps: Iterable[TopicPartition], generations: Mapping[TopicPartition, int]
    ) -> Assignment:
        """The next generation (assign, rewind): a new assignment, this one with ``tps``
        started afresh under ``generations``; this one stays as it was."""
        tps = tuple(tps)
        new = self._next()
        new.generations.update(generations)
        for tp in tps:
            new.seek_floors.pop(tp, None)
            new.flow_paused.discard(tp)
            new.fresh.discard(tp)
            new._positions[tp] = None
        new._assigned = new._assigned | frozenset(tps)
        if new._assigned:
            new.unassigned = None
        return new

    def forgotten(
        self, tps: Iterable[TopicPartition], cause: Literal["revoked", "lost"]
    ) -> Assignment:
        """The next generation (revoke, loss): a new assignment, this one without ``tps``
        (``cause``: ``revoked`` or ``lost``); this one stays as it was."""
        tps = tuple(tps)
        new = self._next()
        for tp in tps:
            new.generations.pop(tp, None)
            new.seek_floors.pop(tp, None)
            new.flow_paused.discard(tp)
            new.fresh.discard(tp)
            new._positions.pop(tp, None)
        new._assigned = new._assigned - frozenset(tps)
        if not new._assigned and new.unassigned is None:
            new.unassigned = Unassigned(new.last_rebalance_s, cause)
        return new

    def share_member(self, assigned: bool) -> Assignment:
        """The next generation of a share group member whose assignment came or went
        (``assigned``: it has partitions to fetch from; a share consumer reports how many, not
        which); this one stays as it was."""
        new = self._next()
        if assigned:
            new.unassigned = None
        elif new.unassigned is None:
            new.unassigned = Unassigned(new.last_rebalance_s, "revoked")
        return new

    def _next(self) -> Assignment:
        """A copy of this assignment for the next generation, its rebalance time now."""
        new = Assignment(self._clock)
        new.generations = dict(self.generations)
        new.seek_floors = dict(self.seek_floors)
        new.flow_paused = set(self.flow_paused)
        new.fresh = set(self.fresh)
        new._positions = dict(self._positions)
        new._assigned = self._assigned
        new.fetching = self.fetching
        new.unassigned = self.unassigned
        new.rebalances = dict(self.rebalances)
        return new


class RebalanceHandler:
    """The assign/revoke/lost callbacks and the rewind; source thread only.

    Args:
        lanes: per input topic, its lane.
        tracker: the offset tracker (generations, in-flight counts).
        committer: commits the revoked partitions' watermarks.
        assignment: the consumer's per-partition state before the first rebalance; each
            assign, revoke, loss and rewind replaces :attr:`assignment` with the next
            generation's (a reference kept from before never sees a later generation).
        metrics: for the ring-fill gauges of partitions that leave.
        revoke_timeout_s: how long a revoke waits for in-flight batches of its partitions.
        auto_offset_reset: ``earliest`` or ``latest``: where a rewind starts a partition
            without a committed offset.
        on_rewound: called after a rewind (e.g. to refresh gauges).
    """

    def __init__(
        self,
        lanes: Mapping[str, Lane],
        tracker: OffsetTracker,
        committer: Committer,
        assignment: Assignment,
        metrics: Metrics,
        revoke_timeout_s: float,
        auto_offset_reset: str,
        on_rewound: Callable[[], None] = lambda: None,
    ) -> None:
        self._lanes = lanes
        self._tracker = tracker
        self._committer = committer
        self.assignment = assignment
        """The current generation's assignment (replaced, never mutated, by a rebalance)."""
        self._metrics = metrics
        self._revoke_timeout_s = revoke_timeout_s
        self._auto_offset_reset = auto_offset_reset
        self._on_rewound = on_rewound

    def on_assign(self, consumer: ConsumerClient, partitions: list[KafkaTopicPartition]) -> None:
        tps = [TopicPartition(p.topic, p.partition) for p in partitions]
        self.assignment.rebalances["assigned"] += 1  # the next generation copies the counts
        self._start(tps)
        consumer.incremental_assign(partitions)
        self._check_fresh(consumer, tps)
        if self.assignment.fetching:
            consumer.resume(partitions)
        else:
            consumer.pause(partitions)
        log.info("partitions assigned", partitions=_names(tps))

    def on_revoke(self, consumer: ConsumerClient, partitions: list[KafkaTopicPartition]) -> None:
        tps = [TopicPartition(p.topic, p.partition) for p in partitions]
        self.assignment.rebalances["revoked"] += 1
        limits: dict[TopicPartition, int] = {}
        for tp in tps:
            lane = self._lanes.get(tp.topic)
            if lane is not None:
                limits[tp] = lane.revoke([tp]).get(tp, 0)
        if not self._tracker.wait_until(limits, self._revoke_timeout_s):
            log.warning(
                "revoke budget exceeded; committing what is done",
                timeout_s=self._revoke_timeout_s,
            )
        if not self._committer.commit(consumer, synchronous=True, only=set(tps)):
            self.rewind(consumer)
        self._forget(tps, "revoked")
        consumer.incremental_unassign(partitions)
        log.info("partitions revoked", partitions=_names(tps))

    def on_lost(self, consumer: ConsumerClient, partitions: list[KafkaTopicPartition]) -> None:
        tps = [TopicPartition(p.topic, p.partition) for p in partitions]
        self.assignment.rebalances["lost"] += 1
        for tp in tps:
            lane = self._lanes.get(tp.topic)
            if lane is not None:
                lane.revoke([tp])
        self._forget(tps, "lost")
        log.warning("partitions lost", partitions=_names(tps))
        if self._committer.abandon() and self.assignment.assigned:
            self.rewind(consumer)
        consumer.incremental_unassign(partitions)

    def rewind(self, consumer: ConsumerClient) -> None:
        """After an aborted transaction: every assigned partition restarts from its committed
        offset, with a fresh ring and generation (the sink drops results of the old one).

        Raises:
            KafkaException: the committed offsets could not be read: a transient error (the
                group coordinator moving, a timeout) still after :data:`REWIND_DEADLINE_S`
                seconds, or any other error."""
        self.assignment.last_rebalance_s = time.monotonic()  # not idle while rewinding
        tps = sorted(self.assignment.assigned)
        committed = retry_transient(
            lambda: read_committed(consumer, [ktp(tp) for tp in tps], 30),
            REWIND_DEADLINE_S,
            "committed offsets to rewind to",
        )
        self._tracker.revoke(tps)
        self._start(tps)
        for part in committed:
            offset: int = part.offset
            if offset < 0:
                offset = OFFSET_BEGINNING if self._auto_offset_reset == "earliest" else OFFSET_END
            consumer.seek(KafkaTopicPartition(part.topic, part.partition, offset))
        self._check_fresh(consumer, tps)
        if self.assignment.fetching:
            consumer.resume([ktp(tp) for tp in tps])
        log.warning("transaction aborted; rewound to committed offsets", partitions=_names(tps))
        self._on_rewound()

    def _check_fresh(self, consumer: ConsumerClient, tps: list[TopicPartition]) -> None:
        """Right after ``tps`` began a generation: mark those whose consumer position reads
        none as :attr:`Assignment.fresh` (a position that cannot be read marks none)."""
        try:
            reported = consumer.position([ktp(tp) for tp in tps])
        except KafkaException as exc:
            log.debug("consumer position unavailable", error=str(exc))
            return
        for part in reported:
            if part.error is None and part.offset < 0:
                self.assignment.fresh.add(TopicPartition(part.topic, part.partition))

    def _start(self, tps: list[TopicPartition]) -> None:
        generations = self._tracker.assign(tps)
        self.assignment = self.assignment.started(tps, generations)
        by_topic: dict[str, list[TopicPartition]] = {}
        for tp in tps:
            by_topic.setdefault(tp.topic, []).append(tp)
        for topic, topic_tps in by_topic.items():
            self._lanes[topic].assign(topic_tps)

    def _forget(self, tps: list[TopicPartition], cause: Literal["revoked", "lost"]) -> None:
        self._tracker.revoke(tps)
        self._committer.forget(tps)
        self.assignment = self.assignment.forgotten(tps, cause)
        for tp in tps:
            with contextlib.suppress(Exception):  # never exported: nothing to remove
                self._metrics.ring_fill.remove(tp.topic, str(tp.partition))
