"""Record deadlines: the header and ``max_age_ms`` rule (pure, injected clocks), the cut that
sets expired records apart, and the source that converts deadlines once at intake."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from streamproc.intake import lane as lane_module
from streamproc.intake.batcher import Batcher
from streamproc.intake.deadlines import (
    DEADLINE_HEADER,
    DEADLINE_SANE_RANGE_MS,
    INVALID,
    Deadlines,
    parse_deadline_ms,
)
from streamproc.intake.lane import Lane
from streamproc.intake.latency import AFTER_CUT_MAX_AGE_S
from streamproc.intake.rings import PartitionBuffers
from streamproc.offsets.tracker import OffsetTracker
from streamproc.records import Batch, Priority, Record, TopicPartition
from tests.support.kafka_fakes import FakeMessage
from tests.unit.source_harness import TP as TP_IN
from tests.unit.source_harness import Harness

TP = TopicPartition("t", 0)
NOW_MS = 1_760_000_000_000  # an epoch-ms wall clock reading
MONO_S = 500.0  # the monotonic clock at the same moment


def record(offset: int, deadline_s: float = math.inf) -> Record:
    return Record(TP, offset, None, b"v", (), NOW_MS, MONO_S, 1, deadline_s=deadline_s)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (b"%d" % (NOW_MS + 250), NOW_MS + 250),
        (b"%d" % (NOW_MS - 60_000), NOW_MS - 60_000),  # past: still a deadline
        (b"", INVALID),
        (b"soon", INVALID),
        (b"-5", INVALID),
        (b" 17", INVALID),
        (b"1.7e12", INVALID),
        ("١٢٣".encode(), INVALID),  # digits, but not ASCII
        (b"9" * 40, INVALID),  # absurdly large
        (b"%d" % (NOW_MS // 1000), INVALID),  # seconds by mistake: 1970, years in the past
        (b"%d" % (NOW_MS * 1000), INVALID),  # microseconds by mistake: far future
        (b"0", INVALID),
        (None, INVALID),
    ],
)
def test_deadline_header_parses_ascii_epoch_ms_within_a_year_of_the_timestamp(
    value: bytes | None, expected: int
) -> None:
    assert parse_deadline_ms(value, NOW_MS) == expected


def test_a_header_just_inside_the_sane_range_is_kept() -> None:
    edge = NOW_MS - DEADLINE_SANE_RANGE_MS
    assert parse_deadline_ms(b"%d" % edge, NOW_MS) == edge
    assert parse_deadline_ms(b"%d" % (edge - 1), NOW_MS) == INVALID


def test_no_header_and_no_max_age_means_no_deadline() -> None:
    assert Deadlines().deadline_s((), NOW_MS, NOW_MS, MONO_S) == (math.inf, False)
    other = (("priority", b"high"),)
    assert Deadlines().deadline_s(other, NOW_MS, NOW_MS, MONO_S) == (math.inf, False)


def test_header_deadline_converts_to_the_monotonic_clock_once() -> None:
    headers = ((DEADLINE_HEADER, b"%d" % (NOW_MS + 250)),)
    # the poll read the wall clock 100 ms after the record's timestamp
    deadline_s, invalid = Deadlines().deadline_s(headers, NOW_MS, NOW_MS + 100, MONO_S)
    assert not invalid
    assert deadline_s == pytest.approx(MONO_S + 0.150)


def test_max_age_counts_from_the_record_timestamp() -> None:
    deadline_s, invalid = Deadlines(max_age_ms=1000).deadline_s((), NOW_MS, NOW_MS + 400, MONO_S)
    assert not invalid
    assert deadline_s == pytest.approx(MONO_S + 0.600)


@pytest.mark.parametrize(("header_in_ms", "expected_s"), [(200, 0.2), (5000, 1.0)])
def test_the_earlier_of_header_and_max_age_applies(header_in_ms: int, expected_s: float) -> None:
    headers = ((DEADLINE_HEADER, b"%d" % (NOW_MS + header_in_ms)),)
    deadline_s, _ = Deadlines(max_age_ms=1000).deadline_s(headers, NOW_MS, NOW_MS, MONO_S)
    assert deadline_s == pytest.approx(MONO_S + expected_s)


def test_an_invalid_header_is_ignored_and_reported_max_age_still_applies() -> None:
    headers = ((DEADLINE_HEADER, b"tomorrow"),)
    assert Deadlines().deadline_s(headers, NOW_MS, NOW_MS, MONO_S) == (math.inf, True)
    deadline_s, invalid = Deadlines(max_age_ms=50).deadline_s(headers, NOW_MS, NOW_MS, MONO_S)
    assert invalid and deadline_s == pytest.approx(MONO_S + 0.05)


def test_an_unknown_timestamp_takes_no_max_age() -> None:
    assert Deadlines(max_age_ms=50).deadline_s((), -1, NOW_MS, MONO_S) == (math.inf, False)


@pytest.mark.parametrize("max_age_ms", [0, -1])
def test_max_age_must_be_positive(max_age_ms: int) -> None:
    with pytest.raises(ValueError, match="max_age_ms"):
        Deadlines(max_age_ms)


def test_take_live_keeps_order_and_a_deadline_at_the_cut_counts_as_passed() -> None:
    buffers = PartitionBuffers(16, 1.0, 0.5)
    buffers.assign([TP])
    records = [record(0, 9.0), record(1), record(2, 10.0), record(3, 11.0), record(4, 2.0)]
    for r in records:
        buffers.push(r)
    live, expired, _ = buffers.take_live(8, None, (0.0, 0.0, 0.0), now_s=10.0, max_expired=8)
    assert [r.offset for r in live] == [1, 3]
    assert [r.offset for r in expired] == [0, 2, 4]
    assert len(buffers.take(8)[0]) == 0 and buffers.views() == []


def test_a_batch_of_only_expired_records_is_not_empty() -> None:
    late = record(0, 1.0)
    batch = Batch(1, (), 2.0, "size", (late,))
    assert len(batch) == 0 and batch.expired == (late,)
    with pytest.raises(ValueError, match="never empty"):
        Batch(2, (), 2.0)


class Clock:
    def __init__(self, now_s: float) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def lane(
    clock: Clock,
    max_age_ms: int | None = None,
    predict_expiry: bool = False,
    latency_target_s: float | None = None,
) -> Lane:
    tracker = OffsetTracker()
    tracker.assign([TP])
    buffers = PartitionBuffers(16, 1.0, 0.5)
    batcher = Batcher(4, 1 << 20, 0.01, latency_target_s=latency_target_s)
    the_lane = Lane("t", buffers, batcher, tracker, clock=clock, predict_expiry=predict_expiry)
    the_lane.assign([TP])
    return the_lane


@pytest.mark.parametrize(("expire_when", "expired"), [("passed", [0]), ("predicted", [0, 2])])
def test_predicted_expiry_sets_apart_records_whose_batch_would_finish_after_their_deadline(
    expire_when: str, expired: list[int]
) -> None:
    # the lane's batches take 20 ms from cut to acknowledgement (the lower 90th percentile of
    # the last ones: one slow outlier of three does not set it): a record due in 10 ms would
    # be served late, one due in 50 ms in time. "passed" runs the first anyway; "predicted"
    # spends no device time on it.
    clock = Clock(100.0)
    the_lane = lane(clock, predict_expiry=expire_when == "predicted", latency_target_s=0.1)
    for after_cut_s in (0.02, 0.02, 0.5):
        the_lane.delivered(np.array([90.0]), 100.0, cut_s=100.0 - after_cut_s)
    records = [record(0, 99.0), record(1, 100.05), record(2, 100.01), record(3)]
    the_lane.offer(records, deadlines=True)  # a full batch: cut at once, at 100.0
    cut = the_lane.next_cut(threading.Event())
    assert cut is not None
    assert [r.offset for r in cut.expired] == expired
    assert [r.offset for r in cut.records] == [o for o in (1, 2, 3) if o not in expired]


def test_predicted_expiry_before_any_acknowledgement_uses_the_expected_device_time() -> None:
    # no batch acknowledged yet: the lead is 2 x the expected device time of the batch
    # (its own and one ahead of it); with nothing measured at all, only the passed expire
    clock = Clock(100.0)
    the_lane = lane(clock, predict_expiry=True, latency_target_s=0.1)
    the_lane.offer([record(0, 100.005), record(1, 100.05), record(2), record(3)], deadlines=True)
    cut = the_lane.next_cut(threading.Event())
    assert cut is not None and cut.expired == []  # nothing measured: nothing predicted
    the_lane.observe(4, 0.004)  # batches of 4 take 4 ms on the device: the lead is 8 ms
    the_lane.offer([record(4, 100.005), record(5, 100.05), record(6), record(7)], deadlines=True)
    cut = the_lane.next_cut(threading.Event())
    assert cut is not None
    assert [r.offset for r in cut.expired] == [4]
    assert [r.offset for r in cut.records] == [5, 6, 7]


def test_a_lead_raised_by_a_stall_does_not_outlive_it() -> None:
    # a stall: the lane's batches took 2 s from cut to acknowledgement. Under on_expired
    # dead_letter a lane whose every record now expires acknowledges no batch, so no new time
    # would replace those: they must age out, or the lane dead-letters everything for ever.
    clock = Clock(100.0)
    the_lane = lane(clock, predict_expiry=True, latency_target_s=0.1)
    for _ in range(4):
        the_lane.delivered(np.array([97.0]), 100.0, cut_s=98.0)
    the_lane.offer([record(0, 101.0), record(1), record(2), record(3)], deadlines=True)
    cut = the_lane.next_cut(threading.Event())
    assert cut is not None and [r.offset for r in cut.expired] == [0]  # due in 1 s, lead 2 s
    clock.now_s = 100.0 + AFTER_CUT_MAX_AGE_S + 0.5  # nothing acknowledged since
    due = clock.now_s + 1.0
    the_lane.offer([record(4, due), record(5), record(6), record(7)], deadlines=True)
    cut = the_lane.next_cut(threading.Event())
    assert cut is not None and cut.expired == []  # the stall's times no longer count
    # and a new time does not bring the old ones back
    the_lane.delivered(np.array([clock.now_s]), clock.now_s, cut_s=clock.now_s - 0.02)
    the_lane.offer([record(8, clock.now_s + 0.01), record(9, due), record(10), record(11)], True)
    cut = the_lane.next_cut(threading.Event())
    assert cut is not None and [r.offset for r in cut.expired] == [8]
    assert [r.offset for r in cut.records] == [9, 10, 11]


def cut_of(the_lane: Lane, due_s: float, first: int) -> tuple[list[int], list[int]]:
    """Offer 4 records (offsets ``first``..) due at ``due_s`` and cut: (served, expired)."""
    the_lane.offer([record(first + i, due_s) for i in range(4)], deadlines=True)
    cut = the_lane.next_cut(threading.Event())
    assert cut is not None
    return [r.offset for r in cut.records], [r.offset for r in cut.expired]


def test_a_lead_no_batch_measures_any_more_is_checked_by_a_probe() -> None:
    # A stall: the lane's batches took 0.5 s from cut to acknowledgement. Every record due
    # sooner is then expired by prediction, so no batch is served and no new time replaces the
    # stall's: before the probe, the lane shed everything until those times aged out (5 s of
    # 100 % expired at half load, the overload bench's timeline). Once nothing was served for
    # a lead, the next cut serves one record (a probe), and its time replaces the stall's.
    clock = Clock(100.0)
    the_lane = lane(clock, predict_expiry=True, latency_target_s=0.1)
    for _ in range(4):
        the_lane.delivered(np.array([99.0]), 100.0, cut_s=99.5)

    assert cut_of(the_lane, 100.2, 0) == ([], [0, 1, 2, 3])  # within a lead of the last served cut
    clock.now_s = 100.6  # nothing served since the cut at 99.5: more than the lead (0.5 s)
    assert cut_of(the_lane, 100.8, 4) == ([4], [5, 6, 7])  # the probe: one record served
    clock.now_s = 100.605  # the probe is still in flight: the stall's lead holds meanwhile
    assert cut_of(the_lane, 100.8, 8) == ([], [8, 9, 10, 11])
    the_lane.delivered(np.array([100.6]), 100.61, cut_s=100.6)  # the probe: 10 ms
    for _ in range(2):  # batches cut before the probe, acknowledged after it: not counted
        the_lane.delivered(np.array([99.9]), 100.615, cut_s=100.0)
    clock.now_s = 100.62  # the stall's times no longer count: the lead is the probe's 10 ms
    assert cut_of(the_lane, 100.7, 12) == ([12, 13, 14, 15], [])
    assert cut_of(the_lane, 100.625, 16) == ([], [16, 17, 18, 19])  # due before the lead: expired


def test_an_expected_device_time_no_batch_measures_any_more_is_checked_by_a_probe() -> None:
    # No time from cut to acknowledgement yet, and batches of 4 were measured at 0.5 s on the
    # device (a stall): the lead is 1 s, which expires every record due sooner, and a device
    # time is measured only by a batch served. A cut with nothing served for a lead before it
    # (or none served yet) that the lead would expire whole serves one record (a probe).
    clock = Clock(100.0)
    the_lane = lane(clock, predict_expiry=True, latency_target_s=10.0)  # batches of 4 fit
    the_lane.observe(4, 0.5)

    assert cut_of(the_lane, 100.5, 0) == ([0], [1, 2, 3])  # nothing served yet: a probe, one record
    clock.now_s = 100.1
    assert cut_of(the_lane, 100.5, 4) == ([], [4, 5, 6, 7])  # due within the lead (1 s)
    clock.now_s = 101.2  # the last batch served was cut at 100.0: more than a lead ago
    the_lane.offer([record(8, 101.25)], deadlines=True)  # due last: the probe
    assert cut_of(the_lane, 101.1, 9) == (
        [8],
        [9, 10, 11, 12],
    )  # 9-12 passed: expired, probe or not
    clock.now_s = 101.3
    assert cut_of(the_lane, 102.0, 13) == ([], [13, 14, 15, 16])  # the probe is in flight


def test_a_batch_the_lead_lets_through_is_no_probe_and_keeps_the_lead_s_times() -> None:
    # Light load: batches cut 100 ms apart, 20 ms from cut to acknowledgement, one of them
    # slow (200 ms). The cuts are more than a lead apart, yet each batch the lead lets through
    # is an ordinary one: it must not drop the times before it (as a probe's acknowledgement
    # does), or one slow batch sets the lead alone and expires the next whole batches.
    clock = Clock(100.0)
    the_lane = lane(clock, predict_expiry=True, latency_target_s=0.1)
    acks = {100.0: 0.02, 100.1: 0.2, 100.4: 0.02, 100.5: 0.02}
    first = 0
    for cut_s, after_cut_s in acks.items():
        clock.now_s = cut_s
        the_lane.offer([record(first + i, cut_s + 0.1) for i in range(4)], deadlines=True)
        cut = the_lane.next_cut(threading.Event())
        assert cut is not None
        assert [r.offset for r in cut.records] == list(range(first, first + 4)), cut_s
        assert cut.expired == []
        the_lane.delivered(np.array([cut_s] * 4), cut_s + after_cut_s, cut_s=cut_s)
        first += 4


def test_lane_cut_sets_records_past_their_deadline_apart() -> None:
    clock = Clock(100.0)
    the_lane = lane(clock)
    records = [record(0, 99.0), record(1), record(2, 100.5), record(3, 50.0)]
    the_lane.offer(records, deadlines=True)
    cut = the_lane.next_cut(threading.Event())
    assert cut is not None
    assert [r.offset for r in cut.records] == [1, 2]
    assert [r.offset for r in cut.expired] == [0, 3]
    assert len(cut.consumed_s) == 4  # every record taken waited in the ring


def test_expired_records_do_not_take_the_places_of_live_ones_in_a_cut() -> None:
    # Overload: a backlog of records past their deadline ahead of live ones. Shedding them 4
    # per cut (the batch size) made every expired record cost a whole cut; one cut must set
    # them all apart and still fill its batch with live records.
    clock = Clock(100.0)
    the_lane = lane(clock)
    stale = [record(offset, 50.0) for offset in range(10)]
    live = [record(offset) for offset in range(10, 15)]
    the_lane.offer(stale + live, deadlines=True)
    cut = the_lane.next_cut(threading.Event())
    assert cut is not None
    assert [r.offset for r in cut.expired] == list(range(10))
    assert [r.offset for r in cut.records] == [10, 11, 12, 13]  # the batch size, all live
    assert len(cut.consumed_s) == 14
    clock.now_s = MONO_S + 1.0  # past offset 14's batch wait: the next cut takes it
    rest = the_lane.next_cut(threading.Event())
    assert rest is not None and [r.offset for r in rest.records] == [14] and rest.expired == []


def test_a_cut_stops_setting_expired_records_apart_at_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the bound keeps one cut's expired results from delaying its live records without limit
    monkeypatch.setattr(lane_module, "MAX_EXPIRED_PER_CUT", 6)
    clock = Clock(100.0)
    the_lane = lane(clock)
    the_lane.offer([record(offset, 50.0) for offset in range(16)], deadlines=True)
    cut = the_lane.next_cut(threading.Event())
    assert cut is not None and cut.records == []
    assert [r.offset for r in cut.expired] == list(range(6))  # exactly the bound
    rest = the_lane.next_cut(threading.Event())
    assert rest is not None and [r.offset for r in rest.expired] == list(range(6, 12))


def test_lane_without_deadlines_never_looks() -> None:
    clock = Clock(100.0)
    the_lane = lane(clock)
    # deadline_s set but the source said no record of the lane has one: nothing expires
    the_lane.offer([record(0, 1.0), record(1, 1.0), record(2), record(3)])
    cut = the_lane.next_cut(threading.Event())
    assert cut is not None and len(cut.records) == 4 and cut.expired == []


def test_source_converts_header_deadlines_at_intake_and_counts_invalid_headers() -> None:
    h = Harness(0)
    h.consumer.schedule_assign([TP_IN])
    h.poll()  # the assignment
    h.source._wall_clock = lambda: NOW_MS / 1000  # the poll's one wall-clock reading
    mono_s = h.clock()  # the source's and the lane's clock
    past = [(DEADLINE_HEADER, b"%d" % (NOW_MS - 1000))]
    soon = [(DEADLINE_HEADER, b"%d" % (NOW_MS + 60_000))]
    bad = [(DEADLINE_HEADER, b"%d" % (NOW_MS // 1000))]  # seconds by mistake
    messages = [
        FakeMessage("in", 0, 0, b"v", None, past, NOW_MS),
        FakeMessage("in", 0, 1, b"v", None, None, NOW_MS),
        FakeMessage("in", 0, 2, b"v", None, soon, NOW_MS),
        FakeMessage("in", 0, 3, b"v", None, bad, NOW_MS),
    ]
    h.source._route(messages, mono_s)
    cut = h.cut()
    assert [r.offset for r in cut.expired] == [0]
    assert [(r.offset, r.deadline_s) for r in cut.records] == [
        (1, math.inf),
        (2, pytest.approx(mono_s + 60)),
        (3, math.inf),  # the invalid header is ignored
    ]
    invalid = h.metrics.counter_value(h.metrics.deadline_header_invalid, topic="in")
    assert invalid == 1


def test_source_applies_max_age_to_records_without_headers() -> None:
    h = Harness(0)
    h.lane.deadlines = Deadlines(max_age_ms=10_000)
    h.consumer.schedule_assign([TP_IN])
    h.poll()
    h.source._wall_clock = lambda: NOW_MS / 1000
    old = FakeMessage("in", 0, 0, b"v", None, None, NOW_MS - 15_000)
    fresh = FakeMessage("in", 0, 1, b"v", None, None, NOW_MS - 5_000)
    h.source._route([old, fresh], h.clock())
    cut = h.cut()
    assert [r.offset for r in cut.expired] == [0] and [r.offset for r in cut.records] == [1]


def test_source_reads_priority_and_deadline_headers_in_one_scan_first_of_each_counting() -> None:
    h = Harness(0)
    h.lane.deadlines = Deadlines(max_age_ms=None)
    h.consumer.schedule_assign([TP_IN])
    h.poll()
    h.source._wall_clock = lambda: NOW_MS / 1000
    mono_s = h.clock()
    soon, later = b"%d" % (NOW_MS + 60_000), b"%d" % (NOW_MS + 120_000)
    messages = [
        FakeMessage("in", 0, 0, b"v", None, [("priority", b"high")], NOW_MS),
        FakeMessage("in", 0, 1, b"v", None, [("priority", b"urgent")], NOW_MS),  # unknown
        FakeMessage(
            "in",
            0,
            2,
            b"v",
            None,
            [("x", b"1"), ("priority", b"low"), (DEADLINE_HEADER, soon), ("priority", b"high")],
            NOW_MS,
        ),
        FakeMessage(
            "in", 0, 3, b"v", None, [(DEADLINE_HEADER, later), (DEADLINE_HEADER, soon)], NOW_MS
        ),
    ]
    h.source._route(messages, mono_s)
    cut = h.cut()
    default = h.lane.default_priority
    assert [(r.offset, r.priority) for r in cut.records] == [
        (0, Priority.HIGH),
        (1, default),
        (2, Priority.LOW),
        (3, default),
    ]
    assert [r.deadline_s for r in cut.records] == [
        math.inf,
        math.inf,
        pytest.approx(mono_s + 60),
        pytest.approx(mono_s + 120),
    ]
