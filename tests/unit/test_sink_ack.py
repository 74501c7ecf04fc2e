"""Batch delivery accounting: a batch's inputs are done only when every report is in."""

from __future__ import annotations

from collections.abc import Callable

from confluent_kafka import KafkaError

from streamproc.records import Record, TopicPartition
from streamproc.sink import _BatchAck

TP = TopicPartition("in", 0)


class RecordingSink:
    transactions = None

    def __init__(self) -> None:
        self.delivered: list[tuple[str, list[int]]] = []
        self.rejected: list[tuple[int, str]] = []
        self.alone: list[tuple[str, bytes | None, Callable[..., None]]] = []

    def _send_alone(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes]],
        on_delivery: Callable[..., None],
    ) -> None:
        self.alone.append((topic, value, on_delivery))

    def _delivered(self, topic: str, records: list[Record]) -> None:
        self.delivered.append((topic, [r.offset for r in records]))

    def _rejected(self, record: Record, err: KafkaError, dlq_topic: str) -> None:
        self.rejected.append((record.offset, dlq_topic))


def _ack(sink: RecordingSink, n: int) -> _BatchAck:
    results = [(Record(TP, o, None, b"v", (), 0, 0.0, 1), b"r%d" % o, []) for o in range(n)]
    return _BatchAck(sink, "out", "in.dlq", results)  # type: ignore[arg-type]


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
    ack.delivered(1, KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED), None)
    assert sink.rejected == [(1, "in.dlq")]
    ack.skipped(2)  # exactly-once: assignment gone, nothing produced
    assert sink.delivered == [("out", [0])]


def test_a_record_batch_refused_as_too_large_is_judged_record_by_record() -> None:
    # The broker's MSG_SIZE_TOO_LARGE refuses the whole record batch: every record of it gets
    # the error. Each is sent again alone; only one refused alone is dead-lettered.
    sink = RecordingSink()
    ack = _ack(sink, 3)
    too_large = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
    for index in range(3):
        ack.delivered(index, too_large, None)
    assert sink.rejected == [] and sink.delivered == []
    assert [(topic, value) for topic, value, _ in sink.alone] == [
        ("out", b"r0"),
        ("out", b"r1"),
        ("out", b"r2"),
    ]
    sink.alone[0][2](None, None)
    sink.alone[1][2](too_large, None)  # too large on its own
    sink.alone[2][2](None, None)
    assert sink.rejected == [(1, "in.dlq")]
    assert sink.delivered == [("out", [0, 2])]
