"""The sink: one idempotent ``acks=all`` producer for results and dead-letter records.

Every output record keeps the input key and carries ``streamproc.source.topic``,
``streamproc.source.partition`` and ``streamproc.source.offset`` (ASCII decimal). Dead-letter
records keep the input value and headers and add ``streamproc.error.stage``,
``streamproc.error.class`` and ``streamproc.error.message``.

An input offset is marked done in the :class:`~offsets.tracker.OffsetTracker` only from the
delivery report of its result or dead-letter record. A result the broker rejects for good is
dead-lettered (stage ``produce``); a dead-letter record the broker rejects stops the pipeline
(:class:`~streamproc.errors.FatalPipelineError`): we cannot go on without losing it.

``MSG_SIZE_TOO_LARGE`` from the broker judges a whole record batch (the producer batches with
linger and compression), not one record: one oversized result refuses every result it shares a
batch with. A record refused that way is therefore sent again *alone*, through a second producer
that never batches (``batch.num.messages=1``, ``linger.ms=0``; created on first need), and only
a refusal of the record on its own dead-letters it (or, for a dead-letter record, leaves its
value out). Records sent again alone may land after later results of their partition.

Two checks come before a result is produced at all. A result whose record cannot fit the output
topic's ``max.message.bytes`` (learned at start-up, :meth:`Sink.set_topic_limits`) even before
compression is dead-lettered at once when the producer does not compress (the broker judges the
record batch as sent); when it compresses, the result is *at risk* and the guarantee decides
(:meth:`Guarantee.plan`): exactly-once produces it in a record batch of its own, so a refusal
names it alone and costs one aborted transaction, never its neighbours. The guarantee's plan
also dead-letters results refused inside an earlier, aborted transaction (see
``streamproc.offsets.refusals``).

A record that fails because the *cluster* is unavailable (its delivery timed out, not enough
in-sync replicas, no leader: :func:`unavailable`) is not the record's fault: it is produced again
(alone) until the cluster takes it, never dead-lettered, and its input stays pending meanwhile,
so the pending limit pauses intake. Under at-least-once, results never time out by default
(``message.timeout.ms`` 0); a user's finite value still never dead-letters a valid result.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, cast

import numpy as np
from confluent_kafka import KafkaError, KafkaException, Message, Producer

from streamproc.errors import FatalPipelineError
from streamproc.kafka.clients import build_client
from streamproc.kafka.protocols import ProducerClient, ProducerFactory
from streamproc.logs import get_logger, kafka_logger, redact
from streamproc.metrics import Metrics
from streamproc.offsets.guarantees import Guarantee, How
from streamproc.offsets.refusals import record_refusal
from streamproc.records import Headers, Record

log = get_logger(__name__)

H_TOPIC = "streamproc.source.topic"
H_PARTITION = "streamproc.source.partition"
H_OFFSET = "streamproc.source.offset"
H_STAGE = "streamproc.error.stage"
H_CLASS = "streamproc.error.class"
H_MESSAGE = "streamproc.error.message"
H_VALUE_OMITTED = "streamproc.error.value_omitted"
H_TIMING = "streamproc.timing"
TIMING_FORMAT = b"queue_wait_ms=%.3f;inference_ms=%.3f;processing_ms=%.3f"
"""The value of the ``streamproc.timing`` header on every result: milliseconds the input
waited in its ring (consumed -> batch cut), the batch's device time, and consumed -> result
produced. One header for the three (it used to be three headers): each header costs the
producer about 0.5 us per record (measured with confluent-kafka 2.x, issue 15)."""
_MAX_ERROR_MESSAGE = 1000
# Key, headers (error message included) and record-batch framing of a dead-letter record.
_DLQ_RECORD_OVERHEAD = 8 * 1024
# A record batch's header (magic v2): the least framing a record pays on top of its bytes.
_RECORD_BATCH_HEADER = 61
# Results whose value is within this of the output topic's limit have their whole record
# (key, headers) measured; smaller ones cannot be over it unless key and headers are huge.
_RESULT_RECORD_SLACK = 16 * 1024
ISOLATION_TIMEOUT_S = 30.0
"""How long producing a record in a record batch of its own waits for the producer's queue to
empty (before) and for its delivery report (after)."""


def parse_timing(value: bytes) -> dict[str, float]:
    """The ``streamproc.timing`` header as ``{"queue_wait_ms": ..., "inference_ms": ...,
    "processing_ms": ...}`` (milliseconds).

    Raises:
        ValueError: not ``name=number`` pairs separated by ``;``.
    """
    timings: dict[str, float] = {}
    for part in value.decode("ascii").split(";"):
        name, sep, number = part.partition("=")
        if not sep:
            raise ValueError(f"not a streamproc.timing header: {value!r}")
        timings[name] = float(number)
    return timings


def _where(record: Record) -> str:
    return f"{record.tp.topic}[{record.tp.partition}]@{record.offset}"


def source_headers(record: Record) -> Headers:
    """The source-coordinate headers of ``record``."""
    return (
        (H_TOPIC, record.tp.topic.encode()),
        (H_PARTITION, b"%d" % record.tp.partition),
        (H_OFFSET, b"%d" % record.offset),
    )


def producer_settings(user: dict[str, Any], transactional_id: str | None = None) -> dict[str, Any]:
    """The results producer's librdkafka settings: our defaults (``linger.ms`` 2, lz4), then
    ``user`` (bootstrap and the ``kafka.producer`` pass-through), then what the guarantees
    need and the user may not change (idempotence, ``acks=all``, the transactional id)."""
    settings: dict[str, Any] = {
        # Measured (benchmarks/linger.py, trades at 10,000 msg/s, 3 alternating runs): 0 ms
        # costs librdkafka's threads 7.5 CPU-µs/msg, 2 ms 5.2, 5 ms 4.5, 20 ms 3.5; the median
        # end-to-end latency grows with it (5, 6, 10, 17 ms). 2 ms keeps most of the CPU saving
        # for 4 ms less latency than 5 (docs/benchmarks.md, "linger.ms").
        "linger.ms": 2,
        "compression.type": "lz4",
        "logger": kafka_logger(),
        **user,
        "enable.idempotence": True,
        "acks": "all",
    }
    if transactional_id:
        settings["transactional.id"] = transactional_id
    else:
        # Never expire a result while the cluster is unavailable (e.g. two of three brokers
        # down: NOT_ENOUGH_REPLICAS): it waits in the queue, the full queue pauses intake.
        # Transactional producers keep librdkafka's bound (transaction.timeout.ms): a timeout
        # there aborts the transaction and the inputs are consumed again.
        settings.setdefault("message.timeout.ms", 0)
    return settings


# Errors that say the cluster cannot take a record now, not that the record is wrong.
_UNAVAILABLE = frozenset(
    {
        KafkaError._MSG_TIMED_OUT,
        KafkaError._TIMED_OUT,
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError.NETWORK_EXCEPTION,
        KafkaError.NOT_ENOUGH_REPLICAS,
        KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.BROKER_NOT_AVAILABLE,
    }
)


def unavailable(err: KafkaError) -> bool:
    """True when ``err`` says the cluster cannot take a record now (a delivery timed out, too
    few in-sync replicas, no leader, no route): the record is to be produced again, not
    dead-lettered."""
    return err.code() in _UNAVAILABLE


def build_producer(settings: dict[str, Any], factory: ProducerFactory = Producer) -> ProducerClient:
    """The results producer from :func:`producer_settings`.

    Raises:
        ConfigError: librdkafka refused a key or value under ``kafka.producer``.
    """
    log.debug("producer config", settings=redact(settings))
    return build_client(factory, settings, "kafka.producer")


def produce_waiting(
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


Row = int
"""A result's index in its batch."""


class _BatchAck:
    """Delivery accounting for one batch of results.

    One delivery callback for the whole batch, :meth:`delivered`, not one closure per record:
    a success only counts down, and when the batch's last report is in, its delivered inputs
    are marked done in one tracker call and counted in one metrics update. A failed report
    carries the record's value but not its headers (measured against the broker: ``headers()``
    is None on a ``MSG_SIZE_TOO_LARGE`` report), so the failed row is found by its value, which
    needs values that differ within the batch; the sink checks that once per batch and falls
    back to one callback per row (:meth:`delivered_row`) when two results are byte-identical.
    A rejected record is dead-lettered and done once its dead-letter record is acknowledged.
    """

    __slots__ = (
        "_acks",
        "_dlq_topic",
        "_failed",
        "_headers",
        "_records",
        "_rows",
        "_sink",
        "_topic",
        "_values",
    )

    def __init__(
        self,
        sink: Sink,
        topic: str,
        dlq_topic: str,
        records: Sequence[Record],
        values: Sequence[bytes],
        headers: Sequence[list[tuple[str, bytes]]],
    ) -> None:
        self._sink = sink
        self._topic = topic
        self._dlq_topic = dlq_topic
        self._records = records
        self._values = values
        self._headers = headers
        self._failed: set[Row] = set()
        self._rows: dict[bytes, Row] | None = None  # value -> row, built at the first failure
        # Reports arrive on whichever thread polls the producer (the sink thread, a sender
        # waiting out a full queue, a flush); next() on itertools.count is atomic under the
        # GIL, so exactly one report sees the last count, without a lock per record.
        self._acks = itertools.count(1)

    def delivered(self, err: KafkaError | None, msg: Message | None) -> None:
        """A delivery report from librdkafka for any row of the batch (distinct values)."""
        if err is None:
            self._count_down()
            return
        rows = self._rows
        if rows is None:
            rows = self._rows = {value: row for row, value in enumerate(self._values)}
        assert msg is not None  # librdkafka passes the message, its value included
        self.delivered_row(rows[cast(bytes, msg.value())], err, msg)

    def delivered_row(
        self, row: Row, err: KafkaError | None, msg: Message | None, how: How = "batch"
    ) -> None:
        """The delivery report of result ``row`` (``err`` None on success); ``how`` it was
        judged when refused (``local``: by the producer, before sending)."""
        if err is not None:
            on_alone = partial(self.delivered_alone, row)
            if self._sink._refused(
                self._records[row],
                self._topic,
                self._values[row],
                self._headers[row],
                err,
                self._dlq_topic,
                on_alone,
                how,
            ):
                return  # the broker refused the record *batch*: judged on its own now
            self._failed.add(row)
        self._count_down()

    def delivered_alone(self, row: Row, err: KafkaError | None, msg: Message | None) -> None:
        """The delivery report of result ``row`` sent again alone."""
        if err is not None and unavailable(err):
            self._sink._produce_again(
                self._topic,
                self._records[row],
                self._values[row],
                self._headers[row],
                err,
                partial(self.delivered_alone, row),
            )
            return
        if err is not None:
            self._failed.add(row)
            self._sink._rejected(self._records[row], err, self._dlq_topic)
        self._count_down()

    def skipped(self, row: Row) -> None:
        """Result ``row`` was not produced (exactly-once: its assignment is gone)."""
        self._failed.add(row)
        self._count_down()

    def _count_down(self) -> None:
        if next(self._acks) != len(self._records):
            return
        records: Sequence[Record] = self._records
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
            (``streamproc.offsets.guarantees``).
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
        self._settings = settings
        # Producers replaced while a call was still inside them (renew_producer): kept alive,
        # never polled nor destroyed (destroying a handle a thread is inside is not safe).
        self._wedged: list[ProducerClient] = []
        self._closed = False
        # The producer for records sent again alone (see the module docstring); made on need.
        self._alone_settings = {**settings, "linger.ms": 0, "batch.num.messages": 1}
        self._producer_factory = producer_factory
        self._alone: ProducerClient | None = None
        self._alone_lock = threading.Lock()
        # A larger value cannot be produced at all (a near one fails and is retried without).
        self._max_dlq_value_bytes = int(settings.get("message.max.bytes", 1_000_000))
        # per output and dead-letter topic, its max.message.bytes when known (set_topic_limits):
        # a dead-letter value that cannot fit is left out up front, so it never shares a
        # rejected request with records that would fit; a result that cannot fit is
        # dead-lettered or produced alone (see the module docstring)
        self._topic_limits: dict[str, int] = {}
        codec = settings.get("compression.type", settings.get("compression.codec", "none"))
        self._compressed = str(codec) != "none"
        self._guarantee = guarantee
        self._metrics = metrics
        self._on_fatal = on_fatal
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="sink", daemon=True)

    def set_topic_limits(self, limits: dict[str, int]) -> None:
        """Per output and dead-letter topic, its ``max.message.bytes`` (learned at start-up);
        call before :meth:`start`: the sink's threads read it without a lock.

        Raises:
            RuntimeError: the sink already started.
        """
        if self._thread.ident is not None:
            raise RuntimeError("topic limits are set before the sink starts")
        self._topic_limits = dict(limits)

    def start(self) -> None:
        self._thread.start()

    def renew_producer(self) -> ProducerClient:
        """Replace the results producer by a fresh one with the same settings and return it
        (exactly-once: a transactional call into the old one never returned, see
        ``streamproc.offsets.transactions``). The old one is kept, never polled again: its records
        belong to the transaction the fresh one's ``init_transactions`` aborts. Call with the
        transaction lock held (no record is produced meanwhile)."""
        fresh = build_producer(self._settings, self._producer_factory)
        self._wedged.append(self._producer)
        self._producer = fresh
        self._metrics.producer_renewals.inc()
        return fresh

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                self._producer.poll(0.05)
            except KafkaException as exc:  # a fatal error of the producer
                err = exc.args[0]
                if not self._guarantee.producer_error(err):
                    self._on_fatal(FatalPipelineError(f"producer failed: {err.str()}"))
                    return
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
        how: How,
    ) -> bool:
        """The result of input ``record`` was refused, judged as ``how`` says.

        Returns:
            True when it was sent again alone (a record-level refusal of a record batch it may
            have shared, e.g. ``MSG_SIZE_TOO_LARGE``; its report goes to ``on_alone``); False
            when it is failed for good: it was dead-lettered, or the guarantee handles it (the
            transaction aborts).
        """
        handling = self._guarantee.refused(record, err, how, dead_letter=False)
        if handling == "abort":
            return False
        if handling == "fatal":
            self._on_fatal(FatalPipelineError(f"result of {_where(record)} refused: {err.str()}"))
            return False
        if how == "batch" and record_refusal(err):
            self._send_alone(topic, record.key, value, headers, on_alone)
            return True
        if unavailable(err):
            self._produce_again(topic, record, value, headers, err, on_alone)
            return True
        self._rejected(record, err, dlq_topic)
        return False

    def _produce_again(
        self,
        topic: str,
        record: Record,
        value: bytes | None,
        headers: list[tuple[str, bytes]],
        err: KafkaError,
        on_delivery: Callable[[KafkaError | None, Message | None], None],
    ) -> None:
        """The cluster could not take the record for input ``record`` (:func:`unavailable`):
        produce it again (alone), its report to ``on_delivery``."""
        self._metrics.child(self._metrics.produce_retries, topic).inc()
        log.warning(
            "cluster unavailable; producing again",
            topic=topic,
            source_partition=record.tp.partition,
            source_offset=record.offset,
            error=err.str(),
        )
        self._send_alone(topic, record.key, value, headers, on_delivery)

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
            produce_waiting(alone, topic, key, value, headers, on_delivery)
        except KafkaException as exc:  # refused before sending: judged on its own already
            on_delivery(exc.args[0], None)

    # -- results ---------------------------------------------------------------------------
    def send_results(
        self,
        topic: str,
        records: Sequence[Record],
        values: Sequence[bytes],
        headers: Sequence[list[tuple[str, bytes]]],
        dlq_topic: str,
    ) -> None:
        """Produce one batch's results to ``topic``.

        Args:
            topic: the output topic.
            records: the input record of each result, in batch order.
            values: each result's value.
            headers: each result's complete output headers (the source coordinates included,
                see :func:`source_headers`).
            dlq_topic: where a result the broker rejects for good is dead-lettered (stage
                ``produce``) instead.
        """
        if not records:
            return
        ack = _BatchAck(self, topic, dlq_topic, records, values, headers)
        # One callback for the batch needs distinct values (see _BatchAck); the check is one
        # set of the values, about 0.08 us per result against 0.15 for a closure per result.
        one_callback = len(set(values)) == len(values)
        too_large, at_risk = self._oversized(topic, records, values, headers)
        plan = self._guarantee.plan(records, at_risk)
        dead = {row: (f"KafkaError.{r.error}", r.message) for row, r in plan.dead.items()}
        dead.update(too_large)
        alone = plan.alone

        def produce(rows: Sequence[int]) -> Sequence[int]:
            refused: list[int] = []
            producer = self._producer
            send = producer.produce
            on_delivery = ack.delivered
            for row in rows:
                if dead and row in dead:  # refused before, or cannot fit: never produced
                    error_class, reason = dead[row]
                    self.dead_letter(records[row], dlq_topic, "produce", error_class, reason)
                    refused.append(row)
                    ack.skipped(row)
                    continue
                if alone and row in alone:
                    report = partial(ack.delivered_row, row)
                    if not self._produce_own_batch(
                        topic, records[row].key, values[row], headers[row], report
                    ):
                        refused.append(row)
                    continue
                if not one_callback:
                    on_delivery = partial(ack.delivered_row, row)
                try:
                    try:
                        send(
                            topic,
                            values[row],
                            records[row].key,
                            headers=headers[row],
                            on_delivery=on_delivery,
                        )
                    except BufferError:  # the queue is full: wait for deliveries
                        produce_waiting(
                            producer,
                            topic,
                            records[row].key,
                            values[row],
                            headers[row],
                            on_delivery,
                        )
                except KafkaException as exc:  # refused before sending
                    refused.append(row)
                    ack.delivered_row(row, exc.args[0], None, "local")
            return refused

        for row in self._guarantee.send_batch(records, produce):
            ack.skipped(row)

    def _oversized(
        self,
        topic: str,
        records: Sequence[Record],
        values: Sequence[bytes],
        headers: Sequence[list[tuple[str, bytes]]],
    ) -> tuple[dict[Row, tuple[str, str]], list[Row]]:
        """Results too large for ``topic``'s ``max.message.bytes`` before compression.

        Returns:
            The rows that cannot fit at all (the producer does not compress), with the error
            class and message of their dead-letter record; and the rows at risk (it
            compresses: the broker judges the compressed record batch).
        """
        limit = self._topic_limits.get(topic)
        if limit is None or not values or max(map(len, values)) <= limit - _RESULT_RECORD_SLACK:
            return {}, []
        too_large: dict[Row, tuple[str, str]] = {}
        at_risk: list[Row] = []
        for row, value in enumerate(values):
            size = (
                _RECORD_BATCH_HEADER
                + len(value)
                + len(records[row].key or b"")
                + sum(len(k) + len(v) for k, v in headers[row])
            )
            if size <= limit:
                continue
            if self._compressed:
                at_risk.append(row)
                continue
            too_large[row] = (
                "KafkaError.MSG_SIZE_TOO_LARGE",
                f"Message size too large: the result's record ({size} bytes, uncompressed) "
                f"exceeds max.message.bytes ({limit}) of topic {topic!r}; not produced",
            )
        return too_large, at_risk

    def _produce_own_batch(
        self,
        topic: str,
        key: bytes | None,
        value: bytes,
        headers: list[tuple[str, bytes]],
        report: Callable[[KafkaError | None, Message | None, How], None],
    ) -> bool:
        """Produce one record in a record batch of its own through the results producer (so
        inside the open transaction): wait for the producer's queue to empty, produce, wait for
        its report. ``report(err, msg, how)`` gets ``how`` ``alone``, or ``batch`` when a wait
        timed out (another record may have shared its record batch). The record batch stays
        its own only while no other thread produces meanwhile: under exactly-once every
        produce holds the transaction lock, which the caller holds.

        Returns:
            False when the producer refused the record before sending (reported as ``local``).
        """
        producer = self._producer
        judged: list[How] = ["alone" if self._drained() else "batch"]

        def delivered(err: KafkaError | None, msg: Message | None) -> None:
            report(err, msg, judged[0])

        try:
            produce_waiting(producer, topic, key, value, headers, delivered)
        except KafkaException as exc:  # refused before sending
            report(exc.args[0], None, "local")
            return False
        if not self._drained():
            judged[0] = "batch"
        return True

    def _drained(self) -> bool:
        """Wait until every record produced so far has its report: True; False after
        :data:`ISOLATION_TIMEOUT_S`, or at once when the open transaction failed (its queued
        records are not sent before the abort purges them: waiting would hold the
        transaction lock, and with it the commit that aborts, for nothing)."""
        deadline_s = time.monotonic() + ISOLATION_TIMEOUT_S
        while self._producer.flush(0.05) != 0:
            if self._guarantee.failed() or time.monotonic() >= deadline_s:
                return False
        return True

    def _delivered(self, topic: str, records: Sequence[Record]) -> None:
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
        known = self._guarantee.remembered(record)
        if known is not None and known.omit_value:  # refused with it inside a transaction
            omit_value = True
        limit = min(self._max_dlq_value_bytes, self._topic_limits.get(dlq_topic, 1 << 62))
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
            handling = self._guarantee.refused(
                record, err, "alone" if alone else "batch", dead_letter=True
            )
            if handling == "abort":
                return  # the transaction aborts and the record is retried after the rewind
            if handling == "fatal":
                fatal(f"{err.str()} (inside the transaction, with nothing left to leave out)")
                return
            if err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
                too_large(err, alone)
                return
            if unavailable(err):
                self._produce_again(dlq_topic, record, value, headers, err, delivered)
                return
            fatal(err.str())

        if alone:
            self._send_alone(dlq_topic, record.key, value, headers, delivered)
            return
        try:
            self._send(record, dlq_topic, record.key, value, headers, delivered)
        except KafkaException as exc:
            err = exc.args[0]
            if self._guarantee.refused(record, err, "local", dead_letter=True) == "abort":
                return  # the transaction failed before: retried after the rewind
            if err.code() == KafkaError.MSG_SIZE_TOO_LARGE and not omit_value:
                # the producer's own limit judges each record alone: again without the value,
                # through the same producer (inside the transaction under exactly-once)
                self.dead_letter(record, dlq_topic, stage, error_class, message, True)
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
            record, produce_waiting, self._producer, topic, key, value, headers, on_delivery
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
