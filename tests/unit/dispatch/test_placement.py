"""Several devices: where each batch goes (pure policy, fake clock and fake device times; no
threads)."""

from __future__ import annotations

import pytest
import structlog

from streamproc.dispatch.placement import DeviceLoad, Placement
from streamproc.metrics import Metrics
from tests.support.kafka_fakes import FakeClock


def simulate(
    placement: Placement,
    service_s: list[float | None],
    batches: int,
    clock: FakeClock,
    size: int = 4,
) -> list[int]:
    """A saturated stream (a batch is always ready) over devices that run their batches one
    at a time, FIFO, ``service_s[d]`` seconds each (None: never completes). A completed batch
    is released at once. Returns the device of each batch, in placement order."""
    queues: list[list[int]] = [[] for _ in service_s]
    started_s: list[float] = [0.0 for _ in service_s]
    placed: list[int] = []
    while len(placed) < batches:
        while len(placed) < batches and placement.has_capacity():
            device = placement.choose(size, clock())
            assert device is not None
            batch_id = len(placed) + 1
            placement.placed(device, batch_id, size, clock())
            if not queues[device]:
                started_s[device] = clock()
            queues[device].append(batch_id)
            placed.append(device)
        finishing = [
            (started_s[d] + s, d) for d, s in enumerate(service_s) if s is not None and queues[d]
        ]
        if not finishing:
            break  # every device with work has stopped
        finish_s, device = min(finishing)
        clock.advance(finish_s - clock())
        done = queues[device].pop(0)
        service = service_s[device]
        assert service is not None
        placement.completed(done, service, clock())
        placement.released(done)
        started_s[device] = clock()
    return placed


def test_a_device_twice_as_fast_gets_about_two_thirds_of_the_batches() -> None:
    clock = FakeClock()
    placed = simulate(Placement(2, 2, stall_timeout_s=30.0), [0.010, 0.020], 600, clock)
    share = placed.count(0) / len(placed)
    assert 0.63 <= share <= 0.70, share
    # both devices busy all along: 400 batches x 10 ms (round-robin: 300 x 20 ms = 6 s)
    assert clock() - 1000.0 == pytest.approx(4.0, rel=0.05)


def test_the_batch_goes_to_the_device_expected_to_finish_it_first() -> None:
    clock = FakeClock()
    placement = Placement(2, 4, stall_timeout_s=30.0)
    placement.observe(0, 8, 0.010)  # fast
    placement.observe(1, 8, 0.025)  # 2.5x slower
    assert placement.choose(8, clock()) == 0  # both idle: the fast one
    for batch_id in (1, 2):
        placement.placed(0, batch_id, 8, clock())
    # fast has 20 ms queued -> 30 ms; slow idle -> 25 ms: the slow one finishes first
    assert placement.expected_finish_s(0, 8, clock()) == pytest.approx(clock() + 0.030)
    assert placement.choose(8, clock()) == 1
    # 6 ms later the fast one's running batch has 4 ms left: 4 + 10 + 10 = 24 ms < 25 ms
    clock.advance(0.006)
    assert placement.choose(8, clock()) == 0
    # sizes never measured are scaled from the nearest measured size
    assert placement.estimate_s(0, 16) == pytest.approx(0.020)
    # a device never measured counts as the mean of the measured ones
    fresh = Placement(3, 1, stall_timeout_s=30.0)
    fresh.observe(0, 8, 0.010)
    fresh.observe(1, 8, 0.030)
    assert fresh.estimate_s(2, 8) == pytest.approx(0.020)


def test_a_device_that_stops_completing_gets_nothing_after_its_in_flight_limit() -> None:
    clock = FakeClock()
    placement = Placement(2, 3, stall_timeout_s=5.0)
    placed = simulate(placement, [0.010, None], 200, clock)
    assert placed.count(1) == 3  # its in-flight limit, then never again
    assert placed.count(0) == 197
    assert placement.in_flight(1) == 3 and placement.waiting(1) == (2, 4, 6)
    assert clock() - 1000.0 < 5.0 and placement.stalled(clock()) == ()  # not yet
    clock.advance(5.0)
    assert placement.stalled(clock()) == (1,)


def test_stalls_are_reported_once_with_log_and_gauge_and_cleared_on_recovery() -> None:
    clock = FakeClock()
    metrics = Metrics()
    load = DeviceLoad("frames", ["cpu:0", "cpu:1"], 2, 5.0, metrics, clock=clock)
    stuck = load.place(1, 4)
    other = load.place(2, 4)
    assert {stuck, other} == {0, 1}
    load.completed(2, 0.01)
    load.released(2)
    label = ["cpu:0", "cpu:1"][stuck]

    def sample(name: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"topic": "frames", "device": label})

    clock.advance(4.9)
    assert load.check_stalls() == () and sample("streamproc_device_stalled") == 0
    clock.advance(0.2)
    with structlog.testing.capture_logs() as logs:
        assert load.check_stalls() == (label,)
        assert load.check_stalls() == (label,)  # still stalled: reported once
    errors = [e for e in logs if e["log_level"] == "error"]
    assert len(errors) == 1 and errors[0]["device"] == label
    assert errors[0]["waiting_batches"] == [1] and errors[0]["topic"] == "frames"
    assert sample("streamproc_device_stalled") == 1
    assert sample("streamproc_device_batches_total") == 1
    assert sample("streamproc_device_in_flight_batches") == 1
    load.completed(1, 5.1)
    load.released(1)
    assert load.check_stalls() == () and sample("streamproc_device_stalled") == 0
    assert sample("streamproc_device_busy_seconds_total") == pytest.approx(5.1)
    assert load.batches() == {"cpu:0": 1, "cpu:1": 1}


def test_place_refuses_when_every_device_is_full() -> None:
    load = DeviceLoad("t", ["cpu:0"], 1, 5.0, Metrics(), clock=FakeClock())
    load.place(1, 4)
    with pytest.raises(RuntimeError):
        load.place(2, 4)
