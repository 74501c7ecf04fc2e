"""The results producer: its librdkafka settings, its client, and the ``sink`` thread polling it.

One idempotent ``acks=all`` producer takes every result and dead-letter record (inside the open
transaction under exactly-once). Next to it, made on first need, a *lone-record producer* that
never batches (``batch.num.messages=1``, ``linger.ms=0``) sends a record again in a record batch
of its own: after the broker refused a record batch the record shared, or while the cluster
cannot take it (:func:`unavailable`). Records sent again alone may land after later results of
their partition.

Thread ownership: :class:`ResultsProducer` owns both clients and the ``sink`` thread, which
polls them for delivery reports. Any thread may produce; only :meth:`ResultsProducer.renew`
(under the transaction lock) replaces the results producer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from streamproc.errors import FatalPipelineError
from streamproc.kafka.clients import build_client
from streamproc.kafka.protocols import DeliveryCallback, ProducerClient, ProducerFactory
from streamproc.logs import get_logger, kafka_logger, redact
from streamproc.metrics import Metrics
from streamproc.offsets.guarantees import How
from streamproc.output.headers import OutputHeaders
from streamproc.records import Record

log = get_logger(__name__)

ISOLATION_TIMEOUT_S = 30.0
"""How long producing a record in a record batch of its own waits for the producer's queue to
empty (before) and for its delivery report (after)."""

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


def producer_settings(user: dict[str, Any], transactional_id: str | None = None) -> dict[str, Any]:
    """The results producer's librdkafka settings: our defaults (``linger.ms`` 2, lz4), then
    ``user`` (bootstrap and the ``kafka.producer`` pass-through), then what the guarantees
    need and the user may not change (idempotence, ``acks=all``, the transactional id).

    Without a transactional id, ``message.timeout.ms`` defaults to 0 (never expire): a result
    waits in the queue while the cluster is unavailable, and the full queue pauses intake.
    A transactional producer keeps librdkafka's bound (``transaction.timeout.ms``): a timeout
    there aborts the transaction and the inputs are consumed again.
    """
    settings: dict[str, Any] = {
        "linger.ms": 2,  # why 2: docs/benchmarks-history.md, "output/producer.py"
        "compression.type": "lz4",
        "logger": kafka_logger(),
        **user,
        "enable.idempotence": True,
        "acks": "all",
    }
    if transactional_id:
        settings["transactional.id"] = transactional_id
    else:
        settings.setdefault("message.timeout.ms", 0)
    return settings


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
    headers: OutputHeaders,
    on_delivery: DeliveryCallback,
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


def _not_recovered(err: KafkaError) -> bool:
    """Before :meth:`ResultsProducer.start`: no fatal error is recovered."""
    return False


class ResultsProducer:
    """The results producer, the lone-record producer and the ``sink`` thread polling both.

    Args:
        client: the results producer (:func:`build_producer`); owned from now on.
        settings: its settings (a renewed producer and the lone-record producer copy them).
        metrics: counts producer renewals and records produced again.
        on_fatal: called (from the ``sink`` thread) when the pipeline must stop.
        factory: builds the renewed and the lone-record producers (tests pass a fake).

    Attributes:
        client: the results producer now; read it at each use (:meth:`renew` replaces it).
        settings: its settings (the sink reads the record size limit from them).
    """

    def __init__(
        self,
        client: ProducerClient,
        settings: dict[str, Any],
        metrics: Metrics,
        on_fatal: Callable[[BaseException], None],
        factory: ProducerFactory = Producer,
    ) -> None:
        self.client = client
        self.settings = settings
        self._metrics = metrics
        self._recovers: Callable[[KafkaError], bool] = _not_recovered
        self._on_fatal = on_fatal
        self._factory = factory
        # Producers replaced while a call was still inside them (renew): kept alive, never
        # polled nor destroyed (destroying a handle a thread is inside is not safe).
        self._wedged: list[ProducerClient] = []
        # Called after a renewal: the replaced producer's records are never reported.
        self._on_renewed: list[Callable[[], None]] = []
        self._lone_settings = {**settings, "linger.ms": 0, "batch.num.messages": 1}
        self._lone: ProducerClient | None = None
        self._lone_lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="sink", daemon=True)

    @property
    def started(self) -> bool:
        """True once :meth:`start` ran."""
        return self._thread.ident is not None

    def start(self, recovers: Callable[[KafkaError], bool]) -> None:
        """Start the ``sink`` thread (once).

        Args:
            recovers: called on the ``sink`` thread with a fatal error ``poll`` raised (the
                guarantee's ``producer_error``); True: it is recovered and polling goes on;
                False: ``on_fatal`` is called and the thread ends.
        """
        self._recovers = recovers
        self._thread.start()

    def renew(self) -> ProducerClient:
        """Replace the results producer by a fresh one with the same settings and return it
        (exactly-once: a transactional call into the old one never returned, see
        ``streamproc.offsets.transactions``). The old one is kept, never polled again: its
        records belong to the transaction the fresh one's ``init_transactions`` aborts. Call
        with the transaction lock held (no record is produced meanwhile)."""
        fresh = build_producer(self.settings, self._factory)
        self._wedged.append(self.client)
        self.client = fresh
        self._metrics.producer_renewals.inc()
        for renewed in self._on_renewed:
            renewed()
        return fresh

    def on_renewed(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` after each :meth:`renew` (under the transaction lock, on the thread
        that renews); register before the pipeline starts."""
        self._on_renewed.append(callback)

    def produce_alone(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: OutputHeaders,
        on_delivery: DeliveryCallback,
    ) -> None:
        """Produce one record in a record batch of its own (the lone-record producer, made on
        first need). A refusal before sending is reported to ``on_delivery`` (message None)."""
        with self._lone_lock:
            if self._lone is None:
                self._lone = self._factory(self._lone_settings)
            lone = self._lone
        try:
            produce_waiting(lone, topic, key, value, headers, on_delivery)
        except KafkaException as exc:  # refused before sending: judged on its own already
            on_delivery(exc.args[0], None)

    def produce_again(
        self,
        topic: str,
        record: Record,
        value: bytes | None,
        headers: OutputHeaders,
        err: KafkaError,
        on_delivery: DeliveryCallback,
    ) -> None:
        """The cluster could not take the record produced for input ``record``
        (:func:`unavailable`, ``err``): count it, and produce it again alone."""
        self._metrics.child(self._metrics.produce_retries, topic).inc()
        log.warning(
            "cluster unavailable; producing again",
            topic=topic,
            source_partition=record.tp.partition,
            source_offset=record.offset,
            error=err.str(),
        )
        self.produce_alone(topic, record.key, value, headers, on_delivery)

    def produce_own_batch(
        self,
        topic: str,
        key: bytes | None,
        value: bytes,
        headers: OutputHeaders,
        report: Callable[[KafkaError | None, Any, How], None],
        give_up: Callable[[], bool],
    ) -> bool:
        """Produce one record in a record batch of its own through the results producer (so
        inside the open transaction): wait for the producer's queue to empty, produce, wait for
        its report. ``report(err, msg, how)`` gets ``how`` ``alone``, or ``batch`` when a wait
        timed out or was given up (another record may have shared its record batch). The
        record batch stays its own only while no other thread produces meanwhile: under
        exactly-once every produce holds the transaction lock, which the caller holds.

        Args:
            give_up: True when waiting is pointless (see :meth:`drained`).

        Returns:
            False when the producer refused the record before sending (reported as ``local``).
        """
        judged: list[How] = ["alone" if self.drained(give_up) else "batch"]

        def delivered(err: KafkaError | None, msg: Any) -> None:
            report(err, msg, judged[0])

        try:
            produce_waiting(self.client, topic, key, value, headers, delivered)
        except KafkaException as exc:  # refused before sending
            report(exc.args[0], None, "local")
            return False
        if not self.drained(give_up):
            judged[0] = "batch"
        return True

    def drained(self, give_up: Callable[[], bool]) -> bool:
        """Wait until every record produced so far has its report: True; False after
        :data:`ISOLATION_TIMEOUT_S`, or at once when ``give_up()`` (exactly-once: the open
        transaction failed, its queued records are not sent before the abort purges them, and
        waiting would hold the transaction lock, and with it the commit that aborts)."""
        deadline_s = time.monotonic() + ISOLATION_TIMEOUT_S
        while self.client.flush(0.05) != 0:
            if give_up() or time.monotonic() >= deadline_s:
                return False
        return True

    def flush(self, timeout_s: float) -> int:
        """Wait for outstanding deliveries (records sent again alone included, and those a
        delivery report of the flush sends alone); return how many are still outstanding."""
        deadline_s = time.monotonic() + timeout_s
        while True:
            left = int(self.client.flush(max(0.0, deadline_s - time.monotonic())))
            lone = self._lone
            if lone is not None:
                left += int(lone.flush(max(0.0, deadline_s - time.monotonic())))
            if left == 0 and len(self.client) == 0:
                return 0
            if time.monotonic() >= deadline_s:
                return left + len(self.client)

    def close(self, timeout_s: float) -> None:
        """Flush, then stop the ``sink`` thread and drop the producers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.flush(timeout_s)
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        del self.client  # the last reference: destroys the librdkafka handle
        self._lone = None

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self.client.poll(0.05)
                except KafkaException as exc:  # a fatal error of the producer
                    err = exc.args[0]
                    if not self._recovers(err):
                        self._on_fatal(FatalPipelineError(f"producer failed: {err.str()}"))
                        return
                lone = self._lone
                if lone is not None:
                    lone.poll(0)
        except BaseException as exc:
            # A delivery callback raised (poll re-raises it). Nothing else serves the reports:
            # every lane's results would wait for acknowledgements for ever, silently.
            self._on_fatal(exc)
