"""Consumer lag per partition, in messages and in seconds, correct while partitions are paused.

librdkafka's own lag statistics come from fetch responses, which stop while a partition is
paused, so they go stale exactly when lag matters. This monitor asks the broker for the latest
offset of every assigned partition (a probe consumer's ``get_watermark_offsets``, off the
consumer thread; it never subscribes). Lag in messages is the work left: the messages in the
pipeline not yet done (the offset tracker's count) plus the offsets not yet fetched (end offset
minus the source's position, which moves past transaction markers as the consumer reads them:
a drained partition reads 0, not 1 per transaction marker). Lag in seconds is the age of the
oldest message in the pipeline not yet done (now minus its record timestamp), 0 when none is.
Series of partitions no longer assigned are removed.

For ``run --exit-when-idle-s`` (:meth:`LagMonitor.watch_group`) each refresh also measures how
far the whole consumer group got: the group's committed offset and the end offset of every
partition of the input topics, whoever owns it (:class:`GroupOffsets`, read by
:mod:`streamproc.idle`).

Not the AdminClient: its ``list_offsets`` and ``list_consumer_group_offsets`` crash librdkafka
2.16.0 (an assertion, SIGABRT: the whole process) when two of three brokers were down and
return (docs/benchmarks-history.md).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from confluent_kafka import Consumer, KafkaException
from confluent_kafka import TopicPartition as KafkaTopicPartition

from streamproc.config.sections import Scalar
from streamproc.logs import get_logger, kafka_logger
from streamproc.metrics import Metrics
from streamproc.records import TopicPartition

log = get_logger(__name__)


@dataclass(frozen=True)
class GroupOffsets:
    """How far the consumer group got in every partition of the input topics, as one refresh
    measured it (the group's, not this member's: partitions another member owns count too).

    Attributes:
        measured_s: monotonic seconds when the refresh began.
        partitions: every partition of the input topics (from the topics' metadata), sorted.
        committed: per partition, the group's committed offset, or where the group would start
            where it has none (``kafka.auto_offset_reset``: the earliest or the end offset);
            a partition whose offsets did not answer is absent.
        ends: per partition, the end offset (high watermark); absent where it did not answer.
            A drained partition of an input written in transactions has committed == end: the
            commit passes the marker after the last record
            (:meth:`~streamproc.offsets.tracker.OffsetTracker.passed`).
    """

    measured_s: float
    partitions: tuple[TopicPartition, ...]
    committed: Mapping[TopicPartition, int]
    ends: Mapping[TopicPartition, int]

    def behind(self) -> dict[TopicPartition, int | None]:
        """Partitions whose committed offset is short of the end offset, each with its lag in
        offsets (end - committed; None where either offset did not answer), sorted."""
        out: dict[TopicPartition, int | None] = {}
        for tp in self.partitions:
            committed, end = self.committed.get(tp), self.ends.get(tp)
            if committed is None or end is None:
                out[tp] = None
            elif committed < end:
                out[tp] = end - committed
        return out


class LagMonitor:
    """Refresh ``streamproc_consumer_lag_messages`` every ``interval_s`` seconds.

    Args:
        admin_config: librdkafka settings of the probe consumer (bootstrap, security).
        group_id: the consumer group (its committed offset stands in for partitions the
            source has not consumed from yet).
        positions: returns, per assigned partition, the next offset the source will deliver,
            or None when it has not consumed from it yet.
        metrics: where the gauges live (``streamproc_consumer_lag_messages`` and
            ``streamproc_consumer_lag_seconds``).
        interval_s: refresh period in seconds.
        on_tick: also called every period (e.g. GPU sampling), errors logged.
        stall_timeout_s: a partition with lag > 0 whose position has not moved for this long
            is *stalled*: counted in ``streamproc_stalled_partitions`` and logged once.
        clock: monotonic clock in seconds.
        probe_factory: builds the probe consumer from its settings (tests pass a fake).
        backlog: per assigned partition, the messages in the pipeline not yet done and the
            timestamp (ms since the epoch) of the oldest of them
            (:meth:`~streamproc.offsets.tracker.OffsetTracker.backlog`); none when omitted.
        wall: wall clock in seconds since the epoch (for the lag in seconds).
    """

    def __init__(
        self,
        admin_config: Mapping[str, Scalar],
        group_id: str,
        positions: Callable[[], dict[TopicPartition, int | None]],
        metrics: Metrics,
        interval_s: float = 5.0,
        on_tick: Callable[[], None] | None = None,
        stall_timeout_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        probe_factory: Callable[[dict[str, Any]], Any] = Consumer,
        backlog: Callable[[], Mapping[TopicPartition, tuple[int, int | None]]] = dict,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._backlog = backlog
        self._wall = wall
        self._stall_timeout_s = stall_timeout_s
        self._clock = clock
        self._progress: dict[TopicPartition, tuple[int | None, float]] = {}
        self.stalled: set[TopicPartition] = set()
        self._probe: Any = probe_factory(
            {
                "log_level": 3,
                **admin_config,
                "group.id": group_id,
                "enable.auto.commit": False,
                "logger": kafka_logger(),
            }
        )
        self._group_id = group_id
        self._positions = positions
        self._metrics = metrics
        self._interval_s = interval_s
        self._on_tick = on_tick
        self._exported: set[TopicPartition] = set()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lag", daemon=True)
        self.latest: dict[TopicPartition, int] = {}
        self.empty_at: Mapping[TopicPartition, float] = {}
        """Per assigned partition not consumed from yet (position None) whose start offset
        (committed, else earliest) equalled its end offset at the last refresh: the
        monotonic time that refresh began. Replaced whole by each refresh (lag thread);
        one attribute read from any thread."""
        self._group_topics: tuple[str, ...] = ()
        self._end_topics: tuple[str, ...] = ()
        self._group_reset: Literal["earliest", "latest"] = "earliest"
        self.group: GroupOffsets | None = None
        """The last complete measurement of the group (:meth:`watch_group`), None before the
        first one; replaced whole by a refresh (lag thread), one attribute read from any
        thread. A refresh whose group measurement fails leaves the previous one."""

    def start(self) -> None:
        self._thread.start()

    def watch_group(
        self, topics: Sequence[str], reset: Literal["earliest", "latest"] = "earliest"
    ) -> None:
        """Measure the group's committed and end offsets of every partition of ``topics`` at
        each refresh from now on (:attr:`group`); ``reset`` is ``kafka.auto_offset_reset``
        (where the group starts in a partition it has committed nothing to). Per refresh: one
        metadata request per topic, one for the committed offsets, one or two per partition
        (thread-safe)."""
        self._group_reset = reset
        self._group_topics = tuple(dict.fromkeys(topics))

    def watch_ends(self, topics: Sequence[str]) -> None:
        """Export the end offset of every partition of ``topics``
        (``streamproc_partition_end_offset``) at each refresh from now on: a share member has
        no position of its own, and the group's backlog is measured against these
        (``streamproc_share_acquired_end_offset``). One metadata request per topic and one per
        partition per refresh (thread-safe)."""
        self._end_topics = tuple(dict.fromkeys(topics))

    def wake(self) -> None:
        """Refresh now instead of at the end of the period (thread-safe)."""
        self._wake.set()

    def close(self) -> None:
        """Stop refreshing and close the probe consumer (its librdkafka handle reconnects
        forever otherwise); idempotent."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        probe, self._probe = self._probe, None
        if probe is not None:
            probe.close()

    def _client(self) -> Any:
        if self._probe is None:
            raise RuntimeError("the lag monitor is closed")
        return self._probe

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.refresh()
                if self._on_tick is not None:
                    self._on_tick()
            except Exception as exc:  # the broker may be away; lag is best effort
                log.debug("lag refresh failed", error=repr(exc))

    def refresh(self, timeout_s: float = 10.0) -> dict[TopicPartition, int]:
        """Query end offsets now, update the gauges and :attr:`empty_at`; return lag in
        messages per partition."""
        started_s = self._clock()
        if self._group_topics:
            try:
                self.group = self._measure_group(started_s, timeout_s)
            except KafkaException as exc:  # the previous measurement stands, older
                log.debug("group offsets unavailable", error=str(exc))
        if self._end_topics:
            try:
                partitions = self._partitions(self._end_topics, timeout_s)
            except KafkaException as exc:  # the previous values stand, older
                log.debug("end offsets unavailable", error=str(exc))
            else:
                gauge = self._metrics.partition_end_offset
                for tp, end in self._offsets(partitions, True, timeout_s).items():
                    gauge.labels(tp.topic, str(tp.partition)).set(end)
        positions = self._positions()
        for tp in set(self._progress) - positions.keys():
            self._progress.pop(tp, None)
            self.stalled.discard(tp)
        for tp in self._exported - positions.keys():
            for gauge in (self._metrics.consumer_lag, self._metrics.consumer_lag_seconds):
                with contextlib.suppress(KeyError):
                    gauge.remove(tp.topic, str(tp.partition))
        self._exported &= positions.keys()
        if not positions:
            self.empty_at = {}
            return {}
        ends = self._offsets(positions, True, timeout_s)
        unknown = [tp for tp, pos in positions.items() if pos is None]
        starts = self._starts(unknown, timeout_s) if unknown else {}
        backlog = self._backlog()
        now_s = self._wall()
        lags = {}
        empty_at: dict[TopicPartition, float] = {}
        for tp, end in ends.items():
            self.latest[tp] = end
            position = positions.get(tp)
            if position is None:
                position = starts.get(tp)
                if position is not None and position >= end:
                    empty_at[tp] = started_s
            if position is None:
                continue
            pending, oldest_ms = backlog.get(tp, (0, None))
            lag = pending + max(0, end - position)
            self._watch(tp, positions.get(tp), lag)
            lags[tp] = lag
            if tp in self._positions():  # still ours after the round trip
                labels = (tp.topic, str(tp.partition))
                self._metrics.consumer_lag.labels(*labels).set(lag)
                age_s = 0.0 if oldest_ms is None else max(0.0, now_s - oldest_ms / 1000.0)
                self._metrics.consumer_lag_seconds.labels(*labels).set(age_s)
                self._exported.add(tp)
        self.empty_at = empty_at
        return lags

    def _watch(self, tp: TopicPartition, position: int | None, lag: int) -> None:
        """Stalled-partition watchdog: assigned, lag > 0, no progress for stall_timeout_s."""
        now_s = self._clock()
        last_position, since_s = self._progress.get(tp, (position, now_s))
        if position != last_position or lag == 0:
            since_s = now_s
        self._progress[tp] = (position, since_s)
        stalled = lag > 0 and now_s - since_s >= self._stall_timeout_s
        if stalled and tp not in self.stalled:
            log.warning(
                "partition stalled",
                topic=tp.topic,
                partition=tp.partition,
                lag=lag,
                position=position,
                stalled_s=round(now_s - since_s, 1),
            )
        if stalled:
            self.stalled.add(tp)
        else:
            self.stalled.discard(tp)
        self._metrics.stalled.set(len(self.stalled))

    def _offsets(
        self, tps: Iterable[TopicPartition], high: bool, timeout_s: float
    ) -> dict[TopicPartition, int]:
        """The high (``high``) or low watermark of each partition that answered."""
        probe = self._client()
        out: dict[TopicPartition, int] = {}
        for tp in tps:
            with contextlib.suppress(KafkaException):
                low, end = probe.get_watermark_offsets(
                    KafkaTopicPartition(tp.topic, tp.partition), timeout=timeout_s
                )
                out[tp] = end if high else low
        return out

    def _measure_group(self, started_s: float, timeout_s: float) -> GroupOffsets:
        """:class:`GroupOffsets` of every partition of the watched topics.

        Raises:
            KafkaException: the metadata or the group's committed offsets did not answer (a
                partial answer would leave partitions out, and a partition left out must
                not read as done).
        """
        probe = self._client()
        reset_to_end = self._group_reset == "latest"
        tps = self._partitions(self._group_topics, timeout_s)
        asked = [KafkaTopicPartition(tp.topic, tp.partition) for tp in tps]
        answered = probe.committed(asked, timeout=timeout_s)
        ends = self._offsets(tps, True, timeout_s)
        committed: dict[TopicPartition, int] = {}
        fresh: list[TopicPartition] = []
        for ktp in answered:
            tp = TopicPartition(ktp.topic, ktp.partition)
            if ktp.error is not None:
                continue
            if ktp.offset >= 0:
                committed[tp] = ktp.offset
            elif reset_to_end:
                if tp in ends:
                    committed[tp] = ends[tp]
            else:
                fresh.append(tp)
        if fresh:
            committed.update(self._offsets(fresh, False, timeout_s))
        return GroupOffsets(started_s, tuple(tps), committed, ends)

    def _partitions(self, topics: Sequence[str], timeout_s: float) -> list[TopicPartition]:
        """Every partition of ``topics``, from their metadata, in order.

        Raises:
            KafkaException: a topic's metadata did not answer.
        """
        probe = self._client()
        tps: list[TopicPartition] = []
        for topic in topics:
            metadata = probe.list_topics(topic, timeout=timeout_s).topics[topic]
            if metadata.error is not None:
                raise KafkaException(metadata.error)
            tps += [TopicPartition(topic, p) for p in sorted(metadata.partitions)]
        return tps

    def _starts(self, tps: list[TopicPartition], timeout_s: float) -> dict[TopicPartition, int]:
        """Committed offset of the group, else the earliest offset (auto.offset.reset)."""
        committed: dict[TopicPartition, int] = {}
        with contextlib.suppress(KafkaException):
            asked = [KafkaTopicPartition(tp.topic, tp.partition) for tp in tps]
            for ktp in self._client().committed(asked, timeout=timeout_s):
                if ktp.offset >= 0:
                    committed[TopicPartition(ktp.topic, ktp.partition)] = ktp.offset
        missing = [tp for tp in tps if tp not in committed]
        if missing:
            committed.update(self._offsets(missing, False, timeout_s))
        return committed
