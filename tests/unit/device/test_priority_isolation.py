"""Priority isolation on a shared device (issue 22, item 7), wired as the pipeline wires it:
two lanes of different priorities in one process, one CPU device. Uses only the pipeline and
worker interfaces that existed before device admission, so it runs (and fails) on that code."""

from __future__ import annotations

import threading
import time

import torch

from streamproc.config import load_config
from streamproc.device import DeviceJob, DeviceResult, DeviceWorker, Release
from streamproc.pipeline import Pipeline
from streamproc.records import Batch, Priority, Record, TopicPartition
from tests.support.kafka_fakes import FakeConsumer, FakeProducer, factory
from tests.support.waiting import wait_until


class ProbeModel:
    """Records when each call entered and the intra-op threads it ran with; waits for
    ``gate`` before returning (a batch that stays on the device)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.entered_s: list[float] = []
        self.threads: list[int] = []
        self.returned_s: list[float] = []

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.entered_s.append(time.monotonic())
        self.threads.append(torch.get_num_threads())
        assert self.gate.wait(60), "gate never opened"
        self.returned_s.append(time.monotonic())
        return (x.reshape(len(x), -1)[:, :1].float().clone(),)

    def reset(self) -> None:
        self.entered_s.clear()
        self.threads.clear()
        self.returned_s.clear()


def job(worker: DeviceWorker, batch_id: int, priority: Priority) -> DeviceJob:
    records = tuple(
        Record(TopicPartition("t", 0), batch_id * 10 + i, None, b"v", (), 0, 0.0, 1, priority)
        for i in range(2)
    )
    slab = worker.pool.lease()
    assert slab is not None
    return DeviceJob(Batch(batch_id, records, 0.0), slab)


def test_a_lower_priority_lane_is_not_launched_while_a_high_priority_batch_is_on_the_device() -> (
    None
):
    """Trades (high) and iot (normal) in one process on one CPU, wired by the pipeline: while a
    trades batch is on the device, an iot batch is not launched (until the trades batch left
    or the defer bound, 250 ms by default, ran out), and it runs with half the intra-op
    threads. Before issue 22 the iot batch started at once with every thread."""
    config = load_config(
        overrides={
            "kafka": {"bootstrap_servers": "127.0.0.1:9"},
            "metrics": {"port": 0},
            "worker": {"device": "cpu"},
            "pipelines": [
                {"name": "t", "input_topic": "t", "output_topic": "to", "workload": "trades"},
                {"name": "i", "input_topic": "i", "output_topic": "io", "workload": "iot"},
            ],
        }
    )
    pipeline = Pipeline(config, factory(FakeConsumer({})), factory(FakeProducer()))
    high_worker, low_worker = pipeline.workers  # lane order: trades, iot; one device
    high, low = ProbeModel(), ProbeModel()
    high_worker.model, low_worker.model = high, low
    completed: list[int] = []

    def on_complete(result: DeviceResult, release: Release) -> None:
        completed.append(result.batch.batch_id)
        release()

    high_worker.on_complete = low_worker.on_complete = on_complete
    default = torch.get_num_threads()
    try:
        for worker in (high_worker, low_worker):
            worker.start()  # warm-up calls the models with the gates open
        high.reset()
        low.reset()
        high.gate.clear()
        high_worker.submit(job(high_worker, 1, Priority.HIGH))
        wait_until(lambda: bool(high.entered_s), "the high-priority batch on the device")
        submitted_s = time.monotonic()
        low_worker.submit(job(low_worker, 2, Priority.NORMAL))
        wait_until(lambda: bool(low.entered_s), "the lower-priority batch to be launched")
        waited_s = low.entered_s[0] - submitted_s
        assert not high.returned_s  # the test still holds the high-priority batch
        assert waited_s >= 0.2, (
            f"the lower-priority batch was launched {waited_s * 1000:.1f} ms after submit, "
            "while a high-priority batch was on the device"
        )
        assert low.threads == [max(1, default // 2)]
        high.gate.set()
        wait_until(lambda: sorted(completed) == [1, 2], "both batches to complete")
        assert high.threads == [default]
        sample = pipeline.metrics.registry.get_sample_value
        lanes = {"i": "cpu:0", "t": "cpu:0"}
        counts = {
            (name, topic): sample(
                f"streamproc_device_{name}_launches_total", {"topic": topic, "device": device}
            )
            for name in ("deferred", "yielded")
            for topic, device in lanes.items()
        }
        assert counts == {
            ("deferred", "i"): 1.0,
            ("yielded", "i"): 1.0,
            ("deferred", "t"): 0.0,
            ("yielded", "t"): 0.0,
        }
    finally:
        high.gate.set()
        for worker in (high_worker, low_worker):
            worker.close(30)
        pipeline.close()
