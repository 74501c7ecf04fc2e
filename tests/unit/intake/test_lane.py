"""The lane (``streamproc.intake.lane``): records into their partition rings, pause at the high
watermark and resume at the low one, batch cuts, revoke and re-assign, the batch cap and the
start-up calibration, over an injected clock. No Kafka client is involved: a lane only returns
what the source must pause or resume.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest

from streamproc.intake.batcher import Batcher
from streamproc.intake.lane import CutRecords, Lane
from streamproc.intake.rings import PartitionBuffers
from streamproc.offsets.tracker import OffsetTracker
from streamproc.records import Record, TopicPartition
from tests.support.kafka_fakes import FakeClock
from tests.unit.fakes import make_records

A = TopicPartition("in", 0)
B = TopicPartition("in", 1)
CAPACITY = 8  # pause at 6 (high watermark 0.75), resume at 2 (low watermark 0.25)
NOW_S = 100.0


class DispatchClock(FakeClock):
    """The lane's clock; the dispatcher reads it once per decision, under the lane's lock.

    :attr:`asked` is set at every read. With :attr:`reads_left` set, the read after the
    allowed ones sets :attr:`stop`, so a dispatcher that would wait returns None instead.
    """

    def __init__(self) -> None:
        super().__init__(NOW_S)
        self.asked = threading.Event()
        self.stop = threading.Event()
        self.reads_left: int | None = None

    def __call__(self) -> float:
        self.asked.set()
        if self.reads_left is not None:
            if self.reads_left == 0:
                self.stop.set()
            self.reads_left -= 1
        return self.now_s


@dataclass
class LaneUnderTest:
    """A lane over partitions A and B, both assigned, with its tracker and clock."""

    batcher: Batcher = field(default_factory=lambda: Batcher(4, 1 << 20, 0.05))
    clock: DispatchClock = field(default_factory=DispatchClock)
    tracker: OffsetTracker = field(default_factory=OffsetTracker)

    def __post_init__(self) -> None:
        self.lane = Lane(
            "in",
            PartitionBuffers(CAPACITY, 0.75, 0.25),
            self.batcher,
            self.tracker,
            clock=self.clock,
        )
        self.generations = self.tracker.assign([A, B])
        self.lane.assign([A, B])

    def records(self, tp: TopicPartition, offsets: range, at_s: float = NOW_S) -> list[Record]:
        return make_records(tp, offsets, self.generations[tp], consumed_at_s=at_s)

    def cut(self) -> CutRecords:
        """The cut due now: the dispatcher must not wait for it (it returns None if it would)."""
        self.clock.stop.clear()
        self.clock.reads_left = 1
        batch = self.lane.next_cut(self.clock.stop)
        self.clock.reads_left = None
        assert batch is not None, "the lane waited instead of cutting"
        return batch

    def held(self, tp: TopicPartition) -> float:
        return self.lane.fill_ratios().get(tp, 0.0) * CAPACITY


@pytest.fixture
def t() -> LaneUnderTest:
    return LaneUnderTest()


def offsets(records: list[Record]) -> list[tuple[TopicPartition, int]]:
    return [(r.tp, r.offset) for r in records]


def test_offered_records_go_into_their_partition_rings_and_are_tracked_as_consumed(
    t: LaneUnderTest,
) -> None:
    polled = [*t.records(A, range(3)), *t.records(B, range(2))]
    offered = t.lane.offer(polled)
    assert offered.accepted == polled and offered.refused == {} and offered.pause == ()
    assert (t.held(A), t.held(B)) == (3, 2)
    assert (t.tracker.pending(A), t.tracker.pending(B)) == (3, 2)


def test_a_partition_at_the_high_watermark_is_paused_once(t: LaneUnderTest) -> None:
    assert t.lane.offer(t.records(A, range(5))).pause == ()
    assert t.lane.offer(t.records(A, range(5, 6))).pause == (A,)  # 6 of 8: the high watermark
    assert t.lane.offer(t.records(A, range(6, 7))).pause == ()  # already paused
    assert t.lane.offer(t.records(B, range(1))).pause == ()


def test_a_full_ring_refuses_the_rest_of_its_partition_untracked_and_others_go_on(
    t: LaneUnderTest,
) -> None:
    offered = t.lane.offer([*t.records(A, range(10)), *t.records(B, range(2))])
    assert offsets(offered.accepted) == offsets([*t.records(A, range(8)), *t.records(B, range(2))])
    assert offered.refused == {A: 8}  # the first refused offset: the source seeks back there
    assert t.tracker.pending(A) == 8  # refused records are not tracked
    assert t.tracker.watermarks([A]) == {A: 0}


def test_cuts_take_the_target_in_offset_order_then_the_deadline_and_resume_at_low(
    t: LaneUnderTest,
) -> None:
    t.lane.offer(t.records(A, range(7)))  # paused at 6
    first = t.cut()
    assert first.reason == "size" and [r.offset for r in first.records] == [0, 1, 2, 3]
    assert first.flow.resume == () and first.cut_at_s == NOW_S
    assert first.consumed_s.tolist() == [NOW_S] * 4
    t.clock.advance(0.06)  # past the 50 ms max wait of the three left
    second = t.cut()
    assert second.reason == "deadline" and [r.offset for r in second.records] == [4, 5, 6]
    assert second.flow.resume == (A,)  # at or below the low watermark now
    assert t.held(A) == 0


def test_a_cut_stops_before_the_record_that_would_pass_max_batch_bytes() -> None:
    t = LaneUnderTest(batcher=Batcher(8, max_batch_bytes=10, max_wait_s=10.0))
    t.lane.offer(make_records(A, range(3), t.generations[A], NOW_S, value=b"vvv"))  # 4 B each
    batch = t.cut()
    assert batch.reason == "bytes" and [r.offset for r in batch.records] == [0, 1]
    assert t.held(A) == 1


def test_cut_times_feed_the_arrival_gaps_so_a_sparse_lane_cuts_before_its_deadline() -> None:
    t = LaneUnderTest(batcher=Batcher(4, 1 << 20, 0.5))
    for offset, at_s in enumerate([NOW_S - 3, NOW_S - 2, NOW_S - 1, NOW_S]):  # 1 s apart
        t.lane.offer(t.records(A, range(offset, offset + 1), at_s))
    assert t.cut().reason == "size"
    t.lane.offer(t.records(A, range(4, 5)))
    # 0.5 s left before its deadline; the next message is due in 1 s: waiting gains nothing
    batch = t.cut()
    assert batch.reason == "sparse" and [r.offset for r in batch.records] == [4]


def test_next_cut_returns_none_once_stop_is_set_and_leaves_the_records_in_their_rings(
    t: LaneUnderTest,
) -> None:
    t.lane.offer(t.records(A, range(2)))
    stop = threading.Event()
    stop.set()
    assert t.lane.next_cut(stop) is None
    assert t.held(A) == 2 and t.tracker.pending(A) == 2  # still there, still uncommitted


def _dispatch(
    lane: Lane, stop: threading.Event
) -> tuple[threading.Thread, list[CutRecords | None]]:
    """A dispatcher thread waiting in :meth:`Lane.next_cut`; its result lands in the list."""
    out: list[CutRecords | None] = []
    thread = threading.Thread(target=lambda: out.append(lane.next_cut(stop)), daemon=True)
    thread.start()
    return thread, out


def test_an_offer_wakes_a_dispatcher_waiting_for_records(t: LaneUnderTest) -> None:
    stop = threading.Event()
    thread, out = _dispatch(t.lane, stop)
    try:
        assert t.clock.asked.wait(5.0)  # deciding under the lock: the offer waits for its wait
        t.lane.offer(t.records(A, range(4)))
        thread.join(5.0)
        assert out and out[0] is not None and [r.offset for r in out[0].records] == [0, 1, 2, 3]
    finally:
        stop.set()
        t.lane.wake()
        thread.join(5.0)


def test_wake_releases_a_dispatcher_waiting_on_an_empty_lane(t: LaneUnderTest) -> None:
    stop = threading.Event()
    thread, out = _dispatch(t.lane, stop)
    assert t.clock.asked.wait(5.0)
    stop.set()
    t.lane.wake()
    thread.join(5.0)
    assert out == [None]


def test_revoke_drops_a_partition_ring_and_its_records_stay_pending(t: LaneUnderTest) -> None:
    t.lane.offer([*t.records(A, range(3)), *t.records(B, range(2))])
    assert t.lane.revoke([A]) == {A: 3}  # never dispatched
    assert set(t.lane.fill_ratios()) == {B}
    assert t.tracker.watermarks([A]) == {A: 0}  # nothing of A may commit
    assert t.lane.offer(t.records(A, range(3, 4))).refused == {A: 3}  # no ring: refused
    t.clock.advance(1.0)
    assert offsets(t.cut().records) == [(B, 0), (B, 1)]


def test_assign_gives_a_fresh_empty_ring_that_pauses_again(t: LaneUnderTest) -> None:
    assert t.lane.offer(t.records(A, range(6))).pause == (A,)
    t.generations = t.tracker.assign([A])
    t.lane.assign([A])
    assert t.held(A) == 0
    assert t.lane.offer(t.records(A, range(6))).pause == (A,)  # the old pause is forgotten


def test_the_batch_cap_is_the_smallest_cap_of_the_lane_devices() -> None:
    t = LaneUnderTest(batcher=Batcher(8, 1 << 20, 0.05))
    t.lane.cap_batch("cuda:0", 6)
    t.lane.cap_batch("cuda:1", 2)
    assert t.lane.cap == 2 and t.lane.target == 2
    t.lane.cap_batch("cuda:1", 8)  # recovered: cuda:0 still holds the cap at 6
    assert t.lane.cap == 6
    t.lane.offer(t.records(A, range(8)))
    assert len(t.cut().records) == 6


def test_calibrate_times_the_sizes_the_adaptive_batcher_needs_then_nothing_more() -> None:
    t = LaneUnderTest(batcher=Batcher(4, 1 << 20, 0.05, adaptive=True))
    timed: list[int] = []

    def time_batch(size: int) -> float:
        timed.append(size)
        return 0.001 * size  # the same throughput at every size

    runs = t.lane.calibrate(time_batch)
    assert runs == len(timed) == 9 and sorted(set(timed)) == [1, 2, 4]  # 3 each
    assert t.lane.target == 1  # equal throughput: the smallest size, lowest latency
    assert t.lane.calibrate(time_batch) == 0 and len(timed) == 9


def test_calibrate_without_the_adaptive_model_times_nothing(t: LaneUnderTest) -> None:
    assert t.lane.calibrate(lambda size: pytest.fail("nothing to measure")) == 0
    assert t.lane.target == 4
