"""The share source over the fake share consumer (``tests.support.kafka_fakes``): records are
acknowledged only once their outputs are, one poll at a time; the lock rule and the stop
release what is not done; the statistics say when the member has partitions. The same on a
real broker: tests/integration/test_share_groups.py."""

from __future__ import annotations

import threading
import time

import orjson
import pytest
from confluent_kafka import AcknowledgeType

from streamproc.config import load_config
from streamproc.errors import ConfigError
from streamproc.intake.batcher import Batcher
from streamproc.intake.lane import CutRecords, Lane, Offered
from streamproc.intake.rings import PartitionBuffers
from streamproc.metrics import Metrics
from streamproc.offsets.guarantees import ShareAcknowledgements
from streamproc.offsets.tracker import OffsetTracker
from streamproc.records import Record, TopicPartition
from streamproc.share.source import ShareSource, share_consumer_settings
from tests.support.kafka_fakes import FakeClock, FakeShareConsumer, FakeShareMessage
from tests.unit.source_harness import drive

PIPELINE = {"name": "p", "input_topic": "in", "output_topic": "out", "workload": "trades"}
ACCEPT, RELEASE = int(AcknowledgeType.ACCEPT), int(AcknowledgeType.RELEASE)
REJECT = int(AcknowledgeType.REJECT)


def _messages(partition: int, offsets: range, delivery_count: int = 1) -> list[FakeShareMessage]:
    return [
        FakeShareMessage("in", partition, o, b"%d" % o, _delivery_count=delivery_count)
        for o in offsets
    ]


class ShareHarness:
    """A share source over a fake share consumer with one lane (ring of 64); the test drives
    the poll loop and says which inputs are done, as the sink would. The source and the lane
    share one fake clock, starting at ``start_s``."""

    def __init__(self, release_after_ms: int = 25_000, start_s: float = 1000.0) -> None:
        self.config = load_config(
            overrides={
                "pipelines": [PIPELINE],
                "kafka": {
                    "group_type": "share",
                    "share_release_after_ms": release_after_ms,
                    "poll_timeout_ms": 10,
                },
            },
            bootstrap="fake:9092",
        )
        self.tracker = OffsetTracker()
        self.metrics = Metrics()
        self.guarantee = ShareAcknowledgements(self.tracker, self.metrics)
        self.clock = FakeClock(start_s)
        self.lane = Lane(
            "in",
            PartitionBuffers(64, 0.9, 0.5),
            Batcher(64, 1 << 30, 0.0),
            self.tracker,
            clock=self.clock,
        )
        self.consumer = FakeShareConsumer()
        self.fatal: list[BaseException] = []
        self.dead_letters: list[tuple[Record, str, str]] = []
        self.source = ShareSource(
            self.config,
            {"in": self.lane},
            self.tracker,
            self.guarantee,
            self.metrics,
            self.fatal.append,
            self.consumer,
            clock=self.clock,
            dead_letter=lambda *letter: self.dead_letters.append(letter),
        )
        self.source.subscribe()

    def turn(self, times: int = 1, advance_s: float = 0.0) -> None:
        """Run the poll loop ``times`` turns, moving the clock ``advance_s`` before each."""
        drive(self.source, self.clock, times, advance_s)
        assert not self.fatal, self.fatal

    def cut(self) -> CutRecords:
        batch = self.lane.next_cut(threading.Event())
        assert batch is not None
        return batch

    def outputs_acknowledged(self, records: list[Record]) -> None:
        """What the sink does when the outputs of ``records`` are acknowledged."""
        self.guarantee.acknowledged(records)

    def count(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.timeout(60)
def test_a_cut_waits_on_the_clock_that_stamped_its_records_not_the_machines() -> None:
    """Records are stamped by the harness's fake clock, so the lane must cut on it too: one
    on the machine's monotonic clock waited until the machine had been up as long as the fake
    clock's start (1,000 s), minutes on a freshly booted machine. Here it starts a day ahead."""
    h = ShareHarness(start_s=time.monotonic() + 86_400.0)
    h.consumer.polls.append(_messages(0, range(0, 3)))
    h.turn()
    assert [r.offset for r in h.cut().records] == [0, 1, 2]


def test_records_are_accepted_only_once_their_outputs_are_and_one_poll_at_a_time() -> None:
    h = ShareHarness()
    h.consumer.polls.extend([_messages(0, range(0, 6)), _messages(0, range(6, 9))])
    h.turn()  # the first poll: six records into the ring
    assert h.consumer.acks == [] and h.count("streamproc_share_in_flight_records") == 6
    batch = h.cut().records
    h.outputs_acknowledged(batch[:4])
    h.turn()  # four done: acknowledged, two still in flight, so no poll
    assert h.consumer.acks == [("in", 0, o, ACCEPT) for o in range(4)]
    assert len(h.consumer.polls) == 1, "polled again while records were in flight"
    h.outputs_acknowledged(batch[4:])
    h.turn(2)  # the last two done, then the next poll (which sends the acknowledgements)
    assert [a[2] for a in h.consumer.acks] == list(range(6))
    assert not h.consumer.polls
    assert h.count("streamproc_share_acknowledged_total", topic="in") == 6
    assert h.count("streamproc_messages_consumed_total", topic="in") == 9


def test_a_record_of_another_poll_or_generation_is_never_acknowledged_twice() -> None:
    h = ShareHarness()
    h.consumer.polls.append(_messages(0, range(0, 2)))
    h.turn()
    records = h.cut().records
    h.outputs_acknowledged(records)
    h.outputs_acknowledged(records)  # a duplicate report (the same inputs again)
    h.turn()
    assert h.consumer.acks == [("in", 0, 0, ACCEPT), ("in", 0, 1, ACCEPT)]


def test_records_not_done_before_their_lock_runs_out_are_released_and_counted() -> None:
    h = ShareHarness(release_after_ms=1000)
    h.consumer.polls.extend([_messages(0, range(0, 4)), _messages(0, range(4, 6))])
    h.turn()
    stuck = h.cut().records  # a slow batch
    h.outputs_acknowledged(stuck[:1])
    h.turn(advance_s=0.5)  # one done; the others still within the lock
    assert h.consumer.acks == [("in", 0, 0, ACCEPT)]
    h.turn(advance_s=0.6)  # 1.1 s after the poll: the rest go back to the group
    assert h.consumer.acks[1:] == [("in", 0, o, RELEASE) for o in (1, 2, 3)]
    assert h.count("streamproc_share_released_total", topic="in", reason="lock") == 3
    h.turn()  # nothing in flight: the next poll
    assert not h.consumer.polls
    h.outputs_acknowledged(stuck[1:])  # the slow batch finishes after all: a duplicate result
    h.turn()
    assert ("in", 0, 1, ACCEPT) not in h.consumer.acks  # released records are not accepted


def test_a_stop_accepts_what_is_done_and_releases_the_rest() -> None:
    h = ShareHarness()
    h.consumer.polls.append(_messages(0, range(0, 3)))
    h.source.start()
    try:
        records = None
        while records is None:  # the thread routed the poll: the batch is ready
            records = h.lane.next_cut(threading.Event()).records
        h.outputs_acknowledged(records[:1])
    finally:
        h.source.close(5.0)
    assert h.consumer.closed
    assert h.consumer.acks == [("in", 0, 0, ACCEPT), ("in", 0, 1, RELEASE), ("in", 0, 2, RELEASE)]
    assert h.count("streamproc_share_released_total", topic="in", reason="stop") == 2


def test_the_busy_ratio_is_the_share_of_time_with_records_in_flight() -> None:
    h = ShareHarness()
    h.turn(advance_s=1.0)  # two idle seconds (the clock moves before each turn and at the end)
    h.consumer.polls.append(_messages(0, range(0, 2)))
    h.turn()  # the poll: records in flight from here
    h.cut()
    h.turn(3, advance_s=1.0)  # three seconds in flight: the 5 s window ends, 3 s of it busy
    assert h.count("streamproc_share_busy_ratio") == pytest.approx(0.6)


def test_the_statistics_say_when_the_member_has_partitions() -> None:
    h = ShareHarness()
    assert h.source.assignment.unassigned is not None  # joined, nothing assigned yet
    h.consumer.stats.append(orjson.dumps({"cgrp": {"assignment_size": 0}}).decode())
    h.turn()
    assert h.source.assignment.unassigned is not None
    h.consumer.stats.append(orjson.dumps({"cgrp": {"assignment_size": 2}}).decode())
    h.turn()
    assert h.source.assignment.unassigned is None and h.source.assigned_partitions == 2
    h.consumer.stats.append(orjson.dumps({"cgrp": {"assignment_size": 0}}).decode())
    h.turn()
    unassigned = h.source.assignment.unassigned
    assert unassigned is not None and unassigned.cause == "revoked"


def test_each_poll_starts_its_partitions_afresh_and_counts_redeliveries() -> None:
    h = ShareHarness()
    # a record released by another member comes back below offsets this member already saw
    h.consumer.polls.extend([_messages(0, range(10, 12)), _messages(0, range(3, 4), 2)])
    h.turn()
    first = h.cut().records
    h.outputs_acknowledged(first)
    h.turn(3)  # acknowledged; the next poll; its record (delivered before) runs alone
    second = h.cut().records
    assert [r.offset for r in second] == [3]
    assert second[0].generation != first[0].generation
    assert h.count("streamproc_share_redelivered_total", topic="in") == 1
    h.outputs_acknowledged(second)
    h.turn()
    assert h.consumer.acks[-1] == ("in", 0, 3, ACCEPT)
    assert h.tracker.total_pending() == 0 and not h.tracker.commit_candidates()


def test_records_delivered_again_run_alone_after_the_rest_each_committed_before_the_next() -> None:
    """A poll that comes back after its member died: any of its records may be the poison one,
    so each runs in a batch of its own, and its acknowledgement is durable before the next
    runs (a second crash costs only the records not tried yet)."""
    h = ShareHarness()
    h.consumer.polls.append(_messages(0, range(0, 2)) + _messages(0, range(2, 5), 3))
    h.turn()
    fresh = h.cut().records
    assert [r.offset for r in fresh] == [0, 1]  # the records delivered for the first time
    h.turn()
    assert h.lane.fill_ratios()[TopicPartition("in", 0)] == 0.0  # no suspect runs beside them
    h.outputs_acknowledged(fresh)
    ran: list[int] = []
    for _ in range(3):
        h.turn()  # the fresh records acknowledged (or the last suspect); the next suspect runs
        (alone,) = h.cut().records
        ran.append(alone.offset)
        commits = h.consumer.commits
        h.outputs_acknowledged([alone])
        h.turn()
        assert h.consumer.commits == commits + 1  # durable before the next one runs
    assert ran == [4, 3, 2]  # delivery count 3 (odd): from the highest offset down
    assert [a[2:] for a in h.consumer.acks] == [(o, ACCEPT) for o in (0, 1, 4, 3, 2)]


def test_a_suspect_its_ring_refuses_is_released_at_once_and_the_next_one_runs() -> None:
    """A suspect whose ring refuses it (its lane no longer takes the partition) goes back to
    the group at once, counted; it does not hold the poll until the lock rule releases it."""
    h = ShareHarness()
    h.consumer.polls.append(_messages(0, range(0, 2), 3))
    refuse_once = [True]
    offer = h.lane.offer_runs

    def refusing(runs: dict[TopicPartition, list[Record]], deadlines: bool = False) -> Offered:
        if refuse_once and any(len(run) == 1 for run in runs.values()):
            refuse_once.clear()
            return Offered({}, {tp: run[0].offset for tp, run in runs.items()}, ())
        return offer(runs, deadlines)

    h.lane.offer_runs = refusing  # type: ignore[method-assign]
    h.turn()  # the poll: two suspects, waiting to run alone
    h.turn()  # the first suspect's ring refuses it: released now
    assert h.consumer.acks == [("in", 0, 1, RELEASE)]  # count 3 (odd): the highest first
    assert h.count("streamproc_share_released_total", topic="in", reason="ring_full") == 1
    h.turn()  # the next suspect runs
    (alone,) = h.cut().records
    assert alone.offset == 0
    h.outputs_acknowledged([alone])
    h.turn()
    assert h.consumer.acks[-1] == ("in", 0, 0, ACCEPT)
    assert h.count("streamproc_share_in_flight_records") == 0
    # consumed counts what a ring took: the suspect that ran, not the one given back
    assert h.count("streamproc_messages_consumed_total", topic="in") == 1


def test_the_highest_offset_acquired_per_partition_is_exported_for_the_backlog() -> None:
    """One past the highest offset acquired, per partition: a record delivered again (a
    lower offset) never moves it back."""
    h = ShareHarness()
    h.consumer.polls.extend([_messages(0, range(10, 14)) + _messages(1, range(0, 3))])
    h.turn()
    assert h.count("streamproc_share_acquired_end_offset", topic="in", partition="0") == 14
    assert h.count("streamproc_share_acquired_end_offset", topic="in", partition="1") == 3
    h.outputs_acknowledged(h.cut().records)
    h.consumer.polls.append(_messages(0, range(4, 6), 2))
    h.turn(2)
    assert not h.consumer.polls  # the redelivery was acquired
    assert h.count("streamproc_share_redelivered_total", topic="in") == 2
    assert h.count("streamproc_share_acquired_end_offset", topic="in", partition="0") == 14


def test_a_record_delivered_too_often_is_dead_lettered_not_run_then_rejected() -> None:
    h = ShareHarness()  # kafka.share_max_deliveries: 5
    poll = _messages(0, range(0, 2)) + _messages(0, range(2, 3), 5) + _messages(0, range(3, 4))
    h.consumer.polls.append(poll)
    h.turn()
    ((poisoned, error_class, message),) = h.dead_letters
    assert poisoned.offset == 2 and error_class == "DeliveryCountExceeded"
    assert "delivered 5 times" in message
    ran = h.cut().records
    assert [r.offset for r in ran] == [0, 1, 3]  # the poison record never enters the ring
    h.outputs_acknowledged(ran)
    h.turn()
    assert len(h.consumer.polls) == 0 and h.count("streamproc_share_in_flight_records") == 1
    h.outputs_acknowledged([poisoned])  # its dead-letter record is durable
    h.turn()
    assert h.consumer.acks[-1] == ("in", 0, 2, REJECT)
    assert [a[3] for a in h.consumer.acks[:3]] == [ACCEPT] * 3
    assert h.tracker.total_pending() == 0 and not h.tracker.commit_candidates()


def test_the_share_consumer_settings_ask_for_explicit_acknowledgement_and_a_bounded_poll() -> None:
    h = ShareHarness()
    settings = share_consumer_settings(h.config, h.guarantee)
    assert settings["share.acknowledgement.mode"] == "explicit"
    assert settings["max.poll.records"] == h.config.kafka.consume_batch_messages
    assert settings["group.id"] == h.config.kafka.group_id
    assert h.consumer.subscribed == ["in"]


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"processing_guarantee": "exactly_once"}, "processing_guarantee"),
        ({"kafka": {"group_type": "share", "group_protocol": "consumer"}}, "kafka.group_protocol"),
        ({"kafka": {"group_type": "share", "group_instance_id": "a"}}, "kafka.group_instance_id"),
        ({"pipelines": [{**PIPELINE, "ordered": True}]}, "pipelines[].ordered"),
    ],
)
def test_a_share_group_refuses_what_it_cannot_keep_naming_the_key(
    overrides: dict[str, object], named: str
) -> None:
    data: dict[str, object] = {"pipelines": [PIPELINE], "kafka": {"group_type": "share"}}
    data.update(overrides)
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        load_config(overrides=data, bootstrap="fake:9092")
