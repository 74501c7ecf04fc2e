"""The committers over the fake consumer and producer (``tests.support.kafka_fakes``); how
the source drives them through rebalances and rewinds is in tests/unit/intake/test_source.py."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError
from confluent_kafka import TopicPartition as KafkaTopicPartition

from streamproc.errors import FatalPipelineError
from streamproc.metrics import Metrics
from streamproc.offsets.committers import AtLeastOnceCommitter, TransactionalCommitter
from streamproc.offsets.refusals import Refusals
from streamproc.offsets.tracker import OffsetTracker
from streamproc.offsets.transactions import Transactions
from streamproc.records import TopicPartition
from tests.support.kafka_fakes import FakeConsumer, FakeProducer, kafka_error

A, B = TopicPartition("in", 0), TopicPartition("in", 1)


def _tracker(done: dict[TopicPartition, int]) -> OffsetTracker:
    """A tracker whose partitions consumed and finished offsets ``0 .. done[tp] - 1``."""
    tracker = OffsetTracker()
    generations = tracker.assign(done)
    for tp, count in done.items():
        for offset in range(count):
            tracker.consumed(tp, offset)
            tracker.done(tp, offset, generations[tp])
    return tracker


def _value(metrics: Metrics, name: str) -> float:
    return metrics.registry.get_sample_value(name) or 0.0


def test_at_least_once_commits_moved_watermarks_of_the_partitions_asked_for() -> None:
    tracker, metrics, consumer = _tracker({A: 3, B: 5}), Metrics(), FakeConsumer({})
    committer = AtLeastOnceCommitter(tracker, metrics)
    assert committer.commit(consumer, synchronous=True, only={A})
    assert consumer.committed_offsets == {A: 3}
    assert committer.commit(consumer, synchronous=True)
    assert consumer.calls_named("commit") == [{A: 3}, {B: 5}]  # A had not moved since
    assert _value(metrics, "streamproc_commits_total") == 2


def test_at_least_once_retries_a_failed_asynchronous_commit_next_cycle() -> None:
    tracker, metrics, consumer = _tracker({A: 2}), Metrics(), FakeConsumer({})
    committer = AtLeastOnceCommitter(tracker, metrics)
    assert committer.commit(consumer, synchronous=False)
    failed = KafkaTopicPartition(A.topic, A.partition, 2)
    committer.on_commit(KafkaError(KafkaError.REBALANCE_IN_PROGRESS), [failed])
    assert _value(metrics, "streamproc_commit_failures_total") == 1
    assert tracker.commit_candidates() == {A: 2}  # forgotten: committed again next cycle
    assert committer.commit(consumer, synchronous=False)
    assert consumer.calls_named("commit") == [{A: 2}, {A: 2}]


def _transactional(producer: FakeProducer, max_aborts: int) -> TransactionalCommitter:
    tracker = _tracker({A: 4})
    return TransactionalCommitter(
        tracker, Metrics(), Transactions(producer), Refusals(), max_aborts=max_aborts
    )


def test_transactional_commits_the_watermarks_with_the_transaction() -> None:
    producer = FakeProducer()
    committer = _transactional(producer, max_aborts=5)
    assert committer.commit(FakeConsumer({}), synchronous=False)
    assert producer.calls[-2:] == ["send_offsets_to_transaction", "commit_transaction"]


def test_transactional_stops_after_max_aborts_that_teach_nothing() -> None:
    producer = FakeProducer()
    committer = _transactional(producer, max_aborts=2)
    abort = kafka_error(KafkaError._TIMED_OUT, txn_requires_abort=True)
    producer.fail_next("commit_transaction", abort, abort)
    assert committer.commit(FakeConsumer({}), synchronous=False) is False  # rewind
    with pytest.raises(FatalPipelineError, match="aborted 2 times in a row"):
        committer.commit(FakeConsumer({}), synchronous=False)
    with pytest.raises(FatalPipelineError):  # never commits after giving up
        committer.commit(FakeConsumer({}), synchronous=False)
    assert producer.calls[-1] == "abort_transaction"
