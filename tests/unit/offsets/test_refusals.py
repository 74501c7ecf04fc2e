"""Records refused inside a transaction (exactly-once), over the fakes
(``tests.support.kafka_fakes``): the refused result is remembered across the abort and dead-lettered
when its input comes back, its neighbours commit, and aborts that teach nothing are bounded.
The same against a real broker: tests/integration/test_refused_records.py.
"""

from __future__ import annotations

import pytest
from confluent_kafka import OFFSET_BEGINNING, KafkaError

from streamproc.errors import FatalPipelineError
from streamproc.metrics import Metrics
from streamproc.offsets.guarantees import ExactlyOnce
from streamproc.offsets.tracker import OffsetTracker
from streamproc.offsets.transactions import Transactions
from streamproc.output.headers import H_CLASS, H_OFFSET, H_STAGE, H_VALUE_OMITTED, source_headers
from streamproc.output.producer import ResultsProducer
from streamproc.output.sink import Sink
from streamproc.records import Record
from tests.support.kafka_fakes import FakeConsumer, FakeProducer, Produced, kafka_error
from tests.unit.source_harness import TP, Harness, consume_again, exactly_once

LIMIT = 1000  # the output topic's max.message.bytes
TOO_LARGE = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)


def _broker(produced: Produced) -> KafkaError | None:
    """The broker's verdict: a record over LIMIT is refused (its whole record batch)."""
    return TOO_LARGE if len(produced.value or b"") > LIMIT else None


class EosSink:
    """An exactly-once sink over a fake transactional producer whose broker refuses records
    over LIMIT bytes; the output topic's limit is known, the producer compresses."""

    def __init__(self, n: int) -> None:
        self.tracker = OffsetTracker()
        self.metrics = Metrics()
        self.producer = FakeProducer(judge=_broker)
        self.guarantee = ExactlyOnce(self.tracker, self.metrics, Transactions(self.producer))
        self.fatal: list[BaseException] = []
        results = ResultsProducer(
            self.producer, {"compression.type": "lz4"}, self.metrics, self.fatal.append
        )
        self.sink = Sink(results, self.guarantee, self.metrics, self.fatal.append)
        self.sink.set_topic_limits({"out": LIMIT})
        self.consumer = FakeConsumer({})
        self.n = n

    def consume(self) -> list[Record]:
        return consume_again(self.tracker, self.n)

    def send(self, records: list[Record], big: set[int]) -> None:
        values = [b"x" * 2 * LIMIT if r.offset in big else b"r%d" % r.offset for r in records]
        headers = [list(source_headers(r)) for r in records]
        self.sink.send_results("out", records, values, headers, "in.dlq")

    def commit(self) -> bool:
        return self.guarantee.committer.commit(self.consumer, synchronous=True)

    def aborts(self) -> float | None:
        return self.metrics.registry.get_sample_value(
            "streamproc_transaction_aborts_total", {"reason": "MSG_SIZE_TOO_LARGE"}
        )


def test_a_result_refused_in_its_own_record_batch_is_dead_lettered_after_the_abort() -> None:
    h = EosSink(4)
    h.send(h.consume(), big={1})
    # the result over the topic's limit went alone: the queue flushed before it (r0 reported),
    # its own report awaited after it (refused: the transaction failed, so r2 and r3 were
    # refused with _STATE before sending)
    assert [p.value for p in h.producer.delivered] == [b"r0"]
    assert h.producer.pending == [] and h.guarantee.failed()
    assert len(h.guarantee.refusals) == 1
    assert h.commit() is False
    assert h.producer.calls[-2:] == ["commit_transaction", "abort_transaction"]
    assert h.aborts() == 1 and not h.guarantee.failed()
    # the partitions rewind and the same inputs come back, the same result among them
    h.send(h.consume(), big={1})
    dead = [p for p in h.producer.pending if p.topic == "in.dlq"]
    assert [dict(p.headers)[H_OFFSET] for p in dead] == [b"1"]
    assert dict(dead[0].headers)[H_STAGE] == b"produce"
    assert dict(dead[0].headers)[H_CLASS] == b"KafkaError.MSG_SIZE_TOO_LARGE"
    assert dead[0].value == b"in1"  # the input's value, not the oversized result
    assert sorted(p.value for p in h.producer.pending if p.topic == "out") == [b"r0", b"r2", b"r3"]
    assert h.commit() is True and h.aborts() == 1
    assert h.tracker.watermarks([TP]) == {TP: 4}  # every offset committed, the refused one too
    assert len(h.guarantee.refusals) == 0  # settled: forgotten at the commit
    assert not h.fatal


def test_results_refused_in_a_shared_record_batch_go_alone_then_only_the_culprit_is_dead() -> None:
    # The broker refused a record batch of four (one record too large, judged as a batch):
    # all four are suspects. Next time each goes alone; only the one refused alone is at fault.
    h = EosSink(4)
    h.sink.set_topic_limits({})  # the topic's limit unknown: no record is at risk up front
    h.send(h.consume(), big={2})
    h.producer.deliver(error=TOO_LARGE)  # one record batch, refused whole
    assert len(h.guarantee.refusals) == 4
    assert h.commit() is False
    h.send(h.consume(), big={2})  # each suspect alone: three accepted, one refused
    assert not [p for p in h.producer.pending if p.topic == "in.dlq"]
    assert h.commit() is False
    h.producer.delivered.clear()
    h.send(h.consume(), big={2})  # the suspects still go alone (flushed): look at everything
    produced = h.producer.delivered + h.producer.pending
    (dead,) = [p for p in produced if p.topic == "in.dlq"]
    assert dict(dead.headers)[H_OFFSET] == b"2"
    assert sorted(p.value for p in produced if p.topic == "out") == [b"r0", b"r1", b"r3"]
    assert h.commit() is True and h.tracker.watermarks([TP]) == {TP: 4}
    assert h.aborts() == 2 and not h.fatal


def test_a_result_over_the_limit_uncompressed_is_dead_lettered_without_an_abort() -> None:
    h = EosSink(3)
    results = ResultsProducer(h.producer, {"compression.type": "none"}, h.metrics, h.fatal.append)
    h.sink = Sink(results, h.guarantee, h.metrics, h.fatal.append)
    h.sink.set_topic_limits({"out": LIMIT})
    h.send(h.consume(), big={0})
    (dead,) = [p for p in h.producer.pending if p.topic == "in.dlq"]
    assert dict(dead.headers)[H_OFFSET] == b"0"
    assert b"too large" in dict(dead.headers)["streamproc.error.message"].lower()
    assert not [p for p in h.producer.pending if p.topic == "out" and p.value == b"x" * 2 * LIMIT]
    assert h.commit() is True and h.tracker.watermarks([TP]) == {TP: 3} and h.aborts() is None


def test_a_dead_letter_record_refused_as_too_large_goes_again_without_its_value_then_stops() -> (
    None
):
    h = EosSink(1)
    (record,) = h.consume()
    # its dead-letter record was refused inside the transaction (which then aborts)
    assert h.guarantee.refused(record, TOO_LARGE, "alone", dead_letter=True) == "abort"
    (record,) = h.consume()  # after the rewind
    h.sink.dead_letter(record, "in.dlq", "decode", "DecodeError", "bad")
    (dead,) = h.producer.pending
    assert dead.value is None and dict(dead.headers)[H_VALUE_OMITTED] == b"3"
    # refused again without its value: nothing left to leave out; the pipeline stops
    h.producer.pending.clear()
    dead.report(TOO_LARGE)
    assert len(h.fatal) == 1 and isinstance(h.fatal[0], FatalPipelineError)
    assert "in[0]@0" in str(h.fatal[0]) and "in.dlq" in str(h.fatal[0])


def test_fruitless_aborts_are_bounded_and_the_error_names_the_offsets() -> None:
    # A transaction that aborts for a reason no record is to blame for (here a delivery
    # timeout), again and again: after kafka.max_transaction_aborts (5) in a row the source
    # stops with an error naming the offsets and the error, and commits nothing after that.
    producer = FakeProducer()
    h = Harness(4, guarantee=exactly_once(producer))
    h.consumer.schedule_assign([TP])
    timed_out = kafka_error(KafkaError._MSG_TIMED_OUT, txn_requires_abort=True)
    for abort in range(1, 6):
        h.poll()
        for record in h.cut().records:
            assert h.guarantee.send(record, lambda: None)
        producer.fail_next("commit_transaction", timed_out)
        if abort < 5:
            h.poll(advance_s=1.5)  # abort, rewind to the beginning (nothing committed yet)
            assert h.consumer.calls_named("seek")[-1] == (TP, OFFSET_BEGINNING)
            continue
        with pytest.raises(FatalPipelineError) as raised:
            h.source.poll_until(lambda: bool(h.clock.advance(1.5)))
    message = str(raised.value)
    assert "aborted 5 times in a row" in message and "in[0] below 4" in message
    assert "_MSG_TIMED_OUT" in message and "kafka.max_transaction_aborts" in message
    assert (
        h.metrics.registry.get_sample_value(
            "streamproc_transaction_aborts_total", {"reason": "_MSG_TIMED_OUT"}
        )
        == 5
    )
    # the closing commit must not commit the aborted transaction's offsets
    calls = len(producer.calls)
    with pytest.raises(FatalPipelineError):
        h.guarantee.committer.commit(h.consumer, synchronous=True)
    assert "commit_transaction" not in producer.calls[calls:]
    assert h.consumer.committed_offsets == {}


def test_aborts_that_teach_something_are_not_fruitless() -> None:
    producer = FakeProducer()
    h = Harness(4, guarantee=exactly_once(producer))
    assert isinstance(h.guarantee, ExactlyOnce)
    h.consumer.schedule_assign([TP])
    too_large = kafka_error(KafkaError.MSG_SIZE_TOO_LARGE, txn_requires_abort=True)
    for attempt in range(8):  # more aborts than the bound, each learning something
        h.poll()
        records = h.cut().records
        for record in records:
            assert h.guarantee.send(record, lambda: None)
        # a suspect (refused in a shared record batch), later the same one refused alone
        h.guarantee.refusals.refused(records[attempt % 4], TOO_LARGE, attempt >= 4, False)
        producer.fail_next("commit_transaction", too_large)
        h.poll(advance_s=1.5)  # raises if the bound were hit
    assert producer.calls.count("abort_transaction") == 8


def test_between_an_abort_and_the_rewind_no_aborted_work_joins_the_next_transaction() -> None:
    # A result of the aborted work produced into the next transaction would be produced once
    # more after the rewind: a duplicate once both commit. The pipeline must not look idle
    # meanwhile either (its done offsets are not committed).
    producer = FakeProducer()
    h = Harness(4, guarantee=exactly_once(producer))
    h.consumer.schedule_assign([TP])
    h.poll()
    records = h.cut().records
    assert h.guarantee.send(records[0], lambda: None)
    producer.fail_next(
        "commit_transaction", kafka_error(KafkaError._MSG_TIMED_OUT, txn_requires_abort=True)
    )
    assert h.guarantee.committer.commit(h.consumer, synchronous=False) is False  # not rewound
    assert h.guarantee.send(records[1], lambda: None) is False
    assert producer.calls.count("begin_transaction") == 1  # no new transaction for it
    assert h.tracker.commit_candidates() == {TP: 1}
