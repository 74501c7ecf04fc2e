"""A lane on one CPU device with its fused route, real threads, wired as the assembly wires it:
which thread runs each batch, cut order across route switches with batches in flight, the
route policy's stints, and the start-up refusal of ``always`` where a lane cannot fuse."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from streamproc.assembly.topic import fusable
from streamproc.config.sections import WorkerConfig
from streamproc.device import DeviceResult, DeviceWorker, Release, StagingPool
from streamproc.device.recovery import BrokenModelError
from streamproc.dispatch.dispatcher import Dispatcher
from streamproc.dispatch.fusion import PROBE_BATCHES, FusedRun, LaneRoute, LaneRoutePolicy
from streamproc.dispatch.placement import DeviceLoad
from streamproc.dispatch.selection import DeviceSpec
from streamproc.errors import ConfigError
from streamproc.intake.batcher import Batcher
from streamproc.intake.lane import Lane
from streamproc.intake.rings import PartitionBuffers
from streamproc.metrics import Metrics
from streamproc.offsets.tracker import OffsetTracker
from streamproc.output.resequencer import Resequencer
from streamproc.records import Batch, Record, TopicPartition
from streamproc.routes import RoutePolicy
from tests.support.kafka_fakes import FakeClock
from tests.support.waiting import wait_until
from tests.unit.dispatch.test_dispatcher import TPS, GatedModel, OffsetDecoder

LIMIT = 2


class ThreadModel(GatedModel):
    """A gated model that notes the thread of each call (after warm-up: ``calls``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.calls.append(threading.current_thread().name)
        return super().__call__(x)


class ScriptedRoutes(LaneRoutePolicy):
    """The route of each batch from a script (then ``fused``); observations are noted only."""

    def __init__(self, script: Sequence[LaneRoute]) -> None:
        super().__init__(FakeClock())
        self.script = list(script)
        self.seen: list[tuple[LaneRoute, int]] = []

    def route(self, hold: bool = False) -> LaneRoute:
        return self.script.pop(0) if self.script else "fused"

    def observe(
        self, route: LaneRoute, items: int, wall_s: float, cpu_s: float, saturated: bool = True
    ) -> None:
        self.seen.append((route, items))


class OneCpuLane:
    """A lane of batches of 2 on one CPU device, with its fused route."""

    def __init__(self, route: LaneRoute | LaneRoutePolicy, model: ThreadModel | None = None):
        self.clock = FakeClock()
        self.metrics = Metrics()
        self.fatal: list[BaseException] = []
        tracker = OffsetTracker()
        self.generations = tracker.assign(TPS)
        self.lane = Lane(
            "in", PartitionBuffers(64, 0.75, 0.25), Batcher(2, 1 << 30, 60.0), tracker,
            clock=self.clock,
        )  # fmt: skip
        self.lane.assign(TPS)
        self.load = DeviceLoad("in", ["cpu:0"], LIMIT, 5.0, self.metrics, self.clock)
        self.handled: list[tuple[int, str, list[tuple[TopicPartition, int, float]]]] = []
        self.resequencer = Resequencer("in", self._handle, self.load.released, self.fatal.append)
        self.pool = StagingPool(LIMIT + 2, 2, (1,), np.dtype(np.float32), pin=False)
        self.model = model or ThreadModel()
        self.observed: list[tuple[int, float]] = []

        def completed(result: DeviceResult, release: Release) -> None:
            self.load.completed(result.batch.batch_id, result.inference_s)
            self.resequencer.put(result, release)

        self.worker = DeviceWorker(
            self.model, torch.device("cpu"), self.pool, LIMIT, 1, completed, self.fatal.append,
            label="cpu:0", on_model_failure="stop",
        )  # fmt: skip
        fused = FusedRun(
            self.worker,
            self.resequencer,
            self.load,
            lambda rows, seconds: self.observed.append((rows, seconds)),
        )
        self.routes: list[LaneRoute] = []
        self.dispatcher = Dispatcher(
            self.lane, OffsetDecoder(), self.pool, [self.worker], self.load, lambda flow: None,
            self.metrics, self.fatal.append, fused=fused, route=route,
            on_route=self.routes.append,
        )  # fmt: skip

    def _handle(self, result: DeviceResult) -> None:
        outputs = result.outputs[0].tolist() if result.outputs else []
        rows = [(r.tp, r.offset, out) for r, out in zip(result.batch.records, outputs, strict=True)]
        self.handled.append((result.batch.batch_id, threading.current_thread().name, rows))

    def start(self) -> None:
        self.worker.start()
        self.model.calls.clear()  # the warm-up's calls
        self.resequencer.start()
        self.dispatcher.start()

    def offer(self, per_partition: int, first: int = 0) -> None:
        records = [
            Record(tp, offset, None, b"v", (), 0, self.clock(), self.generations[tp])
            for offset in range(first, first + per_partition)
            for tp in TPS
        ]
        assert len(self.lane.offer(records).accepted) == len(records)

    def close(self) -> None:
        self.dispatcher.stop(10)
        self.worker.close(10)
        self.resequencer.close(10)
        assert self.pool.leak().missing == 0
        assert self.worker.output_leak().missing == 0


def test_a_fused_lane_runs_every_batch_on_its_dispatcher_thread() -> None:
    lane = OneCpuLane("fused")
    lane.start()
    lane.offer(per_partition=6)  # 6 batches of 2
    wait_until(lambda: len(lane.handled) == 6, "6 batches handled")
    lane.close()
    assert not lane.fatal
    assert lane.routes == ["fused"]
    assert [batch_id for batch_id, _, _ in lane.handled] == list(range(1, 7))
    assert {thread for _, thread, _ in lane.handled} == {"dispatch-in"}
    assert set(lane.model.calls) == {"dispatch-in"}  # the device thread ran no batch
    rows = [row for _, _, batch in lane.handled for row in batch]
    assert all(output == offset for _, offset, output in rows)
    assert sorted((tp.partition, offset) for tp, offset, _ in rows) == sorted(
        (tp.partition, offset) for offset in range(6) for tp in TPS
    )
    # the adaptive batch size learns each fused batch's whole time
    assert [rows for rows, _ in lane.observed] == [2] * 6
    assert lane.worker.idle() and lane.load.in_flight() == {"cpu:0": 0}


def test_a_switch_to_fused_waits_for_the_staged_batches_in_flight_and_keeps_cut_order() -> None:
    script: list[LaneRoute] = ["staged"] * 3 + ["fused"] * 2 + ["staged"] * 2 + ["fused"]
    routes = ScriptedRoutes(script)
    lane = OneCpuLane(routes)
    lane.start()
    lane.model.gate.clear()  # the device thread's batches stay in flight
    lane.offer(per_partition=2)  # batches 1, 2: staged, held on the device
    wait_until(lambda: lane.load.in_flight() == {"cpu:0": LIMIT}, "2 staged batches in flight")
    lane.offer(per_partition=2, first=2)  # batch 3 staged (waits for a slot), 4 fused
    assert lane.handled == []  # nothing can go out before batch 1
    lane.model.gate.set()
    lane.offer(per_partition=4, first=4)  # 5 fused, 6 and 7 staged, 8 fused
    wait_until(lambda: len(lane.handled) == 8, "8 batches handled")
    assert routes.seen == []  # each batch came within max_in_flight + 1 cycles of a switch
    lane.offer(per_partition=5, first=8)  # 9-13 fused: the cycles after 10 are measured
    wait_until(lambda: len(lane.handled) == 13, "13 batches handled")
    lane.close()
    assert not lane.fatal
    assert [batch_id for batch_id, _, _ in lane.handled] == list(range(1, 14))
    threads = [thread for _, thread, _ in lane.handled]
    assert routes_taken(threads) == [*script, *["fused"] * 5]
    per_partition: dict[TopicPartition, list[int]] = {tp: [] for tp in TPS}
    for _, _, rows in lane.handled:
        for tp, offset, output in rows:
            assert output == offset  # each row's output is its own record's
            per_partition[tp].append(offset)
    assert per_partition == {tp: list(range(13)) for tp in TPS}  # offset order, no gaps
    assert routes.seen == [("fused", 2)] * 3


def routes_taken(threads: list[str]) -> list[LaneRoute]:
    return ["fused" if thread == "dispatch-in" else "staged" for thread in threads]


def test_a_broken_model_on_the_fused_route_stops_the_lane_with_its_buffers_back() -> None:
    class Broken(ThreadModel):
        armed = False

        def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            if self.armed:
                raise RuntimeError("broken")
            return super().__call__(x)

    model = Broken()
    lane = OneCpuLane("fused", model)
    lane.start()
    model.armed = True  # every live call raises: judged broken, and under ``stop`` fatal
    lane.offer(per_partition=1)
    wait_until(lambda: len(lane.fatal) == 1, "the lane stopped")
    assert isinstance(lane.fatal[0], BrokenModelError)
    assert lane.handled == []  # neither produced nor dead-lettered: offsets stay uncommitted
    lane.close()  # asserts both pools have every buffer back
    assert lane.worker.idle()


def test_the_route_policy_probes_in_stints_and_keeps_the_cheaper_route() -> None:
    clock = FakeClock()
    policy: RoutePolicy[str] = RoutePolicy("a", "b", "x", clock, start="a", probe_batches=3,
                                           stint=3)  # fmt: skip
    seen = []
    cost = {"a": (1.0, 1.0), "b": (1.0, 2.0)}  # (wall, CPU) per batch of 1: b costs more CPU
    for _ in range(6):
        way = policy.route()
        seen.append(way)
        policy.observe(way, 1, *cost[way])
    assert seen == ["a"] * 3 + ["b"] * 3  # one stint each, the settled way first
    assert not policy.probing and policy.settled == "a"
    clock.advance(policy.base_recheck_s)  # next probe: the parallel way now overlaps
    cost = {"a": (2.0, 1.0), "b": (1.0, 1.5)}
    seen = []
    changes = []
    for _ in range(6):
        way = policy.route()
        seen.append(way)
        if change := policy.observe(way, 1, *cost[way]):
            changes.append(change.route)
    assert seen == ["a"] * 3 + ["b"] * 3
    assert changes == ["b"] and policy.settled == "b"
    assert policy.route() == "b"


def test_always_needs_one_cpu_device_and_says_so_naming_the_key() -> None:
    cpu = DeviceSpec("cpu:0", torch.device("cpu"))
    assert fusable([cpu], "auto") and fusable([cpu], "always")
    assert not fusable([cpu], "never")
    two = [cpu, DeviceSpec("cpu:1", torch.device("cpu"))]
    assert not fusable(two, "auto")
    with pytest.raises(ConfigError, match=r"worker\.fused_lane.*allowed: auto, never, always"):
        fusable(two, "always")
    gpu = DeviceSpec("cuda:0", torch.device("cuda", 0))
    assert not fusable([gpu], "auto")
    with pytest.raises(ConfigError, match=r"worker\.fused_lane"):
        fusable([gpu], "always")


def test_the_lane_policy_starts_fused_and_probes_staged_only_later() -> None:
    clock = FakeClock()
    policy = LaneRoutePolicy(clock, recheck_s=30.0)

    def run(batches: int, cost: dict[LaneRoute, tuple[float, float]]) -> list[LaneRoute]:
        ways = []
        for _ in range(batches):
            way = policy.route()
            ways.append(way)
            policy.observe(way, 100, *cost[way])
            clock.advance(0.01)
        return ways

    light: dict[LaneRoute, tuple[float, float]] = {"fused": (1.0, 1.0), "staged": (1.0, 1.6)}
    assert run(200, light) == ["fused"] * 200  # no probe at start-up
    clock.advance(30.0)
    ways = run(2 * PROBE_BATCHES, light)  # one stint each, fused (settled) first
    assert ways == ["fused"] * PROBE_BATCHES + ["staged"] * PROBE_BATCHES
    assert policy.settled == "fused"  # staged cost more CPU for the same cycle
    clock.advance(60.0)  # the next probe: staged's overlap now shortens the cycle by 30 %
    overlapping: dict[LaneRoute, tuple[float, float]] = {
        "fused": (1.0, 1.0),
        "staged": (0.7, 1.3),
    }
    run(2 * PROBE_BATCHES, overlapping)
    assert policy.settled == "staged" and policy.route() == "staged"


def test_a_fused_batch_that_outlives_the_drain_is_dropped_not_produced() -> None:
    handled: list[int] = []
    released: list[int] = []
    resequencer = Resequencer("in", lambda r: handled.append(r.batch.batch_id), released.append,
                              lambda exc: None)  # fmt: skip
    resequencer.close(1.0)  # the drain gave up on the batch still running on the dispatcher
    record = Record(TPS[0], 0, None, b"v", (), 0, 0.0, 1)
    batch = Batch(1, (record,), 0.0, "size")
    result = DeviceResult(batch=batch, outputs=(), failed={}, error=None, inference_s=0.0,
                          model_calls=1)  # fmt: skip
    gave_back: list[bool] = []
    assert resequencer.hand_over_here(result, lambda: gave_back.append(True)) is False
    assert handled == [] and gave_back == [True] and released == [1]


def test_a_lane_probe_waits_while_the_decode_route_probes() -> None:
    clock = FakeClock()
    policy = LaneRoutePolicy(clock, recheck_s=30.0)
    clock.advance(30.0)  # a probe is due
    assert policy.route(hold=True) == "fused" and not policy.probing
    assert policy.route() == "fused" and policy.probing  # the probe starts once not held


def test_at_partial_load_the_arrivals_set_the_cycle_and_only_the_cpu_decides() -> None:
    clock = FakeClock()
    policy = LaneRoutePolicy(clock, recheck_s=30.0)
    clock.advance(30.0)
    # staged cuts smaller batches at a deadline: its median per-record cycle looks shorter,
    # but over all records both take the arrival rate (1 ms a record); fused costs less CPU
    for _ in range(PROBE_BATCHES):
        route = policy.route()
        assert route == "fused"
        policy.observe(route, 20, 0.020, 0.0010, saturated=False)
    for index in range(PROBE_BATCHES):
        route = policy.route()
        assert route == "staged"
        items = 2 if index % 2 else 38  # same 20 a batch on average, same 1 ms a record
        policy.observe(route, items, items * 0.001, items * 0.00007, saturated=False)
    assert policy.settled == "fused"
    assert "walls set by the arrivals, not compared" in policy.last_probe
    clock.advance(60.0)  # a backlog now: staged's overlap shortens the cycle by 20 %
    for _ in range(PROBE_BATCHES):
        policy.observe(policy.route(), 256, 0.0025, 0.0024, saturated=True)
    for _ in range(PROBE_BATCHES):
        policy.observe(policy.route(), 256, 0.0020, 0.0026, saturated=True)
    assert policy.settled == "staged"


def test_always_with_several_devices_fails_when_the_config_loads() -> None:
    with pytest.raises(ValueError, match=r"worker\.fused_lane: always needs one CPU device"):
        WorkerConfig(fused_lane="always", devices=("cpu", "cpu"))
    with pytest.raises(ValueError, match=r"worker\.fused_lane"):
        WorkerConfig(fused_lane="always", device="cuda")
    assert WorkerConfig(fused_lane="always", device="cpu").fused_lane == "always"
    assert WorkerConfig(fused_lane="always").device == "auto"  # decided at start-up (fusable)
