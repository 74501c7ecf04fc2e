"""Small test helpers shared by several unit-test modules, on top of
``tests.support.kafka_fakes``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import TopicPartition as KafkaTopicPartition

from streamproc.records import Priority, Record, TopicPartition
from tests.support.kafka_fakes import FakeProducer


def make_records(
    tp: TopicPartition,
    offsets: Iterable[int],
    generation: int = 1,
    consumed_at_s: float = 0.0,
    value: bytes = b"v",
    priority: Priority = Priority.NORMAL,
) -> list[Record]:
    """Records of ``tp`` at ``offsets`` (key ``b"k"``, no headers), all consumed at
    ``consumed_at_s`` under ``generation``."""
    return [
        Record(tp, offset, b"k", value, (), 0, consumed_at_s, generation, priority)
        for offset in offsets
    ]


@dataclass
class OffsetsProducer(FakeProducer):
    """A fake transactional producer that also keeps what each ``send_offsets_to_transaction``
    that succeeded was given: ``(offsets per partition, consumer group metadata)``, in order."""

    sent_offsets: list[tuple[dict[TopicPartition, int], Any]] = field(default_factory=list)

    def send_offsets_to_transaction(
        self, positions: list[KafkaTopicPartition], group_metadata: Any, timeout: float = -1
    ) -> None:
        super().send_offsets_to_transaction(positions, group_metadata, timeout)
        offsets = {TopicPartition(p.topic, p.partition): p.offset for p in positions}
        self.sent_offsets.append((offsets, group_metadata))
