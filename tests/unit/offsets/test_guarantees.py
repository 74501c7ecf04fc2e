"""The processing guarantees (``streamproc.offsets.guarantees``) over the fakes:
at-least-once commits an input only after its result's delivery report and never past a gap;
exactly-once puts results and input offsets in one transaction, drops the work of an assignment
that is gone, and sorts refused records into recover / abort / fatal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from confluent_kafka import KafkaError

from streamproc.config.sections import PipelineConfig
from streamproc.kafka.protocols import ktp
from streamproc.metrics import Metrics
from streamproc.offsets.committers import AtLeastOnceCommitter, TransactionalCommitter
from streamproc.offsets.guarantees import NO_PLAN, AtLeastOnce, ExactlyOnce, Handling, How, Plan
from streamproc.offsets.outcomes import Produced
from streamproc.offsets.tracker import OffsetTracker
from streamproc.offsets.transactions import Transactions
from streamproc.records import Record, TopicPartition
from tests.support.kafka_fakes import GROUP_METADATA, FakeConsumer, FakeProducer, kafka_error
from tests.unit.fakes import OffsetsProducer, make_records

TP = TopicPartition("in", 0)
TOO_LARGE = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)


class Inputs:
    """A tracker with ``TP`` assigned and ``n`` of its records consumed, a fake consumer, and
    a fake producer for the results."""

    def __init__(self, n: int, producer: FakeProducer | None = None) -> None:
        self.tracker = OffsetTracker()
        self.metrics = Metrics()
        self.consumer = FakeConsumer({})
        self.producer = producer or FakeProducer()
        self.records = self.consume(n)

    def consume(self, n: int) -> list[Record]:
        """A fresh assignment of ``TP`` and its inputs 0..n-1."""
        self.tracker.revoke([TP])
        generation = self.tracker.assign([TP])[TP]
        records = make_records(TP, range(n), generation)
        self.tracker.consumed_many(records)
        return records

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels or {})


# -- at-least-once ---------------------------------------------------------------------------
@pytest.fixture
def alo() -> tuple[Inputs, AtLeastOnce]:
    inputs = Inputs(3)
    return inputs, AtLeastOnce(inputs.tracker, inputs.metrics)


@dataclass
class RecordingRows:
    """A :class:`RowProducer` that records each call and refuses ``refused`` rows."""

    refused: Sequence[int] = ()
    calls: list[list[int]] = field(default_factory=list)

    def produce_rows(self, rows: Sequence[int]) -> Sequence[int]:
        self.calls.append(list(rows))
        return self.refused


def _send_acknowledged(inputs: Inputs, guarantee: AtLeastOnce, record: Record) -> bool:
    """Produce ``record``'s result; its delivery report acknowledges it (as the sink does)."""

    def produce(rec: Record) -> None:
        def report(err: KafkaError | None, _message: object) -> None:
            if err is None:
                guarantee.acknowledged([rec])

        inputs.producer.produce("out", b"r", on_delivery=report)

    return guarantee.send(record, produce, record)


def test_at_least_once_commits_an_input_only_after_its_report_and_never_past_a_gap(
    alo: tuple[Inputs, AtLeastOnce],
) -> None:
    inputs, guarantee = alo
    assert all(_send_acknowledged(inputs, guarantee, r) for r in inputs.records)
    assert len(inputs.producer.pending) == 3  # produced at once

    def commit() -> dict[TopicPartition, int]:
        guarantee.committer.commit(inputs.consumer, synchronous=True)
        return inputs.consumer.committed_offsets

    assert commit() == {TP: 0}  # no report yet: nothing is done
    first, second, third = inputs.producer.pending
    second.report()
    third.report()
    assert commit() == {TP: 0}  # offset 0 is still unacknowledged: a gap
    first.report()
    assert commit() == {TP: 3}


def test_at_least_once_results_of_a_lost_assignment_are_produced_but_never_committed(
    alo: tuple[Inputs, AtLeastOnce],
) -> None:
    inputs, guarantee = alo
    old = inputs.records
    inputs.consume(3)  # re-assigned: a new generation
    assert _send_acknowledged(inputs, guarantee, old[0])  # produced: a duplicate is allowed
    inputs.producer.deliver()
    assert inputs.tracker.late_results == 1
    assert inputs.tracker.commit_candidates() == {TP: 0}


def test_at_least_once_leaves_refusals_to_the_sink_and_keeps_no_transaction(
    alo: tuple[Inputs, AtLeastOnce],
) -> None:
    inputs, guarantee = alo
    assert guarantee.name == "at_least_once" and guarantee.consumer_settings == {}
    assert isinstance(guarantee.committer, AtLeastOnceCommitter)
    record = inputs.records[0]
    for how in ("local", "alone", "batch"):
        for dead_letter in (False, True):
            assert guarantee.refused(record, TOO_LARGE, how, dead_letter) == "recover"
    assert guarantee.plan(inputs.records, at_risk={1}) is NO_PLAN
    assert guarantee.remembered(record) is None and not guarantee.failed()
    assert guarantee.producer_error(kafka_error(KafkaError._FATAL, fatal=True)) is False


def test_at_least_once_produces_a_whole_batch_in_one_call(
    alo: tuple[Inputs, AtLeastOnce],
) -> None:
    inputs, guarantee = alo
    rows = RecordingRows()
    assert guarantee.send_batch(inputs.records, rows) == ()
    assert rows.calls == [[0, 1, 2]]
    assert inputs.tracker.pending(TP) == 3  # done only on the delivery reports


def test_an_asynchronous_commit_reported_failed_is_retried_on_the_next_cycle(
    alo: tuple[Inputs, AtLeastOnce],
) -> None:
    inputs, guarantee = alo
    inputs.tracker.done_many(inputs.records)
    committer = guarantee.committer
    committer.commit(inputs.consumer, synchronous=False)
    committer.on_commit(KafkaError(KafkaError.REBALANCE_IN_PROGRESS), [ktp(TP, 3)])
    assert inputs.sample("streamproc_commit_failures_total") == 1
    committer.commit(inputs.consumer, synchronous=False)  # the same offsets again
    assert inputs.consumer.calls_named("commit") == [{TP: 3}, {TP: 3}]
    committer.on_commit(None, [ktp(TP, 3)])
    assert inputs.sample("streamproc_commits_total") == 1
    committer.commit(inputs.consumer, synchronous=False)
    assert len(inputs.consumer.calls_named("commit")) == 2  # nothing moved since


# -- exactly-once ----------------------------------------------------------------------------
@pytest.fixture
def eos() -> tuple[Inputs, ExactlyOnce, OffsetsProducer]:
    producer = OffsetsProducer()
    inputs = Inputs(3, producer)
    return inputs, ExactlyOnce(inputs.tracker, inputs.metrics, Transactions(producer)), producer


def _send(guarantee: ExactlyOnce, producer: FakeProducer, record: Record) -> bool:
    return guarantee.send(record, producer.produce, "out", b"r%d" % record.offset)


def test_exactly_once_commits_results_and_their_offsets_in_one_transaction(
    eos: tuple[Inputs, ExactlyOnce, OffsetsProducer],
) -> None:
    inputs, guarantee, producer = eos
    assert guarantee.consumer_settings == {"isolation.level": "read_committed"}
    assert isinstance(guarantee.committer, TransactionalCommitter)
    assert all(_send(guarantee, producer, r) for r in inputs.records)
    assert inputs.tracker.commit_candidates() == {TP: 3}  # done once in the transaction
    assert guarantee.committer.commit(inputs.consumer, synchronous=False) is True
    assert producer.calls == [
        "init_transactions",
        "begin_transaction",
        "produce",
        "produce",
        "produce",
        "send_offsets_to_transaction",
        "commit_transaction",
    ]
    assert producer.sent_offsets == [({TP: 3}, GROUP_METADATA)]
    assert inputs.consumer.calls_named("commit") == []  # the consumer commits nothing itself
    assert inputs.sample("streamproc_commits_total") == 1
    assert guarantee.committer.commit(inputs.consumer, synchronous=False) is True
    assert producer.calls.count("commit_transaction") == 1  # nothing new: no transaction


def test_exactly_once_drops_a_result_whose_assignment_is_gone(
    eos: tuple[Inputs, ExactlyOnce, OffsetsProducer],
) -> None:
    inputs, guarantee, producer = eos
    old = inputs.records[0]
    inputs.consume(3)
    assert _send(guarantee, producer, old) is False
    assert producer.calls == ["init_transactions"]  # nothing produced, no transaction begun
    assert inputs.tracker.late_results == 1


def test_exactly_once_batch_marks_done_only_the_rows_produced(
    eos: tuple[Inputs, ExactlyOnce, OffsetsProducer],
) -> None:
    inputs, guarantee, producer = eos
    gone = make_records(TopicPartition("in", 1), [0], generation=99)  # not assigned
    batch = [*inputs.records, *gone]
    rows = RecordingRows(refused=[1])  # the producer refused row 1 before sending
    assert list(guarantee.send_batch(batch, rows)) == [3]
    assert rows.calls == [[0, 1, 2]] and producer.calls[-1] == "begin_transaction"
    assert inputs.tracker.commit_candidates() == {TP: 1}  # never past the refused row


def test_an_aborted_commit_ends_the_generations_and_counts_the_reason(
    eos: tuple[Inputs, ExactlyOnce, OffsetsProducer],
) -> None:
    inputs, guarantee, producer = eos
    assert _send(guarantee, producer, inputs.records[0])
    producer.fail_next(
        "commit_transaction", kafka_error(KafkaError._MSG_TIMED_OUT, txn_requires_abort=True)
    )
    assert guarantee.committer.commit(inputs.consumer, synchronous=True) is False
    assert producer.calls[-1] == "abort_transaction"
    assert not inputs.tracker.is_current(TP, inputs.records[0].generation)  # rewind follows
    assert inputs.sample("streamproc_transaction_aborts_total", {"reason": "_MSG_TIMED_OUT"}) == 1
    assert inputs.sample("streamproc_commit_failures_total") == 1
    assert producer.sent_offsets == [({TP: 1}, GROUP_METADATA)]  # sent, then aborted


@pytest.mark.parametrize(
    ("code", "how", "dead_letter", "handling", "failed", "must_abort", "remembered"),
    [
        # refused by the producer for its own sake: nothing sent, dead-letter it now
        (KafkaError.MSG_SIZE_TOO_LARGE, "local", False, "recover", False, False, None),
        # refused by the producer for another reason: a gap; abort rather than commit it
        (KafkaError._MSG_TIMED_OUT, "local", False, "abort", False, True, None),
        # refused by the broker alone: at fault, dead-lettered when it comes back
        (KafkaError.MSG_SIZE_TOO_LARGE, "alone", False, "abort", True, False, True),
        # refused in a record batch it may have shared: a suspect, sent alone next time
        (KafkaError.MSG_SIZE_TOO_LARGE, "batch", False, "abort", True, False, False),
        # collateral: the transaction fails, nothing is remembered
        (KafkaError._MSG_TIMED_OUT, "batch", False, "abort", True, False, None),
        (KafkaError._STATE, "local", False, "abort", True, False, None),
        # purged by the abort: says nothing of the open transaction
        (KafkaError._PURGE_QUEUE, "batch", False, "abort", False, False, None),
        # a dead-letter record refused for a reason other than its size: nowhere left
        (KafkaError.INVALID_RECORD, "alone", True, "fatal", True, False, None),
        # a dead-letter record too large: sent again without its value
        (KafkaError.MSG_SIZE_TOO_LARGE, "alone", True, "abort", True, False, True),
    ],
)
def test_exactly_once_sorts_refused_records_into_recover_abort_or_fatal(
    eos: tuple[Inputs, ExactlyOnce, OffsetsProducer],
    code: int,
    how: How,
    dead_letter: bool,
    handling: Handling,
    failed: bool,
    must_abort: bool,
    remembered: bool | None,
) -> None:
    inputs, guarantee, _ = eos
    record = inputs.records[1]
    assert guarantee.refused(record, KafkaError(code), how, dead_letter) == handling
    assert guarantee.failed() is failed
    assert (guarantee.transactions.must_abort is not None) is must_abort
    refusal = guarantee.remembered(record)
    assert (refusal is None) is (remembered is None)
    if refusal is not None:
        assert refusal.alone is remembered and refusal.omit_value is dead_letter


def test_exactly_once_plans_known_culprits_as_dead_and_suspects_and_risks_alone(
    eos: tuple[Inputs, ExactlyOnce, OffsetsProducer],
) -> None:
    inputs, guarantee, _ = eos
    records = inputs.records
    assert guarantee.plan(records, at_risk=()) is NO_PLAN
    assert guarantee.plan(records, at_risk={2}) == Plan(alone=frozenset({2}))
    guarantee.refusals.refused(records[0], TOO_LARGE, alone=True, dead_letter=False)
    guarantee.refusals.refused(records[1], TOO_LARGE, alone=False, dead_letter=False)
    plan = guarantee.plan(records, at_risk={2})
    assert set(plan.dead) == {0} and plan.dead[0].error == "MSG_SIZE_TOO_LARGE"
    assert plan.alone == {1, 2}
    guarantee.transactions.failed = TOO_LARGE  # it aborts anyway: no record goes alone for risk
    assert guarantee.plan(records, at_risk={2}).alone == {1}


def test_exactly_once_recovers_from_a_fatal_producer_error_at_the_next_commit(
    eos: tuple[Inputs, ExactlyOnce, OffsetsProducer],
) -> None:
    _, guarantee, _ = eos
    err = kafka_error(KafkaError.INVALID_TXN_STATE, fatal=True)
    assert guarantee.producer_error(err) is True
    assert guarantee.failed() and guarantee.transactions.fatal_error is err


def test_exactly_once_counts_what_readers_see_apart_from_aborted_transactions(
    eos: tuple[Inputs, ExactlyOnce, OffsetsProducer],
) -> None:
    # the acknowledgement counters count the records of aborted transactions too: readers
    # with read_committed never see them, so the run's summary counts them apart
    inputs, guarantee, producer = eos
    spec = PipelineConfig(name="p", input_topic="in", output_topic="out", workload="trades")
    rows = RecordingRows(refused=[1])  # row 1 not produced (dead-lettered instead, say)
    guarantee.send_batch(inputs.records, rows)
    assert _send(guarantee, producer, inputs.records[1])  # its dead-letter record
    producer.fail_next(
        "commit_transaction", kafka_error(KafkaError._MSG_TIMED_OUT, txn_requires_abort=True)
    )
    assert guarantee.committer.commit(inputs.consumer, synchronous=True) is False
    assert guarantee.produced(inputs.metrics, spec) == Produced(0, 0, 2, 1)
    records = inputs.consume(3)  # rewound: read again
    guarantee.send_batch(records, RecordingRows())
    assert guarantee.produced(inputs.metrics, spec) == Produced(0, 0, 5, 1)  # open: not seen
    assert guarantee.committer.commit(inputs.consumer, synchronous=True) is True
    assert guarantee.produced(inputs.metrics, spec) == Produced(3, 0, 2, 1)
    assert guarantee.produced(inputs.metrics, spec.model_copy(update={"input_topic": "x"})) == (
        Produced(0, 0)
    )


def test_at_least_once_counts_every_acknowledged_record(alo: tuple[Inputs, AtLeastOnce]) -> None:
    inputs, guarantee = alo
    spec = PipelineConfig(name="p", input_topic="in", output_topic="out", workload="trades")
    inputs.metrics.produced.labels("out").inc(3)
    inputs.metrics.dead_lettered.labels("in", "decode").inc(1)
    inputs.metrics.dead_lettered.labels("in", "model").inc(1)
    inputs.metrics.dead_lettered.labels("other", "model").inc(5)
    assert guarantee.produced(inputs.metrics, spec) == Produced(3, 2)


def test_at_least_once_gives_a_version_switch_no_boundary_to_wait_for(
    alo: tuple[Inputs, AtLeastOnce],
) -> None:
    _, guarantee = alo
    assert guarantee.boundary(lambda: None, 1.0) is None


def test_exactly_once_gives_a_version_switch_the_end_of_the_open_transaction(
    eos: tuple[Inputs, ExactlyOnce, OffsetsProducer],
) -> None:
    inputs, guarantee, producer = eos
    asked: list[str] = []
    waits = guarantee.boundary(lambda: asked.append("commit now"), 0.05)
    assert waits is not None and waits() is True and asked == []  # nothing open
    assert _send(guarantee, producer, inputs.records[0])
    assert waits() is False and asked == ["commit now"]  # open, and nobody commits it
    commits = guarantee.boundary(
        lambda: guarantee.committer.commit(inputs.consumer, synchronous=False), 5.0
    )
    assert commits is not None and commits() is True
    assert producer.calls.count("commit_transaction") == 1
