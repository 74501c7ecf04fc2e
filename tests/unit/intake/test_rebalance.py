"""The rebalance handler (``streamproc.intake.rebalance``) over the fake consumer:
assign, revoke and lost callbacks, the commit before a revoke, and the rewind after an aborted
transaction. The callbacks are called directly, as librdkafka calls them from ``consume``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

import pytest
import structlog
from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, KafkaError, KafkaException
from confluent_kafka import TopicPartition as KafkaTopicPartition

from streamproc.intake.batcher import Batcher
from streamproc.intake.lane import Lane
from streamproc.intake.rebalance import Assignment, RebalanceHandler, Unassigned
from streamproc.intake.rings import PartitionBuffers
from streamproc.kafka.protocols import ktp
from streamproc.metrics import Metrics
from streamproc.offsets.committers import AtLeastOnceCommitter, Committer
from streamproc.offsets.guarantees import ExactlyOnce
from streamproc.offsets.tracker import OffsetTracker
from streamproc.offsets.transactions import Transactions
from streamproc.records import Record, TopicPartition
from tests.support.kafka_fakes import FakeClock, FakeConsumer, FakeProducer, kafka_error
from tests.unit.fakes import make_records

A = TopicPartition("in", 0)
B = TopicPartition("in", 1)


@dataclass
class Group:
    """A rebalance handler over a fake consumer, one lane for topic ``in`` and a fake clock."""

    revoke_timeout_s: float = 5.0
    auto_offset_reset: str = "earliest"
    exactly_once: bool = False
    clock: FakeClock = field(default_factory=FakeClock)
    rewound: list[None] = field(default_factory=list)
    next_offset: dict[TopicPartition, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tracker = OffsetTracker()
        self.metrics = Metrics()
        self.consumer = FakeConsumer({})
        self.lane = Lane(
            "in",
            PartitionBuffers(8, 0.75, 0.25),
            Batcher(4, 1 << 20, 0.0),
            self.tracker,
            clock=self.clock,
        )
        self.producer = FakeProducer()
        committer: Committer = (
            ExactlyOnce(self.tracker, self.metrics, Transactions(self.producer)).committer
            if self.exactly_once
            else AtLeastOnceCommitter(self.tracker, self.metrics)
        )
        self.handler = RebalanceHandler(
            {"in": self.lane},
            self.tracker,
            committer,
            Assignment(self.clock),
            self.metrics,
            self.revoke_timeout_s,
            self.auto_offset_reset,
            on_rewound=lambda: self.rewound.append(None),
        )

    @property
    def assignment(self) -> Assignment:
        return self.handler.assignment

    def assign(self, *tps: TopicPartition) -> None:
        self.handler.on_assign(self.consumer, _parts(tps))

    def revoke(self, *tps: TopicPartition) -> None:
        self.handler.on_revoke(self.consumer, _parts(tps))

    def lose(self, *tps: TopicPartition) -> None:
        self.handler.on_lost(self.consumer, _parts(tps))

    def offer(self, tp: TopicPartition, count: int) -> list[Record]:
        """``count`` records of ``tp`` into its ring (consumed long ago: due at once)."""
        start = self.next_offset.get(tp, 0)
        self.next_offset[tp] = start + count
        records = make_records(tp, range(start, start + count), self.tracker.generation(tp) or 0)
        assert self.lane.offer(records).refused == {}
        return records

    def dispatch(self) -> list[Record]:
        """The lane's next cut (its records are in flight from now on)."""
        batch = self.lane.next_cut(threading.Event())
        assert batch is not None
        return batch.records

    def names(self) -> list[str]:
        """The consumer calls made, by name, in order."""
        return [name for name, _ in self.consumer.calls]


def _parts(tps: Iterable[TopicPartition]) -> list[KafkaTopicPartition]:
    return [ktp(tp) for tp in tps]


def test_assign_starts_each_partition_with_a_new_generation_a_ring_and_a_resume() -> None:
    g = Group()
    g.assign(A, B)
    generations = {A: g.tracker.generation(A), B: g.tracker.generation(B)}
    assert None not in generations.values() and generations[A] != generations[B]
    assert g.assignment.generations == generations
    assert set(g.lane.fill_ratios()) == {A, B}
    assert g.consumer.calls == [("incremental_assign", [A, B]), ("resume", [A, B])]
    assert g.assignment.assigned == {A, B} and g.assignment.unassigned is None
    assert g.assignment.positions() == {A: None, B: None}
    assert g.assignment.rebalances == {"assigned": 1, "revoked": 0, "lost": 0}


def test_an_assignment_while_draining_pauses_the_new_partitions() -> None:
    g = Group()
    g.assignment.fetching = False
    g.assign(A)
    assert g.names() == ["incremental_assign", "pause"]


def test_a_partition_assigned_again_gets_a_newer_generation_and_an_empty_ring() -> None:
    g = Group()
    g.assign(A)
    old = g.offer(A, 3)
    g.lose(A)
    g.assign(A)
    generation = g.tracker.generation(A)
    assert generation is not None and generation > old[0].generation
    assert g.lane.fill_ratios() == {A: 0.0}
    assert g.tracker.done_many(old) == 0 and g.tracker.late_results == 3  # never committed


def test_revoke_commits_only_the_revoked_watermarks_before_giving_them_up() -> None:
    g = Group()
    g.assign(A, B)
    g.offer(A, 4)
    g.tracker.done_many(g.dispatch())  # A 0..3 done
    g.offer(B, 2)  # B has nothing done: its watermark is 0
    g.revoke(A)
    assert g.consumer.calls_named("commit") == [{A: 4}]
    names = g.names()
    assert names.index("commit") < names.index("incremental_unassign")
    assert g.consumer.calls_named("incremental_unassign") == [[A]]
    assert g.tracker.generation(A) is None and g.assignment.assigned == {B}
    assert g.assignment.unassigned is None  # B is still ours
    assert set(g.lane.fill_ratios()) == {B}


def test_revoke_waits_only_for_in_flight_batches_not_for_records_left_in_the_ring() -> None:
    g = Group(revoke_timeout_s=5.0)
    g.assign(A)
    g.offer(A, 6)
    g.tracker.done_many(g.dispatch())  # 0..3 done; 4 and 5 never leave the ring
    with structlog.testing.capture_logs() as logs:
        g.revoke(A)
    assert "revoke budget exceeded; committing what is done" not in [e["event"] for e in logs]
    assert g.consumer.calls_named("commit") == [{A: 4}]  # never past the dropped records


def test_revoking_the_last_partition_marks_the_consumer_unassigned_since_then() -> None:
    g = Group()
    g.assign(A)
    g.clock.advance(5.0)
    g.revoke(A)
    assert g.assignment.unassigned == Unassigned(g.clock.now_s, "revoked")
    assert g.assignment.last_rebalance_s == g.clock.now_s
    assert g.assignment.rebalances["revoked"] == 1


def test_lost_partitions_are_dropped_and_forgotten_without_a_commit() -> None:
    g = Group()
    g.assign(A)
    g.offer(A, 4)
    g.tracker.done_many(g.dispatch())
    g.lose(A)
    assert g.consumer.calls_named("commit") == []
    assert g.consumer.calls_named("incremental_unassign") == [[A]]
    assert g.tracker.generation(A) is None and g.lane.fill_ratios() == {}
    assert g.assignment.unassigned == Unassigned(g.clock.now_s, "lost")
    assert g.assignment.rebalances["lost"] == 1


def test_the_ring_fill_gauge_of_a_partition_that_leaves_is_removed() -> None:
    g = Group()
    g.assign(A, B)
    for tp in (A, B):
        g.metrics.ring_fill.labels(tp.topic, str(tp.partition)).set(0.5)
    g.revoke(A)
    sample = g.metrics.registry.get_sample_value
    assert sample("streamproc_ring_fill_ratio", {"topic": "in", "partition": "0"}) is None
    assert sample("streamproc_ring_fill_ratio", {"topic": "in", "partition": "1"}) == 0.5


@pytest.mark.parametrize(
    ("auto_offset_reset", "without_commit"),
    [("earliest", OFFSET_BEGINNING), ("latest", OFFSET_END)],
)
def test_rewind_seeks_every_assigned_partition_to_its_committed_offset_afresh(
    auto_offset_reset: str, without_commit: int
) -> None:
    g = Group(auto_offset_reset=auto_offset_reset)
    g.assign(A, B)
    g.offer(A, 3)
    before = {A: g.tracker.generation(A), B: g.tracker.generation(B)}
    g.consumer.committed_offsets[A] = 2  # B has no committed offset
    g.handler.rewind(g.consumer)
    assert sorted(g.consumer.calls_named("seek")) == [(A, 2), (B, without_commit)]
    assert all(g.tracker.generation(tp) != before[tp] for tp in (A, B))
    assert g.assignment.generations == {A: g.tracker.generation(A), B: g.tracker.generation(B)}
    assert g.lane.fill_ratios() == {A: 0.0, B: 0.0} and g.tracker.pending(A) == 0
    assert g.consumer.calls[-1] == ("resume", [A, B])
    assert g.rewound == [None]


def test_a_rewind_that_cannot_read_the_committed_offsets_raises_and_changes_nothing() -> None:
    g = Group()
    g.assign(A)
    g.offer(A, 3)
    generation = g.tracker.generation(A)
    g.consumer.committed_errors.append(kafka_error(KafkaError.GROUP_AUTHORIZATION_FAILED))
    with pytest.raises(KafkaException):
        g.handler.rewind(g.consumer)
    assert g.consumer.calls_named("seek") == [] and g.rewound == []
    assert g.tracker.generation(A) == generation and g.lane.fill_ratios() == {A: 3 / 8}


def test_a_revoke_whose_transaction_aborts_rewinds_the_partitions_that_stay() -> None:
    g = Group(exactly_once=True)
    g.assign(A, B)
    b_generation = g.tracker.generation(B)
    g.offer(A, 4)
    g.tracker.done_many(g.dispatch())
    g.producer.fail_next(
        "commit_transaction", kafka_error(KafkaError._TIMED_OUT, txn_requires_abort=True)
    )
    g.consumer.committed_offsets.update({A: 1, B: 7})
    g.revoke(A)
    assert g.producer.calls[-1] == "abort_transaction"
    assert (B, 7) in g.consumer.calls_named("seek")  # back to B's committed offset
    assert g.tracker.generation(B) != b_generation  # the aborted work of B is dropped
    assert g.assignment.assigned == {B} and g.tracker.generation(A) is None


def test_assignment_positions_are_copies_and_a_fresh_start_clears_the_partition_state() -> None:
    clock = FakeClock(10.0)
    first = Assignment(clock)
    assert first.unassigned == Unassigned(10.0, "start")
    state = first.started([A], {A: 1})
    assert first.assigned == frozenset() and first.generations == {}  # the first stays as it was
    state.advance(A, 5)
    state.seek_floors[A] = 3
    state.flow_paused.add(A)
    positions = state.positions()
    positions[A] = 99
    assert state.position(A) == 5  # the snapshot is a copy
    clock.advance(1.0)
    again = state.started([A], {A: 2})
    assert (again.position(A), again.generations[A]) == (None, 2)
    assert A not in again.seek_floors and A not in again.flow_paused
    assert again.last_rebalance_s == 11.0 and again.unassigned is None


def test_a_generation_kept_from_before_a_rebalance_never_sees_the_next_one() -> None:
    state = Assignment(FakeClock(10.0)).started([A, B], {A: 1, B: 1})
    state.advance(A, 7)
    state.flow_paused.add(B)
    after = state.forgotten([A], "revoked")
    after.advance(B, 3)
    after.flow_paused.discard(B)
    # the old generation is what it was when the rebalance happened
    assert state.assigned == {A, B} and state.positions() == {A: 7, B: None}
    assert state.flow_paused == {B} and state.generations == {A: 1, B: 1}
    assert after.assigned == {B} and after.positions() == {B: 3} and after.flow_paused == set()
    gone = after.forgotten([B], "lost")
    assert gone.unassigned == Unassigned(10.0, "lost") and after.unassigned is None
