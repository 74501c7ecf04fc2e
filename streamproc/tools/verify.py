"""Verify a run from the broker's point of view: missing/duplicate results, commits, latency.

Reads the whole input, output and dead-letter topics (``isolation.level=read_committed``) and
the consumer group's committed offsets. Every input record is identified by its source
coordinates (topic, partition, offset), which every result and dead-letter record carries in its
``streamproc.source.topic|partition|offset`` headers.
"""

from __future__ import annotations

import bisect
import uuid
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError
from confluent_kafka import TopicPartition as KafkaTopicPartition

from streamproc.kafka.transient import raise_error, read_committed, retry_transient
from streamproc.logs import kafka_logger
from streamproc.output.headers import H_OFFSET, H_PARTITION, H_TOPIC

Coord = tuple[str, int, int]


@dataclass(frozen=True)
class TopicDump:
    """Every record of a topic: key, value, headers and timestamp (ms) per (partition, offset)."""

    records: dict[tuple[int, int], tuple[bytes | None, bytes | None, dict[str, bytes], int]]
    end_offsets: dict[int, int]
    stable: bool = True  # read_committed reached every end offset: no transaction left open


def read_topic(bootstrap_servers: str, topic: str, timeout_s: float = 60.0) -> TopicDump:
    """Read ``topic`` from the beginning to its current end (read_committed). When a
    transaction is still open the end is never reached: ``stable`` is then False (after
    ``timeout_s`` seconds without progress). A topic that does not exist reads as empty;
    transient broker errors while finding the end are retried for up to ``timeout_s``.

    Raises:
        KafkaException: the end offsets could not be read (not transient, or past the
            deadline)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap_servers,
            "group.id": f"streamproc-verify-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            "logger": kafka_logger(),
        }
    )
    try:
        ends = retry_transient(
            lambda: _end_offsets(consumer, topic, timeout_s), timeout_s, f"end offsets of {topic}"
        )
        if ends is None:
            return TopicDump({}, {})
        partitions = sorted(ends)
        todo = {p for p in partitions if ends[p] > 0}
        consumer.assign([KafkaTopicPartition(topic, p, OFFSET_BEGINNING) for p in todo])
        records: dict[tuple[int, int], tuple[bytes | None, bytes | None, dict[str, bytes], int]]
        records = {}
        idle_polls = 0
        while todo and idle_polls < int(timeout_s / 0.5):
            message = consumer.poll(0.5)
            if message is None:
                idle_polls += 1
                continue
            partition, offset = message.partition(), message.offset()
            if partition is None or offset is None:
                continue
            if message.error() is not None:
                if offset >= ends.get(partition, 0):
                    todo.discard(partition)
                continue
            raw = message.headers() or []
            pairs = raw.items() if isinstance(raw, dict) else raw
            headers = {k: v for k, v in pairs if isinstance(v, bytes)}
            records[(partition, offset)] = (
                _as_bytes(message.key()),
                _as_bytes(message.value()),
                headers,
                message.timestamp()[1],
            )
            idle_polls = 0  # the deadline is on time without progress (a loaded machine)
            if offset + 1 >= ends[partition]:
                todo.discard(partition)
        return TopicDump(records, ends, stable=not todo)
    finally:
        consumer.close()


def _end_offsets(consumer: Consumer, topic: str, timeout_s: float) -> dict[int, int] | None:
    """High watermark per partition of ``topic``; None when the topic does not exist.

    Raises:
        KafkaException: a metadata or watermark request failed (transient ones are retried
            by the caller).
    """
    metadata = consumer.list_topics(topic, timeout=timeout_s).topics[topic]
    if metadata.error is not None and metadata.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
        return None
    raise_error(metadata.error)  # e.g. LEADER_NOT_AVAILABLE: retried
    ends = {}
    for partition in sorted(metadata.partitions):
        _, high = consumer.get_watermark_offsets(
            KafkaTopicPartition(topic, partition), timeout=timeout_s
        )
        ends[partition] = high
    return ends


def committed_offsets(
    bootstrap_servers: str,
    group_id: str,
    topic: str,
    partitions: list[int],
    timeout_s: float = 60.0,
) -> dict[int, int]:
    """The group's committed offset per partition (-1001 = none); transient broker errors
    (e.g. ``COORDINATOR_LOAD_IN_PROGRESS``) are retried for up to ``timeout_s`` seconds."""
    consumer = Consumer(
        {"bootstrap.servers": bootstrap_servers, "group.id": group_id, "logger": kafka_logger()}
    )

    def committed() -> dict[int, int]:
        wanted = [KafkaTopicPartition(topic, p) for p in partitions]
        got = read_committed(consumer, wanted, min(30.0, timeout_s))
        return {tp.partition: tp.offset for tp in got}

    try:
        return retry_transient(committed, timeout_s, f"committed offsets of {group_id}")
    finally:
        consumer.close()


@dataclass
class Verdict:
    """The outcome of :func:`verify` for one input topic."""

    topic: str
    inputs: int
    results: int
    dead_lettered: int
    missing: list[Coord]
    duplicates: int
    committed: dict[int, int]
    end_offsets: dict[int, int]
    latencies_ms: list[float] = field(default_factory=list)
    examples: list[bytes] = field(default_factory=list)
    output_stable: bool = True

    @property
    def committed_equals_end(self) -> bool:
        return all(
            self.committed.get(p, -1) == end for p, end in self.end_offsets.items() if end > 0
        )

    @property
    def ok(self) -> bool:
        return not self.missing and self.duplicates == 0 and self.committed_equals_end

    def latency_percentiles(self) -> dict[str, float]:
        if not self.latencies_ms:
            return {}
        values = np.asarray(self.latencies_ms)
        return {f"p{q}": float(np.percentile(values, q)) for q in (50, 95, 99)}


def _source_coord(headers: dict[str, bytes]) -> Coord | None:
    try:
        return (
            headers[H_TOPIC].decode(),
            int(headers[H_PARTITION]),
            int(headers[H_OFFSET]),
        )
    except (KeyError, ValueError):
        return None


def verify(
    bootstrap_servers: str,
    input_topic: str,
    output_topic: str,
    dlq_topic: str,
    group_id: str,
    examples: int = 3,
    outputs: TopicDump | None = None,
) -> Verdict:
    """Count missing and duplicate results per input record and compare commits with ends.

    ``outputs``: the output topic when the caller already read it (:func:`read_topic`), for
    checks of its own on the same records; read here when None."""
    inputs = read_topic(bootstrap_servers, input_topic)
    if outputs is None:
        outputs = read_topic(bootstrap_servers, output_topic)
    dlq = read_topic(bootstrap_servers, dlq_topic)
    seen: Counter[Coord] = Counter()
    first_result_ts: dict[Coord, int] = {}
    example_values: list[bytes] = []
    for _, value, headers, ts in outputs.records.values():
        coord = _source_coord(headers)
        if coord is None or coord[0] != input_topic:
            continue
        seen[coord] += 1
        first_result_ts.setdefault(coord, ts)
        if len(example_values) < examples and value is not None:
            example_values.append(value)
    dead = 0
    for _, _, headers, _ in dlq.records.values():
        coord = _source_coord(headers)
        if coord is not None and coord[0] == input_topic:
            seen[coord] += 1
            dead += 1
    input_coords = [(input_topic, p, o) for (p, o) in inputs.records]
    missing = [c for c in input_coords if seen[c] == 0]
    duplicates = sum(seen[c] - 1 for c in input_coords if seen[c] > 1)
    latencies = [
        float(first_result_ts[(input_topic, p, o)] - rec[3])
        for (p, o), rec in inputs.records.items()
        if (input_topic, p, o) in first_result_ts
    ]
    committed = committed_offsets(
        bootstrap_servers, group_id, input_topic, sorted(inputs.end_offsets)
    )
    return Verdict(
        topic=input_topic,
        inputs=len(input_coords),
        results=sum(1 for c in input_coords if c in first_result_ts),
        dead_lettered=dead,
        missing=missing,
        duplicates=duplicates,
        committed=committed,
        end_offsets=inputs.end_offsets,
        latencies_ms=latencies,
        examples=example_values,
        output_stable=outputs.stable and dlq.stable,
    )


CommitSample = tuple[float, dict[int, int]]  # (wall-clock ms, committed offset per partition)


def replayed_after_commit(
    outputs: TopicDump,
    input_topic: str,
    commits: list[CommitSample],
    margin_ms: float = 1000.0,
) -> list[Coord]:
    """Results produced again for an input whose offset was already committed: at-least-once
    duplicates beyond the work since the last successful commit (empty when every duplicate is
    work a rewind to the last commit repeats).

    Args:
        outputs: the output topic (:func:`read_topic`); each record's timestamp is its
            CreateTime (ms), set when streamproc produced it.
        input_topic: only results of this input topic count.
        commits: the group's committed offsets sampled over the run, in time order (a
            committed offset is the next offset to consume).
        margin_ms: a copy is judged against the last sample at least this much older than
            the copy (clock granularity, and the time between a sample's answer and its
            recording).

    Returns:
        The source coordinates of every copy after the first (by timestamp) created when the
        group had already committed past its offset, in output order.
    """
    copies: dict[Coord, list[tuple[int, tuple[int, int]]]] = {}
    for position, (_, _, headers, ts) in sorted(outputs.records.items()):
        coord = _source_coord(headers)
        if coord is not None and coord[0] == input_topic:
            copies.setdefault(coord, []).append((ts, position))
    times = [t for t, _ in commits]
    beyond: list[tuple[tuple[int, int], Coord]] = []
    for coord, found in copies.items():
        _, partition, offset = coord
        for ts, position in sorted(found)[1:]:
            i = bisect.bisect_right(times, ts - margin_ms) - 1
            if i >= 0 and offset < commits[i][1].get(partition, -1):
                beyond.append((position, coord))
    return [coord for _, coord in sorted(beyond)]


def _as_bytes(data: str | bytes | None) -> bytes | None:
    """A key or value as bytes (the client types them ``str | bytes``; ours are bytes)."""
    return data.encode() if isinstance(data, str) else data
