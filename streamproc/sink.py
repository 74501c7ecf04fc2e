"""The sink: one idempotent ``acks=all`` producer for results and dead-letter records.

Every output record keeps the input key and carries ``streamproc.source.topic``,
``streamproc.source.partition`` and ``streamproc.source.offset`` (ASCII decimal). Dead-letter
records keep the input value and headers and add ``streamproc.error.stage``,
``streamproc.error.class`` and ``streamproc.error.message``.

An input offset is marked done in the :class:`~streamproc.commit.OffsetTracker` only from the
delivery report of its result or dead-letter record. A result the broker rejects for good is
dead-lettered (stage ``produce``); a dead-letter record the broker rejects stops the pipeline
(:class:`~streamproc.errors.FatalPipelineError`): we cannot go on without losing it.

``MSG_SIZE_TOO_LARGE`` from the broker judges a whole record batch (the producer batches with
linger and compression), not one record: one oversized result refuses every result it shares a
batch with. A record refused that way is therefore sent again *alone*, through a second producer
that never batches (``batch.num.messages=1``, ``linger.ms=0``; created on first need), and only
a refusal of the record on its own dead-letters it (or, for a dead-letter record, leaves its
value out). Records sent again alone may land after later results of their partition.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
from confluent_kafka import KafkaError, KafkaException, Message, Producer

from streamproc.clients import build_client
from streamproc.edges import ProducerClient, ProducerFactory
from streamproc.errors import FatalPipelineError
from streamproc.guarantees import Guarantee
from streamproc.logs import get_logger, kafka_logger, redact
from streamproc.metrics import Metrics
from streamproc.records import Headers, Record

log = get_logger(__name__)

H_TOPIC = "streamproc.source.topic"
H_PARTITION = "streamproc.source.partition"
H_OFFSET = "streamproc.source.offset"
H_STAGE = "streamproc.error.stage"
H_CLASS = "streamproc.error.class"
H_MESSAGE = "streamproc.error.message"
H_VALUE_OMITTED = "streamproc.error.value_omitted"
H_INFERENCE_MS = "streamproc.timing.inference_ms"
H_QUEUE_MS = "streamproc.timing.queue_wait_ms"
H_PROCESSING_MS = "streamproc.timing.processing_ms"
_MAX_ERROR_MESSAGE = 1000
# Key, headers (error message included) and record-batch framing of a dead-letter record.
_DLQ_RECORD_OVERHEAD = 8 * 1024


def source_headers(record: Record) -> Headers:
    """The source-coordinate headers of ``record``."""
    return (
        (H_TOPIC, record.tp.topic.encode()),
        (H_PARTITION, b"%d" % record.tp.partition),
        (H_OFFSET, b"%d" % record.offset),
    )


def producer_settings(user: dict[str, Any], transactional_id: str | None = None) -> dict[str, Any]:
    """The results producer's librdkafka settings: our defaults (``linger.ms`` 5, lz4), then
    ``user`` (bootstrap and the ``kafka.producer`` pass-through), then what the guarantees
    need and the user may not change (idempotence, ``acks=all``, the transactional id)."""
    settings: dict[str, Any] = {
        "linger.ms": 5,
        "compression.type": "lz4",
        "logger": kafka_logger(),
        **user,
        "enable.idempotence": True,
        "acks": "all",
    }
    if transactional_id:
        settings["transactional.id"] = transactional_id
    return settings


def build_producer(settings: dict[str, Any], factory: ProducerFactory = Producer) -> ProducerClient:
    """The results producer from :func:`producer_settings`.

    Raises:
        ConfigError: librdkafka refused a key or value under ``kafka.producer``.
    """
    log.debug("producer config", settings=redact(settings))
    return build_client(factory, settings, "kafka.producer")


def _produce_waiting(
    producer: ProducerClient,
    topic: str,
    key: bytes | None,
    value: bytes | None,
    headers: list[tuple[str, bytes]],
    on_delivery: Callable[[KafkaError | None, Message | None], None],
) -> None:
    """``producer.produce``; while its queue is full, wait for deliveries instead of dropping.

    Raises:
        KafkaException: the producer refused the record before sending it.
    """
    while True:
        try:
            producer.produce(topic, value=value, key=key, headers=headers, on_delivery=on_delivery)
            return
        except BufferError:
            producer.poll(0.05)


class _BatchAck:
    """Delivery accounting for one batch of results.

    librdkafka still reports every record, but a success only decrements a counter here; when
    the batch's last report is in, its delivered records are marked done in one tracker call and
    counted in one metrics update (per-record bookkeeping in the delivery callback was a
    measured share of the light workloads' GIL time). A rejected record is dead-lettered and
    done once its dead-letter record is acknowledged.
    """

    __slots__ = ("_acks", "_dlq_topic", "_failed", "_records", "_results", "_sink", "_topic")

    def __init__(
        self,
        sink: Sink,
        topic: str,
        dlq_topic: str,
        results: Sequence[tuple[Record, bytes, list[tuple[str, bytes]]]],
    ) -> None:
        self._sink = sink
        self._topic = topic
        self._dlq_topic = dlq_topic
        self._results = results
        self._records = [record for record, _, _ in results]
        self._failed: set[int] = set()
        # Reports arrive on whichever thread polls the producer (the sink thread, a sender
        # waiting out a full queue, a flush); next() on itertools.count is atomic under the
        # GIL, so exactly one report sees the last count, without a lock per record.
        self._acks = itertools.count(1)

    def delivered(self, index: int, err: KafkaError | None, msg: Message | None) -> None:
        """The delivery report of result ``index`` (``err`` None on success)."""
        if err is not None:
            record, value, headers = self._results[index]
            on_alone = partial(self.delivered_alone, index)
            if self._sink._refused(
                record, self._topic, value, headers, err, self._dlq_topic, on_alone
            ):
                return  # the broker refused the record *batch*: judged on its own now
            self._failed.add(index)
        self._count_down()

    def delivered_alone(self, index: int, err: KafkaError | None, msg: Message | None) -> None:
        """The delivery report of result ``index`` sent again alone."""
        if err is not None:
            self._failed.add(index)
            self._sink._rejected(self._records[index], err, self._dlq_topic)
        self._count_down()

    def skipped(self, index: int) -> None:
        """Result ``index`` was not produced (exactly-once: its assignment is gone)."""
        self._failed.add(index)
        self._count_down()

    def _count_down(self) -> None:
        if next(self._acks) != len(self._records):
            return
        records = self._records
        if self._failed:
            failed = self._failed
            records = [r for i, r in enumerate(records) if i not in failed]
        self._sink._delivered(self._topic, records)


class Sink:
    """Produces results and dead-letter records; reports acknowledgements to the tracker.

    Args:
        producer: the results producer (:func:`build_producer`); the sink owns it from now on.
        settings: its settings (the producer for records sent again alone copies them).
        guarantee: when an input is done and who recovers a refused record
            (``streamproc.guarantees``).
        metrics: metrics to count produced / dead-lettered records.
        on_fatal: called (from the sink thread) when the pipeline must stop.
        producer_factory: builds the producer for records sent again alone (tests pass a fake).
    """

    def __init__(
        self,
        producer: ProducerClient,
        settings: dict[str, Any],
        guarantee: Guarantee,
        metrics: Metrics,
        on_fatal: Callable[[BaseException], None],
        producer_factory: ProducerFactory = Producer,
    ) -> None:
        self._producer = producer
        self._closed = False
        # The producer for records sent again alone (see the module docstring); made on need.
        self._alone_settings = {**settings, "linger.ms": 0, "batch.num.messages": 1}
        self._producer_factory = producer_factory
        self._alone: ProducerClient | None = None
        self._alone_lock = threading.Lock()
        # A larger value cannot be produced at all (a near one fails and is retried without).
        self._max_dlq_value_bytes = int(settings.get("message.max.bytes", 1_000_000))
        # per dead-letter topic, its max.message.bytes when known (set_dead_letter_limits): a
        # value that cannot fit is left out up front, so it never shares a rejected request
        # with records that would fit
        self._dead_letter_limits: dict[str, int] = {}
        self._guarantee = guarantee
        self._metrics = metrics
        self._on_fatal = on_fatal
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="sink", daemon=True)

    def set_dead_letter_limits(self, limits: dict[str, int]) -> None:
        """Per dead-letter topic, its ``max.message.bytes`` (learned at start-up); call before
        :meth:`start`: the sink's threads read it without a lock."""
        if self._thread.ident is not None:
            raise RuntimeError("dead-letter limits are set before the sink starts")
        self._dead_letter_limits = dict(limits)

    def start(self) -> None:
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            self._producer.poll(0.05)
            alone = self._alone
            if alone is not None:
                alone.poll(0)

    def _refused(
        self,
        record: Record,
        topic: str,
        value: bytes | None,
        headers: list[tuple[str, bytes]],
        err: KafkaError,
        dlq_topic: str,
        on_alone: Callable[[KafkaError | None, Message | None], None],
    ) -> bool:
        """The broker refused the result of input ``record``.

        Returns:
            True when it was sent again alone (``MSG_SIZE_TOO_LARGE`` judges a whole record
            batch; its report goes to ``on_alone``); False when it is failed for good: it was
            dead-lettered, or the guarantee handles it (the transaction aborts).
        """
        if not self._guarantee.sink_recovers(record, err):
            return False
        if err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
            self._send_alone(topic, record.key, value, headers, on_alone)
            return True
        self._rejected(record, err, dlq_topic)
        return False

    def _send_alone(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes]],
        on_delivery: Callable[[KafkaError | None, Message | None], None],
    ) -> None:
        """Produce one record in a record batch of its own."""
        with self._alone_lock:
            if self._alone is None:
                self._alone = self._producer_factory(self._alone_settings)
            alone = self._alone
        try:
            _produce_waiting(alone, topic, key, value, headers, on_delivery)
        except KafkaException as exc:  # refused before sending: judged on its own already
            on_delivery(exc.args[0], None)

    # -- results ---------------------------------------------------------------------------
    def send_results(
        self,
        topic: str,
        results: Sequence[tuple[Record, bytes, list[tuple[str, bytes]]]],
        dlq_topic: str,
    ) -> None:
        """Produce one batch's results to ``topic``.

        Args:
            topic: the output topic.
            results: ``(input record, result value, complete output headers)`` per result, in
                batch order; the headers must already carry the source coordinates
                (:func:`source_headers`).
            dlq_topic: where a result the broker rejects for good is dead-lettered (stage
                ``produce``) instead.
        """
        if not results:
            return
        ack = _BatchAck(self, topic, dlq_topic, results)
        delivered = ack.delivered
        for index, (record, value, headers) in enumerate(results):
            try:
                sent = self._send(
                    record, topic, record.key, value, headers, partial(delivered, index)
                )
            except KafkaException as exc:
                delivered(index, exc.args[0], None)
                continue
            if not sent:
                ack.skipped(index)

    def _delivered(self, topic: str, records: list[Record]) -> None:
        """Every delivery report of a batch is in: count it and mark its inputs done."""
        if not records:
            return
        self._metrics.child(self._metrics.produced, topic).inc(len(records))
        created_ms = np.fromiter((r.timestamp_ms for r in records), np.float64, len(records))
        self._metrics.end_to_end.labels(records[0].tp.topic).observe_many(
            np.maximum(0.0, (time.time() * 1000.0 - created_ms) / 1000.0)
        )
        self._guarantee.acknowledged(records)

    def _rejected(self, record: Record, err: KafkaError, dlq_topic: str) -> None:
        """The broker rejected a result for good (on its own): dead-letter it."""
        log.warning(
            "result rejected",
            topic=record.tp.topic,
            partition=record.tp.partition,
            offset=record.offset,
            error=str(err),
        )
        self.dead_letter(record, dlq_topic, "produce", f"KafkaError.{err.name()}", err.str())

    # -- dead-letter -----------------------------------------------------------------------
    def dead_letter(
        self,
        record: Record,
        dlq_topic: str,
        stage: str,
        error_class: str,
        message: str,
        omit_value: bool = False,
        alone: bool = False,
    ) -> None:
        """Produce ``record`` to ``dlq_topic`` with the error headers.

        The original key, value and headers are kept, except a value too large for a Kafka
        record (over the producer's ``message.max.bytes``, or refused by the dead-letter topic
        with ``MSG_SIZE_TOO_LARGE`` when sent alone): then the value is left out and
        ``streamproc.error.value_omitted`` holds its size in bytes; the source coordinate
        headers say where to read it (the input topic keeps it for its retention). A record
        refused as part of a record batch is first sent again alone (``alone``). Any other
        rejection of a dead-letter record stops the pipeline (``on_fatal``): we cannot go on
        without losing the record.
        """
        value = record.value
        limit = min(self._max_dlq_value_bytes, self._dead_letter_limits.get(dlq_topic, 1 << 62))
        if value is not None and (omit_value or len(value) > limit - _DLQ_RECORD_OVERHEAD):
            value, omit_value = None, True
        headers = [
            *record.headers,
            *source_headers(record),
            (H_STAGE, stage.encode()),
            (H_CLASS, error_class.encode()),
            (H_MESSAGE, message[:_MAX_ERROR_MESSAGE].encode(errors="replace")),
        ]
        if omit_value:
            headers.append((H_VALUE_OMITTED, b"%d" % len(record.value or b"")))
        if not alone:
            log.info(
                "dead-lettered",
                topic=record.tp.topic,
                partition=record.tp.partition,
                offset=record.offset,
                stage=stage,
                error_class=error_class,
                reason=message[:200],
                value_omitted=omit_value,
            )

        def fatal(reason: str) -> None:
            self._on_fatal(
                FatalPipelineError(
                    f"dead-letter topic {dlq_topic!r} rejected the record from "
                    f"{record.tp.topic}[{record.tp.partition}]@{record.offset}: {reason}"
                )
            )

        def too_large(err: KafkaError, judged_alone: bool) -> None:
            """Refused as too large: alone first, then without the value, then give up."""
            if not judged_alone:
                self.dead_letter(record, dlq_topic, stage, error_class, message, omit_value, True)
            elif not omit_value:
                self.dead_letter(record, dlq_topic, stage, error_class, message, True, True)
            else:
                fatal(err.str())

        def delivered(err: KafkaError | None, msg: Message | None) -> None:
            if err is None:
                self._metrics.dead_lettered.labels(record.tp.topic, stage).inc()
                self._guarantee.acknowledged((record,))
                return
            if not self._guarantee.sink_recovers(record, err):
                return  # the transaction aborts and the record is retried after the rewind
            if err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
                too_large(err, alone)
                return
            fatal(err.str())

        if alone:
            self._send_alone(dlq_topic, record.key, value, headers, delivered)
            return
        try:
            self._send(record, dlq_topic, record.key, value, headers, delivered)
        except KafkaException as exc:
            err = exc.args[0]
            if err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
                too_large(err, True)  # the producer's own limit judges each record alone
                return
            fatal(str(exc))

    def _send(
        self,
        record: Record,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes]],
        on_delivery: Callable[[KafkaError | None, Message | None], None],
    ) -> bool:
        """Produce one record for input ``record``, as the guarantee says (see
        :meth:`Guarantee.send`).

        Returns:
            False when nothing was produced (the input's assignment is gone: exactly-once).
        """
        return self._guarantee.send(
            record, _produce_waiting, self._producer, topic, key, value, headers, on_delivery
        )

    def flush(self, timeout_s: float) -> int:
        """Wait for outstanding deliveries (records sent again alone included, and those a
        delivery report of the flush sends alone); return how many are still outstanding."""
        deadline_s = time.monotonic() + timeout_s
        while True:
            left = int(self._producer.flush(max(0.0, deadline_s - time.monotonic())))
            alone = self._alone
            if alone is not None:
                left += int(alone.flush(max(0.0, deadline_s - time.monotonic())))
            if left == 0 and len(self._producer) == 0:
                return 0
            if time.monotonic() >= deadline_s:
                return left + len(self._producer)

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush, then stop the poll thread and drop the producers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.flush(timeout_s)
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        del self._producer  # the last reference: destroys the librdkafka handle
        self._alone = None
