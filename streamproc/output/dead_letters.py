"""Dead-letter records, and the ladder a dead-letter record the broker refuses as too large climbs.

A dead-letter record keeps the input's key, value and headers and adds the error headers
(``streamproc.output.headers``). Its input is done once the record is acknowledged.

The ladder, one :class:`Step` after the other (:func:`after_too_large`):

1. **in the batch** (:data:`IN_BATCH`): through the results producer, as the processing
   guarantee says (``Guarantee.send``: inside the open transaction under exactly-once);
2. **alone** (:data:`ALONE`): the broker refused the record batch it shared
   (``MSG_SIZE_TOO_LARGE`` judges a whole record batch), so it goes again in a record batch of
   its own (the lone-record producer);
3. **without the value**: refused on its own (alone, or by the producer before sending), it goes
   again with its value left out; ``streamproc.error.value_omitted`` holds the value's size and
   the source coordinates say where to read it (the input topic keeps it for its retention);
4. **fatal**: refused on its own without its value: ``on_fatal`` gets a
   :class:`~streamproc.errors.FatalPipelineError`; we cannot go on without losing the record.

The value is left out from the first step when it cannot fit (the producer's
``message.max.bytes`` or the topic's ``max.message.bytes``, less the record's overhead) or when a
refusal inside an aborted transaction said so (``Guarantee.remembered``). Other refusals: while
the cluster is unavailable the same step is produced again (alone) until the cluster takes it;
when the guarantee answers ``abort`` nothing more is done (the input comes back after the
rewind); when it answers ``fatal`` (refused inside the transaction with nothing left to leave
out), and for any other refusal, the pipeline stops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from attrs import define
from confluent_kafka import KafkaError, KafkaException

from streamproc.errors import FatalPipelineError
from streamproc.logs import get_logger
from streamproc.metrics import Metrics
from streamproc.offsets.guarantees import Guarantee, How
from streamproc.output.headers import OutputHeaders, dead_letter_headers
from streamproc.output.limits import RecordLimits
from streamproc.output.producer import ResultsProducer, produce_waiting, unavailable
from streamproc.records import Headers, Record

log = get_logger(__name__)


@dataclass(frozen=True)
class Step:
    """One step of the ladder: where the dead-letter record is produced and with what.

    Attributes:
        alone: in a record batch of its own (the lone-record producer), not through the
            results producer.
        value_omitted: its value is left out.
    """

    alone: bool
    value_omitted: bool


IN_BATCH = Step(alone=False, value_omitted=False)
IN_BATCH_WITHOUT_VALUE = Step(alone=False, value_omitted=True)
ALONE = Step(alone=True, value_omitted=False)
ALONE_WITHOUT_VALUE = Step(alone=True, value_omitted=True)


def after_too_large(step: Step, how: How) -> Step | None:
    """The step after ``step``'s record was refused as too large, judged as ``how`` says
    (``batch``: with the record batch it shared; ``alone`` or ``local``: on its own)::

        IN_BATCH               --batch-->  ALONE
        IN_BATCH               --local-->  IN_BATCH_WITHOUT_VALUE  (the producer's own limit)
        IN_BATCH_WITHOUT_VALUE --batch-->  ALONE_WITHOUT_VALUE
        ALONE                  --alone-->  ALONE_WITHOUT_VALUE
        *_WITHOUT_VALUE        --alone or local-->  None (fatal)

    Returns:
        The next step; None when nothing is left to leave out (fatal).
    """
    if how == "batch":
        return replace(step, alone=True)
    if not step.value_omitted:
        return replace(step, value_omitted=True)
    return None


@dataclass(frozen=True)
class DeadLetter:
    """Why and where an input is dead-lettered.

    Attributes:
        record: the input (its key, value and headers are kept).
        topic: the dead-letter topic.
        stage: ``streamproc.error.stage`` (decode|model|encode|produce|callback).
        error_class: ``streamproc.error.class``.
        message: ``streamproc.error.message``.
        trace: its own trace headers (``streamproc.tracing``; empty: the input's are kept).
    """

    record: Record
    topic: str
    stage: str
    error_class: str
    message: str
    trace: Headers = ()

    def where(self) -> str:
        """The input's coordinates, ``topic[partition]@offset``."""
        record = self.record
        return f"{record.tp.topic}[{record.tp.partition}]@{record.offset}"


@dataclass(frozen=True)
class Attempt:
    """One try at producing a dead-letter record.

    Attributes:
        letter: what is dead-lettered.
        step: where, and whether the value is left out.
        value: the value produced (None when left out).
        headers: the record's complete headers.
    """

    letter: DeadLetter
    step: Step
    value: bytes | None
    headers: OutputHeaders


@define(eq=False)
class DeadLetters:
    """Produces dead-letter records and climbs the ladder with a refused one.

    Args:
        producer: the results producer and the lone-record producer.
        guarantee: how a record is produced, when its input is done, who handles a refusal.
        limits: the producer's and the topics' record size limits.
        metrics: counts dead-lettered records.
        on_fatal: called (from the thread of the refusal) when the pipeline must stop.
    """

    _producer: ResultsProducer
    _guarantee: Guarantee
    _limits: RecordLimits
    _metrics: Metrics
    _on_fatal: Callable[[BaseException], None]

    def send(
        self,
        record: Record,
        topic: str,
        stage: str,
        error_class: str,
        message: str,
        trace: Headers = (),
    ) -> None:
        """Produce ``record``'s dead-letter record to ``topic`` (step 1 of the ladder); the
        arguments are those of :class:`DeadLetter`."""
        known = self._guarantee.remembered(record)
        step = IN_BATCH_WITHOUT_VALUE if known is not None and known.omit_value else IN_BATCH
        letter = DeadLetter(record, topic, stage, error_class, message, trace)
        self._produce(self._attempt(letter, step))

    def _attempt(self, letter: DeadLetter, step: Step) -> Attempt:
        """``letter`` at ``step``, its value left out also when it cannot fit."""
        value = letter.record.value
        if value is not None and (
            step.value_omitted or not self._limits.dead_letter_value_fits(letter.topic, len(value))
        ):
            value, step = None, replace(step, value_omitted=True)
        headers = dead_letter_headers(
            letter.record,
            letter.stage,
            letter.error_class,
            letter.message,
            step.value_omitted,
            letter.trace,
        )
        return Attempt(letter, step, value, headers)

    def _produce(self, attempt: Attempt) -> None:
        """Produce ``attempt`` (its report to :meth:`_delivered`)."""
        letter = attempt.letter
        record = letter.record
        report = partial(self._delivered, attempt)
        if attempt.step.alone:
            self._producer.produce_alone(
                letter.topic, record.key, attempt.value, attempt.headers, report
            )
            return
        log.info(
            "dead-lettered",
            **record.where(),
            stage=letter.stage,
            error_class=letter.error_class,
            reason=letter.message[:200],
            value_omitted=attempt.step.value_omitted,
        )
        try:
            self._guarantee.send(
                record,
                produce_waiting,
                self._producer.client,
                letter.topic,
                record.key,
                attempt.value,
                attempt.headers,
                report,
            )
        except KafkaException as exc:
            self._refused_before_sending(attempt, exc)

    def _delivered(self, attempt: Attempt, err: KafkaError | None, msg: Any) -> None:
        """The delivery report of ``attempt``: done, or refused (see the module docstring)."""
        letter = attempt.letter
        if err is None:
            self._metrics.dead_lettered.labels(letter.record.tp.topic, letter.stage).inc()
            self._guarantee.acknowledged((letter.record,))
            return
        how: How = "alone" if attempt.step.alone else "batch"
        handling = self._guarantee.refused(letter.record, err, how, dead_letter=True)
        if handling == "abort":
            return  # the transaction aborts and the record is retried after the rewind
        if handling == "fatal":
            self._fatal(
                letter, f"{err.str()} (inside the transaction, with nothing left to leave out)"
            )
        elif err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
            self._climb(attempt, how, err.str())
        elif unavailable(err):  # the same step again, alone, until the cluster takes it
            self._producer.produce_again(
                letter.topic,
                letter.record,
                attempt.value,
                attempt.headers,
                err,
                partial(self._delivered, attempt),
            )
        else:
            self._fatal(letter, err.str())

    def _refused_before_sending(self, attempt: Attempt, exc: KafkaException) -> None:
        """The producer refused ``attempt`` before sending it (judged ``local``)."""
        err = exc.args[0]
        if self._guarantee.refused(attempt.letter.record, err, "local", dead_letter=True) == (
            "abort"
        ):
            return  # the transaction failed before: retried after the rewind
        if err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
            # the producer's own limit judges each record alone: again without the value,
            # through the same producer (inside the transaction under exactly-once)
            self._climb(attempt, "local", str(exc))
        else:
            self._fatal(attempt.letter, str(exc))

    def _climb(self, attempt: Attempt, how: How, reason: str) -> None:
        """Refused as too large, judged as ``how`` says: the next step, or fatal at the end."""
        step = after_too_large(attempt.step, how)
        if step is None:
            self._fatal(attempt.letter, reason)
        else:
            self._produce(self._attempt(attempt.letter, step))

    def _fatal(self, letter: DeadLetter, reason: str) -> None:
        self._on_fatal(
            FatalPipelineError(
                f"dead-letter topic {letter.topic!r} rejected the record from "
                f"{letter.where()}: {reason}"
            )
        )
