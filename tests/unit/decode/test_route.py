"""The inline-or-threads route policy, driven by a fake clock and a fake cost model per way."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from streamproc.decode.route import DecodeRoutePolicy, Route
from tests.support.kafka_fakes import FakeClock


@dataclass
class Costs:
    """Seconds to decode a batch of ``batch`` records each way, as (dispatcher's wait, CPU):
    inline, ``per_item_s`` a record, both; on the pool, ``handoff_s`` of CPU per slice plus the
    records' CPU times ``contention`` (GIL-bound slices take turns), and a wait of the hand-offs
    plus the longest slice's records when the decoder releases the GIL (``parallel``: the
    ``workers`` slices run at once on free cores) or all of them when it does not."""

    batch: int = 256
    per_item_s: float = 2.2e-6
    handoff_s: float = 30e-6
    workers: int = 2
    parallel: bool = False
    contention: float = 1.15

    def seconds(self, route: Route) -> tuple[float, float]:
        if route == "inline":
            return self.batch * self.per_item_s, self.batch * self.per_item_s
        slices = min(self.workers, self.batch)
        cpu_s = slices * self.handoff_s + self.batch * self.per_item_s * self.contention
        rows = math.ceil(self.batch / slices) if self.parallel else self.batch
        return slices * self.handoff_s + rows * self.per_item_s * self.contention, cpu_s


def drive(
    policy: DecodeRoutePolicy, clock: FakeClock, costs: Costs, seconds: float
) -> tuple[list[Route], list[tuple[float, Route]]]:
    """Feed the policy a backlog of batches for ``seconds`` of fake time; returns the way of
    every batch and the changes (time, way)."""
    routes: list[Route] = []
    changes: list[tuple[float, Route]] = []
    end_s = clock() + seconds
    while clock() < end_s:
        route = policy.route()
        wall_s, cpu_s = costs.seconds(route)
        clock.advance(wall_s + 0.001)  # the rest of the dispatcher's cycle
        routes.append(route)
        change = policy.observe(route, costs.batch, wall_s, cpu_s)
        if change is not None:
            assert change.route == policy.settled
            changes.append((clock(), change.route))
    return routes, changes


def test_light_gil_bound_decode_goes_inline_after_one_probe_and_stays() -> None:
    clock = FakeClock()
    policy = DecodeRoutePolicy(clock)
    assert policy.settled == "pool" and policy.probing
    routes, changes = drive(policy, clock, Costs(), 1800.0)
    assert [route for _, route in changes] == ["inline"]
    assert changes[0][0] - 1000.0 < 1.0  # the first probe decides within a second
    assert policy.settled == "inline"
    # afterwards the pool gets only probe batches, ever fewer (rechecks 30 s, 60 s, ... 600 s)
    assert routes.count("pool") <= 16 * 8
    assert routes[-1] == "inline"


def test_small_batches_go_inline_where_hand_offs_dominate() -> None:
    clock = FakeClock()
    policy = DecodeRoutePolicy(clock)
    _, changes = drive(policy, clock, Costs(batch=4, contention=1.0), 60.0)
    assert [route for _, route in changes] == ["inline"]


def test_expensive_decode_that_splits_over_the_pool_stays_on_the_pool() -> None:
    clock = FakeClock()
    policy = DecodeRoutePolicy(clock)
    video = Costs(batch=2, per_item_s=2e-3, handoff_s=50e-6, parallel=True, contention=1.0)
    routes, changes = drive(policy, clock, video, 1800.0)
    assert changes == []
    assert policy.settled == "pool"
    # probes (8 batches inline each) at 0 s, then 30, 60, 120, 240, 480, 600, 600 s apart
    assert routes.count("inline") <= 16 * 9
    assert routes.count("pool") > 20 * routes.count("inline")


def test_an_expensive_decode_with_no_split_keeps_the_way_it_has() -> None:
    """JPEG-like cost on a pool of one thread: the pool costs only its hand-off more (2.5 %
    CPU and wait), within the margin, so the lane keeps the pool (the sizer can still grow
    it)."""
    clock = FakeClock()
    policy = DecodeRoutePolicy(clock)
    video = Costs(batch=2, per_item_s=2e-3, handoff_s=50e-6, workers=1, contention=1.0)
    _, changes = drive(policy, clock, video, 600.0)
    assert changes == [] and policy.settled == "pool"


def test_costs_within_the_margin_never_flap() -> None:
    """Pool and inline within 5 % of each other (wait and CPU), alternating which is cheaper
    from probe to probe: the lane never switches."""
    clock = FakeClock()
    policy = DecodeRoutePolicy(clock, recheck_s=1.0, max_recheck_s=1.0)
    changes: list[Route] = []
    for probe in range(200):
        factor = 0.95 if probe % 2 else 1.05
        for _ in range(2 * policy.probe_batches):
            route = policy.route()
            decode_s = 1e-3 * (factor if route == "inline" else 1.0)
            clock.advance(decode_s)
            if (change := policy.observe(route, 100, decode_s, decode_s)) is not None:
                changes.append(change.route)
        clock.advance(1.0)
    assert changes == []


def test_a_lane_whose_decode_turns_expensive_goes_back_to_the_pool() -> None:
    clock = FakeClock()
    policy = DecodeRoutePolicy(clock, recheck_s=300.0)
    _, changes = drive(policy, clock, Costs(), 5.0)
    assert [route for _, route in changes] == ["inline"]
    # the payload changes: 1,000x the decode per record, and it now splits over the pool (the
    # same CPU either way, but the pool halves the dispatcher's wait)
    heavy = Costs(per_item_s=2.2e-3, parallel=True, contention=1.0)
    switched_s = clock()
    _, changes = drive(policy, clock, heavy, 600.0)
    assert [route for _, route in changes] == ["pool"]
    # noticed by the drift check (64 inline batches, ~36 s here, then a probe of 8 + 8),
    # not the 300 s recheck
    assert changes[0][0] - switched_s < 60.0


def test_a_probe_alternates_the_two_ways_batch_by_batch() -> None:
    clock = FakeClock()
    policy = DecodeRoutePolicy(clock, probe_batches=3)
    routes = []
    for _ in range(6):
        route = policy.route()
        routes.append(route)
        seconds = 1e-4 if route == "inline" else 1e-3
        policy.observe(route, 10, seconds, seconds)
    assert routes == ["pool", "inline", "pool", "inline", "pool", "inline"]
    assert not policy.probing and policy.settled == "inline"


def test_route_policy_refuses_bad_settings() -> None:
    with pytest.raises(ValueError):
        DecodeRoutePolicy(probe_batches=0)
    with pytest.raises(ValueError):
        DecodeRoutePolicy(margin=1.0)
    with pytest.raises(ValueError):
        DecodeRoutePolicy(drift=1.0)


def test_one_preempted_batch_in_a_probe_does_not_decide_it() -> None:
    """Trades-like costs, but two inline batches of the probe took 10 ms more (20x the whole
    batch's decode; wall and CPU): the medians per record still show inline cheaper."""
    clock = FakeClock()
    policy = DecodeRoutePolicy(clock)
    costs = Costs()
    inline_batches = 0
    while policy.probing:
        route = policy.route()
        wall_s, cpu_s = costs.seconds(route)
        if route == "inline":
            inline_batches += 1
            if inline_batches in (2, 7):
                wall_s, cpu_s = wall_s + 0.010, cpu_s + 0.010
        clock.advance(wall_s)
        policy.observe(route, costs.batch, wall_s, cpu_s)
    assert policy.settled == "inline"
