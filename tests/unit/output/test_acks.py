"""A batch's acknowledgement through its narrow protocol (:class:`DeliveryHandler`): a recording
handler, no sink; the reports come from the fake producer (``tests.support.kafka_fakes``),
whose failed reports carry the value but no headers, as the real client's do."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial

from confluent_kafka import KafkaError

from streamproc.kafka.protocols import DeliveryCallback
from streamproc.output.acks import BatchAck, DeliveryHandler, OutputBatch, RefusedResult
from streamproc.records import Record, TopicPartition
from tests.support.kafka_fakes import FakeProducer

TP = TopicPartition("in", 0)
REFUSED = KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)


class Handler:
    """Records what the ack asks; ``resend`` rows are produced again (to :attr:`lone`)."""

    def __init__(self, resend: set[int] | None = None) -> None:
        self.resend = resend or set()
        self.refused: list[RefusedResult] = []
        self.acknowledged_batches: list[tuple[str, list[int]]] = []
        self.cuts: list[float | None] = []
        self.lone = FakeProducer()

    def recover(self, refused: RefusedResult, report: DeliveryCallback) -> bool:
        self.refused.append(refused)
        if refused.record.offset not in self.resend:
            return False
        self.resend.discard(refused.record.offset)
        self.lone.produce(refused.topic, refused.value, on_delivery=report)
        return True

    def acknowledged(
        self,
        topic: str,
        records: Sequence[Record],
        exemplar: dict[str, str] | None = None,
        cut_s: float | None = None,
    ) -> None:
        self.acknowledged_batches.append((topic, [r.offset for r in records]))
        self.cuts.append(cut_s)


def produce(
    values: list[bytes], handler: DeliveryHandler, keys: Sequence[bytes | None] | None = None
) -> tuple[BatchAck, FakeProducer]:
    """One batch of results to ``out`` through a fake producer, each with the ack's one
    callback, as the sink produces them; ``keys``: the inputs' keys (None: none)."""
    keys = keys or [None] * len(values)
    records = [Record(TP, o, k, b"in", (), 0, 0.0, 1) for o, k in enumerate(keys)]
    headers = [[("streamproc.source.offset", b"%d" % o)] for o in range(len(values))]
    ack = BatchAck(handler, OutputBatch("out", "in.dlq", records, values, headers))
    producer = FakeProducer()
    for row, value in enumerate(values):
        producer.produce("out", value, keys[row], headers=headers[row], on_delivery=ack.delivered)
    return ack, producer


def report(producer: FakeProducer, value: bytes, error: KafkaError | None = None) -> None:
    (pos,) = [i for i, p in enumerate(producer.pending) if p.value == value]
    producer.pending.pop(pos).report(error)


def test_the_handler_hears_of_the_batch_once_after_its_last_report_in_any_order() -> None:
    handler = Handler()
    _, producer = produce([b"a", b"b", b"c"], handler)
    report(producer, b"c")
    report(producer, b"a")
    assert handler.acknowledged_batches == []
    report(producer, b"b")
    assert handler.acknowledged_batches == [("out", [0, 1, 2])]  # batch order


def test_the_handler_hears_when_the_batch_was_cut() -> None:
    # the lane's predicted expiry learns the time from cut to acknowledgement from this
    handler = Handler()
    records = [Record(TP, 0, None, b"in", (), 0, 0.0, 1)]
    ack = BatchAck(handler, OutputBatch("out", "in.dlq", records, [b"r"], [[]], cut_at_s=9.75))
    producer = FakeProducer()
    producer.produce("out", b"r", on_delivery=ack.delivered)
    report(producer, b"r")
    # a batch that ran on no device is sent without a cut time: the handler hears none
    ack = BatchAck(handler, OutputBatch("out", "in.dlq", records, [b"e"], [[]]))
    producer.produce("out", b"e", on_delivery=ack.delivered)
    report(producer, b"e")
    assert handler.cuts == [9.75, None]


def test_a_refused_row_reaches_the_handler_whole_and_is_left_out_when_failed_for_good() -> None:
    handler = Handler()
    _, producer = produce([b"a", b"b", b"c"], handler)
    report(producer, b"b", REFUSED)  # a failed report: value, no headers
    (refused,) = handler.refused
    assert (refused.record.offset, refused.value, refused.topic) == (1, b"b", "out")
    assert refused.headers == [("streamproc.source.offset", b"1")]
    assert refused.dead_letter_topic == "in.dlq"
    assert refused.error is REFUSED and refused.how == "batch"
    producer.deliver()
    assert handler.acknowledged_batches == [("out", [0, 2])]


def test_a_row_produced_again_holds_the_batch_and_its_next_report_is_judged_alone() -> None:
    handler = Handler(resend={1})
    _, producer = produce([b"a", b"b"], handler)
    producer.deliver(error=KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))  # the record batch
    assert [r.how for r in handler.refused] == ["batch", "batch"]
    assert handler.acknowledged_batches == [] and len(handler.lone.pending) == 1
    handler.lone.deliver(error=REFUSED)  # refused again, on its own
    assert handler.refused[-1].how == "alone" and handler.refused[-1].record.offset == 1
    assert handler.acknowledged_batches == [("out", [])]


def test_a_row_produced_again_and_acknowledged_is_in_the_batch() -> None:
    handler = Handler(resend={0})
    _, producer = produce([b"a", b"b"], handler)
    report(producer, b"a", KafkaError(KafkaError._MSG_TIMED_OUT))
    report(producer, b"b")
    assert handler.acknowledged_batches == []
    handler.lone.deliver()
    assert handler.acknowledged_batches == [("out", [0, 1])]


def test_identical_values_blame_the_row_with_the_reported_key() -> None:
    # expired results are all empty: the input's key still tells them apart
    handler = Handler()
    _, producer = produce([b"", b"", b"ok"], handler, keys=[b"k0", b"k1", b"k1"])
    first, second, _ = producer.pending
    first.report(REFUSED)
    second.report()
    assert [r.record.offset for r in handler.refused] == [0]
    producer.deliver()
    assert handler.acknowledged_batches == [("out", [1, 2])]


def test_rows_alike_in_value_and_key_are_each_taken_as_refused_and_the_batch_waits() -> None:
    # the report cannot say which of rows 0-2 failed: each is produced again alone
    handler = Handler(resend={0, 1, 2})
    _, producer = produce([b"", b"", b"", b"ok"], handler, keys=[b"k"] * 4)
    first, second, third, fourth = producer.pending
    second.report(KafkaError(KafkaError._MSG_TIMED_OUT))
    assert [r.record.offset for r in handler.refused] == [0, 1, 2]
    first.report()
    third.report()
    fourth.report()
    assert handler.acknowledged_batches == []  # three reports from the lone producer to come
    handler.lone.deliver(count=2)
    assert handler.acknowledged_batches == []
    handler.lone.deliver()
    assert handler.acknowledged_batches == [("out", [0, 1, 2, 3])]


def test_every_alike_report_failing_produces_each_row_again_once_not_once_per_report() -> None:
    handler = Handler(resend={0, 1, 2})
    _, producer = produce([b"", b"", b""], handler, keys=[b"k"] * 3)
    producer.deliver(error=KafkaError(KafkaError._MSG_TIMED_OUT))  # an outage: all three
    assert sorted(r.record.offset for r in handler.refused) == [0, 1, 2]
    assert len(handler.lone.pending) == 3
    handler.lone.deliver()
    assert handler.acknowledged_batches == [("out", [0, 1, 2])]


class ReportingValues(list[bytes]):
    """A batch's values whose first iteration lets one more report in after its first value:
    a report another thread handles while this one builds the value -> rows map."""

    def __init__(self, values: list[bytes]) -> None:
        super().__init__(values)
        self.midway: Callable[[], None] | None = None

    def __iter__(self) -> Iterator[bytes]:
        for index, value in enumerate(list.__iter__(self)):
            if index == 1 and self.midway is not None:
                midway, self.midway = self.midway, None
                midway()
            yield value


def test_a_report_during_the_map_build_sees_the_whole_map() -> None:
    handler = Handler(resend={1, 2})
    values = ReportingValues([b"a", b"", b""])
    records = [Record(TP, o, None, b"in", (), 0, 0.0, 1) for o in range(3)]
    ack = BatchAck(handler, OutputBatch("out", "in.dlq", records, values, [[]] * 3))
    producer = FakeProducer()
    for value in list(values):
        producer.produce("out", value, on_delivery=ack.delivered)
    first, second, third = producer.pending
    values.midway = partial(second.report, KafkaError(KafkaError._MSG_TIMED_OUT))
    first.report(REFUSED)  # builds the map; the second report comes in halfway
    assert sorted(r.record.offset for r in handler.refused) == [0, 1, 2]
    third.report()
    handler.lone.deliver()
    assert handler.acknowledged_batches == [("out", [1, 2])]


def test_alike_rows_failed_for_good_are_left_out_and_not_blamed_again() -> None:
    handler = Handler()  # nothing produced again: each alike row fails for good
    _, producer = produce([b"", b"", b""], handler, keys=[b"k"] * 3)
    first, second, third = producer.pending
    first.report(REFUSED)
    assert [r.record.offset for r in handler.refused] == [0, 1, 2]
    second.report(REFUSED)  # its row failed for good already: blamed on no row again
    third.report()
    assert len(handler.refused) == 3
    assert handler.acknowledged_batches == [("out", [])]


def test_skipped_rows_and_local_refusals_count_down_without_a_report() -> None:
    handler = Handler()
    records = [Record(TP, o, None, b"in", (), 0, 0.0, 1) for o in range(3)]
    ack = BatchAck(handler, OutputBatch("out", "in.dlq", records, [b"a", b"b", b"c"], [[]] * 3))
    ack.skipped(0)
    ack.delivered_row(1, REFUSED, None, "local")
    assert handler.refused[0].how == "local" and handler.acknowledged_batches == []
    ack.delivered(None, None)
    assert handler.acknowledged_batches == [("out", [2])]
