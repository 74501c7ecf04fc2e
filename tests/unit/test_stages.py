"""Per-stage latency (``streamproc.stages``): every stage of the record path is counted once per
record, with its own time and no other stage's, on both lane routes; the histogram's
``observe_repeated`` and ``quantile``; the tracker's acknowledgement-to-commit waits."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from streamproc.config.sections import PipelineConfig
from streamproc.device import DeviceResult, DeviceWorker, Release, StagingPool
from streamproc.device.staging import Slab
from streamproc.dispatch.dispatcher import Dispatcher
from streamproc.dispatch.fusion import FusedRun, LaneRoute
from streamproc.dispatch.placement import DeviceLoad
from streamproc.errors import RecordError
from streamproc.histograms import BatchHistogram, bucket_quantile
from streamproc.intake.batcher import Batcher
from streamproc.intake.lane import Lane
from streamproc.intake.rings import PartitionBuffers
from streamproc.metrics import Metrics
from streamproc.offsets.guarantees import AtLeastOnce
from streamproc.offsets.tracker import OffsetTracker
from streamproc.output.producer import ResultsProducer
from streamproc.output.resequencer import Resequencer
from streamproc.output.results import ResultHandler
from streamproc.output.sink import Sink
from streamproc.records import Record, TopicPartition
from streamproc.stages import BATCH_STAGES, STAGES, StageRecorder
from streamproc.workloads import Encoded, Workload
from tests.support.kafka_fakes import FakeClock, FakeConsumer, FakeProducer, factory
from tests.support.waiting import wait_until

TPS = (TopicPartition("in", 0), TopicPartition("in", 1))
EPOCH_S = 1_700_000_000.0
"""The fake wall clock is the fake monotonic clock plus this."""

# each stage's own time, all different (whole milliseconds: record timestamps are in ms), so
# that one stage's time counted in another shows
CONSUME_S, RING_S, BATCH_S = 0.002, 0.003, 0.005
DECODE_S, DEVICE_S, ENCODE_S, PRODUCE_S, COMMIT_S = 0.007, 0.011, 0.017, 0.023, 0.4


class ReadClock(FakeClock):
    """A fake clock that counts its readings per thread name."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            self.reads[threading.current_thread().name] += 1
        return self.now_s


class SteppingDecoder:
    """Decodes each record's offset into its row; the decode takes ``DECODE_S``."""

    probing = False
    hold_probes = False

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def decode(self, records: Sequence[Record], slab: Slab) -> dict[int, RecordError]:
        for row, record in enumerate(records):
            slab.array[row] = record.offset
        self.clock.advance(DECODE_S)
        return {}


class SteppingModel:
    """Each row's value; a live call takes ``DEVICE_S`` (the warm-up's take no time)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.live = False

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.live:
            self.clock.advance(DEVICE_S)
        return (x[:, 0].clone(),)


class SteppingWorkload(Workload):
    """Encodes each row's value; a batch's encode takes ``ENCODE_S``."""

    name = "stepping"
    item_shape = (1,)
    item_dtype = np.dtype(np.float32)

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def encode_many(
        self, records: Sequence[Record], outputs: tuple[np.ndarray, ...]
    ) -> list[Encoded | Exception]:
        self.clock.advance(ENCODE_S)
        return [Encoded(b"%d" % int(value)) for value in outputs[0]]


class TimedLane:
    """One lane wired as the assembly wires it (real lane, dispatcher, device worker,
    resequencer, result handler, sink, guarantee and tracker), a fake producer and consumer,
    and one fake clock for every stage."""

    def __init__(self, route: LaneRoute) -> None:
        self.clock = ReadClock()
        self.metrics = Metrics()
        self.fatal: list[BaseException] = []
        self.tracker = OffsetTracker(clock=self.clock)
        self.generations = self.tracker.assign(TPS)
        self.lane = Lane(
            "in", PartitionBuffers(64, 0.75, 0.25), Batcher(4, 1 << 30, 60.0), self.tracker,
            clock=self.clock,
        )  # fmt: skip
        self.lane.assign(TPS)
        load = DeviceLoad("in", ["cpu:0"], 2, 5.0, self.metrics, FakeClock())
        self.producer = FakeProducer(deliver_on_flush=False)
        self.guarantee = AtLeastOnce(self.tracker, self.metrics)
        results = ResultsProducer(
            self.producer, {}, self.metrics, self.fatal.append, factory(self.producer)
        )
        sink = Sink(results, self.guarantee, self.metrics, self.fatal.append)
        spec = PipelineConfig(name="p", input_topic="in", output_topic="out", workload="x:y")
        handler = ResultHandler(spec, SteppingWorkload(self.clock), sink, self.metrics)
        self.resequencer = Resequencer("in", handler, load.released, self.fatal.append)
        self.pool = StagingPool(4, 4, (1,), np.dtype(np.float32), pin=False)
        self.model = SteppingModel(self.clock)

        def completed(result: DeviceResult, release: Release) -> None:
            load.completed(result.batch.batch_id, result.inference_s)
            self.resequencer.put(result, release)

        self.worker = DeviceWorker(
            self.model, torch.device("cpu"), self.pool, 2, 1, completed, self.fatal.append,
            label="cpu:0",
        )  # fmt: skip
        fused = FusedRun(self.worker, self.resequencer, load, lambda rows, seconds: None)
        recorder = StageRecorder(
            self.metrics.stage, "in", self.clock, lambda: EPOCH_S + self.clock()
        )
        self.dispatcher = Dispatcher(
            self.lane, SteppingDecoder(self.clock), self.pool, [self.worker], load,
            lambda flow: None, self.metrics, self.fatal.append, fused=fused, route=route,
            resequencer=self.resequencer, stages=recorder,
        )  # fmt: skip

    def offer(self, tp: TopicPartition, offset: int) -> None:
        """One record, consumed now, its timestamp ``CONSUME_S`` before."""
        now_s = self.clock.now_s
        timestamp_ms = round((EPOCH_S + now_s - CONSUME_S) * 1000)
        record = Record(tp, offset, None, b"v", (), timestamp_ms, now_s, self.generations[tp])
        assert self.lane.offer([record]).accepted == [record]

    def seconds(self, stage: str) -> tuple[float, float]:
        """The stage's count and sum of seconds."""
        registry = self.metrics.registry
        labels = {"topic": "in", "stage": stage}
        count = registry.get_sample_value("streamproc_stage_seconds_count", labels)
        total = registry.get_sample_value("streamproc_stage_seconds_sum", labels)
        return count or 0.0, total or 0.0


@pytest.mark.parametrize("route", ["fused", "staged"])
def test_each_stage_counts_its_own_time_once_per_record(route: LaneRoute) -> None:
    lane = TimedLane(route)
    lane.worker.start()
    lane.model.live = True
    lane.resequencer.start()
    # two records wait in their rings before the dispatcher is ready...
    lane.offer(TPS[0], 0)
    lane.offer(TPS[1], 0)
    lane.clock.advance(RING_S)
    lane.dispatcher.start()
    # ...it reads the clock as it becomes ready and as the batcher decides (2 of 4: wait)
    wait_until(lambda: lane.clock.reads["dispatch-in"] >= 2, "the dispatcher waiting for a cut")
    lane.clock.advance(BATCH_S)
    lane.offer(TPS[0], 1)  # the cut: four records, two of them consumed just now
    lane.offer(TPS[1], 1)
    wait_until(lambda: len(lane.producer.pending) == 4, "four results produced")
    lane.clock.advance(PRODUCE_S)
    assert lane.producer.deliver() == 4  # the batch's last report
    lane.clock.advance(COMMIT_S)
    lane.guarantee.committer.commit(FakeConsumer({}), synchronous=True)
    lane.dispatcher.stop(10)
    lane.worker.close(10)
    lane.resequencer.close(10)
    assert not lane.fatal
    expected = {
        "consume": 4 * CONSUME_S,
        "ring": 2 * RING_S,  # the two consumed before the dispatcher was ready
        "batch": 2 * BATCH_S,  # the same two waited for the cut; the other two were cut at once
        "decode": 4 * DECODE_S,
        "device": 4 * DEVICE_S,
        "encode": 4 * ENCODE_S,
        "produce": 4 * PRODUCE_S,
        "commit": 4 * COMMIT_S,
    }
    assert list(expected) == list(STAGES)
    for stage, seconds in expected.items():
        count, total = lane.seconds(stage)
        assert count == 4, stage
        # epoch seconds near 1.7e9 carry about 2e-7 s of float resolution
        assert total == pytest.approx(seconds, abs=1e-5), stage
    assert lane.tracker.commit_candidates() == {}  # the commit covered both partitions


def test_the_first_three_stages_split_each_record_at_the_dispatchers_readiness() -> None:
    clock = FakeClock(100.0)
    metrics = Metrics()
    recorder = StageRecorder(metrics.stage, "t", clock, lambda: EPOCH_S + clock())
    tp = TopicPartition("t", 0)
    consumed = [100.0, 100.5, 101.0]  # before, before, after the dispatcher was ready (100.8)
    lags = [0.25, 2.0, 0.0]  # timestamp to consume
    records = [
        Record(tp, i, None, b"v", (), round((EPOCH_S + c - lag) * 1000), c)
        for i, (c, lag) in enumerate(zip(consumed, lags, strict=True))
    ]
    clock.now_s = 101.2
    stage_clock = recorder.cut(records, np.array(consumed), ready_s=100.8, cut_s=101.2)

    def summed(stage: str) -> float:
        value = metrics.registry.get_sample_value(
            "streamproc_stage_seconds_sum", {"topic": "t", "stage": stage}
        )
        assert value is not None, stage
        return value

    assert summed("consume") == pytest.approx(sum(lags))
    assert summed("ring") == pytest.approx(0.8 + 0.3 + 0.0)
    assert summed("batch") == pytest.approx(0.4 + 0.4 + 0.2)
    clock.advance(0.125)
    stage_clock.lap("decode")
    assert summed("decode") == pytest.approx(3 * 0.125)  # once per record of the batch
    assert stage_clock.lapped == ["decode"]
    with pytest.raises(KeyError):
        stage_clock.lap("commit")  # not a batch's stage: counted by the commit itself
    assert set(BATCH_STAGES) < set(STAGES)


def test_observe_repeated_counts_as_copies_and_quantiles_read_like_histogram_quantile() -> None:
    from prometheus_client import CollectorRegistry

    bounds = (0.001, 0.01, 0.1, 1.0)
    ours = BatchHistogram("a_seconds", "a", ["s"], bounds, CollectorRegistry())
    copies = BatchHistogram("b_seconds", "b", ["s"], bounds, CollectorRegistry())
    for value, count in [(0.0005, 3), (0.01, 2), (0.05, 5), (7.0, 1), (0.2, 0)]:
        ours.labels("x").observe_repeated(value, count)
        copies.labels("x").observe_many(np.full(count, value))
    (counts, total), (copied_counts, copied_total) = (
        ours.labels("x").snapshot(),
        copies.labels("x").snapshot(),
    )
    assert counts == copied_counts == [3, 5, 10, 10, 11]
    assert total == pytest.approx(copied_total)
    # cumulative [3, 5, 10, 10, 11]: the median (rank 5.5) is in (0.01, 0.1], 0.5 of 5 into it
    assert ours.labels("x").quantile(0.5) == pytest.approx(0.01 + 0.09 * 0.5 / 5)
    assert ours.labels("x").quantile(0.99) == 1.0  # the +Inf bucket: the largest bound
    assert ours.labels("y").quantile(0.5) is None
    assert bucket_quantile(bounds, [0, 4, 4, 4, 4], 0.5) == pytest.approx(0.001 + 0.009 * 0.5)
    with pytest.raises(ValueError, match="outside"):
        bucket_quantile(bounds, [0, 0, 0, 0, 1], 1.5)


def test_a_commit_reports_the_wait_of_each_acknowledged_run_it_covers() -> None:
    clock = FakeClock(10.0)
    tracker = OffsetTracker(clock=clock)
    p0, p1 = TopicPartition("t", 0), TopicPartition("t", 1)
    gen = tracker.assign([p0, p1])
    records = {
        (tp, o): Record(tp, o, None, b"", (), 0, 0.0, gen[tp]) for tp in (p0, p1) for o in range(6)
    }
    tracker.consumed_many(records.values())
    tracker.done_many([records[(p0, o)] for o in (3, 4, 5)] + [records[(p1, 0)]])  # at 10.0
    clock.advance(1.0)
    tracker.done_many([records[(p0, o)] for o in (0, 1, 2)])  # at 11.0: p0 contiguous to 6
    clock.advance(0.5)
    waits = tracker.mark_committed(tracker.commit_candidates())
    # p0 (watermark 6) covers both its runs, the later-acknowledged one too; p1 (watermark 1)
    # covers its only run
    assert sorted(waits) == sorted([("t", 1.5, 3), ("t", 0.5, 3), ("t", 1.5, 1)])
    assert tracker.mark_committed({p0: 6}) == []  # each run is reported once
    tracker.done_many([records[(p1, o)] for o in (2, 3)])  # a gap at 1: not committable yet
    clock.advance(2.0)
    assert tracker.mark_committed({p1: 1}) == []
    tracker.done_many([records[(p1, 1)]])
    clock.advance(1.0)
    assert sorted(tracker.mark_committed({p1: 4})) == [("t", 1.0, 1), ("t", 3.0, 2)]
