"""The source over the fake consumer, driven by the test (no source thread): the
harness the source, refusal, idle and producer-recovery tests share, and the inputs they
consume again under a fresh generation."""

from __future__ import annotations

import threading
from collections.abc import Callable

from streamproc.config import load_config
from streamproc.intake.batcher import Batcher
from streamproc.intake.lane import CutRecords, Lane
from streamproc.intake.rings import PartitionBuffers
from streamproc.intake.source import Source
from streamproc.intake.thread import SourceThread
from streamproc.metrics import Metrics
from streamproc.offsets.guarantees import AtLeastOnce, ExactlyOnce, Guarantee
from streamproc.offsets.tracker import OffsetTracker
from streamproc.offsets.transactions import Transactions
from streamproc.records import Record, TopicPartition
from tests.support.kafka_fakes import FakeClock, FakeConsumer, FakeProducer, factory

TP = TopicPartition("in", 0)
PIPELINE = {"name": "p", "input_topic": "in", "output_topic": "out", "workload": "trades"}


class Harness:
    """A source over a fake consumer with one lane (ring of 8: pause at 6, resume at 2);
    ``markers``: offsets of every partition that hold no message (transaction markers). The
    source and the lane share one fake clock, starting at ``start_s``: a cut waits on the
    clock that stamped its records, not on the machine's."""

    def __init__(
        self,
        messages: int,
        guarantee: Callable[[OffsetTracker, Metrics], Guarantee] | None = None,
        revoke_timeout_s: float = 10.0,
        partitions: int = 1,
        markers: frozenset[int] = frozenset(),
        start_s: float = 1000.0,
    ) -> None:
        self.config = load_config(
            overrides={
                "pipelines": [PIPELINE],
                "buffers": {"ring_capacity": 8, "high_watermark": 0.75, "low_watermark": 0.25},
                "revoke_timeout_s": revoke_timeout_s,
                "kafka": {"commit_interval_ms": 1000},
            },
            bootstrap="fake:9092",
        )
        self.late: list[tuple[TopicPartition, int, bool]] = []
        self.tracker = OffsetTracker(on_late=lambda tp, n, first: self.late.append((tp, n, first)))
        self.metrics = Metrics()
        self.guarantee = (guarantee or AtLeastOnce)(self.tracker, self.metrics)
        self.clock = FakeClock(start_s)
        self.lane = Lane(
            "in",
            PartitionBuffers(8, 0.75, 0.25),
            Batcher(4, 1 << 30, 0.0),
            self.tracker,
            clock=self.clock,
        )
        self.consumer = FakeConsumer(
            {
                TopicPartition("in", p): [b"%d" % i for i in range(messages)]
                for p in range(partitions)
            },
            markers={TopicPartition("in", p): markers for p in range(partitions)},
        )
        self.fatal: list[BaseException] = []
        self.source = Source(
            self.config,
            {"in": self.lane},
            self.tracker,
            self.guarantee,
            self.metrics,
            self.fatal.append,
            factory(self.consumer),
            clock=self.clock,
        )
        self.source.subscribe()  # no source thread: the test drives the poll loop itself

    def poll(self, times: int = 1, advance_s: float = 0.0) -> None:
        """Run the poll loop ``times`` iterations, moving the clock ``advance_s`` before each."""
        drive(self.source, self.clock, times, advance_s)
        assert not self.fatal, self.fatal

    def cut(self) -> CutRecords:
        batch = self.lane.next_cut(threading.Event())
        assert batch is not None
        self.source.apply(batch.flow)
        return batch

    def count(self, name: str, **labels: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels)

    def in_ring(self) -> float:
        return self.lane.fill_ratios().get(TP, 0.0) * 8


def drive(source: SourceThread, clock: FakeClock, times: int, advance_s: float) -> None:
    """Run ``source``'s poll loop ``times`` turns on this thread, moving ``clock`` by
    ``advance_s`` before each (and once more at the end)."""
    left = [times]

    def done() -> bool:
        left[0] -= 1
        clock.advance(advance_s)
        return left[0] < 0

    source.poll_until(done)


def exactly_once(producer: FakeProducer) -> Callable[[OffsetTracker, Metrics], Guarantee]:
    return lambda tracker, metrics: ExactlyOnce(tracker, metrics, Transactions(producer))


def consume_again(tracker: OffsetTracker, n: int) -> list[Record]:
    """The inputs 0..n-1 of TP under a fresh generation (an assignment, or a rewind)."""
    tracker.revoke([TP])
    generation = tracker.assign([TP])[TP]
    records = [Record(TP, o, b"k", b"in%d" % o, (), 0, 0.0, generation) for o in range(n)]
    tracker.consumed_many(records)
    return records
