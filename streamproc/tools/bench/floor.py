"""The honest at-least-once floor: the simplest single-threaded loop with streamproc's guarantees.

What it does per message is what streamproc must do at the least for the same promise:

* the results producer streamproc builds (:func:`streamproc.output.producer.producer_settings`:
  idempotent, ``acks=all``, ``linger.ms`` 2, lz4) and the consumer settings of its source
  (:func:`streamproc.intake.source.consumer_settings`: no auto commit, ``fetch.wait.max.ms`` 20;
  but librdkafka's own prefetch, not the ring-sized one: the floor has no rings to pause);
* the result headers streamproc writes: source topic, partition and offset, and the timing
  header (``streamproc.timing``: queue wait, inference and processing milliseconds);
* a delivery callback per message; an input offset counts as done only from its result's
  delivery report;
* asynchronous commits, every ``kafka.commit_interval_ms`` (streamproc's default 1 s), of the
  fully delivered offsets: per partition, one past the longest delivered prefix of what was
  consumed (:class:`DeliveredOffsets`); a synchronous commit of the final positions at the end.

"floor" produces the input value as the result (no decode, no model). "floor + work" runs, in the
same thread and batches of the size streamproc settles on, the workload's own
``decode_many`` -> model -> ``encode_many`` (:class:`Work`), with torch on one thread; rows that
fail decode or encode are dead-lettered with streamproc's error headers. Not handled (the bench's
group has one member and clean input): rebalances after the first assignment, retries of an
encode, records refused by the broker (the run fails instead).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, Protocol, TypeVar, cast

import numpy as np
import torch
from confluent_kafka import Consumer, KafkaError, Producer
from confluent_kafka import TopicPartition as KafkaTopicPartition

from streamproc.config import Config
from streamproc.errors import RecordError
from streamproc.intake.source import consumer_settings, prefetch_settings
from streamproc.metrics import Metrics
from streamproc.offsets.guarantees import AtLeastOnce
from streamproc.offsets.tracker import OffsetTracker
from streamproc.output.headers import (
    H_CLASS,
    H_MESSAGE,
    H_OFFSET,
    H_PARTITION,
    H_STAGE,
    H_TIMING,
    H_TOPIC,
    TIMING_FORMAT,
)
from streamproc.output.producer import produce_waiting, producer_settings
from streamproc.records import Record, TopicPartition
from streamproc.tools.bench.cpu import CpuMeter
from streamproc.workloads import Encoded, load_workload

K = TypeVar("K", bound=Hashable)


class _Message(Protocol):
    """A consumed message without an error (``confluent_kafka.Message``): its coordinates are
    set."""

    def partition(self) -> int: ...
    def offset(self) -> int: ...
    def key(self) -> bytes | None: ...
    def value(self) -> bytes | None: ...
    def headers(self) -> list[tuple[str, bytes]] | None: ...
    def timestamp(self) -> tuple[int, int]: ...


POLL_S = 0.1
"""Longest blocking wait for input when none is buffered (seconds)."""
STALL_S = 60.0
"""The loop fails when no input arrives and nothing is delivered for this long (seconds)."""


class DeliveredOffsets(Generic[K]):
    """Which input offsets may be committed: per partition, one past the longest delivered
    prefix of the consumed offsets (an offset is delivered when its result, or dead-letter
    record, is acknowledged). Pure bookkeeping, no Kafka calls; one thread uses it.

    Offsets of a partition must be consumed in increasing order, and may have gaps (compacted
    records, transaction markers). Deliveries may arrive in any order.
    """

    def __init__(self) -> None:
        self._pending: dict[K, deque[int]] = {}
        self._early: dict[K, set[int]] = {}
        self._position: dict[K, int] = {}
        self._committed: dict[K, int] = {}

    def consumed(self, partition: K, offset: int) -> None:
        """``offset`` of ``partition`` was consumed and its result is being produced.

        Raises:
            ValueError: ``offset`` is not above every offset consumed before on ``partition``.
        """
        pending = self._pending.setdefault(partition, deque())
        last = pending[-1] if pending else self._position.get(partition, -1) - 1
        if offset <= last:
            raise ValueError(f"offset {offset} of {partition!r} consumed after {last}")
        pending.append(offset)

    def delivered(self, partition: K, offset: int) -> None:
        """The result of ``offset`` was acknowledged.

        Raises:
            KeyError: ``offset`` of ``partition`` was never consumed (or delivered twice).
        """
        pending = self._pending.get(partition)
        if not pending or offset < pending[0]:
            raise KeyError(f"offset {offset} of {partition!r} is not awaiting delivery")
        if offset != pending[0]:
            self._early.setdefault(partition, set()).add(offset)
            return
        pending.popleft()
        position = offset + 1
        early = self._early.get(partition)
        while early and pending and pending[0] in early:
            early.discard(pending[0])
            position = pending.popleft() + 1
        self._position[partition] = position

    def to_commit(self) -> dict[K, int]:
        """The positions (next offset to read) that advanced since the last call; they count
        as committed from now on."""
        changed = {p: o for p, o in self._position.items() if self._committed.get(p) != o}
        self._committed.update(changed)
        return changed

    def positions(self) -> dict[K, int]:
        """Every partition's position: one past its longest delivered prefix."""
        return dict(self._position)

    def awaiting(self) -> int:
        """Consumed offsets whose delivery (or that of an earlier one) is outstanding."""
        return sum(len(pending) for pending in self._pending.values())


@dataclass
class _Deliveries:
    """Delivery reports of the floor's producer (called on the loop's own thread, from
    ``producer.poll``/``flush``)."""

    offsets: DeliveredOffsets[int] = field(default_factory=DeliveredOffsets)
    done: int = 0
    failures: list[str] = field(default_factory=list)

    def report(self, partition: int, offset: int, err: KafkaError | None, _msg: Any) -> None:
        if err is not None:
            self.failures.append(f"{partition}@{offset}: {err}")
            return
        self.offsets.delivered(partition, offset)
        self.done += 1


class Work:
    """The workload's own decode -> model -> encode for one batch, in the calling thread.

    Args:
        workload_name: a built-in workload or any spec :func:`load_workload` takes.
        batch_size: the most messages per call; the staging rows are allocated once.
    """

    def __init__(self, workload_name: str, batch_size: int) -> None:
        self.workload = load_workload(workload_name)
        self.model = self.workload.build_model(torch.device("cpu"))
        self.rows = np.zeros(
            (batch_size, *self.workload.item_shape), dtype=self.workload.item_dtype
        )
        self.model(torch.from_numpy(self.rows))  # warm-up, outside the measured window

    def __call__(
        self, records: Sequence[Record]
    ) -> tuple[list[Encoded | RecordError | Exception], float]:
        """Per record, its encoded result or the error that sends it to the dead-letter topic;
        and the model's time for the batch (seconds)."""
        count = len(records)
        rows = self.rows[:count]
        failed = self.workload.decode_many(records, rows)
        started_s = time.monotonic()
        outputs = tuple(out.numpy() for out in self.model(torch.from_numpy(rows)))
        inference_s = time.monotonic() - started_s
        if not failed:
            return list(self.workload.encode_many(records, outputs)), inference_s
        keep = [i for i in range(count) if i not in failed]
        encoded = self.workload.encode_many(
            [records[i] for i in keep], tuple(out[keep] for out in outputs)
        )
        by_row: dict[int, Encoded | RecordError | Exception] = dict(failed)
        by_row.update(zip(keep, encoded, strict=True))
        return [by_row[i] for i in range(count)], inference_s


def run_floor(
    config: Config,
    messages: int,
    work: Work | None,
    batch_size: int,
    meter: CpuMeter,
    ready: Callable[[], None],
) -> dict[str, Any]:
    """Consume ``messages`` inputs of the config's only pipeline, produce one result each and
    commit them; return a summary (``committed`` positions, ``dead_lettered`` count).

    Args:
        config: a bench config (:func:`streamproc.tools.bench.contenders.pipeline_config`).
        messages: inputs to process; the loop ends once all are delivered and committed.
        work: the workload's work per batch, or None for the bare floor.
        batch_size: the most messages taken per ``consume`` call.
        meter: its window opens when the first input arrives and closes when the last result
            is acknowledged.
        ready: called once the consumer owns its partitions (a paced replay may start).

    Raises:
        RuntimeError: a result was refused by the broker, or the input stalled.
    """
    spec = config.pipelines[0]
    source, sink, dlq = spec.input_topic, spec.output_topic, spec.dead_letter_topic
    guarantee = AtLeastOnce(OffsetTracker(), Metrics())  # only its consumer settings are used
    commit_errors: list[str] = []

    def on_commit(err: KafkaError | None, _partitions: list[KafkaTopicPartition]) -> None:
        if err is not None:
            commit_errors.append(str(err))

    settings = consumer_settings(config, guarantee)
    for key in prefetch_settings(config):  # no rings, never paused: librdkafka's own prefetch
        if key not in config.kafka.consumer:
            del settings[key]
    consumer = Consumer({**settings, "on_commit": on_commit})
    producer = Producer(
        producer_settings({"bootstrap.servers": config.bootstrap_servers, **config.kafka.producer})
    )
    assigned: list[bool] = []
    consumer.subscribe([source], on_assign=lambda _c, _p: assigned.append(True))
    deliveries = _Deliveries()
    report = deliveries.report
    offsets = deliveries.offsets
    topic_b = source.encode()
    partition_b: dict[int, bytes] = {}
    commit_every_s = config.kafka.commit_interval_ms / 1000.0
    next_commit_s = 0.0
    consumed = dead = batches = 0
    last_progress_s = time.monotonic()

    def commit(positions: dict[int, int], asynchronous: bool = True) -> None:
        kafka_offsets = [KafkaTopicPartition(source, p, o) for p, o in positions.items()]
        if kafka_offsets and asynchronous:
            consumer.commit(offsets=kafka_offsets, asynchronous=True)
        elif kafka_offsets:
            consumer.commit(offsets=kafka_offsets, asynchronous=False)

    announced = False
    while consumed < messages:
        # non-blocking first; block (briefly) only while nothing is buffered
        batch = consumer.consume(batch_size, 0) or consumer.consume(1, POLL_S)
        now_s = time.monotonic()
        if assigned and not announced:
            ready()  # the assignment callback ran inside consume()
            announced = True
        ok = cast(list[_Message], [m for m in batch if m.error() is None])
        if ok:
            if not consumed:
                meter.mark_start()
            consumed += len(ok)
            batches += 1
            last_progress_s = now_s
            if work is None:
                _produce_bare(producer, ok, sink, topic_b, partition_b, offsets, report, now_s)
            else:
                dead += _produce_worked(
                    producer, ok, work, source, sink, dlq, topic_b, partition_b, offsets, report
                )
        elif now_s - last_progress_s > STALL_S:
            raise RuntimeError(f"floor: input stalled at {consumed} of {messages} messages")
        producer.poll(0)
        if deliveries.failures:
            raise RuntimeError(f"floor: results refused: {deliveries.failures[:3]}")
        if now_s >= next_commit_s:
            commit(offsets.to_commit())
            next_commit_s = now_s + commit_every_s
    left = producer.flush(60)
    meter.mark_end()
    if left or deliveries.failures or offsets.awaiting():
        raise RuntimeError(
            f"floor: {left} results unsent, {offsets.awaiting()} undelivered, refused: "
            f"{deliveries.failures[:3]}"
        )
    final = offsets.positions()
    commit(final, asynchronous=False)
    consumer.close()
    return {
        "committed": final,
        "dead_lettered": dead,
        "commit_errors": commit_errors[:3],
        "mean_batch": round(consumed / max(1, batches), 1),
    }


def _partition_bytes(partition_b: dict[int, bytes], partition: int) -> bytes:
    found = partition_b.get(partition)
    if found is None:
        found = partition_b[partition] = b"%d" % partition
    return found


def _produce_bare(
    producer: Producer,
    batch: list[_Message],
    sink: str,
    topic_b: bytes,
    partition_b: dict[int, bytes],
    offsets: DeliveredOffsets[int],
    report: Callable[[int, int, KafkaError | None, Any], None],
    consumed_s: float,
) -> None:
    """The bare floor: the input value as the result, with streamproc's headers. One consume
    call shares one consume time, so the timing headers are formatted once per call."""
    timing = TIMING_FORMAT % (0.0, 0.0, (time.monotonic() - consumed_s) * 1000)
    for message in batch:
        partition, offset = message.partition(), message.offset()
        offsets.consumed(partition, offset)
        produce_waiting(
            producer,
            sink,
            message.key(),
            message.value(),
            [
                (H_TOPIC, topic_b),
                (H_PARTITION, _partition_bytes(partition_b, partition)),
                (H_OFFSET, b"%d" % offset),
                (H_TIMING, timing),
            ],
            partial(report, partition, offset),
        )


def _produce_worked(
    producer: Producer,
    batch: list[_Message],
    work: Work,
    source: str,
    sink: str,
    dlq: str,
    topic_b: bytes,
    partition_b: dict[int, bytes],
    offsets: DeliveredOffsets[int],
    report: Callable[[int, int, KafkaError | None, Any], None],
) -> int:
    """Floor + work: decode, model and encode the batch, then produce as the bare floor does.
    Returns how many inputs were dead-lettered."""
    consumed_s = time.monotonic()
    records = [
        Record(
            TopicPartition(source, m.partition()),
            m.offset(),
            m.key(),
            m.value(),
            tuple(m.headers() or ()),
            m.timestamp()[1],
            consumed_s,
        )
        for m in batch
    ]
    results, inference_s = work(records)
    timing = TIMING_FORMAT % (0.0, inference_s * 1000, (time.monotonic() - consumed_s) * 1000)
    dead = 0
    for record, result in zip(records, results, strict=True):
        partition, offset = record.tp.partition, record.offset
        offsets.consumed(partition, offset)
        source_headers: list[tuple[str, bytes]] = [
            (H_TOPIC, topic_b),
            (H_PARTITION, _partition_bytes(partition_b, partition)),
            (H_OFFSET, b"%d" % offset),
        ]
        on_delivery = partial(report, partition, offset)
        if isinstance(result, Encoded):
            produce_waiting(
                producer,
                sink,
                record.key,
                result.value,
                [
                    *source_headers,
                    *result.headers,
                    (H_TIMING, timing),
                ],
                on_delivery,
            )
            continue
        dead += 1
        stage = result.stage if isinstance(result, RecordError) else "encode"
        produce_waiting(
            producer,
            dlq,
            record.key,
            record.value,
            [
                *record.headers,
                *source_headers,
                (H_STAGE, stage.encode()),
                (H_CLASS, type(result).__name__.encode()),
                (H_MESSAGE, str(result)[:1000].encode(errors="replace")),
            ],
            on_delivery,
        )
    return dead
