"""The dead-letter ladder, step by step: in the batch, then alone, then without the value, then
fatal; over the fake producers (``tests.support.kafka_fakes``), at-least-once."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError

from streamproc.errors import FatalPipelineError
from streamproc.metrics import Metrics
from streamproc.offsets.guarantees import AtLeastOnce, How
from streamproc.offsets.tracker import OffsetTracker
from streamproc.output.dead_letters import (
    ALONE,
    ALONE_WITHOUT_VALUE,
    IN_BATCH,
    IN_BATCH_WITHOUT_VALUE,
    DeadLetters,
    Step,
    after_too_large,
)
from streamproc.output.headers import H_CLASS, H_OFFSET, H_STAGE, H_VALUE_OMITTED
from streamproc.output.limits import DEAD_LETTER_OVERHEAD_BYTES, RecordLimits
from streamproc.output.producer import ResultsProducer
from streamproc.records import Record, TopicPartition
from tests.support.kafka_fakes import FakeProducer, Produced, factory

TP = TopicPartition("in", 0)
DLQ = "in.dlq"
TOO_LARGE = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)


@pytest.mark.parametrize(
    ("step", "how", "after"),
    [
        (IN_BATCH, "batch", ALONE),
        (IN_BATCH, "local", IN_BATCH_WITHOUT_VALUE),
        (IN_BATCH_WITHOUT_VALUE, "batch", ALONE_WITHOUT_VALUE),
        (IN_BATCH_WITHOUT_VALUE, "local", None),
        (ALONE, "alone", ALONE_WITHOUT_VALUE),
        (ALONE_WITHOUT_VALUE, "alone", None),
    ],
)
def test_each_step_after_a_too_large_refusal(step: Step, how: How, after: Step | None) -> None:
    assert after_too_large(step, how) == after


class Ladder:
    """Dead letters over a fake results producer and a fake lone-record producer."""

    def __init__(self, value: bytes | None = b"input-value", limits: dict[str, int] | None = None):
        self.tracker = OffsetTracker()
        generation = self.tracker.assign([TP])[TP]
        self.record = Record(TP, 0, b"k", value, (("h", b"1"),), 0, 0.0, generation)
        self.tracker.consumed_many([self.record])
        self.metrics = Metrics()
        self.results = FakeProducer()
        self.lone = FakeProducer()
        self.fatal: list[BaseException] = []
        guarantee = AtLeastOnce(self.tracker, self.metrics)
        producer = ResultsProducer(
            self.results, {}, self.metrics, self.fatal.append, factory(self.lone)
        )
        record_limits = RecordLimits({})
        record_limits.set_topics(limits or {})
        self.letters = DeadLetters(
            producer, guarantee, record_limits, self.metrics, self.fatal.append
        )

    def send(self) -> None:
        self.letters.send(self.record, DLQ, "decode", "DecodeError", "bad input")

    @staticmethod
    def take(producer: FakeProducer) -> Produced:
        (produced,) = producer.pending
        producer.pending.clear()
        return produced

    def done(self) -> bool:
        return self.tracker.watermarks([TP]).get(TP) == 1

    def counted(self) -> float | None:
        return self.metrics.registry.get_sample_value(
            "streamproc_messages_dead_lettered_total", {"topic": "in", "stage": "decode"}
        )


def test_the_whole_ladder_in_the_batch_then_alone_then_without_the_value_then_fatal() -> None:
    h = Ladder()
    h.send()
    first = h.take(h.results)  # step 1: through the results producer, value kept
    assert (first.topic, first.key, first.value) == (DLQ, b"k", b"input-value")
    assert first.headers[0] == ("h", b"1") and (H_STAGE, b"decode") in first.headers
    assert (H_OFFSET, b"0") in first.headers and H_VALUE_OMITTED not in dict(first.headers)
    first.report(TOO_LARGE)  # judged with the record batch it shared
    second = h.take(h.lone)  # step 2: alone, value still kept
    assert second.value == b"input-value" and h.results.pending == []
    second.report(TOO_LARGE)  # judged on its own
    third = h.take(h.lone)  # step 3: alone, without the value
    assert third.value is None and dict(third.headers)[H_VALUE_OMITTED] == b"11"
    assert (H_CLASS, b"DecodeError") in third.headers
    assert not h.fatal and not h.done()
    third.report(TOO_LARGE)  # step 4: nothing left to leave out
    (fatal,) = h.fatal
    assert isinstance(fatal, FatalPipelineError)
    assert "'in.dlq'" in str(fatal) and "in[0]@0" in str(fatal)
    assert not h.done() and h.counted() is None


def test_a_step_acknowledged_marks_the_input_done_and_counts_it() -> None:
    h = Ladder()
    h.send()
    h.take(h.results).report(TOO_LARGE)
    h.take(h.lone).report(None)  # taken alone, with its value
    assert h.done() and h.counted() == 1 and not h.fatal


def test_refused_by_the_producer_before_sending_goes_again_without_the_value_in_the_batch() -> None:
    h = Ladder()
    h.results.fail_next("produce", TOO_LARGE)  # the producer's own message.max.bytes
    h.send()
    again = h.take(h.results)  # the same producer, not the lone one
    assert again.value is None and dict(again.headers)[H_VALUE_OMITTED] == b"11"
    assert h.lone.pending == []
    again.report(None)
    assert h.done() and not h.fatal


def test_refused_by_the_producer_without_the_value_is_fatal() -> None:
    h = Ladder()
    h.results.fail_next("produce", TOO_LARGE, TOO_LARGE)
    h.send()
    assert len(h.fatal) == 1 and h.results.pending == [] and h.lone.pending == []


def test_a_value_that_cannot_fit_the_topic_is_left_out_from_the_first_step() -> None:
    h = Ladder(value=b"x" * 100, limits={DLQ: DEAD_LETTER_OVERHEAD_BYTES + 99})
    h.send()
    first = h.take(h.results)
    assert first.value is None and dict(first.headers)[H_VALUE_OMITTED] == b"100"
    first.report(TOO_LARGE)  # still refused with its record batch: alone, still without it
    second = h.take(h.lone)
    assert second.value is None and not h.fatal
    second.report(TOO_LARGE)
    assert len(h.fatal) == 1


def test_a_value_that_fits_the_topic_is_kept() -> None:
    h = Ladder(value=b"x" * 99, limits={DLQ: DEAD_LETTER_OVERHEAD_BYTES + 99})
    h.send()
    assert h.take(h.results).value == b"x" * 99


def test_while_the_cluster_is_unavailable_the_same_step_goes_again_alone() -> None:
    h = Ladder()
    h.send()
    h.take(h.results).report(KafkaError(KafkaError.NOT_ENOUGH_REPLICAS))
    again = h.take(h.lone)
    assert again.value == b"input-value"  # the same step: value kept
    again.report(KafkaError(KafkaError._MSG_TIMED_OUT))
    retries = h.metrics.registry.get_sample_value(
        "streamproc_produce_retries_total", {"topic": DLQ}
    )
    assert retries == 2
    # judged as the step it repeats (in the batch): a too-large refusal now goes alone
    h.take(h.lone).report(TOO_LARGE)
    assert h.take(h.lone).value == b"input-value" and not h.fatal


def test_any_other_refusal_of_a_dead_letter_record_is_fatal() -> None:
    h = Ladder()
    h.send()
    h.take(h.results).report(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))
    assert len(h.fatal) == 1 and h.lone.pending == [] and not h.done()
