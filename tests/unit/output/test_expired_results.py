"""What a record past its deadline becomes in the result handler: an ``expired`` result in
offset order with its batch's results, or a dead-letter record with stage ``deadline``."""

from __future__ import annotations

import numpy as np
import pytest

from streamproc.config.sections import PipelineConfig
from streamproc.device import DeviceResult
from streamproc.errors import ModelError
from streamproc.metrics import Metrics
from streamproc.output.headers import H_OFFSET, H_PARTITION, H_RESULT_KIND, H_TOPIC
from streamproc.output.results import ResultHandler, expired_reason
from streamproc.records import Batch, Headers, Record, TopicPartition
from streamproc.workloads import Encoded, Workload

SPEC = PipelineConfig(name="p", input_topic="in", output_topic="out", workload="x:y")
P0, P1 = TopicPartition("in", 0), TopicPartition("in", 1)


class Sent:
    """An in-memory sink: every result and dead-letter record, in the order sent."""

    def __init__(self) -> None:
        self.results: list[tuple[Record, bytes, dict[str, bytes]]] = []
        self.dead: list[tuple[Record, str, str, str]] = []
        self.cuts: list[float | None] = []

    def send_results(
        self,
        topic: str,
        records: list[Record],
        values: list[bytes],
        headers: list[list[tuple[str, bytes]]],
        dlq: str,
        clock: object = None,
        settle: object = None,
        cut_at_s: float | None = None,
    ) -> None:
        assert topic == "out"
        self.cuts.append(cut_at_s)
        for record, value, row in zip(records, values, headers, strict=True):
            self.results.append((record, value, dict(row)))

    def dead_letter(
        self, record: Record, dlq: str, stage: str, cls: str, msg: str, trace: Headers = ()
    ) -> None:
        assert dlq == "in.dlq"
        self.dead.append((record, stage, cls, msg))


class Echo(Workload):
    def __init__(self) -> None:
        self.encoded: list[int] = []

    def encode(self, record: Record, outputs: tuple[np.ndarray, ...]) -> Encoded:
        self.encoded.append(record.offset)
        return Encoded(b"ok")


def rec(tp: TopicPartition, offset: int, deadline_s: float = float("inf")) -> Record:
    return Record(tp, offset, b"k%d" % offset, b"v", (), 0, 0.0, 1, deadline_s=deadline_s)


def handle(spec: PipelineConfig, result: DeviceResult) -> tuple[Sent, Echo]:
    sink, workload = Sent(), Echo()
    ResultHandler(spec, workload, sink, Metrics())(result)  # type: ignore[arg-type]
    return sink, workload


def test_expired_results_go_out_in_offset_order_with_the_batch_results() -> None:
    live = (rec(P0, 1), rec(P1, 7), rec(P0, 3))
    expired = (rec(P0, 0, 1.0), rec(P0, 2, 1.0), rec(P1, 8, 1.0))
    batch = Batch(1, live, 2.0, "size", expired)
    sink, workload = handle(SPEC, DeviceResult(batch, (np.zeros((3, 1)),), {}, None, 0.01))
    assert sorted(workload.encoded) == [1, 3, 7]  # the expired ones are never encoded
    order = [(r.tp.partition, r.offset) for r, _, _ in sink.results]
    assert [o for p, o in order if p == 0] == [0, 1, 2, 3]
    assert [o for p, o in order if p == 1] == [7, 8]
    for record, value, headers in sink.results:
        assert headers[H_TOPIC] == b"in" and headers[H_PARTITION] == b"%d" % record.tp.partition
        assert headers[H_OFFSET] == b"%d" % record.offset
        if record in expired:
            assert value == b"" and headers[H_RESULT_KIND] == b"expired"
        else:
            assert value == b"ok" and H_RESULT_KIND not in headers
    assert sink.dead == []
    assert sink.cuts == [2.0]  # the expiry lead learns this batch's time from its cut


def test_a_batch_whose_every_record_expired_produces_only_expired_results() -> None:
    # as the cut pops them: runs of each partition, in offset order within it
    expired = (rec(P0, 4, 1.0), rec(P0, 5, 1.0), rec(P1, 2, 1.0), rec(P0, 6, 1.0))
    batch = Batch(2, (), 2.0, "deadline", expired)
    sink, workload = handle(SPEC, DeviceResult(batch, (), {}, None, 0.0, model_calls=0))
    assert workload.encoded == []
    assert [(r.tp.partition, r.offset, v) for r, v, _ in sink.results] == [
        (0, 4, b""),
        (0, 5, b""),
        (1, 2, b""),
        (0, 6, b""),
    ]
    for record, _, headers in sink.results:  # the shared coordinate headers are each its own
        assert headers == {
            H_TOPIC: b"in",
            H_PARTITION: b"%d" % record.tp.partition,
            H_OFFSET: b"%d" % record.offset,
            H_RESULT_KIND: b"expired",
        }
    # it ran on no device: its time from cut to acknowledgement teaches the expiry lead nothing
    assert sink.cuts == [None]


@pytest.mark.parametrize("model_failed", [False, True])
def test_on_expired_dead_letter_sends_them_to_the_dead_letter_topic(model_failed: bool) -> None:
    spec = SPEC.model_copy(update={"on_expired": "dead_letter"})
    expired = (rec(P0, 0, 1.5),)
    batch = Batch(3, (rec(P0, 1),), 2.0, "size", expired)
    error = ModelError("boom") if model_failed else None
    outputs = () if model_failed else (np.zeros((1, 1)),)
    sink, _ = handle(spec, DeviceResult(batch, outputs, {}, error, 0.01))
    deadline = [(r.offset, stage, cls) for r, stage, cls, _ in sink.dead if stage == "deadline"]
    assert deadline == [(0, "deadline", "DeadlineExpired")]
    assert "500.0 ms" in next(msg for r, s, _, msg in sink.dead if s == "deadline")
    assert all(r.offset != 0 for r, _, _ in sink.results)


def test_a_failed_model_call_still_gives_the_expired_records_their_results() -> None:
    batch = Batch(4, (rec(P0, 1),), 2.0, "size", (rec(P0, 0, 1.0),))
    sink, _ = handle(SPEC, DeviceResult(batch, (), {}, ModelError("boom"), 0.01))
    assert [(r.offset, stage) for r, stage, _, _ in sink.dead] == [(1, "model")]
    assert [(r.offset, v) for r, v, _ in sink.results] == [(0, b"")]


@pytest.mark.parametrize(
    ("deadline_s", "reason"),
    [
        (9.995, "past its deadline by 5.0 ms when its batch was cut; not run"),
        (10.003, "due 3.0 ms after its batch was cut, sooner than the batch's expected"),
    ],
)
def test_a_dead_letter_says_how_late_or_how_soon_its_expired_record_was(
    deadline_s: float, reason: str
) -> None:
    # expired by prediction (expire_when: predicted) a record is not yet late at its cut: its
    # dead-letter record must not read "past its deadline by -3.0 ms"
    assert expired_reason(10.0, deadline_s).startswith(reason)
