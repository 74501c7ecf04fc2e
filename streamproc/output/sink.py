"""The sink: produces results and dead-letter records; reports acknowledged inputs.

Every output record keeps the input key and carries the headers of ``streamproc.output.headers``.
An input offset is marked done (through the processing guarantee) only from the delivery report
of its result or dead-letter record. The sink composes one module per role:

* ``output.producer``: the idempotent ``acks=all`` results producer, the lone-record producer and
  the ``sink`` thread polling them;
* ``output.limits``: results too large for their topic are dead-lettered before they are
  produced (the producer does not compress), or put at risk and left to the guarantee's plan
  (``Guarantee.plan``: exactly-once produces them in a record batch of their own; the plan
  also dead-letters results refused inside an earlier, aborted transaction, see
  ``streamproc.offsets.refusals``);
* ``output.acks``: one batch's delivery accounting;
* ``output.deliveries``: what a refused result becomes (sent again alone, produced again while
  the cluster is unavailable, or dead-lettered with stage ``produce``);
* ``output.dead_letters``: dead-letter records and the ladder a refused one climbs; a
  dead-letter record refused with nothing left to try stops the pipeline
  (:class:`~streamproc.errors.FatalPipelineError`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from functools import partial

from attrs import define
from confluent_kafka import KafkaException

from streamproc.intake.lane import Lane
from streamproc.kafka.protocols import DeliveryCallback
from streamproc.metrics import Metrics
from streamproc.offsets.guarantees import Guarantee
from streamproc.offsets.identity import TransactionalIdentity
from streamproc.output.acks import BatchAck, OutputBatch, Row
from streamproc.output.dead_letters import DeadLetters
from streamproc.output.deliveries import ResultDeliveries
from streamproc.output.headers import OutputHeaders
from streamproc.output.latency import LatencyReport
from streamproc.output.limits import RecordLimits
from streamproc.output.producer import ResultsProducer, produce_waiting
from streamproc.output.window import AckWindow
from streamproc.records import Headers, Laps, Record
from streamproc.tracing.context import own_trace_headers


class Sink:
    """Produces results and dead-letter records; reports acknowledgements to the guarantee.

    Args:
        producer: the results producer and its ``sink`` thread (not started); the sink owns it
            from now on and starts it with the guarantee's ``producer_error``. The guarantee
            may hold the same producer (exactly-once renews it), so it is built first.
        guarantee: when an input is done and who recovers a refused record
            (``streamproc.offsets.guarantees``).
        metrics: metrics to count produced / dead-lettered records.
        on_fatal: called (from the thread that learns it) when the pipeline must stop.
        identity: the ``transactional.id`` the producer uses (exactly-once); owned from now
            on: its host slot is given back when the sink closes.
    """

    def __init__(
        self,
        producer: ResultsProducer,
        guarantee: Guarantee,
        metrics: Metrics,
        on_fatal: Callable[[BaseException], None],
        identity: TransactionalIdentity | None = None,
    ) -> None:
        self._guarantee = guarantee
        self._identity = identity
        self._producer = producer
        self._limits = RecordLimits(producer.settings)
        self._dead_letters = DeadLetters(self._producer, guarantee, self._limits, metrics, on_fatal)
        self._deliveries = ResultDeliveries(
            self._producer, self._dead_letters, guarantee, metrics, on_fatal
        )
        self._metrics = metrics

    def set_topic_limits(self, limits: dict[str, int]) -> None:
        """Per output and dead-letter topic, its ``max.message.bytes`` (learned at start-up);
        call before :meth:`start`: the sink's threads read it without a lock.

        Raises:
            RuntimeError: the sink already started.
        """
        if self._producer.started:
            raise RuntimeError("topic limits are set before the sink starts")
        self._limits.set_topics(limits)

    def watch_latency(self, lanes: Mapping[str, Lane]) -> None:
        """Measure each lane's latency target on its acknowledged results (``lanes`` by input
        topic; see :mod:`streamproc.output.latency`); call before :meth:`start`: the delivery
        callbacks read it without a lock.

        Raises:
            RuntimeError: the sink already started.
        """
        if self._producer.started:
            raise RuntimeError("the latency watch is set before the sink starts")
        self._deliveries.latency = LatencyReport(lanes, self._metrics)

    def watch_window(self, window: AckWindow) -> None:
        """Forget ``window``'s holds whenever the results producer is replaced (its records
        are never reported; see :mod:`streamproc.output.window`); call before :meth:`start`.

        Raises:
            RuntimeError: the sink already started.
        """
        if self._producer.started:
            raise RuntimeError("windows are watched before the sink starts")
        self._producer.on_renewed(window.abandon)

    def start(self) -> None:
        """Start the ``sink`` thread, which polls the producers for delivery reports."""
        self._producer.start(self._guarantee.producer_error)

    def send_results(
        self,
        topic: str,
        records: Sequence[Record],
        values: Sequence[bytes],
        headers: Sequence[OutputHeaders],
        dlq_topic: str,
        clock: Laps | None = None,
        settle: Callable[[], None] | None = None,
        cut_at_s: float | None = None,
    ) -> None:
        """Produce one batch's results to ``topic``.

        Args:
            topic: the output topic.
            records: the input record of each result, in batch order.
            values: each result's value.
            headers: each result's complete output headers (the source coordinates included,
                see :func:`~streamproc.output.headers.source_headers`).
            dlq_topic: where a result the broker rejects for good is dead-lettered (stage
                ``produce``) instead.
            clock: the batch's stage clock (:mod:`streamproc.stages`): its ``produce`` stage
                ends with the batch's last delivery report.
            settle: called once after the batch's last delivery report is handled (the
                lane's :class:`~streamproc.output.window.AckWindow`); at once when ``records``
                is empty.
            cut_at_s: when the batch was cut (monotonic seconds; None: it ran on no device, or
                not known): the lane's expiry lead learns from its time to acknowledgement.
        """
        if not records:
            if settle is not None:
                settle()
            return
        ack = BatchAck(
            self._deliveries,
            OutputBatch(topic, dlq_topic, records, values, headers, clock, cut_at_s),
            settle,
        )
        too_large, at_risk = self._limits.oversized(topic, records, values, headers)
        plan = self._guarantee.plan(records, at_risk)
        dead = {row: (f"KafkaError.{r.error}", r.message) for row, r in plan.dead.items()}
        dead.update(too_large)
        batch = _PlannedBatch(
            ack, dead, plan.alone, self._producer, self._dead_letters, self._guarantee.failed
        )
        for row in self._guarantee.send_batch(records, batch):
            ack.skipped(row)

    def dead_letter(
        self,
        record: Record,
        dlq_topic: str,
        stage: str,
        error_class: str,
        message: str,
        trace: Headers = (),
    ) -> None:
        """Produce ``record`` to ``dlq_topic`` with the error headers (see
        ``streamproc.output.dead_letters``: a value too large is left out, a refused record
        climbs the ladder, one refused with nothing left to try stops the pipeline);
        ``trace``: the dead-letter record's own trace headers (replacing the input's)."""
        self._dead_letters.send(record, dlq_topic, stage, error_class, message, trace)

    def flush(self, timeout_s: float) -> int:
        """Wait for outstanding deliveries (records sent again alone included); return how many
        are still outstanding after ``timeout_s`` seconds."""
        return self._producer.flush(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush, then stop the ``sink`` thread and drop the producers (idempotent); then give
        the transactional id's host slot back."""
        self._producer.close(timeout_s)
        if self._identity is not None:
            self._identity.release()


@define(eq=False)
class _PlannedBatch:
    """One batch's results and the plan to produce them: a
    :class:`~streamproc.offsets.guarantees.RowProducer` for ``Guarantee.send_batch``.

    Args:
        ack: the batch's delivery accounting (its results in :attr:`BatchAck.batch`).
        dead: rows to dead-letter (stage ``produce``) instead, with the error class and message
            of their dead-letter record.
        alone: rows to produce in a record batch of their own.
        producer: the results producer.
        dead_letters: produces the dead rows' dead-letter records.
        give_up: True when waiting for the producer's queue is pointless (``Guarantee.failed``).
    """

    _ack: BatchAck
    _dead: Mapping[Row, tuple[str, str]]
    _alone: Collection[Row]
    _producer: ResultsProducer
    _dead_letters: DeadLetters
    _give_up: Callable[[], bool]

    def produce_rows(self, rows: Sequence[int]) -> Sequence[int]:
        """Produce the results of ``rows`` (see ``RowProducer.produce_rows``). A dead row is
        dead-lettered instead and returned with the refused rows (its input is done through its
        dead-letter record)."""
        ack = self._ack
        batch = ack.batch
        topic, records, values, headers = batch.topic, batch.records, batch.values, batch.headers
        dead, alone = self._dead, self._alone
        refused: list[int] = []
        producer = self._producer.client
        send = producer.produce
        on_delivery: DeliveryCallback = ack.delivered
        for row in rows:
            if dead and row in dead:  # refused before, or cannot fit: never produced
                self._dead_letter(row)
                refused.append(row)
                continue
            if alone and row in alone:
                if not self._produce_alone(row):
                    refused.append(row)
                continue
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
                        producer, topic, records[row].key, values[row], headers[row], on_delivery
                    )
            except KafkaException as exc:  # refused before sending
                refused.append(row)
                ack.delivered_row(row, exc.args[0], None, "local")
        return refused

    def _dead_letter(self, row: Row) -> None:
        batch = self._ack.batch
        error_class, reason = self._dead[row]
        self._dead_letters.send(
            batch.records[row],
            batch.dead_letter_topic,
            "produce",
            error_class,
            reason,
            own_trace_headers(batch.headers[row]),
        )
        self._ack.skipped(row)

    def _produce_alone(self, row: Row) -> bool:
        """Produce ``row`` in a record batch of its own; False when refused before sending."""
        batch = self._ack.batch
        return self._producer.produce_own_batch(
            batch.topic,
            batch.records[row].key,
            batch.values[row],
            batch.headers[row],
            partial(self._ack.delivered_row, row),
            self._give_up,
        )
