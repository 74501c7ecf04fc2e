"""The lag monitor over a fake probe consumer: lag in messages counts the work left (messages in
the pipeline not yet done plus offsets not yet fetched), lag in seconds the age of the oldest
message not yet done."""

from __future__ import annotations

from types import SimpleNamespace

from confluent_kafka import TopicPartition as KafkaTopicPartition

from streamproc.kafka.lag import LagMonitor
from streamproc.metrics import Metrics
from streamproc.records import TopicPartition

TP = TopicPartition("in", 0)
OTHER = TopicPartition("in", 1)


class Probe:
    """End offsets per partition; no committed offsets."""

    def __init__(self, ends: dict[TopicPartition, int]) -> None:
        self.ends = ends

    def get_watermark_offsets(self, tp: KafkaTopicPartition, timeout: float) -> tuple[int, int]:
        return (0, self.ends[TopicPartition(tp.topic, tp.partition)])

    def list_topics(self, topic: str, timeout: float) -> SimpleNamespace:
        partitions = {tp.partition: None for tp in self.ends if tp.topic == topic}
        return SimpleNamespace(topics={topic: SimpleNamespace(error=None, partitions=partitions)})

    def committed(
        self, tps: list[KafkaTopicPartition], timeout: float
    ) -> list[KafkaTopicPartition]:
        return [KafkaTopicPartition(t.topic, t.partition, -1001) for t in tps]

    def close(self) -> None:
        pass


def test_lag_is_the_backlog_in_the_pipeline_plus_what_is_not_fetched_and_its_age() -> None:
    metrics = Metrics()
    positions: dict[TopicPartition, int | None] = {TP: 40, OTHER: 12}
    backlog = {TP: (16, 1_000_000), OTHER: (0, None)}
    monitor = LagMonitor(
        {"bootstrap.servers": "fake:9092"},
        "g",
        positions.copy,
        metrics,
        probe_factory=lambda _: Probe({TP: 50, OTHER: 12}),
        backlog=backlog.copy,
        wall=lambda: 1_007.5,
    )
    # TP: 16 consumed and not done + 10 not fetched; OTHER drained (its position passed the
    # transaction marker after its last record, so the end offset is reached: 0, not 1)
    assert monitor.refresh() == {TP: 26, OTHER: 0}

    def sample(name: str, tp: TopicPartition) -> float | None:
        labels = {"topic": tp.topic, "partition": str(tp.partition)}
        return metrics.registry.get_sample_value(name, labels)

    assert sample("streamproc_consumer_lag_messages", TP) == 26
    assert sample("streamproc_consumer_lag_seconds", TP) == 7.5  # record timestamp 1,000 s
    assert sample("streamproc_consumer_lag_seconds", OTHER) == 0.0
    del positions[TP]  # revoked: both series go
    monitor.refresh()
    assert sample("streamproc_consumer_lag_messages", TP) is None
    assert sample("streamproc_consumer_lag_seconds", TP) is None
    monitor.close()


def test_a_share_member_exports_the_end_offset_of_every_input_partition() -> None:
    """A share member has no position (no consumer lag of its own): the lag thread measures
    the end offset of every partition of the input topics, against which the group's records
    not yet acquired are counted (streamproc_share_acquired_end_offset)."""
    metrics = Metrics()
    probe = Probe({TP: 50, OTHER: 12, TopicPartition("elsewhere", 0): 7})
    monitor = LagMonitor(
        {"bootstrap.servers": "fake:9092"}, "g", dict, metrics, probe_factory=lambda _: probe
    )
    monitor.refresh()
    assert metrics.registry.get_sample_value("streamproc_partition_end_offset", {
        "topic": "in", "partition": "0"}) is None  # fmt: skip
    monitor.watch_ends(["in"])
    assert monitor.refresh() == {}  # no lag of its own
    ends = {
        (s.labels["topic"], s.labels["partition"]): s.value
        for m in metrics.registry.collect()
        if m.name == "streamproc_partition_end_offset"
        for s in m.samples
    }
    assert ends == {("in", "0"): 50, ("in", "1"): 12}
    probe.ends[TP] = 64
    monitor.refresh()
    labels = {"topic": "in", "partition": "0"}
    assert metrics.registry.get_sample_value("streamproc_partition_end_offset", labels) == 64
