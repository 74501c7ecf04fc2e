"""The source, its rebalance handler and committers over the fake consumer and producer
(``tests.support.kafka_fakes``): seek-back, rewind, commit retry, revoke with in-flight batches
and late results, without a broker. The same behaviour on a real broker is covered by
tests/integration.
"""

from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import KafkaError

from streamproc.records import Record, TopicPartition
from tests.support.kafka_fakes import FakeProducer, kafka_error
from tests.unit.source_harness import TP, Harness, exactly_once


@pytest.mark.timeout(60)
def test_a_cut_of_fewer_records_than_a_batch_waits_on_the_sources_clock() -> None:
    """Three records, a batch of four: the cut comes at their deadline on the clock that
    stamped them (the harness's fake clock, here a day ahead of the machine's), not when the
    machine's monotonic clock gets there."""
    h = Harness(3, start_s=time.monotonic() + 86_400.0)
    h.consumer.schedule_assign([TP])
    h.poll()
    assert [r.offset for r in h.cut().records] == [0, 1, 2]


def test_a_full_ring_refuses_pauses_and_seeks_back_then_resumes_where_it_stopped() -> None:
    h = Harness(20)
    h.consumer.schedule_assign([TP])
    h.poll()
    assert h.in_ring() == 8
    assert h.consumer.calls_named("seek") == [(TP, 8)]  # the first refused offset
    assert TP in h.consumer.paused and h.source.assignment.flow_paused == {TP}
    assert h.tracker.pending(TP) == 8
    first, second = h.cut(), h.cut()
    assert [r.offset for r in first.records + second.records] == list(range(8))
    assert second.flow.resume == (TP,)  # at the low watermark
    h.poll()
    # resumed with a seek to the refused offset: fetching starts there at once
    assert h.consumer.calls_named("resume")[-1] == [TP]
    # the same poll refilled the ring from there and refused again at 16
    assert h.consumer.calls_named("seek") == [(TP, 8), (TP, 8), (TP, 16)]
    offsets = [r.offset for r in h.cut().records + h.cut().records]
    assert offsets == list(range(8, 16))  # nothing skipped, nothing twice


def test_a_failed_commit_is_retried_with_the_same_offsets_on_the_next_cycle() -> None:
    h = Harness(6)
    h.consumer.schedule_assign([TP])
    h.poll()
    records = h.cut().records
    h.tracker.done_many(records)
    h.consumer.commit_errors.append(KafkaError(KafkaError.REBALANCE_IN_PROGRESS))
    h.poll(advance_s=1.5)  # past the commit interval: the commit fails
    assert h.consumer.calls_named("commit") == [{TP: 4}]
    assert h.consumer.committed_offsets == {}
    assert h.count("streamproc_commit_failures_total") == 1
    h.poll(advance_s=1.5)  # next cycle: the same watermark again
    assert h.consumer.calls_named("commit") == [{TP: 4}, {TP: 4}]
    assert h.consumer.committed_offsets == {TP: 4}
    h.poll(advance_s=1.5)
    assert len(h.consumer.calls_named("commit")) == 2  # nothing moved: nothing to commit


def test_revoke_waits_for_in_flight_batches_then_commits_what_is_done() -> None:
    h = Harness(6)
    h.consumer.schedule_assign([TP])
    h.poll()
    in_flight = h.cut().records  # offsets 0-3 in flight; 4-5 stay in the ring
    revoking = threading.Event()

    def finish_in_flight() -> None:
        # the revoke has dropped the ring (its two records stay pending) and waits
        while TP in h.lane.fill_ratios():
            revoking.wait(0.001)
        h.tracker.done_many(in_flight)

    worker = threading.Thread(target=finish_in_flight)
    worker.start()
    h.consumer.schedule_revoke([TP])
    h.poll()
    worker.join()
    assert h.consumer.calls_named("commit") == [{TP: 4}]  # the in-flight batch made it
    assert h.consumer.calls_named("incremental_unassign") == [[TP]]
    assert h.source.assignment.assigned == frozenset() and h.late == []


def test_results_after_the_revoke_budget_are_late_counted_and_never_committed() -> None:
    h = Harness(6, revoke_timeout_s=0.05)
    h.consumer.schedule_assign([TP])
    h.poll()
    in_flight = h.cut().records
    h.consumer.schedule_revoke([TP])
    h.poll()  # nobody completes the batch: the budget runs out
    commits = h.consumer.calls_named("commit")
    assert commits == [{TP: 0}]  # only what was done: nothing past the in-flight batch
    assert h.tracker.done_many(in_flight) == 0  # the batch completes after all
    assert h.late == [(TP, 4, True)]  # reported as it happens, first for this assignment
    h.poll(advance_s=1.5)
    assert h.consumer.calls_named("commit") == commits  # late results are never committed


def _commit_to_abort(producer: FakeProducer) -> tuple[Harness, list[Record]]:
    """Exactly-once from committed offset 2 of 6: records 2..5 fetched, 2 and 3 sent inside
    the transaction, and the next commit fails so that the transaction aborts."""
    h = Harness(6, guarantee=exactly_once(producer))
    h.consumer.committed_offsets[TP] = 2
    h.consumer.schedule_assign([TP])
    h.poll()
    assert h.consumer.positions[TP] == 6  # 2..5 fetched
    batch = h.cut().records
    assert all(h.guarantee.send(r, lambda: None) for r in batch[:2])  # in the transaction
    producer.fail_next(
        "commit_transaction", kafka_error(KafkaError._FENCED, txn_requires_abort=True)
    )
    return h, batch


def test_an_aborted_transaction_rewinds_to_the_committed_offsets_with_a_new_generation() -> None:
    producer = FakeProducer()
    h, batch = _commit_to_abort(producer)
    old_generation = batch[0].generation
    h.poll(advance_s=1.5)
    assert producer.calls[-1] == "abort_transaction"
    assert h.consumer.calls_named("seek")[-1] == (TP, 2)  # back to the committed offset
    assert h.tracker.generation(TP) != old_generation
    assert h.in_ring() == 0 and h.count("streamproc_commit_failures_total") == 1
    # a result of the aborted generation is not produced, and counted late
    assert h.guarantee.send(batch[2], lambda: None) is False
    assert h.late == [(TP, 1, True)]
    h.poll()
    assert [r.offset for r in h.cut().records] == [2, 3, 4, 5]  # processed again
    assert h.count("streamproc_messages_read_again_total", topic="in") == 4
    assert h.count("streamproc_messages_consumed_total", topic="in") == 4 + 4  # 0-3, then 2-5


def test_the_rewind_after_an_abort_retries_a_coordinator_that_moved() -> None:
    # a stalled broker (the group coordinator): the abort's rewind read the committed offsets
    # while the coordinator moved, got NOT_COORDINATOR and stopped the process (exit 1)
    producer = FakeProducer()
    h, _ = _commit_to_abort(producer)
    h.consumer.committed_errors.extend(
        [kafka_error(KafkaError.NOT_COORDINATOR), kafka_error(KafkaError._TIMED_OUT)]
    )
    h.poll(advance_s=1.5)
    assert producer.calls[-1] == "abort_transaction"
    assert len(h.consumer.calls_named("committed")) == 3  # twice refused, then answered
    assert h.consumer.calls_named("seek")[-1] == (TP, 2)  # back to the committed offset
    h.poll()
    assert [r.offset for r in h.cut().records] == [2, 3, 4, 5]  # processed again


def test_lost_partitions_abort_the_open_transaction_that_holds_their_results() -> None:
    # faults run L (streamproc cut off from the group coordinator's broker for 30 s): the
    # session timed out while the open transaction held results of the lost partition; they
    # stayed in it, the next commit carried them without their offsets, the partition was
    # fetched again from its committed offset: one result twice under read_committed
    producer = FakeProducer()
    h = Harness(6, guarantee=exactly_once(producer))
    h.consumer.schedule_assign([TP])
    h.poll()
    batch = h.cut().records
    assert all(h.guarantee.send(r, lambda: None) for r in batch[:2])  # in the transaction
    h.consumer.schedule_lost([TP])
    h.poll()
    assert producer.calls[-1] == "abort_transaction"  # their results never commit
    assert "commit_transaction" not in producer.calls
    assert h.count("streamproc_transaction_aborts_total", reason="partitions_lost") == 1
    assert h.guarantee.send(batch[2], lambda: None) is False  # a late result is not produced
    h.consumer.schedule_assign([TP])
    h.poll(advance_s=1.5)
    assert [r.offset for r in h.cut().records] == [0, 1, 2, 3]  # fetched again, sent once


def test_lost_partitions_rewind_the_ones_still_assigned_when_their_work_was_aborted() -> None:
    producer = FakeProducer()
    other = TopicPartition("in", 1)
    h = Harness(6, guarantee=exactly_once(producer), partitions=2)
    h.consumer.committed_offsets[other] = 2
    h.consumer.schedule_assign([TP, other])
    h.poll()
    batch = h.cut().records + h.cut().records
    assert {r.tp.partition for r in batch} == {0, 1}  # both partitions' work in the transaction
    assert all(h.guarantee.send(r, lambda: None) for r in batch)
    h.consumer.schedule_lost([TP])
    h.poll()
    assert producer.calls[-1] == "abort_transaction"
    assert h.consumer.calls_named("seek")[-1] == (other, 2)  # its aborted work comes again


def test_a_retriable_send_offsets_error_is_retried_not_fatal() -> None:
    producer = FakeProducer()
    h = Harness(4, guarantee=exactly_once(producer))
    h.consumer.schedule_assign([TP])
    h.poll()
    for record in h.cut().records:
        assert h.guarantee.send(record, lambda: None)
    producer.fail_next(
        "send_offsets_to_transaction",
        kafka_error(KafkaError.CONCURRENT_TRANSACTIONS, retriable=True),
    )
    h.poll(advance_s=1.5)
    assert producer.calls.count("send_offsets_to_transaction") == 2
    assert producer.calls[-1] == "commit_transaction"
    assert (
        h.count("streamproc_commits_total") == 1
        and h.count("streamproc_commit_failures_total") == 0
    )


def test_a_drained_partition_commits_past_the_transaction_marker_after_its_records() -> None:
    # input written by a transactional producer: records 0-2, its commit marker at 3. The
    # commit stopped at 3 (last record + 1): a lag of 1 for ever, so a lag-scaled group never
    # scaled to zero
    h = Harness(4, markers=frozenset({3}))
    h.consumer.schedule_assign([TP])
    h.poll()
    records = h.cut().records
    assert [r.offset for r in records] == [0, 1, 2]
    h.tracker.done_many(records)
    h.poll(advance_s=1.5)
    assert h.consumer.committed_offsets == {TP: 4}  # the end offset: lag 0
    assert h.source.positions() == {TP: 4}


def test_markers_between_records_never_move_the_commit_past_a_record_not_done() -> None:
    h = Harness(7, markers=frozenset({2, 6}))
    h.consumer.schedule_assign([TP])
    h.poll()
    records = h.cut().records
    assert [r.offset for r in records] == [0, 1, 3, 4]
    h.tracker.done_many(records[:2])
    h.poll(advance_s=1.5)
    assert h.consumer.committed_offsets == {TP: 3}  # 3 is not done
    h.tracker.done_many(records[2:] + h.cut().records)
    h.poll(advance_s=1.5)
    assert h.consumer.committed_offsets == {TP: 7}


def test_under_exactly_once_the_transaction_commits_past_the_trailing_marker() -> None:
    producer = FakeProducer()
    h = Harness(3, exactly_once(producer), markers=frozenset({2}))
    h.consumer.schedule_assign([TP])
    h.poll()
    records = h.cut().records
    for record in records:
        assert h.guarantee.send(record, lambda: None)
    producer.deliver()
    h.tracker.done_many(records)
    h.poll(advance_s=1.5)
    assert producer.committed_offsets == {TP: 3}


ABORTED = frozenset(range(6))  # 5 aborted records and their abort marker: nothing to deliver


def test_a_partition_of_only_aborted_records_commits_the_consumer_position() -> None:
    # read_committed delivers nothing from it, so no record ever moved its watermark: the
    # group's committed offset stayed short of the end for ever and --exit-when-idle-s
    # exited 1 on every run
    h = Harness(6, markers=ABORTED)
    h.consumer.schedule_assign([TP])
    h.poll()
    assert h.in_ring() == 0
    h.poll(advance_s=1.5)
    assert h.consumer.committed_offsets == {TP: 6}
    assert h.source.positions() == {TP: 6}


def test_under_exactly_once_an_aborted_only_partition_commits_in_an_offsets_only_transaction() -> (
    None
):
    producer = FakeProducer()
    h = Harness(6, exactly_once(producer), markers=ABORTED)
    h.consumer.schedule_assign([TP])
    h.poll()
    h.poll(advance_s=1.5)
    assert producer.committed_offsets == {TP: 6}
    assert h.consumer.committed_offsets == {}  # not the consumer's own commit


def test_aborted_records_after_committed_ones_commit_the_position_past_them() -> None:
    h = Harness(9, markers=frozenset(range(3, 9)))
    h.consumer.committed_offsets[TP] = 3  # a run before processed 0-2
    h.consumer.schedule_assign([TP])
    h.poll()
    h.poll(advance_s=1.5)
    assert h.consumer.committed_offsets == {TP: 9}


def test_a_position_reported_before_anything_was_read_in_the_generation_is_never_committed() -> (
    None
):
    # a client still reporting the position of an earlier assignment: offsets below it may
    # hold records this generation never saw
    h = Harness(2)
    h.consumer.committed_offsets[TP] = 2  # nothing left to read
    h.consumer.stale_positions[TP] = 5
    h.consumer.schedule_assign([TP])
    h.poll()
    h.poll(advance_s=1.5)
    assert h.consumer.committed_offsets == {TP: 2}
    assert h.source.positions() == {TP: None}


def test_an_untrusted_position_is_still_not_trusted_once_reading_starts() -> None:
    # stale at the generation's start: the stale value and a real one cannot be told apart
    h = Harness(6, markers=ABORTED)
    h.consumer.stale_positions[TP] = 6
    h.consumer.schedule_assign([TP])
    h.poll()
    h.poll(advance_s=1.5)
    assert h.consumer.committed_offsets == {}


def test_a_partition_with_records_in_flight_is_committed_only_up_to_them() -> None:
    # another partition is aborted-only; this one's records are not done
    h = Harness(6, markers=frozenset({4, 5}), partitions=2)
    other = TopicPartition("in", 1)
    h.consumer.markers = {TP: frozenset({4, 5}), other: ABORTED}
    h.consumer.schedule_assign([TP, other])
    h.poll()
    records = h.cut().records
    assert {r.tp for r in records} == {TP}
    h.poll(advance_s=1.5)
    assert h.consumer.committed_offsets == {TP: 0, other: 6}  # 0-3 are not done
    h.tracker.done_many(records)
    h.poll(advance_s=1.5)
    assert h.consumer.committed_offsets == {other: 6, TP: 6}
