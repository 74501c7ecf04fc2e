"""The source: the one thread that owns the Kafka consumer.

It polls, wraps each message in a :class:`~streamproc.records.Record`, routes it to its lane's
rings, applies pause/resume decisions and schedules commits. It never decodes or runs a model,
and keeps polling while partitions are paused, so group membership survives long device work.
Commits are made by the guarantee's committer (``offsets.committers``) and rebalances handled by
``streamproc.intake.rebalance``, both on this thread.

Flow control: a partition paused at its ring's high watermark is resumed at the low one. Pausing
makes librdkafka drop the partition's prefetched messages, and a plain resume is fetched again
only on the broker thread's next idle wake-up, long after the ring ran dry. A resume therefore
also seeks the partition to its next offset, which starts the fetch at once (the measurements:
docs/benchmarks-history.md). What a pause drops is fetched again, so librdkafka prefetches per
partition no more than its ring takes before it pauses (:func:`prefetch_settings`). While
partitions are paused the source never blocks long in ``consume``: with everything paused it
waits on its control queue instead (a resume wakes it at once), with some paused at most
:data:`PAUSED_POLL_S`.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from confluent_kafka import Consumer, KafkaException

from streamproc.config import Config
from streamproc.intake.lane import Lane
from streamproc.intake.rebalance import Assignment, RebalanceHandler
from streamproc.intake.rings import FlowControl, high_mark
from streamproc.intake.routing import route
from streamproc.intake.source_control import COMMIT_NOW, STOP_FETCHING, SourceControl
from streamproc.intake.thread import SourceThread, message_error
from streamproc.kafka.clients import build_client
from streamproc.kafka.protocols import ConsumerClient, ConsumerFactory, MessageLike, ktp
from streamproc.logs import get_logger, kafka_logger, redact
from streamproc.metrics import Metrics
from streamproc.offsets.guarantees import Guarantee
from streamproc.offsets.tracker import OffsetTracker
from streamproc.records import (
    Record,
    TopicPartition,
)

log = get_logger(__name__)

PAUSED_POLL_S = 0.005
"""Longest blocking ``consume`` while some partitions are paused and others are not (a resume
queued meanwhile waits at most this long)."""
GAUGE_INTERVAL_S = 1.0
"""Ring fill gauges are refreshed at least this often (and at every pause and resume)."""


FETCH_QUEUE_BACKOFF_MS = 10
"""librdkafka's ``fetch.queue.backoff.ms`` under :func:`prefetch_settings` (its default: 1,000):
how long a partition whose prefetch is full waits before it is considered for a fetch again."""


def prefetch_settings(config: Config) -> dict[str, int]:
    """How much librdkafka prefetches: ``queued.min.messages`` (documented per partition) =
    what a ring takes before its partition pauses (``buffers.high_watermark`` x
    ``buffers.ring_capacity``: :func:`~streamproc.intake.rings.high_mark`), and
    ``fetch.queue.backoff.ms`` :data:`FETCH_QUEUE_BACKOFF_MS`. ``queued.max.messages.kbytes``
    (64 MiB, the whole consumer's) is left as it is: a ring of large messages pauses by its
    bytes long before 12,288 records, so its prefetch is bounded by those 64 MiB, as before.

    librdkafka's defaults prefetch up to 100,000 messages per partition (``queued.min.messages``,
    bounded by ``queued.max.messages.kbytes``) and drop them when the partition is paused, so
    under a backlog every pause fetched most of the backlog again (measured, trades, 200,000
    records over 4 partitions: 990,000 messages fetched with rings of 16,384, 12.4 million with
    the default 256; docs/benchmarks.md, "The prefetch a pause drops"). The short backoff keeps
    a partition whose smaller prefetch ran low from waiting a second for its next fetch (with
    the default backoff, 4,096 a partition cut a trades backlog from 52,000 to 10,000 msg/s).
    """
    buffers = config.buffers
    return {
        "queued.min.messages": high_mark(buffers.ring_capacity, buffers.high_watermark),
        "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS,
    }


def consumer_settings(config: Config, guarantee: Guarantee) -> dict[str, Any]:
    """The consumer's librdkafka settings: ours (by ``kafka.group_protocol``: the classic
    protocol's assignor and session timeout, or ``group.protocol=consumer``; static membership
    when ``kafka.group_instance_id`` is set), then the user's ``kafka.consumer``, then what the
    guarantee needs (``isolation.level`` for exactly-once)."""
    kafka = config.kafka
    if kafka.group_protocol == "classic":
        group: dict[str, Any] = {
            "partition.assignment.strategy": "cooperative-sticky",
            "session.timeout.ms": kafka.session_timeout_ms,
        }
    else:  # KIP-848: the broker assigns (incrementally) and times sessions out
        group = {"group.protocol": "consumer"}
    if kafka.group_instance_id is not None:
        group["group.instance.id"] = kafka.group_instance_id
    return {
        "bootstrap.servers": config.bootstrap_servers,
        "group.id": kafka.group_id,
        **group,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": kafka.auto_offset_reset,
        "max.poll.interval.ms": kafka.max_poll_interval_ms,
        # A resumed partition is fetched in the broker's next fetch session; with the
        # default 500 ms long-poll on idle partitions every pause/resume cycle would stall
        # that long (measured: 605 msg/s -> see docs/benchmarks.md). Override freely.
        "fetch.wait.max.ms": 20,
        **prefetch_settings(config),
        "logger": kafka_logger(),
        **kafka.consumer,
        **guarantee.consumer_settings,
    }


class Source(SourceThread):
    """Consumer thread for all lanes of one process.

    Args:
        config: the validated config.
        lanes: per input topic, its lane.
        tracker: the offset tracker.
        guarantee: its committer commits; its consumer settings apply.
        metrics: process metrics.
        on_fatal: called when the consumer hits a fatal error.
        consumer_factory: builds the consumer from its settings (tests pass a fake).
        clock: monotonic clock in seconds.
        wall_clock: wall clock in seconds since the epoch (records' deadlines are epoch
            milliseconds: converted to ``clock`` once per record at intake).
        control: its control queue (default: its own).

    Raises:
        ConfigError: librdkafka refused a key or value under ``kafka.consumer``.
    """

    def __init__(
        self,
        config: Config,
        lanes: Mapping[str, Lane],
        tracker: OffsetTracker,
        guarantee: Guarantee,
        metrics: Metrics,
        on_fatal: Callable[[BaseException], None],
        consumer_factory: ConsumerFactory = Consumer,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        control: SourceControl | None = None,
    ) -> None:
        super().__init__(clock, on_fatal, control)
        self._config = config
        self._wall_clock = wall_clock
        self._lanes = lanes
        self._metrics = metrics
        self._committer = guarantee.committer
        self._tracker = tracker
        # per partition, the offset after the highest this process consumed (source thread)
        self._read_up_to: dict[TopicPartition, int] = {}
        settings = consumer_settings(config, guarantee)
        settings["on_commit"] = self._committer.on_commit
        log.debug(
            "consumer config",
            settings=redact({k: v for k, v in settings.items() if not callable(v)}),
        )
        self._consumer: ConsumerClient = build_client(consumer_factory, settings, "kafka.consumer")
        self.rebalance = RebalanceHandler(
            lanes,
            tracker,
            self._committer,
            Assignment(clock),
            metrics,
            config.revoke_timeout_s,
            config.kafka.auto_offset_reset,
            on_rewound=self._export_buffer_gauges,
        )

    # -- read from any thread (written by the source thread only) ------------------------
    @property
    def assignment(self) -> Assignment:
        """The current generation's assignment (:attr:`RebalanceHandler.assignment`); read
        it again after a poll: a rebalance replaces it."""
        return self.rebalance.assignment

    def positions(self) -> dict[TopicPartition, int | None]:
        """Next offset to deliver per assigned partition (None before its first message)."""
        return self.assignment.positions()

    # -- control from other threads --------------------------------------------------------
    def subscribe(self) -> None:
        """Subscribe to the lanes' input topics (rebalances arrive inside :meth:`poll_until`)."""
        self._consumer.subscribe(
            list(self._lanes),
            on_assign=self.rebalance.on_assign,
            on_revoke=self.rebalance.on_revoke,
            on_lost=self.rebalance.on_lost,
        )

    def apply(self, flow: FlowControl) -> None:
        """Queue a flow-control change for the source thread (:meth:`SourceControl.apply`)."""
        self.control.apply(flow)

    def request_commit(self) -> None:
        """Commit now (:meth:`SourceControl.request_commit`)."""
        self.control.request_commit()

    # -- the source thread -----------------------------------------------------------------
    def _finish(self) -> None:
        """Commit the final watermarks, close the consumer (leaving the group)."""
        with contextlib.suppress(Exception):
            self._commit(synchronous=True)
        with contextlib.suppress(Exception):
            self._consumer.close()

    def poll_until(self, done: Callable[[], bool]) -> None:
        """The poll loop, until ``done()`` (the thread runs it until :meth:`close`; unit tests
        run it on their own thread with a fake consumer)."""
        kafka = self._config.kafka
        timeout_s = kafka.poll_timeout_s
        commit_every_s = kafka.commit_interval_s
        clock = self._clock
        next_commit_s = clock() + commit_every_s
        next_gauges_s = clock()
        while not done():
            self._drain_control()
            # Take what is already fetched without waiting; only block (for one message) when
            # nothing is. consume(n, timeout) waits until n messages or the timeout, which at
            # low rates added up to poll_timeout_ms to every message's latency.
            messages = self._consumer.consume(kafka.consume_batch_messages, 0)
            if not messages:
                messages = self._wait_for_input(timeout_s)
            now_s = self._last_poll_s = clock()
            if messages:
                self._route(messages, now_s)
            if now_s >= next_commit_s:
                self._commit(synchronous=False)
                next_commit_s = now_s + commit_every_s
            if now_s >= next_gauges_s:
                self._export_buffer_gauges()
                next_gauges_s = now_s + GAUGE_INTERVAL_S

    def _wait_for_input(self, timeout_s: float) -> Sequence[MessageLike]:
        """Block for input, but let a queued resume (or stop) in without delay."""
        state = self.assignment
        assigned = state.assigned
        if assigned and (not state.fetching or assigned <= state.flow_paused):
            # Nothing can arrive before a resume: wait for one on the control queue.
            try:
                item = self._control.get(timeout=timeout_s)
            except queue.Empty:
                return []
            self._control_item(item)
            return []
        if state.flow_paused:
            timeout_s = min(timeout_s, PAUSED_POLL_S)
        return self._consumer.consume(1, timeout_s)

    def _route(self, messages: Sequence[MessageLike], now_s: float) -> None:
        """Wrap one poll's messages in records (:func:`~streamproc.intake.routing.route`) and
        offer them to their lanes: one lock acquisition per lane and poll, not per message."""
        state = self.assignment
        routed = route(
            messages,
            self._lanes,
            state.generations.get,
            state.seek_floors,
            self._wall_clock() * 1000.0,
            now_s,
            self._metrics,
            message_error,
        )
        lanes = self._lanes
        for topic, runs in routed.runs.items():
            self._offer(topic, lanes[topic], runs, topic in routed.deadlines)

    def _offer(
        self,
        topic: str,
        lane: Lane,
        runs: dict[TopicPartition, list[Record]],
        deadlines: bool,
    ) -> None:
        """Offer one lane's records, per partition a run in offset order (``deadlines``: some
        has one); a partition whose ring is full refuses the rest of its run, is paused, and
        is sought back to the first refused offset."""
        offered = lane.offer_runs(runs, deadlines)
        state = self.assignment
        consumer = self._consumer
        for tp, offset in offered.refused.items():
            # Ring full: refuse, pause, and fetch this offset again after resuming.
            state.seek_floors[tp] = offset
            consumer.pause([ktp(tp)])
            consumer.seek(ktp(tp, offset))
        if offered.runs:
            read_up_to, again, accepted = self._read_up_to, 0, 0
            for tp, run in offered.runs.items():
                end = run[-1].offset + 1
                state.advance(tp, end)
                accepted += len(run)
                up_to = read_up_to.get(tp, 0)
                if run[0].offset < up_to:  # some of it was read before (a rewind, a seek)
                    again += sum(1 for record in run if record.offset < up_to)
                if end > up_to:
                    read_up_to[tp] = end
                self._last_input_s = run[-1].consumed_at_s
            self._metrics.child(self._metrics.consumed, topic).inc(accepted)
            if again:
                self._metrics.child(self._metrics.read_again, topic).inc(again)
        if offered.pause:
            consumer.pause([ktp(tp) for tp in offered.pause])
        if offered.pause or offered.refused:
            state.flow_paused.update(offered.pause)
            state.flow_paused.update(offered.refused)
            self._export_buffer_gauges()

    def _export_buffer_gauges(self) -> None:
        """Ring fill per partition and the count of partitions paused by flow control."""
        for lane in self._lanes.values():
            for tp, fill in lane.fill_ratios().items():
                self._metrics.ring_fill.labels(tp.topic, str(tp.partition)).set(fill)
        self._metrics.paused.set(len(self.assignment.flow_paused))

    def _drain_control(self) -> None:
        while True:
            try:
                item = self._control.get_nowait()
            except queue.Empty:
                return
            self._control_item(item)

    def _control_item(self, item: FlowControl | str) -> None:
        state = self.assignment
        if item == COMMIT_NOW:
            self._commit(synchronous=False)
            return
        if item == STOP_FETCHING:
            state.fetching = False
            if state.assigned:
                self._consumer.pause([ktp(tp) for tp in state.assigned])
            return
        assert isinstance(item, FlowControl)
        self._resume([tp for tp in item.resume if tp in state.generations])

    def _resume(self, tps: list[TopicPartition]) -> None:
        """Resume partitions paused by flow control, and seek each to its next offset: the
        seek starts the fetch at once (see the module docstring)."""
        if not tps:
            return
        state = self.assignment
        state.flow_paused.difference_update(tps)
        if state.fetching:
            self._consumer.resume([ktp(tp) for tp in tps])
            for tp in tps:
                # A refused record's offset (its floor), else the next offset after the last
                # record taken. No floor is set here: that next offset may not exist (a
                # transaction marker, a compacted record); the seek's own barrier drops
                # anything fetched before it, and the pause already dropped the prefetch.
                offset = state.seek_floors.get(tp)
                if offset is None:
                    offset = state.position(tp)
                if offset is not None:
                    self._consumer.seek(ktp(tp, offset))
        self._export_buffer_gauges()

    def _pass_empty_offsets(self) -> None:
        """Move each drained partition's watermark to the consumer's position where the
        consumer passed offsets that hold no message (the transaction marker that follows a
        transactional producer's records, aborted or compacted records): the commit then
        reaches the end offset and the lag of a drained partition reads 0, not 1 for ever.

        A partition that delivered a record in this generation counts from the offset after
        it; one that delivered none (aborted transactions only, for a read_committed consumer)
        only when it is :attr:`~streamproc.intake.rebalance.Assignment.fresh` (its position
        read none when the generation began, so a position now is this generation's own; an
        old one from before a seek or an earlier assignment never counts). Never a partition
        paused by flow control or sought back after a refusal. Every message below the
        position was then handed to :meth:`_route` already (this thread, between polls); the
        tracker still holds the watermark at the first record not done.
        """
        state = self.assignment
        mine: dict[TopicPartition, int] = {}
        for tp in state.assigned:
            if tp in state.flow_paused or tp in state.seek_floors:
                continue
            position = state.position(tp)
            if position is None:
                if tp not in state.fresh:
                    continue
                position = 0  # a position read (past a marker) is at least 1
            mine[tp] = position
        if not mine:
            return
        try:
            reported = self._consumer.position([ktp(tp) for tp in mine])
        except KafkaException as exc:
            log.debug("consumer position unavailable", error=str(exc))
            return
        passed: dict[TopicPartition, tuple[int, int]] = {}
        for part in reported:
            tp = TopicPartition(part.topic, part.partition)
            position = part.offset
            if part.error is None and position > mine[tp]:
                passed[tp] = (state.generations[tp], position)
                state.advance(tp, position)
        if passed:
            self._tracker.passed(passed)

    def _commit(self, synchronous: bool) -> None:
        self._pass_empty_offsets()
        if not self._committer.commit(self._consumer, synchronous):
            self.rebalance.rewind(self._consumer)
