"""Batch delivery accounting: a batch's inputs are done only when every report is in."""

from __future__ import annotations

from confluent_kafka import KafkaError

from streamproc.records import Record, TopicPartition
from streamproc.sink import _BatchAck

TP = TopicPartition("in", 0)


class RecordingSink:
    def __init__(self) -> None:
        self.delivered: list[tuple[str, list[int]]] = []
        self.rejected: list[tuple[int, str]] = []

    def _delivered(self, topic: str, records: list[Record]) -> None:
        self.delivered.append((topic, [r.offset for r in records]))

    def _rejected(self, record: Record, err: KafkaError, dlq_topic: str) -> None:
        self.rejected.append((record.offset, dlq_topic))


def _ack(sink: RecordingSink, n: int) -> _BatchAck:
    records = [Record(TP, o, None, b"v", (), 0, 0.0, 1) for o in range(n)]
    return _BatchAck(sink, "out", "in.dlq", records)  # type: ignore[arg-type]


def test_batch_is_done_only_after_its_last_report_in_any_order() -> None:
    sink = RecordingSink()
    ack = _ack(sink, 3)
    ack.delivered(2, None, None)
    ack.delivered(0, None, None)
    assert sink.delivered == []  # offset 1 not acknowledged yet: nothing may be marked done
    ack.delivered(1, None, None)
    assert sink.delivered == [("out", [0, 1, 2])]


def test_rejected_result_is_dead_lettered_and_left_out_of_the_done_set() -> None:
    sink = RecordingSink()
    ack = _ack(sink, 3)
    ack.delivered(0, None, None)
    ack.delivered(1, KafkaError(KafkaError.MSG_SIZE_TOO_LARGE), None)
    assert sink.rejected == [(1, "in.dlq")]
    ack.skipped(2)  # exactly-once: assignment gone, nothing produced
    assert sink.delivered == [("out", [0])]
