"""Batch delivery accounting: a batch's inputs are done only when every report is in.

A real :class:`Sink` over the fake producer (``tests.support.kafka_fakes``): the results
producer holds records until the test delivers them, in any order, with any error.
"""

from __future__ import annotations

from confluent_kafka import KafkaError

from streamproc.metrics import Metrics
from streamproc.offsets.guarantees import AtLeastOnce
from streamproc.offsets.tracker import OffsetTracker
from streamproc.output.headers import H_OFFSET, H_STAGE, source_headers
from streamproc.output.producer import ResultsProducer
from streamproc.output.sink import Sink
from streamproc.records import Record, TopicPartition
from tests.support.kafka_fakes import FakeProducer, factory

TP = TopicPartition("in", 0)


class Harness:
    def __init__(self, n: int, keys: list[bytes | None] | None = None) -> None:
        self.tracker = OffsetTracker()
        self.generation = self.tracker.assign([TP])[TP]
        keys = keys or [None] * n
        self.records = [Record(TP, o, keys[o], b"v", (), 0, 0.0, self.generation) for o in range(n)]
        self.tracker.consumed_many(self.records)
        self.producer = FakeProducer()
        self.alone = FakeProducer()
        self.fatal: list[BaseException] = []
        metrics = Metrics()
        results = ResultsProducer(
            self.producer, {}, metrics, self.fatal.append, factory(self.alone)
        )
        self.sink = Sink(results, AtLeastOnce(self.tracker, metrics), metrics, self.fatal.append)

    def send(self, values: list[bytes] | None = None) -> None:
        if values is None:
            values = [b"r%d" % r.offset for r in self.records]
        headers = [list(source_headers(r)) for r in self.records]
        self.sink.send_results("out", self.records, values, headers, "in.dlq")

    def report(self, index: int, error: KafkaError | None = None) -> None:
        """Deliver the pending record of input ``index`` (results producer)."""
        (pos,) = [i for i, p in enumerate(self.producer.pending) if p.value == b"r%d" % index]
        record = self.producer.pending.pop(pos)
        if error is None:
            self.producer.delivered.append(record)
        record.report(error)

    @property
    def watermark(self) -> int | None:
        return self.tracker.watermarks([TP]).get(TP)


def test_batch_is_done_only_after_its_last_report_in_any_order() -> None:
    h = Harness(3)
    h.send()
    h.report(2)
    h.report(0)
    assert h.watermark == 0  # offset 1 not acknowledged yet: nothing may be marked done
    assert h.tracker.pending(TP) == 3
    h.report(1)
    assert h.watermark == 3 and h.tracker.pending(TP) == 0


def test_rejected_result_is_dead_lettered_and_left_out_of_the_done_set() -> None:
    h = Harness(3)
    h.send()
    h.report(0)
    h.report(1, KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))
    h.report(2)
    dead = [p for p in h.producer.pending if p.topic == "in.dlq"]
    assert len(dead) == 1 and (H_STAGE, b"produce") in dead[0].headers
    assert h.watermark == 1  # offset 1 waits for its dead-letter record
    h.producer.deliver()
    assert h.watermark == 3


def test_a_record_batch_refused_as_too_large_is_judged_record_by_record() -> None:
    # The broker's MSG_SIZE_TOO_LARGE refuses the whole record batch: every record of it gets
    # the error. Each is sent again alone; only one refused alone is dead-lettered.
    h = Harness(3)
    h.send()
    too_large = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
    for index in range(3):
        h.report(index, too_large)
    assert h.producer.pending == [] and h.watermark == 0
    assert [(p.topic, p.value) for p in h.alone.pending] == [
        ("out", b"r0"),
        ("out", b"r1"),
        ("out", b"r2"),
    ]
    assert h.alone.settings["batch.num.messages"] == 1 and h.alone.settings["linger.ms"] == 0
    first, second, third = h.alone.pending
    h.alone.pending.clear()
    for produced, error in ((first, None), (second, too_large), (third, None)):
        produced.report(error)
    dead = [p for p in h.producer.pending if p.topic == "in.dlq"]
    assert len(dead) == 1 and (("streamproc.source.offset", b"1") in dead[0].headers)
    assert h.watermark == 1
    h.producer.deliver()
    assert h.watermark == 3 and not h.fatal


def test_one_delivery_callback_serves_a_batch_and_finds_a_failed_row_by_its_value() -> None:
    h = Harness(4)
    h.send()
    assert len({id(p.on_delivery) for p in h.producer.pending}) == 1  # no closure per record
    h.report(2, KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))  # a report without headers
    (dead,) = [p for p in h.producer.pending if p.topic == "in.dlq"]
    assert (H_OFFSET, b"2") in dead.headers and (H_STAGE, b"produce") in dead.headers
    for index in (0, 1, 3):
        h.report(index)
    assert h.watermark == 2  # offset 2 waits for its dead-letter record
    h.producer.deliver()
    assert h.watermark == 4 and not h.fatal


def test_identical_results_share_the_callback_and_the_key_blames_the_right_input() -> None:
    # A failed report carries the key and value but no headers: byte-identical results (every
    # expired result is empty) are told apart by their inputs' keys.
    h = Harness(3, keys=[b"k0", b"k1", b"k2"])
    h.send([b"same", b"same", b"other"])
    assert len({id(p.on_delivery) for p in h.producer.pending}) == 1
    first, second, third = h.producer.pending
    h.producer.pending.clear()
    first.report(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))
    second.report()
    third.report()
    (dead,) = [p for p in h.producer.pending if p.topic == "in.dlq"]
    assert (H_OFFSET, b"0") in dead.headers  # the first input, not its twin
    assert h.watermark == 0
    h.producer.deliver()
    assert h.watermark == 3 and not h.fatal


def test_results_alike_in_key_and_value_are_all_produced_again_when_one_fails() -> None:
    # the report cannot say which of the two failed: both are produced again (one of them
    # twice, at least once), and the inputs are done only once both are acknowledged again
    h = Harness(2)
    h.send([b"", b""])
    first, second = h.producer.pending
    h.producer.pending.clear()
    second.report(KafkaError(KafkaError._MSG_TIMED_OUT))
    first.report()
    assert not [p for p in h.producer.pending if p.topic == "in.dlq"]
    assert h.watermark == 0 and len(h.alone.pending) == 2
    h.alone.deliver(count=1)
    assert h.watermark == 0
    h.alone.deliver()
    assert h.watermark == 2 and not h.fatal


def test_alike_results_all_refused_are_each_dead_lettered_once() -> None:
    # a record-level refusal of every one of five alike results: each is produced alone once
    # (not once per report), refused alone, and dead-lettered once
    h = Harness(5)
    h.send([b""] * 5)
    h.producer.deliver(error=KafkaError(KafkaError.INVALID_RECORD))
    assert len(h.alone.pending) == 5
    h.alone.deliver(error=KafkaError(KafkaError.INVALID_RECORD))
    dead = [p for p in h.producer.pending if p.topic == "in.dlq"]
    assert sorted(dict(p.headers)[H_OFFSET] for p in dead) == [b"%d" % o for o in range(5)]
    assert h.watermark == 0
    h.producer.deliver()
    assert h.watermark == 5 and not h.fatal


def test_a_result_timed_out_while_the_cluster_is_down_is_sent_again_not_dead_lettered() -> None:
    """A produce that times out (two of three brokers down longer than message.timeout.ms) is a
    condition of the cluster, not of the record: it is produced again until acknowledged."""
    h = Harness(2)
    h.send()
    h.report(0)
    h.report(1, KafkaError(KafkaError._MSG_TIMED_OUT))
    assert not [p for p in h.producer.pending if p.topic == "in.dlq"]
    assert h.watermark == 0  # the batch waits for its result produced again
    (again,) = h.alone.pending
    assert again.topic == "out" and again.value == b"r1"
    h.alone.deliver(error=KafkaError(KafkaError.NOT_ENOUGH_REPLICAS))  # still down: again
    assert not [p for p in h.producer.pending if p.topic == "in.dlq"] and h.watermark == 0
    h.alone.deliver()
    assert h.watermark == 2
    assert not h.fatal


def test_a_dead_letter_record_timed_out_is_sent_again_not_fatal() -> None:
    h = Harness(1)
    h.send()
    h.report(0, KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))
    (dead,) = [p for p in h.producer.pending if p.topic == "in.dlq"]
    h.producer.pending.remove(dead)
    dead.report(KafkaError(KafkaError._MSG_TIMED_OUT))
    assert not h.fatal
    (again,) = [p for p in h.alone.pending if p.topic == "in.dlq"]
    assert (H_STAGE, b"produce") in again.headers
    h.alone.deliver()
    assert h.watermark == 1


def test_results_never_time_out_by_default_under_at_least_once() -> None:
    from streamproc.output.producer import producer_settings

    assert producer_settings({})["message.timeout.ms"] == 0  # 0: librdkafka never expires
    assert producer_settings({"message.timeout.ms": 5000})["message.timeout.ms"] == 5000
    # transactional: librdkafka bounds it by transaction.timeout.ms (a timeout aborts)
    assert "message.timeout.ms" not in producer_settings({}, "tx-1")


def test_a_rejected_traced_result_dead_letters_with_the_results_own_context() -> None:
    h = Harness(1)
    h.records[0] = Record(TP, 0, None, b"v", (("traceparent", b"input"),), 0, 0.0, h.generation)
    own = [("traceparent", b"00-%032x-%016x-01" % (1, 2)), ("tracestate", b"k=v")]
    h.sink.send_results(
        "out", h.records, [b"r0"], [[*source_headers(h.records[0]), *own]], "in.dlq"
    )
    h.report(0, KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))
    (dead,) = [p for p in h.producer.pending if p.topic == "in.dlq"]
    assert [x for x in dead.headers if x[0] in ("traceparent", "tracestate")] == own
