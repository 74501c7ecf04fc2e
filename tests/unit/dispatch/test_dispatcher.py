"""A lane on two devices, with real threads (dispatcher, device, completion, results) and a fake
clock: placement, a device that stops completing, and result order per partition."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import structlog
import torch

from streamproc.device import DeviceResult, DeviceWorker, Release, Slab, StagingPool
from streamproc.dispatch.dispatcher import Dispatcher
from streamproc.dispatch.placement import DeviceLoad
from streamproc.errors import RecordError
from streamproc.intake.batcher import Batcher
from streamproc.intake.lane import Lane
from streamproc.intake.rings import PartitionBuffers
from streamproc.metrics import Metrics
from streamproc.offsets.tracker import OffsetTracker
from streamproc.output.resequencer import Resequencer
from streamproc.records import Record, TopicPartition
from tests.support.kafka_fakes import FakeClock
from tests.support.waiting import wait_until

TPS = (TopicPartition("in", 0), TopicPartition("in", 1))
LIMIT = 2  # in-flight batches per device


class OffsetDecoder:
    """Writes each record's offset into its slab row (so outputs can be matched to inputs)."""

    probing = False
    hold_probes = False

    def decode(self, records: Sequence[Record], slab: Slab) -> dict[int, RecordError]:
        for row, record in enumerate(records):
            slab.array[row] = record.offset
        return {}


class GatedModel:
    """Returns each row's value; waits for ``gate`` first (a device that stops completing)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        assert self.gate.wait(60), "gate never opened"
        return (x[:, 0].clone(),)


class TwoDeviceLane:
    """A lane of batches of 2 over two logical CPU devices, wired as the assembly wires it."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.metrics = Metrics()
        self.fatal: list[BaseException] = []
        tracker = OffsetTracker()
        generations = tracker.assign(TPS)
        self.generations = generations
        self.lane = Lane(
            "in",
            PartitionBuffers(64, 0.75, 0.25),
            Batcher(2, 1 << 30, 60.0),  # size cuts only: the fake clock never reaches 60 s
            tracker,
            clock=self.clock,
        )
        self.lane.assign(TPS)
        self.load = DeviceLoad("in", ["cpu:0", "cpu:1"], LIMIT, 5.0, self.metrics, self.clock)
        self.handled: list[DeviceResult] = []
        self.outputs: list[list[float]] = []
        self.resequencer = Resequencer("in", self._handle, self.load.released, self.fatal.append)
        self.pool = StagingPool(2 * (LIMIT + 1), 2, (1,), np.dtype(np.float32), pin=False)
        self.models = [GatedModel(), GatedModel()]

        def completed(result: DeviceResult, release: Release) -> None:
            self.load.completed(result.batch.batch_id, result.inference_s)
            self.resequencer.put(result, release)

        self.workers = [
            DeviceWorker(
                model,
                torch.device("cpu"),
                self.pool,
                LIMIT,
                1,
                completed,
                self.fatal.append,
                label=f"cpu:{i}",
            )
            for i, model in enumerate(self.models)
        ]
        self.dispatcher = Dispatcher(
            self.lane,
            OffsetDecoder(),
            self.pool,
            self.workers,
            self.load,
            lambda flow: None,
            self.metrics,
            self.fatal.append,
            resequencer=self.resequencer,
        )

    def _handle(self, result: DeviceResult) -> None:
        self.handled.append(result)
        # views: valid during the call only (none where every record of the batch expired)
        self.outputs.append(result.outputs[0].tolist() if result.outputs else [])

    def start(self) -> None:
        for worker in self.workers:
            worker.start()  # warm-up runs the models: gates are open until started
        self.resequencer.start()
        self.dispatcher.start()

    def offer(self, per_partition: int, expired_from: int | None = None) -> None:
        """``per_partition`` records on each partition; those from offset ``expired_from`` on
        are already past their deadline."""
        now_s = self.clock()
        records = [
            Record(
                tp,
                offset,
                None,
                b"v",
                (),
                0,
                now_s,
                self.generations[tp],
                deadline_s=now_s - 1.0
                if expired_from is not None and offset >= expired_from
                else float("inf"),
            )
            for offset in range(per_partition)
            for tp in TPS
        ]
        offered = self.lane.offer(records, deadlines=expired_from is not None)
        assert len(offered.accepted) == len(records)

    def close(self) -> None:
        self.dispatcher.stop(10)
        for worker in self.workers:
            worker.close(10)
        self.resequencer.close(10)


def test_a_stopped_device_is_held_at_its_limit_and_reported_and_order_survives() -> None:
    lane = TwoDeviceLane()
    lane.start()
    stuck = lane.models[0]
    stuck.gate.clear()  # cpu:0 stops completing: it gets batch 1 (tie -> lower index)
    lane.offer(per_partition=8)  # 16 records: 8 batches of 2
    # nothing is released behind batch 1, so both devices fill up to their limit and stop
    wait_until(lambda: lane.load.in_flight() == {"cpu:0": LIMIT, "cpu:1": LIMIT}, "full")
    wait_until(lambda: lane.resequencer.held == LIMIT, "cpu:1's results held")
    assert lane.handled == []  # batch 1 is not done: nothing may go out before it
    assert lane.load.batches() == {"cpu:0": LIMIT, "cpu:1": LIMIT}
    assert lane.resequencer.next_batch_id == 1

    def stalled() -> float | None:
        return lane.metrics.registry.get_sample_value(
            "streamproc_device_stalled", {"topic": "in", "device": "cpu:0"}
        )

    assert lane.load.check_stalls() == () and stalled() == 0
    lane.clock.advance(5.5)
    with structlog.testing.capture_logs() as logs:
        assert lane.load.check_stalls() == ("cpu:0",)
    assert stalled() == 1
    assert [e["device"] for e in logs if e["log_level"] == "error"] == ["cpu:0"]

    stuck.gate.set()  # it completes again: everything flows, in cut order
    wait_until(lambda: len(lane.handled) == 8, "all 8 batches handled")
    lane.clock.advance(0.1)
    assert lane.load.check_stalls() == () and stalled() == 0
    lane.close()
    assert not lane.fatal

    assert [r.batch.batch_id for r in lane.handled] == list(range(1, 9))
    per_partition: dict[TopicPartition, list[int]] = {tp: [] for tp in TPS}
    for result, outputs in zip(lane.handled, lane.outputs, strict=True):
        offsets = [record.offset for record in result.batch.records]
        assert outputs == offsets  # each row's output is its own record's
        for record in result.batch.records:
            per_partition[record.tp].append(record.offset)
    assert per_partition == {tp: list(range(8)) for tp in TPS}  # offset order, no gaps
    batches = lane.load.batches()
    assert batches["cpu:0"] >= LIMIT and batches["cpu:1"] >= LIMIT
    assert sum(batches.values()) == 8
    # the leak check: everything came back
    assert lane.pool.leak().missing == 0
    assert all(w.output_leak().missing == 0 for w in lane.workers)


def test_results_completed_out_of_order_go_out_in_cut_order() -> None:
    lane = TwoDeviceLane()
    lane.start()
    slow = lane.models[0]
    slow.gate.clear()
    lane.offer(per_partition=2)  # batches 1 (cpu:0, gated) and 2 (cpu:1)
    wait_until(lambda: lane.resequencer.held == 1, "batch 2 completed first")
    assert lane.handled == []
    slow.gate.set()
    wait_until(lambda: len(lane.handled) == 2, "both batches handled")
    assert [r.batch.batch_id for r in lane.handled] == [1, 2]
    assert lane.resequencer.max_waiting == 1  # batch 2 did wait
    lane.close()
    assert lane.load.batches() == {"cpu:0": 1, "cpu:1": 1}
    assert not lane.fatal


def test_a_cut_whose_every_record_expired_runs_nowhere_and_keeps_its_turn() -> None:
    lane = TwoDeviceLane()
    lane.start()
    lane.models[0].gate.clear()  # batch 1 (cpu:0) does not complete yet
    lane.offer(per_partition=4, expired_from=2)  # 8 records: 4 live, 4 expired; cuts of 2
    # batch 1 stuck; the other live batch completed on cpu:1; the all-expired cut queued (an
    # expired record never takes a live one's place: 3 cuts, not 4)
    wait_until(lambda: lane.resequencer.held == 2, "every later batch waiting for batch 1")
    assert lane.handled == []  # an expired result may not overtake an earlier batch
    lane.models[0].gate.set()
    wait_until(lambda: len(lane.handled) == 3, "all 3 batches handed over")
    lane.close()
    assert not lane.fatal
    assert [r.batch.batch_id for r in lane.handled] == [1, 2, 3]
    # cut 2 set tp0's expired records apart beside tp1's live ones; cut 3 holds only expired
    assert [len(r.batch.records) for r in lane.handled] == [2, 2, 0]
    assert [len(r.batch.expired) for r in lane.handled] == [0, 2, 2]
    only_expired = lane.handled[2]
    assert only_expired.model_calls == 0 and only_expired.outputs == ()
    expired = {(r.tp, r.offset) for result in lane.handled for r in result.batch.expired}
    assert expired == {(tp, offset) for tp in TPS for offset in (2, 3)}
    assert sum(lane.load.batches().values()) == 2  # no device slot for the expired cuts
    assert lane.load.in_flight() == {"cpu:0": 0, "cpu:1": 0}
    assert lane.metrics.counter_value(lane.metrics.expired, topic="in") == 4
    assert lane.pool.leak().missing == 0
    assert all(w.output_leak().missing == 0 for w in lane.workers)
