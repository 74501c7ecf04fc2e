"""The transactional producer's state (``streamproc.offsets.transactions``) over the in-package
fake producer: begin / produce / send_offsets / commit in that order, retries of retriable
errors, abort on abortable ones, stop on ownership errors, and a fresh producer for any other
fatal error or a failed abort.
"""

from __future__ import annotations

import threading

import pytest
from confluent_kafka import KafkaError

from streamproc.errors import FatalPipelineError
from streamproc.kafka.protocols import ProducerClient
from streamproc.offsets.transactions import Transactions, WedgedCall, bounded
from streamproc.records import TopicPartition
from tests.support.kafka_fakes import kafka_error
from tests.unit.fakes import OffsetsProducer

TP = TopicPartition("in", 0)
OFFSETS = {TP: 5}
META = "group-metadata"
ABORTABLE = kafka_error(KafkaError._MSG_TIMED_OUT, txn_requires_abort=True)


class Renewals:
    """The ``renew`` hook: hands out fresh fake producers and keeps them."""

    def __init__(self) -> None:
        self.fresh: list[OffsetsProducer] = []

    def __call__(self) -> ProducerClient:
        self.fresh.append(OffsetsProducer())
        return self.fresh[-1]


@pytest.fixture
def producer() -> OffsetsProducer:
    return OffsetsProducer()


@pytest.fixture
def renewals() -> Renewals:
    return Renewals()


@pytest.fixture
def txn(producer: OffsetsProducer, renewals: Renewals) -> Transactions:
    return Transactions(producer, timeout_s=1.0, max_attempts=3, renew=renewals)


def _produce(txn: Transactions, producer: OffsetsProducer) -> None:
    txn.produce(producer.produce, "out", b"r")


def _delivery_failed(txn: Transactions, err: KafkaError) -> None:
    """A delivery report failed inside the open transaction (the guarantee notes it so)."""
    txn.failed = err


def test_the_producer_is_initialised_once_and_a_transaction_begins_with_the_first_record(
    txn: Transactions, producer: OffsetsProducer
) -> None:
    assert producer.calls == ["init_transactions"]  # fences an older instance at once
    _produce(txn, producer)
    _produce(txn, producer)
    assert txn.produce_many(lambda rows: [rows[-1]], [0, 1]) == [1]  # the refused rows
    assert producer.calls == ["init_transactions", "begin_transaction", "produce", "produce"]


@pytest.mark.parametrize(
    ("produced", "offsets", "expected"),
    [
        (False, {}, []),  # nothing to commit: no transaction at all
        (
            False,
            OFFSETS,
            ["begin_transaction", "send_offsets_to_transaction", "commit_transaction"],
        ),
        (True, {}, ["begin_transaction", "produce", "commit_transaction"]),
        (
            True,
            OFFSETS,
            ["begin_transaction", "produce", "send_offsets_to_transaction", "commit_transaction"],
        ),
    ],
    ids=["nothing", "offsets-only", "records-only", "records-and-offsets"],
)
def test_commit_sends_the_offsets_into_the_transaction_before_committing_it(
    txn: Transactions,
    producer: OffsetsProducer,
    produced: bool,
    offsets: dict[TopicPartition, int],
    expected: list[str],
) -> None:
    if produced:
        _produce(txn, producer)
    assert txn.commit(offsets, META) is True
    assert producer.calls[1:] == expected
    assert producer.sent_offsets == ([(OFFSETS, META)] if offsets else [])
    assert txn.commits == (1 if expected else 0)


def test_the_next_record_after_a_commit_begins_a_new_transaction(
    txn: Transactions, producer: OffsetsProducer
) -> None:
    _produce(txn, producer)
    assert txn.commit(OFFSETS, META)
    _produce(txn, producer)
    assert producer.calls.count("begin_transaction") == 2
    assert producer.calls[-2:] == ["begin_transaction", "produce"]


@pytest.mark.parametrize("method", ["send_offsets_to_transaction", "commit_transaction"])
def test_a_retriable_error_is_retried_and_the_transaction_aborts_once_the_tries_are_spent(
    txn: Transactions, producer: OffsetsProducer, method: str
) -> None:
    _produce(txn, producer)
    busy = kafka_error(KafkaError.COORDINATOR_LOAD_IN_PROGRESS, retriable=True)
    producer.fail_next(method, busy, busy, busy)  # max_attempts 3
    assert txn.commit(OFFSETS, META) is False
    assert producer.calls.count(method) == 3
    assert producer.calls[-1] == "abort_transaction"
    assert txn.aborts == 1 and txn.commits == 0
    assert txn.abort_reason == "COORDINATOR_LOAD_IN_PROGRESS"


def test_an_abortable_error_aborts_at_once_and_clears_the_transaction_state(
    txn: Transactions, producer: OffsetsProducer
) -> None:
    _produce(txn, producer)
    _delivery_failed(txn, ABORTABLE)
    producer.fail_next("commit_transaction", ABORTABLE)
    assert txn.commit(OFFSETS, META) is False
    assert producer.calls[-2:] == ["commit_transaction", "abort_transaction"]  # no retry
    assert txn.abort_error is ABORTABLE and txn.abort_reason == "_MSG_TIMED_OUT"
    assert txn.failed is None and txn.must_abort is None
    _produce(txn, producer)
    assert producer.calls[-2:] == ["begin_transaction", "produce"]


def test_a_transaction_with_a_missing_record_is_aborted_not_committed(
    txn: Transactions, producer: OffsetsProducer
) -> None:
    _produce(txn, producer)
    txn.must_abort = kafka_error(KafkaError._QUEUE_FULL)  # refused before sending, not its fault
    assert txn.commit(OFFSETS, META) is False
    assert "send_offsets_to_transaction" not in producer.calls
    assert "commit_transaction" not in producer.calls
    assert producer.calls[-1] == "abort_transaction" and txn.abort_reason == "_QUEUE_FULL"


@pytest.mark.parametrize(
    "code",
    [
        KafkaError._FENCED,
        KafkaError.PRODUCER_FENCED,
        KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    ],
)
def test_an_ownership_error_stops_the_pipeline_and_is_never_replaced(
    txn: Transactions, producer: OffsetsProducer, renewals: Renewals, code: int
) -> None:
    _produce(txn, producer)
    producer.fail_next("commit_transaction", kafka_error(code, fatal=True))
    with pytest.raises(FatalPipelineError, match=r"transactional\.id"):
        txn.commit(OFFSETS, META)
    assert renewals.fresh == []  # a fresh producer would fence the rightful owner


def test_any_other_fatal_error_replaces_the_producer_and_counts_as_an_abort(
    txn: Transactions, producer: OffsetsProducer, renewals: Renewals
) -> None:
    _produce(txn, producer)
    producer.fail_next("commit_transaction", kafka_error(KafkaError.INVALID_TXN_STATE, fatal=True))
    assert txn.commit(OFFSETS, META) is False
    (fresh,) = renewals.fresh
    assert fresh.calls == ["init_transactions"]  # fences the old one, aborts its transaction
    assert txn.renewals == 1 and txn.aborts == 1 and txn.abort_reason == "INVALID_TXN_STATE"
    calls_before = list(producer.calls)
    txn.produce(fresh.produce, "out", b"r")
    assert txn.commit(OFFSETS, META) is True
    assert fresh.calls[1:] == [
        "begin_transaction",
        "produce",
        "send_offsets_to_transaction",
        "commit_transaction",
    ]
    assert producer.calls == calls_before  # the old producer is never called again


def test_a_fatal_error_without_a_replacement_stops_the_pipeline(producer: OffsetsProducer) -> None:
    txn = Transactions(producer, timeout_s=1.0)
    _produce(txn, producer)
    producer.fail_next("commit_transaction", kafka_error(KafkaError.INVALID_TXN_STATE, fatal=True))
    with pytest.raises(FatalPipelineError, match="transactional producer failed"):
        txn.commit(OFFSETS, META)


def test_a_fatal_error_raised_from_poll_is_acted_on_at_the_next_commit(
    txn: Transactions, producer: OffsetsProducer, renewals: Renewals
) -> None:
    _produce(txn, producer)
    txn.producer_error(kafka_error(KafkaError.INVALID_TXN_STATE, fatal=True))
    assert txn.failed is not None  # nothing more goes into the transaction
    assert txn.commit(OFFSETS, META) is False
    assert "commit_transaction" not in producer.calls and len(renewals.fresh) == 1
    assert txn.fatal_error is None and txn.failed is None


def test_a_retriable_abort_error_is_retried_and_the_producer_kept(
    txn: Transactions, producer: OffsetsProducer, renewals: Renewals
) -> None:
    _produce(txn, producer)
    producer.fail_next("commit_transaction", ABORTABLE)
    producer.fail_next("abort_transaction", kafka_error(KafkaError._TIMED_OUT, retriable=True))
    assert txn.commit(OFFSETS, META) is False
    assert producer.calls.count("abort_transaction") == 2
    assert txn.aborts == 1 and renewals.fresh == []


def test_an_abort_that_fails_replaces_the_producer_with_the_commit_error_as_reason(
    txn: Transactions, producer: OffsetsProducer, renewals: Renewals
) -> None:
    _produce(txn, producer)
    producer.fail_next("commit_transaction", ABORTABLE)
    producer.fail_next("abort_transaction", kafka_error(KafkaError.INVALID_TXN_STATE))
    assert txn.commit(OFFSETS, META) is False
    assert len(renewals.fresh) == 1 and txn.abort_reason == "_MSG_TIMED_OUT"


def test_abort_at_stop_aborts_only_an_open_transaction(
    txn: Transactions, producer: OffsetsProducer
) -> None:
    txn.abort()
    assert producer.calls == ["init_transactions"] and txn.aborts == 0
    _produce(txn, producer)
    txn.abort()
    assert producer.calls[-1] == "abort_transaction" and txn.aborts == 1
    txn.abort()  # nothing open any more
    assert producer.calls.count("abort_transaction") == 1


def test_bounded_returns_the_result_raises_the_error_or_judges_the_call_wedged() -> None:
    def refuse() -> None:
        raise ValueError("refused")

    assert bounded("answer", lambda: 42, 5.0) == 42
    with pytest.raises(ValueError, match="refused"):
        bounded("refuse", refuse, 5.0)
    release = threading.Event()
    try:
        with pytest.raises(WedgedCall, match="send_offsets_to_transaction did not return"):
            bounded("send_offsets_to_transaction", release.wait, 0.01)
    finally:
        release.set()  # the call goes on running: let its thread end
