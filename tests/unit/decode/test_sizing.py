"""The decode-worker sizing policy, driven by a fake clock and a fake decode cost model.

The model: a dispatcher with a backlog decodes batches of ``batch`` records, ``cost_s`` CPU
seconds each, on ``cores`` cores: ``w`` workers split a batch into ``min(w, batch)`` slices of at
most ``ceil(batch / w)`` records, and slices beyond the cores share them. The device takes
``device_s`` per batch, overlapped with the next decode (two batches in flight), so a batch
cycle lasts ``max(decode, device)`` (plus ``gap_s`` when input is sparse).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest

from streamproc.decode.protocol import DecodeSample
from streamproc.decode.sizing import DecodeSizer, DecodeSizingPolicy
from streamproc.metrics import Metrics
from tests.support.kafka_fakes import FakeClock


@dataclass
class Load:
    batch: int = 16
    cost_s: float = 0.002
    cores: int = 8
    device_s: float = 0.001
    gap_s: float = 0.0  # idle time between batches (input-bound)

    def decode_s(self, workers: int) -> float:
        slices = min(workers, self.batch)
        return math.ceil(self.batch / workers) * self.cost_s * max(1.0, slices / self.cores)


def run(
    policy: DecodeSizingPolicy, clock: FakeClock, load: Load | None, seconds: float
) -> list[tuple[float, int]]:
    """Drive the policy for ``seconds`` of fake time (``load`` None: no input at all); returns
    (time, count) after each change."""
    changes: list[tuple[float, int]] = []
    end_s = clock() + seconds
    while clock() < end_s:
        if load is None:
            clock.advance(0.1)
        else:
            decode_s = load.decode_s(policy.workers)
            clock.advance(max(decode_s, load.device_s) + load.gap_s)
            policy.observe(DecodeSample("video", load.batch, decode_s, policy.workers))
        decision = policy.decide()
        if decision is not None:
            assert decision.workers == policy.workers
            policy.resized(decision.workers)
            changes.append((clock(), decision.workers))
    return changes


def test_grows_under_a_decode_bound_load_to_the_count_that_pays() -> None:
    clock = FakeClock()
    policy = DecodeSizingPolicy(1, 8, 1, clock)
    changes = run(policy, clock, Load(batch=16, cores=8), 120)
    # 1 -> 2 -> 3 -> 4 -> 6 -> 8: 5 is skipped (ceil(16/5) = ceil(16/4) = 4 records per slice)
    assert [count for _, count in changes] == [2, 3, 4, 6, 8]
    assert policy.workers == 8
    # a trial lasts two windows (4 s), and the next step follows it at once
    assert changes[-1][0] - changes[0][0] < 4 * 4.1


def test_never_beyond_the_bounds() -> None:
    clock = FakeClock()
    policy = DecodeSizingPolicy(2, 4, 2, clock)
    seen = [count for _, count in run(policy, clock, Load(batch=64, cores=64), 300)]
    assert max(seen) == 4 and policy.workers == 4
    seen += [count for _, count in run(policy, clock, None, 300)]
    assert min(seen) == 2 and policy.workers == 2
    assert all(2 <= count <= 4 for count in seen)
    with pytest.raises(ValueError, match="minimum <= start <= maximum"):
        DecodeSizingPolicy(3, 2, 2, clock)


def test_shrinks_when_idle_one_worker_per_three_quiet_windows() -> None:
    clock = FakeClock()
    policy = DecodeSizingPolicy(1, 8, 6, clock)
    changes = run(policy, clock, None, 60)
    assert [count for _, count in changes] == [5, 4, 3, 2, 1]
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(changes)]
    assert all(gap >= 3 * policy.window_s - 0.2 for gap in gaps)  # three windows each
    assert policy.last_window == {}


def test_no_flapping_where_more_workers_do_not_pay() -> None:
    """Two cores: 2 workers halve the decode, a third only time-shares the cores. The policy
    settles at 2 and probes 3 again only after a back-off that doubles (30, 60, ... 600 s)."""
    clock = FakeClock()
    policy = DecodeSizingPolicy(1, 8, 1, clock)
    changes = run(policy, clock, Load(batch=16, cores=2), 1800)
    counts = [count for _, count in changes]
    assert counts[:3] == [2, 3, 2]
    assert set(counts) == {2, 3} and policy.workers == 2
    probes = [t for t, count in changes if count == 3]
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert all(later >= earlier for earlier, later in itertools.pairwise(gaps))
    assert len(probes) <= 7  # 30 + 60 + 120 + 240 + 480 + 600 s of back-off fill 30 minutes
    time_at_2 = sum(
        (b[0] if b is not None else clock()) - a[0]
        for a, b in zip(changes, [*changes[1:], None], strict=True)
        if a[1] == 2
    )
    assert time_at_2 / (clock() - changes[0][0]) > 0.98


def test_holds_between_the_thresholds() -> None:
    """Decode waits 40 % of the time with 2 workers: not decode-bound (< 50 %), and one worker
    fewer would wait 80 % (> 25 %): the count holds for good."""
    clock = FakeClock()
    policy = DecodeSizingPolicy(1, 8, 2, clock)
    load = Load(batch=4, cost_s=0.01, cores=8, device_s=0.0, gap_s=0.03)  # 20 ms of 50 ms
    assert run(policy, clock, load, 600) == []
    assert policy.workers == 2
    assert policy.last_window["video"].share == pytest.approx(0.4, abs=0.02)


def test_a_light_load_shrinks_to_what_keeps_decode_below_a_quarter() -> None:
    clock = FakeClock()
    policy = DecodeSizingPolicy(1, 8, 8, clock)
    # 64 records of 1 ms per batch, one batch per 100 ms on 8 cores: w workers wait 64/w ms.
    load = Load(batch=64, cost_s=0.001, cores=8, device_s=0.0, gap_s=0.1)
    run(policy, clock, load, 300)
    # 8 -> 4 waits 16 ms of ~116 ms; 3 would wait 22 of 122 ms: 0.18 * 4/3 < 0.25 allows it;
    # at 3, two workers would wait 32 ms of 132 (0.24 expected before: 0.18 * 3/2 = 0.27): hold.
    assert policy.workers == 3
    assert policy.last_window["video"].share < policy.grow_share


def test_batches_of_one_record_never_grow_the_pool() -> None:
    clock = FakeClock()
    policy = DecodeSizingPolicy(1, 8, 1, clock)
    assert run(policy, clock, Load(batch=1, cost_s=0.02, cores=8), 60) == []
    assert policy.last_window["video"].share == pytest.approx(1.0, abs=0.01)


def test_samples_split_for_another_count_are_ignored() -> None:
    clock = FakeClock()
    policy = DecodeSizingPolicy(1, 4, 2, clock)
    policy.observe(DecodeSample("video", 8, 5.0, workers=3))  # decoded before a resize
    clock.advance(2.5)
    assert policy.decide() is None
    assert policy.last_window == {}


class _FakeWorkers:
    def __init__(self, workers: int, reach: int | None = None) -> None:
        self.workers = workers
        self.reach = reach  # the most it can start (a process that fails to start)
        self.calls: list[int] = []

    def resize(self, workers: int) -> int:
        self.calls.append(workers)
        self.workers = workers if self.reach is None else min(workers, self.reach)
        return self.workers


def test_sizer_applies_decisions_and_sets_the_metrics() -> None:
    clock = FakeClock()
    metrics = Metrics()
    workers = _FakeWorkers(1, reach=2)
    sizer = DecodeSizer(workers, DecodeSizingPolicy(1, 8, 1, clock), metrics)
    load = Load(batch=16, cores=8)

    def window() -> None:
        end_s = clock() + 2.0
        while clock() < end_s:
            decode_s = load.decode_s(workers.workers)
            clock.advance(decode_s)
            sizer.observe(DecodeSample("video", load.batch, decode_s, workers.workers))
        sizer.step()

    window()
    assert workers.calls == [2] and metrics.decode_workers._value.get() == 2
    ratio = metrics.decode_wait_ratio.labels("video")._value.get()
    assert ratio == pytest.approx(1.0)
    window()
    assert workers.calls == [2]  # the trial spans two windows
    window()  # the trial pays (twice the rate): kept, and 3 asked for at once
    assert workers.calls == [2, 3] and workers.workers == 2  # a process failed to start
    assert metrics.decode_workers._value.get() == 2 and sizer.workers == 2
    window()  # growth backs off instead of failing to start a process every window
    assert workers.calls == [2, 3]
