"""The acknowledgement window: a lane's inputs whose results are produced and not yet
acknowledged are bounded in bytes (``buffers.max_unacknowledged_bytes``).

The chain under test is the real one: a :class:`ResultHandler` on its lane's resequencer thread,
a real :class:`Sink` over the fake producer (``tests.support.kafka_fakes``), which holds every
record until the test delivers it, and the lane's :class:`DeviceLoad` with one in-flight batch.
While acknowledgements lag, the next batch's results wait, its device slot stays taken, and so
the dispatcher (``DeviceLoad.wait_capacity``) cuts no further batch. Before the window existed,
the results went out at once and the slot came back: intake went on while every input stayed
held for its acknowledgement.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from streamproc.config.sections import PipelineConfig
from streamproc.device import DeviceResult
from streamproc.dispatch.placement import DeviceLoad
from streamproc.metrics import Metrics
from streamproc.offsets.guarantees import AtLeastOnce
from streamproc.offsets.tracker import OffsetTracker
from streamproc.output.producer import ResultsProducer
from streamproc.output.resequencer import Resequencer
from streamproc.output.results import ResultHandler
from streamproc.output.sink import Sink
from streamproc.output.window import AckWindow
from streamproc.records import Batch, Record, TopicPartition
from streamproc.workloads import Encoded, Workload
from tests.support.kafka_fakes import FakeProducer, factory
from tests.support.waiting import wait_until

TP = TopicPartition("in", 0)
SPEC = PipelineConfig(name="p", input_topic="in", output_topic="out", workload="x:y")
FRAME = b"f" * 4096  # an input far larger than its result, as a video frame is
BATCH = 4


def window(limit_bytes: int, metrics: Metrics | None = None) -> AckWindow:
    metrics = metrics or Metrics()
    return AckWindow(
        limit_bytes,
        metrics.unacknowledged_bytes.labels("in"),
        metrics.unacknowledged_wait.labels("in"),
    )


class Small(Workload):
    """Encodes each row as a result of a few bytes (its input's offset)."""

    def encode(self, record: Record, outputs: tuple[np.ndarray, ...]) -> Encoded:
        return Encoded(b"r%d" % record.offset)


class Lane:
    """One lane's output side: tracker, sink over the fake producer, window, device load with
    one in-flight batch, resequencer and result handler."""

    def __init__(self, limit_bytes: int) -> None:
        self.metrics = Metrics()
        self.tracker = OffsetTracker()
        self.generation = self.tracker.assign([TP])[TP]
        self.producer = FakeProducer()
        self.fatal: list[BaseException] = []
        results = ResultsProducer(
            self.producer, {}, self.metrics, self.fatal.append, factory(FakeProducer())
        )
        self.sink = Sink(
            results, AtLeastOnce(self.tracker, self.metrics), self.metrics, self.fatal.append
        )
        self.window = window(limit_bytes, self.metrics)
        handler = ResultHandler(SPEC, Small(), self.sink, self.metrics, window=self.window)
        self.load = DeviceLoad("in", ["cpu"], 1, 60.0, self.metrics)
        self.resequencer = Resequencer(
            "in", handler, self.load.released, self.fatal.append, metrics=self.metrics
        )
        self.resequencer.start()
        self.offset = 0
        self.batch_id = 0

    def run_batch(self) -> None:
        """Cut, place and complete one batch of :data:`BATCH` frames (the dispatcher's and
        the device's part)."""
        records = []
        for _ in range(BATCH):
            records.append(Record(TP, self.offset, None, FRAME, (), 0, 0.0, self.generation))
            self.offset += 1
        self.tracker.consumed_many(records)
        self.batch_id += 1
        self.load.place(self.batch_id, BATCH)
        self.load.completed(self.batch_id, 0.001)
        result = DeviceResult(
            Batch(self.batch_id, tuple(records), 0.0), (np.zeros((BATCH, 1)),), {}, None, 0.001
        )
        self.resequencer.put(result, lambda: None)

    def can_cut(self) -> bool:
        """Whether the dispatcher would cut the next batch now (a device below its limit)."""
        return self.load.in_flight()["cpu"] < 1

    def results_out(self) -> int:
        return sum(1 for p in self.producer.pending if p.topic == "out") + len(
            self.producer.delivered
        )

    def close(self) -> None:
        self.window.close()
        self.resequencer.close(5.0)
        assert self.fatal == []


def test_lagging_acknowledgements_stop_the_next_cut_at_the_byte_limit() -> None:
    lane = Lane(limit_bytes=BATCH * len(FRAME))  # one batch's inputs fill the window
    lane.run_batch()
    wait_until(lane.can_cut, "batch 1's results handed to the sink")
    assert lane.results_out() == BATCH and lane.window.held_bytes == BATCH * len(FRAME)

    lane.run_batch()  # batch 2 completes while batch 1's acknowledgements lag
    wait_until(lambda: lane.window.waiting == 1, "batch 2's results waiting for acknowledgements")
    assert lane.results_out() == BATCH  # batch 2 not produced
    assert not lane.can_cut()  # its device slot stays taken: the dispatcher cuts nothing

    lane.producer.deliver()  # the broker acknowledges batch 1
    wait_until(lane.can_cut, "batch 2 produced after batch 1's acknowledgements")
    assert lane.results_out() == 2 * BATCH
    assert lane.window.held_bytes == BATCH * len(FRAME)  # batch 2's inputs, until acknowledged
    lane.producer.deliver()
    assert lane.window.held_bytes == 0
    assert lane.tracker.watermarks([TP])[TP] == 2 * BATCH
    assert lane.metrics.unacknowledged_wait.labels("in")._value.get() > 0
    lane.close()


def test_below_the_limit_results_go_out_without_waiting_for_acknowledgements() -> None:
    lane = Lane(limit_bytes=3 * BATCH * len(FRAME))
    for _ in range(3):
        lane.run_batch()
        wait_until(lane.can_cut, f"batch {lane.batch_id} handed to the sink")
    assert lane.results_out() == 3 * BATCH and lane.window.waiting == 0
    assert lane.metrics.unacknowledged_bytes.labels("in")._value.get() == 3 * BATCH * len(FRAME)
    lane.producer.deliver()
    assert lane.window.held_bytes == 0
    lane.close()


def test_a_result_refused_for_good_settles_with_the_batchs_last_report() -> None:
    """The refused result's input leaves the window when the batch's last report is in; its
    dead-letter record (carrying the input's value) is then bounded by the producer's queue,
    like every dead-letter record."""
    from confluent_kafka import KafkaError

    lane = Lane(limit_bytes=BATCH * len(FRAME))
    lane.run_batch()
    wait_until(lane.can_cut, "batch 1 handed to the sink")
    first = lane.producer.pending.pop(0)
    first.report(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))  # dead-lettered
    assert lane.window.held_bytes == BATCH * len(FRAME)  # three results still unacknowledged
    lane.producer.deliver()  # the other results and the dead-letter record
    assert lane.window.held_bytes == 0
    assert lane.producer.delivered[-1].topic == "in.dlq"
    assert lane.tracker.watermarks([TP])[TP] == BATCH
    lane.close()


def test_close_releases_a_waiting_batch() -> None:
    lane = Lane(limit_bytes=BATCH * len(FRAME))
    lane.run_batch()
    wait_until(lane.can_cut, "batch 1 handed to the sink")
    lane.run_batch()
    wait_until(lambda: lane.window.waiting == 1, "batch 2 waiting")
    lane.window.close()  # the drain: intake stopped, results no longer wait
    wait_until(lane.can_cut, "batch 2 produced after close")
    assert lane.results_out() == 2 * BATCH
    lane.producer.deliver()
    lane.close()


def test_a_batch_larger_than_the_limit_goes_when_the_window_is_empty() -> None:
    w = window(limit_bytes=1024)
    settle = w.hold(10_000)  # alone: admitted, or nothing larger than the limit would ever go
    assert w.held_bytes == 10_000 and w.waiting == 0
    settle()
    assert w.held_bytes == 0


def test_a_settle_counts_once_and_not_after_abandon() -> None:
    w = window(limit_bytes=1024)
    first, second = w.hold(100), w.hold(50)
    first()
    first()  # a second call of the same settle does nothing
    assert w.held_bytes == 50
    w.abandon()  # their producer was replaced: never reported
    assert w.held_bytes == 0
    second()  # a late report of an abandoned hold does nothing
    assert w.held_bytes == 0


def test_a_limit_below_one_byte_is_refused() -> None:
    with pytest.raises(ValueError, match="limit_bytes"):
        window(limit_bytes=0)


def test_settle_wakes_every_waiter_below_the_limit() -> None:
    w = window(limit_bytes=100)
    settle = w.hold(100)
    done: list[int] = []
    threads = [threading.Thread(target=lambda: done.append(w.hold(10) and 1)) for _ in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: w.waiting == 2, "two holders waiting")
    settle()
    for t in threads:
        t.join(5.0)
    assert done == [1, 1] and w.held_bytes == 20
