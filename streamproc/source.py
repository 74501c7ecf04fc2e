"""The source: the one thread that owns the Kafka consumer.

It polls, wraps each message in a :class:`~streamproc.records.Record`, pushes it into its
partition's ring, applies pause/resume decisions, commits watermarks, and handles rebalances.
It never decodes or runs a model, and keeps polling while partitions are paused, so group
membership survives long device work.

Rebalances (cooperative-sticky, incremental):

* assign: fresh tracker generation + fresh ring per partition, then resume them (librdkafka keeps
  a partition's pause state across revoke/re-assign; we never rely on it).
* revoke: drop the revoked rings, wait (bounded by ``revoke_timeout_s``) for their in-flight
  batches, commit their watermarks synchronously, forget them.
* lost: drop and forget without committing.

Flow control: a partition paused at its ring's high watermark is resumed at the low one. Pausing
makes librdkafka drop the partition's prefetched messages, and a plain resume is fetched again
only on the broker thread's next idle wake-up (measured: ~1 s after the pause, whatever the
fetch settings), so the ring ran dry long before. A resume therefore also seeks the partition
to its next offset, which starts the fetch at once (2 ms on loopback). While partitions are
paused the source never blocks long in ``consume``: with everything paused it waits on its
control queue instead (a resume wakes it at once), with some paused at most
:data:`PAUSED_POLL_S`.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_END,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
)
from confluent_kafka import TopicPartition as KafkaTopicPartition

from streamproc.buffers import FlowControl, PartitionBuffers
from streamproc.clients import build_client
from streamproc.commit import OffsetTracker
from streamproc.config import Config
from streamproc.logs import get_logger, kafka_logger, redact
from streamproc.metrics import Metrics
from streamproc.records import Record, TopicPartition
from streamproc.transactions import Transactions

log = get_logger(__name__)

PAUSED_POLL_S = 0.005
"""Longest blocking ``consume`` while some partitions are paused and others are not (a resume
queued meanwhile waits at most this long)."""
GAUGE_INTERVAL_S = 1.0
"""Ring fill gauges are refreshed at least this often (and at every pause and resume)."""


@dataclass
class TopicLane:
    """What the source needs of one pipeline: its rings and the condition guarding them."""

    buffers: PartitionBuffers
    cond: threading.Condition
    default_priority: int = 1  # 0 high, 1 normal, 2 low


_PRIORITY = {b"high": 0, b"normal": 1, b"low": 2}


def _priority(headers: tuple[tuple[str, bytes], ...], default: int) -> int:
    """Priority class from the ``priority`` header (high|normal|low), else ``default``."""
    for key, value in headers:
        if key == "priority":
            return _PRIORITY.get(value, default)
    return default


def _ktp(tp: TopicPartition, offset: int | None = None) -> KafkaTopicPartition:
    if offset is None:
        return KafkaTopicPartition(tp.topic, tp.partition)
    return KafkaTopicPartition(tp.topic, tp.partition, offset)


class Source:
    """Consumer thread for all pipelines of one process.

    Args:
        config: the validated config.
        lanes: per input topic, its rings.
        tracker: offset tracker shared with the sink.
        metrics: process metrics.
        on_fatal: called when the consumer hits a fatal error.
        transactions: exactly-once mode: commits go through the producer's transaction
            (``send_offsets_to_transaction``) instead of ``Consumer.commit``; an aborted
            transaction rewinds every assigned partition to its committed offset.
    """

    def __init__(
        self,
        config: Config,
        lanes: dict[str, TopicLane],
        tracker: OffsetTracker,
        metrics: Metrics,
        on_fatal: Callable[[BaseException], None],
        transactions: Transactions | None = None,
    ) -> None:
        self._config = config
        self._transactions = transactions
        self._lanes = lanes
        self._tracker = tracker
        self._metrics = metrics
        self._on_fatal = on_fatal
        self._control: queue.SimpleQueue[FlowControl | str] = queue.SimpleQueue()
        self._generations: dict[TopicPartition, int] = {}
        self._seek_floor: dict[TopicPartition, int] = {}
        self._positions: dict[TopicPartition, int | None] = {}
        self._flow_paused: set[TopicPartition] = set()  # paused by us at the high watermark
        self._last_commit_error: str | None = None
        self._stop = threading.Event()
        self._fetching = True
        self.last_poll_s = time.monotonic()
        self.last_input_s = time.monotonic()
        self.last_rebalance_s = time.monotonic()
        self.ever_assigned = False
        self.rebalance_counts = {"assigned": 0, "revoked": 0, "lost": 0}
        self.assigned: frozenset[TopicPartition] = frozenset()
        kafka = config.kafka
        settings: dict[str, Any] = {
            "bootstrap.servers": config.bootstrap_servers,
            "group.id": kafka.group_id,
            "partition.assignment.strategy": "cooperative-sticky",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": kafka.auto_offset_reset,
            "session.timeout.ms": kafka.session_timeout_ms,
            "max.poll.interval.ms": kafka.max_poll_interval_ms,
            "on_commit": self._on_commit,
            # A resumed partition is fetched in the broker's next fetch session; with the
            # default 500 ms long-poll on idle partitions every pause/resume cycle would stall
            # that long (measured: 605 msg/s -> see docs/benchmarks.md). Override freely.
            "fetch.wait.max.ms": 20,
            "logger": kafka_logger(),
            **kafka.consumer,
        }
        if transactions is not None:
            settings["isolation.level"] = "read_committed"
        log.debug(
            "consumer config",
            settings=redact({k: v for k, v in settings.items() if not callable(v)}),
        )
        self._consumer = build_client(Consumer, settings, "kafka.consumer")
        self._thread = threading.Thread(target=self._run, name="source", daemon=True)

    # -- control from other threads --------------------------------------------------------
    def start(self) -> None:
        self._consumer.subscribe(
            list(self._lanes),
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_lost,
        )
        self._thread.start()

    def apply(self, flow: FlowControl) -> None:
        """Queue a flow-control change for the source thread (thread-safe)."""
        if flow:
            self._control.put(flow)

    def positions(self) -> dict[TopicPartition, int | None]:
        """Next offset to deliver per assigned partition (None before its first message)."""
        return dict(self._positions)

    def stop_fetching(self) -> None:
        """Pause every assigned partition; polling (and group membership) continues."""
        self._control.put("stop_fetching")

    def close(self, timeout_s: float) -> None:
        """Commit final watermarks, close the consumer (leaving the group), join the thread."""
        self._stop.set()
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join(timeout_s)
        else:  # never started
            with contextlib.suppress(Exception):
                self._consumer.close()

    # -- the source thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            self._on_fatal(exc)
        finally:
            with contextlib.suppress(Exception):
                self._commit(synchronous=True)
            with contextlib.suppress(Exception):
                self._consumer.close()

    def _loop(self) -> None:
        kafka = self._config.kafka
        timeout_s = kafka.poll_timeout_ms / 1000.0
        commit_every_s = kafka.commit_interval_ms / 1000.0
        next_commit_s = time.monotonic() + commit_every_s
        next_gauges_s = time.monotonic()
        while not self._stop.is_set():
            self._drain_control()
            # Take what is already fetched without waiting; only block (for one message) when
            # nothing is. consume(n, timeout) waits until n messages or the timeout, which at
            # low rates added up to poll_timeout_ms to every message's latency.
            messages = self._consumer.consume(kafka.consume_batch_messages, 0)
            if not messages:
                messages = self._wait_for_input(timeout_s)
            self.last_poll_s = time.monotonic()
            if messages:
                self._handle(messages)
            if self.last_poll_s >= next_commit_s:
                self._commit(synchronous=False)
                next_commit_s = self.last_poll_s + commit_every_s
            if self.last_poll_s >= next_gauges_s:
                self._export_buffer_gauges()
                next_gauges_s = self.last_poll_s + GAUGE_INTERVAL_S

    def _wait_for_input(self, timeout_s: float) -> list[Message]:
        """Block for input, but let a queued resume (or stop) in without delay."""
        if self.assigned and (not self._fetching or self.assigned <= self._flow_paused):
            # Nothing can arrive before a resume: wait for one on the control queue.
            try:
                item = self._control.get(timeout=timeout_s)
            except queue.Empty:
                return []
            self._control_item(item)
            return []
        if self._flow_paused:
            timeout_s = min(timeout_s, PAUSED_POLL_S)
        return self._consumer.consume(1, timeout_s)

    def _handle(self, messages: list[Message]) -> None:
        """Wrap one poll's messages in records and push them into their rings: one lock
        acquisition per lane and poll, not per message (the per-message work here runs under
        the GIL with every other stage)."""
        now_s = time.monotonic()
        generations, floors, lanes = self._generations, self._seek_floor, self._lanes
        by_lane: dict[str, list[Record]] = {}
        for message in messages:
            if message.error() is not None:
                self._on_message_error(message)
                continue
            topic, partition, offset = message.topic(), message.partition(), message.offset()
            tp = TopicPartition(topic, partition)
            generation = generations.get(tp)
            if generation is None:
                continue  # not ours (revoked between fetch and delivery)
            if floors:
                floor = floors.get(tp)
                if floor is not None:
                    if offset != floor:
                        continue  # fetched before our seek took effect; it will come again
                    del floors[tp]
            lane = lanes[topic]
            raw_headers = message.headers()
            headers = tuple(raw_headers) if raw_headers else ()
            default = lane.default_priority
            priority = _priority(headers, default) if headers else default
            record = Record(
                tp,
                offset,
                message.key(),
                message.value(),
                headers,
                message.timestamp()[1],
                now_s,
                generation,
                priority,
            )
            batch = by_lane.get(topic)
            if batch is None:
                by_lane[topic] = [record]
            else:
                batch.append(record)
        for topic, records in by_lane.items():
            self._push(topic, lanes[topic], records)

    def _on_message_error(self, message: Message) -> None:
        err = message.error()
        if err.code() == KafkaError._PARTITION_EOF:
            return
        if err.fatal():
            raise KafkaException(err)
        log.warning("consumer error", error=str(err))

    def _push(self, topic: str, lane: TopicLane, records: list[Record]) -> None:
        """Push one lane's records; a partition whose ring is full refuses the rest of its
        records, is paused, and is sought back to the first refused offset."""
        refused: dict[TopicPartition, int] = {}
        pause: list[TopicPartition] = []
        accepted: list[Record] = []
        buffers = lane.buffers
        with lane.cond:
            for record in records:
                if record.tp in refused:
                    continue
                flow = buffers.push(record)
                if flow is None:
                    refused[record.tp] = record.offset
                    continue
                accepted.append(record)
                if flow.pause:
                    pause.extend(flow.pause)
            if accepted:
                self._tracker.consumed_many(accepted)
                lane.cond.notify()
        for tp, offset in refused.items():
            # Ring full: refuse, pause, and fetch this offset again after resuming.
            self._seek_floor[tp] = offset
            self._consumer.pause([_ktp(tp)])
            self._consumer.seek(_ktp(tp, offset))
        if accepted:
            self.last_input_s = accepted[-1].consumed_at_s
            positions = self._positions
            for record in accepted:
                positions[record.tp] = record.offset + 1
            self._metrics.child(self._metrics.consumed, topic).inc(len(accepted))
        if pause:
            self._consumer.pause([_ktp(tp) for tp in pause])
        if pause or refused:
            self._flow_paused.update(pause)
            self._flow_paused.update(refused)
            self._export_buffer_gauges()

    def _export_buffer_gauges(self) -> None:
        """Ring fill per partition and the count of partitions paused by flow control."""
        for lane in self._lanes.values():
            with lane.cond:
                fills = lane.buffers.fill_ratios()
            for tp, fill in fills.items():
                self._metrics.ring_fill.labels(tp.topic, str(tp.partition)).set(fill)
        self._metrics.paused.set(len(self._flow_paused))

    def _drain_control(self) -> None:
        while True:
            try:
                item = self._control.get_nowait()
            except queue.Empty:
                return
            self._control_item(item)

    def _control_item(self, item: FlowControl | str) -> None:
        if item == "stop_fetching":
            self._fetching = False
            if self.assigned:
                self._consumer.pause([_ktp(tp) for tp in self.assigned])
            return
        assert isinstance(item, FlowControl)
        self._resume([tp for tp in item.resume if tp in self._generations])

    def _resume(self, tps: list[TopicPartition]) -> None:
        """Resume partitions paused by flow control, and seek each to its next offset: the
        seek starts the fetch at once (see the module docstring)."""
        if not tps:
            return
        self._flow_paused.difference_update(tps)
        if self._fetching:
            self._consumer.resume([_ktp(tp) for tp in tps])
            for tp in tps:
                # A refused record's offset (its floor), else the next offset after the last
                # record taken. No floor is set here: that next offset may not exist (a
                # transaction marker, a compacted record); the seek's own barrier drops
                # anything fetched before it, and the pause already dropped the prefetch.
                offset = self._seek_floor.get(tp)
                if offset is None:
                    offset = self._positions.get(tp)
                if offset is not None:
                    self._consumer.seek(_ktp(tp, offset))
        self._export_buffer_gauges()

    # -- commits ---------------------------------------------------------------------------
    def _commit(self, synchronous: bool, only: set[TopicPartition] | None = None) -> None:
        if self._transactions is not None:
            self._commit_transaction()
            return
        candidates = self._tracker.commit_candidates()
        if only is not None:
            candidates = {tp: o for tp, o in candidates.items() if tp in only}
        if not candidates:
            return
        offsets = [_ktp(tp, offset) for tp, offset in candidates.items()]
        self._tracker.mark_committed(candidates)
        try:
            result = self._consumer.commit(offsets=offsets, asynchronous=not synchronous)
        except KafkaException as exc:
            self._commit_failed(candidates, exc)
            return
        if synchronous and result is not None:
            self._on_commit(None, result)

    def _commit_transaction(self) -> None:
        """Exactly-once: close the open transaction with every moved watermark."""
        assert self._transactions is not None
        with self._transactions.lock:  # no record may join between reading offsets and commit
            candidates = self._tracker.commit_candidates()
            committed = self._transactions.commit(
                candidates, self._consumer.consumer_group_metadata()
            )
            if committed:
                if candidates:
                    self._tracker.mark_committed(candidates)
                    self._metrics.commits.inc()
                return
            self._metrics.commit_failures.inc()
            self._rewind()

    def _rewind(self) -> None:
        """After an abort: every assigned partition restarts from its committed offset, with a
        fresh ring and generation (results of the old generation are dropped by the sink)."""
        tps = sorted(self.assigned)
        committed = self._consumer.committed([_ktp(tp) for tp in tps], timeout=30)
        self._flow_paused.difference_update(tps)
        self._tracker.revoke(tps)
        self._generations.update(self._tracker.assign(tps))
        for tp in tps:
            lane = self._lanes[tp.topic]
            with lane.cond:
                lane.buffers.revoke([tp])
                lane.buffers.assign([tp])
                lane.cond.notify_all()
            self._seek_floor.pop(tp, None)
            self._positions[tp] = None
        for ktp in committed:
            offset = (
                ktp.offset
                if ktp.offset >= 0
                else (
                    OFFSET_BEGINNING
                    if self._config.kafka.auto_offset_reset == "earliest"
                    else OFFSET_END
                )
            )
            self._consumer.seek(KafkaTopicPartition(ktp.topic, ktp.partition, offset))
        if self._fetching:
            self._consumer.resume([_ktp(tp) for tp in tps])
        log.warning(
            "transaction aborted; rewound to committed offsets",
            partitions=[f"{t.topic}[{t.partition}]" for t in tps],
        )

    def _commit_failed(self, candidates: dict[TopicPartition, int], exc: object) -> None:
        # Counted and retried on the next cycle, never fatal (e.g. REBALANCE_IN_PROGRESS).
        self._metrics.commit_failures.inc()
        self._tracker.forget_committed(candidates)
        reason = str(exc)
        if reason != self._last_commit_error:  # one line per distinct error, not per retry
            log.warning(
                "commit failed; retrying next cycle", error=reason, partitions=len(candidates)
            )
        self._last_commit_error = reason

    def _on_commit(self, err: KafkaError | None, partitions: list[KafkaTopicPartition]) -> None:
        failed = {
            TopicPartition(p.topic, p.partition): p.offset
            for p in partitions
            if err is not None or p.error is not None
        }
        if failed:
            self._commit_failed(failed, err or partitions[0].error)
        if len(failed) < len(partitions):
            self._metrics.commits.inc()
            self._last_commit_error = None

    # -- rebalance callbacks (run on the source thread, inside consume) ----------------------
    def _on_assign(self, consumer: Consumer, partitions: list[KafkaTopicPartition]) -> None:
        tps = [TopicPartition(p.topic, p.partition) for p in partitions]
        self.rebalance_counts["assigned"] += 1
        generations = self._tracker.assign(tps)
        self._generations.update(generations)
        for tp in tps:
            self._seek_floor.pop(tp, None)
            self._flow_paused.discard(tp)
            self._positions[tp] = None
            lane = self._lanes[tp.topic]
            with lane.cond:
                lane.buffers.assign([tp])
        self.assigned = self.assigned | set(tps)
        self.ever_assigned = True
        self.last_rebalance_s = time.monotonic()
        consumer.incremental_assign(partitions)
        if self._fetching:
            consumer.resume(partitions)
        else:
            consumer.pause(partitions)
        log.info("partitions assigned", partitions=[f"{t.topic}[{t.partition}]" for t in tps])

    def _on_revoke(self, consumer: Consumer, partitions: list[KafkaTopicPartition]) -> None:
        tps = [TopicPartition(p.topic, p.partition) for p in partitions]
        self.rebalance_counts["revoked"] += 1
        limits = {}
        for tp in tps:
            lane = self._lanes.get(tp.topic)
            if lane is None:
                continue
            with lane.cond:
                dropped = lane.buffers.revoke([tp]).get(tp, [])
                lane.cond.notify_all()
            limits[tp] = len(dropped)
        drained = self._tracker.wait_until(limits, self._config.revoke_timeout_s)
        if not drained:
            log.warning(
                "revoke budget exceeded; committing what is done",
                timeout_s=self._config.revoke_timeout_s,
            )
        self._commit(synchronous=True, only=set(tps))
        self._forget(tps)
        consumer.incremental_unassign(partitions)
        log.info("partitions revoked", partitions=[f"{t.topic}[{t.partition}]" for t in tps])

    def _on_lost(self, consumer: Consumer, partitions: list[KafkaTopicPartition]) -> None:
        tps = [TopicPartition(p.topic, p.partition) for p in partitions]
        self.rebalance_counts["lost"] += 1
        for tp in tps:
            lane = self._lanes.get(tp.topic)
            if lane is not None:
                with lane.cond:
                    lane.buffers.revoke([tp])
        self._forget(tps)
        consumer.incremental_unassign(partitions)
        log.warning("partitions lost", partitions=[f"{t.topic}[{t.partition}]" for t in tps])

    def _forget(self, tps: list[TopicPartition]) -> None:
        self._tracker.revoke(tps)
        for tp in tps:
            self._generations.pop(tp, None)
            self._seek_floor.pop(tp, None)
            self._flow_paused.discard(tp)
            self._positions.pop(tp, None)
            with contextlib.suppress(Exception):
                self._metrics.ring_fill.remove(tp.topic, str(tp.partition))
        self.assigned = self.assigned - set(tps)
        self.last_rebalance_s = time.monotonic()
