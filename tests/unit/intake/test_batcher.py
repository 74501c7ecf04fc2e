from __future__ import annotations

import csv
import math
import random
from pathlib import Path

import pytest

from streamproc.intake.batcher import AdaptiveBatchSize, Batcher, Cut, Wait
from streamproc.intake.lane import Lane
from streamproc.intake.rings import PartitionBuffers
from streamproc.offsets.tracker import OffsetTracker
from streamproc.records import Priority, Record, TopicPartition

A = TopicPartition("t", 0)
B = TopicPartition("t", 1)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def fill(bufs: PartitionBuffers, tp: TopicPartition, at_s: list[float], size: int = 10) -> None:
    base = bufs.total()
    for i, t in enumerate(at_s):
        bufs.push(Record(tp, base + i, None, b"x" * size, (), 0, t, 1))


@pytest.fixture
def bufs() -> PartitionBuffers:
    b = PartitionBuffers(capacity=64, high_watermark=1.0, low_watermark=0.0)
    b.assign([A, B])
    return b


def test_no_messages_means_wait_without_deadline(bufs: PartitionBuffers) -> None:
    assert Batcher(4, 1 << 20, 0.010).decide(bufs.views(), 0.0) == Wait(None)


def test_cuts_on_size(bufs: PartitionBuffers) -> None:
    clock = FakeClock()
    fill(bufs, A, [clock.now_s] * 3)
    fill(bufs, B, [clock.now_s] * 2)
    assert Batcher(4, 1 << 20, 0.050).decide(bufs.views(), clock()) == Cut(4, "size")


def test_cuts_on_bytes(bufs: PartitionBuffers) -> None:
    fill(bufs, A, [100.0, 100.0], size=600)
    assert Batcher(8, 1000, 0.050).decide(bufs.views(), 100.0) == Cut(8, "bytes")


def test_deadline_counts_from_consume_time_not_from_now(bufs: PartitionBuffers) -> None:
    clock = FakeClock()
    batcher = Batcher(8, 1 << 20, max_wait_s=0.02)
    fill(bufs, A, [clock.now_s - 0.015])  # consumed 15 ms ago
    decision = batcher.decide(bufs.views(), clock())
    assert isinstance(decision, Wait)
    assert decision.until_s == pytest.approx(clock.now_s + 0.005)
    clock.now_s += 0.005
    assert batcher.decide(bufs.views(), clock()) == Cut(8, "deadline")


def test_oldest_message_across_partitions_sets_the_deadline(bufs: PartitionBuffers) -> None:
    batcher = Batcher(8, 1 << 20, max_wait_s=0.01)
    fill(bufs, A, [100.0])
    fill(bufs, B, [99.0])
    assert batcher.decide(bufs.views(), 99.011) == Cut(8, "deadline")


def test_zero_wait_cuts_immediately_and_never_empty(bufs: PartitionBuffers) -> None:
    batcher = Batcher(8, 1 << 20, max_wait_s=0.0)
    assert batcher.decide(bufs.views(), 1.0) == Wait(None)
    fill(bufs, A, [1.0])
    assert batcher.decide(bufs.views(), 1.0) == Cut(8, "deadline")
    taken, _ = bufs.take(8)
    assert len(taken) == 1


def test_rejects_nonpositive_batch_size() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        Batcher(0, 1, 1)


def prio(bufs: PartitionBuffers, tp: TopicPartition, at_s: float, priority: int) -> None:
    offset = bufs.total() + 100 * tp.partition
    bufs.push(Record(tp, offset, None, b"x", (), 0, at_s, 1, priority))


WAITS = {Priority.HIGH: 0.002, Priority.NORMAL: 0.020, Priority.LOW: 0.050}


def test_high_priority_cuts_early_and_low_waits_longer(bufs: PartitionBuffers) -> None:
    batcher = Batcher(8, 1 << 20, WAITS)
    prio(bufs, A, 100.0, priority=2)  # low: deadline 100.050
    assert batcher.decide(bufs.views(), 100.010) == Wait(pytest.approx(100.050))
    prio(bufs, B, 100.009, priority=0)  # high: deadline 100.011
    assert batcher.decide(bufs.views(), 100.010) == Wait(pytest.approx(100.011))
    assert batcher.decide(bufs.views(), 100.011) == Cut(8, "deadline")


def test_take_is_earliest_deadline_first_and_low_priority_ages(bufs: PartitionBuffers) -> None:
    batcher = Batcher(8, 1 << 20, WAITS)
    prio(bufs, A, 100.000, priority=2)  # low, deadline 100.050
    prio(bufs, B, 100.049, priority=0)  # high, deadline 100.051
    taken, _ = bufs.take(1, None, batcher.max_wait_s)
    assert taken[0].tp == A  # the old low-priority record has aged past the fresh high one
    prio(bufs, A, 100.050, priority=2)  # fresh low, deadline 100.100
    taken, _ = bufs.take(1, None, batcher.max_wait_s)
    assert taken[0].tp == B


def test_urgent_record_behind_older_ones_pulls_its_partition_first(bufs: PartitionBuffers) -> None:
    batcher = Batcher(8, 1 << 20, WAITS)
    prio(bufs, A, 100.000, priority=2)
    prio(bufs, A, 100.001, priority=0)  # high, but behind a low one in offset order
    prio(bufs, B, 100.000, priority=1)  # normal, deadline 100.020
    taken, _ = bufs.take(2, None, batcher.max_wait_s)
    assert [(r.tp, r.priority) for r in taken] == [(A, 2), (A, 0)]  # offset order kept


def test_the_candidate_sizes_follow_the_cap_down_and_back_up() -> None:
    sizer = AdaptiveBatchSize(16)
    assert sizer.candidates == [1, 2, 4, 8, 16]
    sizer.set_cap(12)
    assert sizer.candidates == [1, 2, 4, 8, 12]
    sizer.observe(12, 0.01)
    sizer.observe(16, 0.01)  # above the cap now: not a candidate, ignored
    assert sizer.throughput(12) is None and 16 not in sizer._service_s
    sizer.cap = 3  # a plain assignment counts too
    assert sizer.candidates == [1, 2, 3]
    sizer.set_cap(64)  # clamped to max_batch_size
    assert sizer.candidates == [1, 2, 4, 8, 16]


def test_adaptive_size_finds_the_throughput_optimum() -> None:
    # service times measured here for EfficientNet-Lite0 on 2 CPU cores (issue 4):
    # 46 img/s at batch 1, 63 at 4, 32 at 16 -> the optimum is 4, not the maximum.
    profile = {1: 1 / 46, 2: 2 / 55, 4: 4 / 63, 8: 8 / 45, 16: 16 / 32}
    batcher = Batcher(16, 1 << 30, 0.020, adaptive=True)
    sizer = batcher.sizer
    assert sizer is not None and sizer.candidates == [1, 2, 4, 8, 16]
    for _ in range(40):
        size = batcher.target
        batcher.observe(size, profile[size])
    assert batcher.target == 4
    assert sizer.throughput(4) == pytest.approx(63)
    assert sizer.throughput(16) is None  # past the peak at 8 (45 < 0.8 x 63): never tried


def test_adaptive_size_trusts_no_single_batch_and_rechecks_both_neighbours() -> None:
    sizer = Batcher(64, 1 << 30, 0.020, adaptive=True).sizer
    assert sizer is not None
    sizer.observe(1, 1 / 100)
    sizer.observe(1, 1 / 100)
    assert sizer.target() == 1  # two batches are not enough to trust size 1
    profile = {1: 1 / 100, 2: 2 / 150, 4: 4 / 300, 8: 8 / 200, 16: 16 / 100}
    seen = []
    for _ in range(400):
        size = sizer.target()
        seen.append(size)
        sizer.observe(size, profile[size])
    assert sizer.target() == 4
    assert 2 in seen[100:] and 8 in seen[100:]  # periodic re-measurement below and above
    assert seen[100:].count(4) > 0.9 * 300
    assert 32 not in seen and 16 not in seen  # 8 already fell below 0.8 x best


def test_adaptive_size_is_used_for_size_cuts(bufs: PartitionBuffers) -> None:
    batcher = Batcher(16, 1 << 30, 1.0, adaptive=True)
    fill(bufs, A, [100.0])
    assert batcher.decide(bufs.views(), 100.0) == Cut(1, "size")  # first size to measure: 1
    for size, rate in ((1, 10.0), (2, 30.0), (4, 20.0), (8, 10.0), (16, 5.0)):
        for _ in range(3):
            batcher.observe(size, size / rate)
    fill(bufs, A, [100.0])
    assert batcher.decide(bufs.views(), 100.0) == Cut(2, "size")


def test_adaptive_size_prefers_the_smaller_of_near_equal_sizes() -> None:
    sizer = Batcher(16, 1 << 30, 0.020, adaptive=True).sizer
    assert sizer is not None
    # 8 is the fastest, 4 within 5 % of it (same work, half the wait), 2 clearly slower
    profile = {1: 1 / 30, 2: 2 / 45, 4: 4 / 60, 8: 8 / 62, 16: 16 / 40}
    for _ in range(30):
        size = sizer.target()
        sizer.observe(size, profile[size])
    assert sizer.target() == 4
    slower = {**profile, 4: 4 / 55}  # 4 now 11 % below 8: throughput wins
    sizer = Batcher(16, 1 << 30, 0.020, adaptive=True).sizer
    assert sizer is not None
    for _ in range(30):
        size = sizer.target()
        sizer.observe(size, slower[size])
    assert sizer.target() == 8


def test_a_fused_lane_aims_for_the_throughput_optimal_size_itself() -> None:
    batcher = Batcher(16, 1 << 30, 0.020, adaptive=True)
    lane = Lane("in", PartitionBuffers(64, 0.75, 0.25), batcher, OffsetTracker())
    sizer = batcher.sizer
    assert sizer is not None
    profile = {1: 1 / 30, 2: 2 / 45, 4: 4 / 60, 8: 8 / 62, 16: 16 / 40}  # 4 within 5 % of 8
    for _ in range(30):
        size = sizer.target()
        sizer.observe(size, profile[size])
    assert lane.target == 4  # staged: the latency tie-break
    lane.observe(16, 16 / 1000, whole=True)  # a fused batch's whole time: not learnt staged
    assert sizer.throughput(16) == 40
    lane.aim_for_throughput(True)
    assert lane.target == 8  # fused: the fastest size
    lane.observe(4, 4 / 1000)  # a staged probe's device time: not learnt fused
    assert sizer.throughput(4) == 60
    lane.aim_for_throughput(False)
    assert lane.target == 4
    with pytest.raises(ValueError, match="near_best"):
        sizer.set_near_best(0.0)


def test_adaptive_size_ignores_one_interfered_batch_but_follows_a_lasting_slowdown() -> None:
    # trades model on 2 busy cores (measured): about 0.2 ms per batch at any size up to 256
    # alone, but a batch that loses the CPU mid-call can take 30 ms.
    clean = {size: 0.0002 + size * 0.000002 for size in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    sizer = Batcher(256, 1 << 30, 0.002, adaptive=True).sizer
    assert sizer is not None
    outlier_at = {32: 1, 64: 2}  # the 2nd batch of 32 and the 3rd of 64 were interfered with
    seen: dict[int, int] = {}
    while (size := sizer.unmeasured()) is not None:
        slow = outlier_at.get(size) == seen.get(size, 0)
        sizer.observe(size, 0.030 if slow else clean[size])
        seen[size] = seen.get(size, 0) + 1
    assert sizer.target() == 256  # an average would have stopped exploring at 32
    # a lasting slowdown of 256 (e.g. a shared device): followed once the window has turned
    for _ in range(sizer.window):
        sizer.observe(256, 0.05)
    assert sizer.throughput(256) == pytest.approx(256 / 0.05)
    assert sizer.target() == 128

    with pytest.raises(ValueError, match="window"):
        AdaptiveBatchSize(16, window=0)


def test_adaptive_size_ignores_service_times_that_are_not_positive_and_finite() -> None:
    sizer = AdaptiveBatchSize(4, min_observations=1)
    for bad in (math.nan, math.inf, 0.0, -1.0):
        sizer.observe(2, bad)  # a NaN first in a window made min() NaN for good
    sizer.observe(3, 0.001)  # not a candidate
    assert sizer.throughput(2) is None and sizer.throughput(3) is None
    for size in (1, 2, 4):
        sizer.observe(size, 0.001 * size**0.5)
    assert sizer.target() == 4


def test_calibration_is_round_robin_so_a_drifting_machine_favours_no_size() -> None:
    # the machine slows by 10 % per batch during calibration (this VM drifts by tens of
    # percent within seconds); measured one size after the other, size 2 (83 % of 4's rate)
    # looked faster than 4 and won
    rate = {1: 30.0, 2: 50.0, 4: 60.0, 8: 50.0, 16: 30.0}
    sizer = Batcher(16, 1 << 30, 0.020, adaptive=True).sizer
    assert sizer is not None
    order = []
    while (size := sizer.unmeasured()) is not None:
        sizer.observe(size, size / rate[size] * (1 + 0.1 * len(order)))
        order.append(size)
    assert order[:4] == [1, 2, 4, 8]  # a first round over the sizes in play
    assert sorted(order) == [1, 1, 1, 2, 2, 2, 4, 4, 4, 8, 8, 8]  # as many batches as before
    assert sizer.target() == 4


def test_sparse_arrivals_cut_at_once_instead_of_waiting_for_nothing(bufs: PartitionBuffers) -> None:
    clock = FakeClock()
    batcher = Batcher(4, 1 << 20, max_wait_s=0.05)
    fill(bufs, A, [clock.now_s])
    assert isinstance(batcher.decide(bufs.views(), clock()), Wait)  # no gaps known yet
    # video at about 10 msg/s: one frame per 100 ms, each cut alone
    for k in range(4):
        batcher.cut([clock.now_s - 0.4 + 0.1 * k])
    assert batcher.arrivals.typical_s == pytest.approx(0.1)
    # a frame every 100 ms, 50 ms to the deadline: waiting adds latency only
    assert batcher.decide(bufs.views(), clock()) == Cut(4, "sparse")


def test_arrivals_that_can_grow_the_batch_are_waited_for(bufs: PartitionBuffers) -> None:
    clock = FakeClock()
    batcher = Batcher(4, 1 << 20, max_wait_s=0.05)
    for k in range(4):
        batcher.cut([clock.now_s - 0.04 + 0.01 * k])  # 100 msg/s: 5 expected in 50 ms
    fill(bufs, A, [clock.now_s])
    decision = batcher.decide(bufs.views(), clock())
    assert decision == Wait(pytest.approx(clock.now_s + 0.05))
    # 35 ms later 15 ms are left: a 10 ms gap still fits, worth the wait; at 45 ms not
    clock.now_s += 0.035
    assert isinstance(batcher.decide(bufs.views(), clock()), Wait)
    clock.now_s += 0.010
    assert batcher.decide(bufs.views(), clock()) == Cut(4, "sparse")


def test_a_backlog_fetched_in_one_poll_gives_no_sparse_cut(bufs: PartitionBuffers) -> None:
    batcher = Batcher(4, 1 << 20, max_wait_s=0.05)
    for _ in range(5):
        batcher.cut([100.0] * 256)  # one consume time for everything
    assert batcher.arrivals.typical_s == 0.0
    batcher.cut([99.0])  # an older record (another partition, earliest deadline first)
    assert batcher.arrivals.typical_s == 0.0  # gaps are never negative
    fill(bufs, A, [100.0])
    assert batcher.decide(bufs.views(), 100.001) == Wait(pytest.approx(100.05))


def test_a_burst_after_idle_forms_one_batch() -> None:
    """Bursts of 8 messages within 1 ms, 2 s apart; max wait 5 ms, batch 8, a 20 ms model.

    Replays the dispatcher's loop with a fake clock: a message is consumed, the batcher is
    asked (the device is free: the previous burst finished long ago), and either cuts or waits
    until the next arrival or its deadline. Every burst after the first must be cut as one
    batch of 8 (the mean rate over the idle gaps, 4 msg/s, once cut each burst's first
    message alone 0.4 ms after it was consumed).
    """
    batcher = Batcher(8, 1 << 20, max_wait_s=0.005)
    bufs = PartitionBuffers(capacity=64, high_watermark=1.0, low_watermark=0.0)
    bufs.assign([A])
    cuts: list[list[int]] = []
    offset = 0
    for burst in range(6):
        start_s = 100.0 + 2.0 * burst
        arrivals = [start_s + 0.000125 * i for i in range(8)]
        sizes: list[int] = []
        pending = list(arrivals)
        now_s = start_s
        while pending or bufs.total():
            while pending and pending[0] <= now_s:
                bufs.push(Record(A, offset, None, b"x", (), 0, pending.pop(0), 1))
                offset += 1
            decision = batcher.decide(bufs.views(), now_s)
            if isinstance(decision, Cut):
                records, _ = bufs.take(decision.count, None, batcher.max_wait_s)
                batcher.cut([r.consumed_at_s for r in records])
                sizes.append(len(records))
                now_s += 0.020  # the model's time; the next burst is far away
                continue
            wake = [t for t in (decision.until_s, pending[0] if pending else None) if t]
            now_s = max(now_s, min(wake))
        cuts.append(sizes)
    assert all(sizes == [8] for sizes in cuts[1:]), cuts


TRADES_80PCT = Path(__file__).parent / "data" / "adaptive_batch_trades_80pct.csv"
CALIBRATION = 27  # the recording's first rows: start-up calibration, 3 rounds over 1..256


def _recorded(path: Path) -> list[tuple[int, float]]:
    """(batch size, device seconds) per batch, as the results thread reported them."""
    lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    rows = list(csv.DictReader(lines))
    return [(int(row["size"]), float(row["device_us"]) / 1e6) for row in rows]


def test_a_recorded_trades_run_does_not_ratchet_down_to_tiny_batches() -> None:
    # The drift of issue 15, as recorded: trades at 80 % load. Calibration (idle process) timed
    # every size from 1 to 256 at 70-110 µs; the stream then timed the size in use at 0.3-0.6
    # ms at best (up to 38 ms) while every other size kept its idle-time best. Today's code
    # went 256 -> 128 -> 16 -> 8 -> 4 -> 2 -> 1 and cut batches of 1-8 for ~90 batches
    # (observations 417-505), although each fresh batch of 1-8 cost >= 4x more device time per
    # message than the run's fresh batches of 256. The replay is open loop (the recorded run
    # fed only the sizes today's code asked for), so where it fed a hundred batches of 32 the
    # freshest evidence is of 32 alone: the tolerance is "never below 16", and 256 once fresh
    # batches of 256 arrive or are due for a re-measurement.
    sizer = AdaptiveBatchSize(256)
    targets = []
    for size, service_s in _recorded(TRADES_80PCT):
        sizer.observe(size, service_s)
        targets.append(sizer.target())
    live = targets[CALIBRATION:]
    assert min(live) >= 16, f"the target fell to {min(live)}"
    assert targets[505] == 256  # where today's code aimed for batches of 2


def test_interference_in_stretches_keeps_the_target_at_the_optimum() -> None:
    # A closed-loop model of the same run (seeded, no clocks): device time of the trades model
    # at n rows is 80 µs + 0.1 µs x n on an idle process (calibration); on the live stream add
    # 100 µs and interference not proportional to the work, as recorded for batches of 256
    # (60 % up to 0.4 ms, 30 % 0.4-3 ms, 10 % 3-20 ms), and in 30 % of the stretches of 40
    # batches a floor of 1-4 ms (runs of 8+ batches all above 1 ms are in the recording: another
    # thread or process held the cores). 256 is the optimum throughout: the interference is
    # the same at every size. Today's code ratcheted down to batches of 1 in every seed, with
    # 1.6-9.2 % of all batches at 16 or fewer rows. Tolerated now: a size whose only fast times
    # are old (calibration) gets single batches to be re-measured when the size in use is
    # interfered with (< 1 % of the batches), and 128 and 256 trade places on noise (both
    # within one power of two of the optimum: a few percent of CPU per message here).
    def device_s(n: int) -> float:
        return 80e-6 + 0.1e-6 * n

    for seed in range(5):
        rng = random.Random(seed)
        sizer = AdaptiveBatchSize(256)
        while (size := sizer.unmeasured()) is not None:
            sizer.observe(size, device_s(size) * rng.uniform(1.0, 1.3))
        floor_s = 0.0
        sizes = []
        for i in range(3000):
            if i % 40 == 0:
                floor_s = rng.uniform(1e-3, 4e-3) if rng.random() < 0.3 else 0.0
            size = sizer.target()
            sizes.append(size)
            u = rng.random()
            spread = (0.0, 0.4e-3) if u < 0.6 else (0.4e-3, 3e-3) if u < 0.9 else (3e-3, 20e-3)
            sizer.observe(size, device_s(size) + 100e-6 + rng.uniform(*spread) + floor_s)
        small = sum(size <= 16 for size in sizes) / len(sizes)
        assert min(sizes) >= 8 and small < 0.01, (seed, min(sizes), small)
        assert sizes[-100:].count(256) >= 90, (seed, sizes[-100:])
