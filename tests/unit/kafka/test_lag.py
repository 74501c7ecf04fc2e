"""The lag monitor over a fake probe consumer: lag in messages counts the work left (messages in
the pipeline not yet done plus offsets not yet fetched), lag in seconds the age of the oldest
message not yet done."""

from __future__ import annotations

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
