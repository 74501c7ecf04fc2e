"""The latency target (``pipelines[].latency_target_ms``, ``streamproc.intake.latency``): the
batcher's waits and batch cap fit the target, the measured P99 (consume to acknowledgement)
moves them, and the readings say when the lane is over its target. Every clock is injected."""

from __future__ import annotations

import numpy as np
import pytest

from streamproc.intake.batcher import Batcher, Cut, Wait
from streamproc.intake.lane import Lane
from streamproc.intake.latency import (
    ADJUST_EVERY_S,
    MAX_SCALE,
    MIN_SAMPLES,
    MIN_SCALE,
    WAIT_SHARE,
    WARN_EVERY_S,
    WINDOW_S,
    LatencyTarget,
)
from streamproc.intake.rings import PartitionBuffers
from streamproc.offsets.tracker import OffsetTracker
from streamproc.records import Priority, Record, TopicPartition
from tests.support.kafka_fakes import FakeClock
from tests.unit.fakes import make_records

A = TopicPartition("t", 0)
NOW_S = 100.0


def rings(records: int, at_s: float = NOW_S) -> PartitionBuffers:
    bufs = PartitionBuffers(capacity=256, high_watermark=1.0, low_watermark=0.0)
    bufs.assign([A])
    for offset in range(records):
        bufs.push(Record(A, offset, None, b"x", (), 0, at_s, 1))
    return bufs


def test_a_10ms_target_does_not_wait_20ms_after_consume() -> None:
    """Target 10 ms, max wait 20 ms, 8 ms per batch of 32 measured: one record waits at most
    the target's wait share (2.5 ms), not the configured 20 ms."""
    batcher = Batcher(32, 1 << 20, 0.020, latency_target_s=0.010)
    batcher.observe(1, 0.0005)
    batcher.observe(32, 0.008)
    decision = batcher.decide(rings(1).views(), NOW_S)
    assert isinstance(decision, Wait)
    assert decision.until_s == pytest.approx(NOW_S + WAIT_SHARE * 0.010)
    assert batcher.decide(rings(1).views(), NOW_S + 0.0025).reason == "deadline"  # type: ignore[union-attr]


def test_a_10ms_target_caps_a_batch_whose_device_time_does_not_fit() -> None:
    """8 ms per batch of 32 (0.5 ms for one): a batch of 32 behind another on its device
    (2 x 8 ms) plus the wait cannot fit 10 ms; the cap is the largest power of two that does
    (8: 2.19 ms interpolated, 2.5 + 2 x 2.19 <= 10; 16 would need 2.5 + 2 x 4.1)."""
    batcher = Batcher(32, 1 << 20, 0.020, latency_target_s=0.010)
    batcher.observe(1, 0.0005)
    batcher.observe(32, 0.008)
    assert batcher.target == 8
    assert batcher.decide(rings(32).views(), NOW_S) == Cut(8, "size")


def test_with_only_a_too_slow_size_measured_the_cap_is_one() -> None:
    """8 ms for 32 and nothing smaller measured: no smaller batch is known to be faster, so
    the cap falls to 1 (the batch of one is then measured and the cap climbs from there)."""
    batcher = Batcher(32, 1 << 20, 0.020, latency_target_s=0.010)
    batcher.observe(32, 0.008)
    assert batcher.decide(rings(32).views(), NOW_S) == Cut(1, "size")
    batcher.observe(1, 0.0005)
    assert batcher.target == 8


def test_the_adaptive_size_is_capped_by_the_target_too() -> None:
    profile = {1: 0.0005, 2: 0.0007, 4: 0.0012, 8: 0.0022, 16: 0.0042, 32: 0.008}
    batcher = Batcher(32, 1 << 20, 0.020, adaptive=True, latency_target_s=0.010)
    for _ in range(60):
        size = batcher.target
        batcher.observe(size, profile[size])
    sizer = batcher.sizer
    assert sizer is not None and sizer.cap == 8  # 16 and 32 are never aimed for
    assert batcher.target <= 8


def test_no_target_keeps_the_configured_wait_and_size() -> None:
    batcher = Batcher(32, 1 << 20, 0.020)
    batcher.observe(32, 0.008)
    assert batcher.decide(rings(1).views(), NOW_S) == Wait(pytest.approx(NOW_S + 0.020))
    assert batcher.decide(rings(32).views(), NOW_S) == Cut(32, "size")


def test_a_short_class_wait_stays_shorter_than_the_target_share() -> None:
    waits = {Priority.HIGH: 0.002, Priority.NORMAL: 0.020, Priority.LOW: 0.050}
    batcher = Batcher(4, 1 << 20, waits, latency_target_s=0.030)
    assert batcher.waits_s == pytest.approx((0.002, 0.0075, 0.0075))
    assert batcher.max_wait_s == (0.002, 0.020, 0.050)  # the take order's ages are unchanged


def acknowledge(
    target: LatencyTarget, now_s: float, latency_s: float, count: int = MIN_SAMPLES
) -> object:
    return target.acknowledged(np.full(count, latency_s), now_s)


def settle(target: LatencyTarget, start_s: float, latency_s: float, periods: int) -> float:
    """Acknowledge ``MIN_SAMPLES`` results of ``latency_s`` once per adjustment period."""
    now_s = start_s
    for _ in range(periods):
        now_s += ADJUST_EVERY_S
        acknowledge(target, now_s, latency_s)
    return now_s


def test_over_target_shrinks_the_wait_and_cap_and_under_target_grows_them_back() -> None:
    target = LatencyTarget(0.010)
    for size, seconds in {1: 0.0005, 8: 0.0022, 32: 0.008}.items():
        target.observe(size, seconds)
    assert target.scale == 1.0
    wide = target.batch_cap(32, WAIT_SHARE * 0.010)
    now_s = settle(target, NOW_S, 0.030, periods=3)  # P99 30 ms against 10 ms
    assert target.scale < 1.0
    assert target.waits_s((0.020,)) < (WAIT_SHARE * 0.010,)
    assert target.batch_cap(32, target.waits_s((0.020,))[0]) < wide
    settle(target, now_s, 0.002, periods=20)  # well under: back to the open-loop budget
    assert target.scale == 1.0  # and never above it while under target and not saturated


def test_the_scale_stays_within_its_bounds() -> None:
    target = LatencyTarget(0.010)
    settle(target, NOW_S, 1.0, periods=40)
    assert target.scale == MIN_SCALE
    now_s = NOW_S + 100
    for _ in range(40):
        target.cut(backlog=True)
        now_s = settle(target, now_s, 1.0, periods=1)
    assert target.scale == MAX_SCALE


def test_a_saturated_lane_grows_its_cap_even_over_target() -> None:
    """Cuts that leave a full batch waiting: the device holds records back, not the batcher;
    a smaller batch would lower capacity, so the cap grows instead (capacity first)."""
    target = LatencyTarget(0.010)
    for size, seconds in {1: 0.0005, 8: 0.0022, 32: 0.008}.items():
        target.observe(size, seconds)
    before = target.batch_cap(32, target.waits_s((0.020,))[0])
    now_s = NOW_S
    for _ in range(6):
        for _ in range(4):
            target.cut(backlog=True)
        now_s = settle(target, now_s, 0.050, periods=1)
    assert target.scale > 1.0
    assert target.batch_cap(32, target.waits_s((0.020,))[0]) > before
    for _ in range(8):  # the backlog gone, still over target: shrinks again
        for _ in range(4):
            target.cut(backlog=False)
        now_s = settle(target, now_s, 0.050, periods=1)
    assert target.scale < 1.0


def test_no_adjustment_before_enough_results_or_time() -> None:
    target = LatencyTarget(0.010)
    acknowledge(target, NOW_S + ADJUST_EVERY_S, 0.050, count=MIN_SAMPLES - 1)
    assert target.scale == 1.0
    acknowledge(target, NOW_S + ADJUST_EVERY_S + 0.1, 0.050, count=1)
    assert target.scale < 1.0
    shrunk = target.scale
    acknowledge(target, NOW_S + ADJUST_EVERY_S + 0.2, 0.050, count=MIN_SAMPLES)
    assert target.scale == shrunk  # within the adjustment period


def test_the_p99_is_of_the_sliding_window_and_over_target_time_accrues_while_over() -> None:
    target = LatencyTarget(0.010)
    latencies = np.linspace(0.001, 0.100, 100)
    reading = target.acknowledged(latencies, NOW_S)
    assert reading is not None
    assert reading.p99_s == pytest.approx(float(np.percentile(latencies, 99)))
    assert reading.over_target_s == 0.0 and reading.went_over  # the first over reading warns
    reading = target.acknowledged(np.full(1, 0.001), NOW_S + 0.5)
    assert reading is not None and reading.over_target_s == pytest.approx(0.5)
    assert not reading.went_over
    # the slow results age out of the window: under target, nothing more accrues
    reading = target.acknowledged(np.full(50, 0.001), NOW_S + WINDOW_S + 1.0)
    assert reading is not None and reading.p99_s == pytest.approx(0.001)
    assert reading.over_target_s == pytest.approx(WINDOW_S)  # the gap counts at most a window
    assert reading.back_within
    reading = target.acknowledged(np.full(50, 0.001), NOW_S + WINDOW_S + 2.0)
    assert reading is not None and reading.over_target_s == 0.0 and not reading.back_within


def test_readings_come_at_most_every_quarter_second_and_warnings_are_rate_limited() -> None:
    target = LatencyTarget(0.010)
    assert target.acknowledged(np.full(5, 0.050), NOW_S) is not None
    assert target.acknowledged(np.full(5, 0.050), NOW_S + 0.1) is None  # too soon: no reading
    now_s = NOW_S + WINDOW_S + 1  # under again (the slow ones aged out)
    under = target.acknowledged(np.full(5, 0.001), now_s)
    assert under is not None and under.back_within
    over = target.acknowledged(np.full(500, 0.050), now_s + 0.5)
    assert over is not None and not over.went_over  # over again within a minute: no warning
    later = NOW_S + WARN_EVERY_S + 2 * WINDOW_S
    assert target.acknowledged(np.full(5, 0.001), later) is not None
    again = target.acknowledged(np.full(500, 0.050), later + 0.5)
    assert again is not None and again.went_over


def test_the_window_keeps_at_most_its_newest_samples() -> None:
    from streamproc.intake.latency import MAX_SAMPLES

    target = LatencyTarget(0.010)
    target.acknowledged(np.full(MAX_SAMPLES, 0.050), NOW_S)
    reading = target.acknowledged(np.full(MAX_SAMPLES, 0.001), NOW_S + 0.5)
    assert reading is not None and reading.p99_s == pytest.approx(0.001)


def test_device_time_estimates_interpolate_and_stay_conservative() -> None:
    target = LatencyTarget(0.010)
    assert target.service_s(8) is None  # nothing measured: no estimate, no cap
    assert target.batch_cap(32, 0.0025) == 32
    target.observe(4, 0.002)
    assert target.service_s(4) == pytest.approx(0.002)
    assert target.service_s(8) == pytest.approx(0.004)  # linear per row above the largest
    assert target.service_s(2) == pytest.approx(0.002)  # a smaller batch: no faster known
    target.observe(16, 0.005)
    assert target.service_s(8) == pytest.approx(0.003)  # between two measured sizes
    for seconds in (0.004, 0.009, 0.005):
        target.observe(16, seconds)
    assert target.service_s(16) == pytest.approx(0.005)  # the median of its recent batches


def test_a_target_must_be_positive() -> None:
    with pytest.raises(ValueError, match="latency target"):
        LatencyTarget(0.0)


def test_the_lane_turns_acknowledgements_into_readings_and_the_batcher_follows() -> None:
    clock = FakeClock(NOW_S)
    tracker = OffsetTracker()
    batcher = Batcher(32, 1 << 20, 0.020, latency_target_s=0.010)
    lane = Lane("t", PartitionBuffers(256, 1.0, 0.0), batcher, tracker, clock=clock)
    generations = tracker.assign([A])
    lane.assign([A])
    assert lane.latency_target_s == 0.010
    before = batcher.waits_s
    now_s = NOW_S
    for _ in range(3):
        now_s += ADJUST_EVERY_S
        consumed = np.full(MIN_SAMPLES, now_s - 0.040)  # 40 ms from consume to ack
        reading = lane.delivered(consumed, now_s)
        assert reading is not None and reading.p99_s == pytest.approx(0.040)
    assert batcher.waits_s < before
    lane.offer(make_records(A, range(1), generations[A], consumed_at_s=NOW_S))
    assert lane.latency_target_s == 0.010


def test_a_lane_without_a_target_reads_nothing() -> None:
    lane = Lane("t", PartitionBuffers(8, 1.0, 0.0), Batcher(4, 1 << 20, 0.02), OffsetTracker())
    assert lane.latency_target_s is None
    assert lane.delivered(np.zeros(3), NOW_S) is None


def simulate(
    rate_msg_s: float, target_s: float | None, duration_s: float = 20.0
) -> tuple[float, int]:
    """One lane on one device, in simulated time: records arrive every ``1 / rate_msg_s`` s, a
    batch of ``n`` takes ``2 ms + 0.1875 ms x n`` (8 ms for 32, 3.5 ms for 8), the device takes
    the next batch when it is free, the broker acknowledges 1 ms after the batch; every size
    timed once at start (as ``Lane.calibrate`` does). Returns the P99 from consume to
    acknowledgement over the second half, and the records left waiting at the end."""
    batcher = Batcher(32, 1 << 30, 0.020, latency_target_s=target_s)
    for size in (1, 2, 4, 8, 16, 32):
        batcher.observe(size, 0.002 + 0.0001875 * size)
    bufs = PartitionBuffers(capacity=1 << 20, high_watermark=1.0, low_watermark=0.0)
    bufs.assign([A])
    gap_s, now_s, free_s, arrived = 1.0 / rate_msg_s, 0.0, 0.0, 0
    latencies: list[float] = []
    while now_s < duration_s:
        while arrived * gap_s <= now_s:  # every arrival up to now is in the ring
            bufs.push(Record(A, arrived, None, b"x", (), 0, arrived * gap_s, 1))
            arrived += 1
        decision = batcher.decide(bufs.views(), now_s)
        next_arrival_s = arrived * gap_s
        if isinstance(decision, Wait):
            now_s = (
                next_arrival_s
                if decision.until_s is None
                else min(decision.until_s, next_arrival_s)
            )
            continue
        records, _ = bufs.take(decision.count, None, batcher.max_wait_s)
        service_s = 0.002 + 0.0001875 * len(records)
        acked_s = now_s + service_s + 0.001
        consumed = np.array([r.consumed_at_s for r in records])
        batcher.observe(len(records), service_s)
        batcher.cut(consumed)
        batcher.acknowledged(consumed, acked_s)
        if now_s >= duration_s / 2:
            latencies.extend(acked_s - consumed)
        free_s = now_s + service_s
        now_s = max(free_s, now_s)
    return float(np.percentile(latencies, 99)), bufs.total()


def test_a_light_load_meets_a_target_the_configured_wait_alone_would_miss() -> None:
    """200 msg/s against a 10 ms target: with the 20 ms wait alone the P99 is over 20 ms."""
    untargeted_p99_s, _ = simulate(200.0, None)
    targeted_p99_s, _ = simulate(200.0, 0.010)
    assert untargeted_p99_s > 0.020
    assert targeted_p99_s < 0.010


def test_a_load_only_large_batches_carry_grows_the_cap_instead_of_falling_behind() -> None:
    """3,000 msg/s: batches of 8 (the 10 ms target's cap) carry 2,286 msg/s, 16 carry 3,200 and
    32 4,000. Capping at 8 would let the backlog grow for ever: the lane is saturated, so its cap
    grows until it keeps up (to the smallest size that carries 1.25 x the rate measured), and
    the P99 stays near the target."""
    p99_s, left = simulate(3000.0, 0.010)
    assert left < 100  # kept up: no backlog at the end
    assert p99_s < 0.020


def test_the_cap_never_falls_below_the_size_that_carries_the_measured_rate() -> None:
    target = LatencyTarget(0.010)
    for size in (1, 2, 4, 8, 16, 32):
        target.observe(size, 0.002 + 0.0001875 * size)  # 8 ms for 32
    assert target.batch_cap(32, 0.0025) == 8  # the budget alone
    now_s = settle(target, NOW_S, 0.005, periods=1)
    target.acknowledged(np.full(3000, 0.005), now_s + ADJUST_EVERY_S)  # 3,000 results a second
    assert target.batch_cap(32, 0.0025) == 32  # 16 carries 3,200 < 1.25 x 3,000; 32 4,000


def fast_profile(size: int) -> float:
    """2 ms + 0.02 ms per row: 64 carry 19,500 msg/s, 128 28,100, 256 36,000, 512 41,800."""
    return 0.002 + 0.00002 * size


def test_the_measured_rate_is_not_bounded_by_the_samples_kept() -> None:
    """30,000 results a second (a trades lane: issue 28's runs carry 30,000 to 90,000 msg/s):
    only the newest 16,384 latencies are kept for the P99, but the rate that capacity first
    reads counts every result. The budget alone caps at 64 (19,500 msg/s); 1.25 x 30,000 =
    37,500 msg/s needs 512 (41,800). A rate read from the kept samples (about 16,400/s) would
    ask only for 20,500 and cap at 128 (28,100 msg/s): the lane would fall behind."""
    target = LatencyTarget(0.010)
    for size in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        target.observe(size, fast_profile(size))
    assert target.batch_cap(512, 0.0025) == 64  # the budget alone
    now_s = settle(target, NOW_S, 0.005, periods=1)
    for step in range(1, 31):  # 30,000 results over one adjustment period, in batches
        target.acknowledged(np.full(1000, 0.005), now_s + step * ADJUST_EVERY_S / 30)
    assert target.batch_cap(512, 0.0025) == 512


def test_a_dispatcher_waiting_is_woken_when_a_device_time_shrinks_the_cap() -> None:
    """16 records wait below the cap (32, nothing measured) for the target's wait (25 s of a
    100 s target). Device times then measured (1 row 5 s, 32 rows 80 s) cap the batch at 8:
    a batch is ready now, and the waiting dispatcher is woken for it rather than sleeping out
    the 25 s."""
    import threading

    asked = threading.Event()

    def clock() -> float:
        asked.set()  # called under the lane's lock, which the dispatcher holds until it waits
        return NOW_S

    tracker = OffsetTracker()
    batcher = Batcher(32, 1 << 20, 60.0, latency_target_s=100.0)
    lane = Lane("t", PartitionBuffers(256, 1.0, 0.0), batcher, tracker, clock=clock)
    generations = tracker.assign([A])
    lane.assign([A])
    lane.offer(make_records(A, range(16), generations[A], consumed_at_s=NOW_S))
    stop = threading.Event()
    cuts: list[object] = []
    dispatcher = threading.Thread(target=lambda: cuts.append(lane.next_cut(stop)), daemon=True)
    dispatcher.start()
    assert asked.wait(10)
    lane.observe(1, 5.0)  # takes the lane's lock: the dispatcher is waiting by now
    lane.observe(32, 80.0)
    assert lane.target == 8
    dispatcher.join(10)  # woken: it cuts at once (not after its 25 s wait)
    try:
        assert not dispatcher.is_alive(), "the dispatcher slept through the smaller cap"
    finally:
        stop.set()
        lane.wake()
    assert len(cuts[0].records) == 8  # type: ignore[attr-defined]


def test_capacity_first_counts_every_device_of_the_lane() -> None:
    """Two devices share a lane's batches: 3,000 results a second is 1,500 per device. Batches
    of 8 (the 10 ms target's budget; 2,286 msg/s per device, 4,571 for both) carry 1.25 x
    3,000: the cap stays 8. Compared with one device's throughput, capacity first would force
    32 (8 ms a batch, the target given up) with the devices 66 % busy at 8."""
    tracker = OffsetTracker()
    batcher = Batcher(32, 1 << 20, 0.020, latency_target_s=0.010, devices=2)
    lane = Lane("t", PartitionBuffers(256, 1.0, 0.0), batcher, tracker, clock=FakeClock(NOW_S))
    for size in (1, 2, 4, 8, 16, 32):
        lane.observe(size, 0.002 + 0.0001875 * size)  # 8 ms for 32
    assert lane.target == 8  # the budget alone
    now_s = NOW_S + ADJUST_EVERY_S
    lane.delivered(np.full(MIN_SAMPLES, now_s - 0.005), now_s)
    for step in range(1, 31):  # 3,000 results over one adjustment period, in batches
        at_s = now_s + step * ADJUST_EVERY_S / 30
        lane.delivered(np.full(100, at_s - 0.005), at_s)
    assert lane.target == 8
