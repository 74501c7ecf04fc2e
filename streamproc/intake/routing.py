"""One poll's messages routed: each wrapped in a :class:`~streamproc.records.Record` and grouped
per lane and partition, in offset order (both intakes: the consumer group's
:class:`~streamproc.intake.source.Source` and the share group's
:class:`~streamproc.share.source.ShareSource`).

A record's priority and deadline (``streamproc.intake.deadlines``) are worked out here, where its
headers are read anyway: a deadline only for a record with headers or on a lane with
``max_age_ms``, against one wall-clock reading per poll. The per-message work runs under the GIL
with every other stage, so what can be is looked up once per partition and poll, not per message.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from streamproc.intake.deadlines import DEADLINE_HEADER
from streamproc.intake.lane import Lane
from streamproc.kafka.protocols import MessageLike
from streamproc.metrics import Metrics
from streamproc.records import (
    PRIORITY_HEADER,
    PRIORITY_HEADER_VALUES,
    Headers,
    Record,
    TopicPartition,
)

_Entry = list[Any]
"""Per partition of one poll: ``[TopicPartition, generation or None, Lane, lane has
max_age_ms, the partition's records so far or None]``."""


class Routed(NamedTuple):
    """One poll's records, ready to offer.

    Attributes:
        runs: per lane (its input topic), per partition, the poll's records in offset order.
        deadlines: the lanes offered a record with a deadline in this poll.
    """

    runs: dict[str, dict[TopicPartition, list[Record]]]
    deadlines: set[str]


def route(
    messages: Sequence[MessageLike],
    lanes: Mapping[str, Lane],
    generation_of: Callable[[TopicPartition], int | None],
    floors: dict[TopicPartition, int],
    wall_ms: float,
    now_s: float,
    metrics: Metrics,
    on_error: Callable[[MessageLike], None],
) -> Routed:
    """Wrap one poll's messages in records, grouped per lane and partition.

    Args:
        messages: what one ``consume``/``poll`` returned (offset order per partition).
        lanes: per input topic, its lane.
        generation_of: the partition's generation (asked once per partition and poll); None:
            not ours (revoked between fetch and delivery), its messages are dropped.
        floors: per partition sought back after a refusal, the offset the next message must
            have (anything fetched before the seek took effect is dropped); a partition's
            floor is removed when it is met.
        wall_ms: the wall clock in epoch milliseconds, read once for the poll.
        now_s: the monotonic time of the poll (each record's ``consumed_at_s``).
        metrics: counts records whose deadline header is invalid, per input topic.
        on_error: called with each message that carries an error instead of a record.
    """
    # per lane, per partition: this poll's records of it, in offset order
    by_lane: dict[str, dict[TopicPartition, list[Record]]] = {}
    with_deadline: set[str] = set()  # lanes offered a record with a deadline in this poll
    invalid: dict[str, int] = {}  # per lane: records whose deadline header was invalid
    inf = math.inf
    # per topic and partition of this poll: its TopicPartition, generation, lane, whether
    # the lane has max_age_ms, and the partition's run of records (None until its first),
    # looked up once per poll instead of building and hashing a TopicPartition per message
    known: dict[str, dict[int, _Entry]] = {}
    for message in messages:
        if message.error() is not None:
            on_error(message)
            continue
        topic, partition, offset = message.topic(), message.partition(), message.offset()
        assert topic is not None and partition is not None and offset is not None
        partitions = known.get(topic)
        if partitions is None:
            partitions = known[topic] = {}
        entry = partitions.get(partition)
        if entry is None:
            tp = TopicPartition(topic, partition)
            lane = lanes[topic]
            timed = lane.deadlines.max_age_ms is not None
            entry = partitions[partition] = [tp, generation_of(tp), lane, timed, None]
        tp, generation, lane, timed, run = entry
        if generation is None:
            continue  # not ours (revoked between fetch and delivery)
        if floors:
            floor = floors.get(tp)
            if floor is not None:
                if offset != floor:
                    continue  # fetched before our seek took effect; it will come again
                del floors[tp]
        raw_headers = message.headers()
        priority = lane.default_priority
        timestamp_ms = message.timestamp()[1]
        deadline_s = inf
        dated = timed
        if raw_headers:
            headers: Headers = tuple(raw_headers)
            # one scan for both headers read here (the first of each name counts, as in
            # Priority.of and Deadlines.deadline_s)
            named = False
            for key, value in headers:
                if key == PRIORITY_HEADER and not named:
                    priority = PRIORITY_HEADER_VALUES.get(value, priority)
                    named = True
                elif key == DEADLINE_HEADER:
                    dated = True
        else:
            headers = ()
        if dated:
            deadline_s, bad = lane.deadlines.deadline_s(headers, timestamp_ms, wall_ms, now_s)
            if bad:
                invalid[topic] = invalid.get(topic, 0) + 1
            if deadline_s != inf:
                with_deadline.add(topic)
        record = Record(
            tp,
            offset,
            message.key(),
            message.value(),
            headers,
            timestamp_ms,
            now_s,
            generation,
            priority,
            deadline_s,
        )
        if run is None:
            run = entry[4] = [record]
            runs = by_lane.get(topic)
            if runs is None:
                by_lane[topic] = {tp: run}
            else:
                runs[tp] = run
        else:
            run.append(record)
    for topic, count in invalid.items():
        metrics.child(metrics.deadline_header_invalid, topic).inc(count)
    return Routed(by_lane, with_deadline)
