from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from confluent_kafka import TopicPartition as KafkaTopicPartition

from streamproc.config.sections import PipelineConfig
from streamproc.device import DeviceResult
from streamproc.errors import DecodeError, RegistryUnavailable
from streamproc.kafka.lag import LagMonitor
from streamproc.metrics import Metrics
from streamproc.output.results import ResultHandler
from streamproc.records import Batch, Headers, Record, TopicPartition
from streamproc.workloads import Encoded, Workload

TP = TopicPartition("in", 0)
SPEC = PipelineConfig(name="p", input_topic="in", output_topic="out", workload="x:y")


class MemorySink:
    def __init__(self) -> None:
        self.results: list[tuple[int, bytes]] = []
        self.dead: list[tuple[int, str, str]] = []

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
        for record, value, row_headers in zip(records, values, headers, strict=True):
            assert dict(row_headers)["streamproc.source.offset"] == b"%d" % record.offset
            self.results.append((record.offset, value))

    def dead_letter(
        self, record: Record, dlq: str, stage: str, cls: str, msg: str, trace: Headers = ()
    ) -> None:
        self.dead.append((record.offset, stage, cls))


class Flaky(Workload):
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def encode(self, record: Record, outputs: tuple[np.ndarray, ...]) -> Encoded:
        self.calls += 1
        if self.calls <= self.failures:
            raise RuntimeError("callback failed")
        return Encoded(b"ok")


def run(workload: Workload, failed: dict | None = None) -> MemorySink:  # type: ignore[type-arg]
    sink = MemorySink()
    handler = ResultHandler(SPEC, workload, sink, Metrics(), attempts=3)  # type: ignore[arg-type]
    records = tuple(Record(TP, i, None, b"v", (), 0, 0.0, 1) for i in range(2))
    handler(DeviceResult(Batch(1, records, 0.0), (np.zeros((2, 1)),), failed or {}, None, 0.01))
    return sink


def test_failing_callback_is_retried_then_succeeds() -> None:
    workload = Flaky(failures=2)
    sink = run(workload)
    assert [offset for offset, _ in sink.results] == [0, 1]
    assert workload.calls == 4 and sink.dead == []


def test_callback_failing_every_retry_is_dead_lettered_and_stream_goes_on() -> None:
    workload = Flaky(failures=100)
    sink = run(workload)
    assert sink.dead == [(0, "encode", "RuntimeError"), (1, "encode", "RuntimeError")]
    assert workload.calls == 6  # 3 attempts per record


def test_decode_failures_are_dead_lettered_in_order() -> None:
    sink = run(Flaky(failures=0), failed={0: DecodeError("bad")})
    assert sink.dead == [(0, "decode", "DecodeError")]
    assert [offset for offset, _ in sink.results] == [1]


def test_stalled_partition_watchdog_with_fake_clock() -> None:
    now = [0.0]
    metrics = Metrics()
    monitor = LagMonitor(
        {"bootstrap.servers": "127.0.0.1:9", "log_level": 0},
        "g",
        dict,
        metrics,
        stall_timeout_s=10,
        clock=lambda: now[0],
    )
    monitor._watch(TP, 5, lag=3)
    now[0] = 9.0
    monitor._watch(TP, 5, lag=3)
    assert monitor.stalled == set()
    now[0] = 10.0
    monitor._watch(TP, 5, lag=3)
    assert monitor.stalled == {TP} and metrics.stalled._value.get() == 1
    now[0] = 11.0
    monitor._watch(TP, 6, lag=2)  # progress clears it
    assert monitor.stalled == set() and metrics.stalled._value.get() == 0
    now[0] = 30.0
    monitor._watch(TP, 6, lag=0)  # no lag: never stalled
    assert monitor.stalled == set()
    monitor.close()


class Probe:
    """A probe consumer: watermarks and committed offsets, no AdminClient."""

    def __init__(self, settings: dict[str, object]) -> None:
        self.settings = settings
        self.closed = False

    def get_watermark_offsets(self, tp: KafkaTopicPartition, timeout: float) -> tuple[int, int]:
        return (2, 10 + tp.partition)

    def committed(
        self, tps: list[KafkaTopicPartition], timeout: float
    ) -> list[KafkaTopicPartition]:
        return [
            KafkaTopicPartition(t.topic, t.partition, 7 if t.partition == 1 else -1001) for t in tps
        ]

    def close(self) -> None:
        self.closed = True


def test_lag_comes_from_a_probe_consumer_of_the_group() -> None:
    made: list[Probe] = []
    positions = {
        TopicPartition("in", 0): 4,
        TopicPartition("in", 1): None,
        TopicPartition("in", 2): None,
    }
    monitor = LagMonitor(
        {"bootstrap.servers": "127.0.0.1:9"},
        "g",
        lambda: dict(positions),
        Metrics(),
        probe_factory=lambda settings: made.append(Probe(settings)) or made[-1],
    )
    (probe,) = made
    assert probe.settings["group.id"] == "g" and probe.settings["enable.auto.commit"] is False
    lags = monitor.refresh()
    # end - position; else end - committed; else end - earliest (low watermark)
    assert lags == {
        TopicPartition("in", 0): 10 - 4,
        TopicPartition("in", 1): 11 - 7,
        TopicPartition("in", 2): 12 - 2,
    }
    monitor.close()
    assert probe.closed


class BatchFails(Flaky):
    """encode_many reports row 1 failed; encode alone then fails ``failures`` more times."""

    def encode_many(
        self, records: Sequence[Record], outputs: tuple[np.ndarray, ...]
    ) -> list[Encoded | Exception]:
        return [Encoded(b"batch"), RuntimeError("row failed in the batch")]


def test_a_row_failing_in_the_batch_encode_is_retried_alone() -> None:
    workload = BatchFails(failures=1)
    sink = run(workload)
    assert sink.results == [(0, b"batch"), (1, b"ok")]  # 1 batch try + 2 alone: 2nd succeeds
    assert workload.calls == 2 and sink.dead == []
    always = BatchFails(failures=100)
    sink = run(always)
    assert sink.results == [(0, b"batch")] and sink.dead == [(1, "encode", "RuntimeError")]
    assert always.calls == 2  # attempts=3: the batch try and two alone


class Recording(Flaky):
    """Records which rows the batch encode was given; returns a bad value for one of them."""

    def __init__(self) -> None:
        super().__init__(failures=0)
        self.given: list[int] = []

    def encode_many(
        self, records: Sequence[Record], outputs: tuple[np.ndarray, ...]
    ) -> list[Encoded | Exception]:
        self.given = [record.offset for record in records]
        return [b"not an Encoded"]  # type: ignore[list-item]


class ReturnsBytes(Flaky):
    """A workload bug: its per-record encode returns bytes instead of Encoded."""

    def encode(self, record: Record, outputs: tuple[np.ndarray, ...]) -> Encoded:
        self.calls += 1
        return b"raw"  # type: ignore[return-value]


def test_a_wrong_type_from_encode_is_dead_lettered_not_fatal() -> None:
    # it raised AttributeError out of the completion thread (the pipeline's fatal path)
    workload = ReturnsBytes(failures=0)
    sink = run(workload)
    assert sink.results == []
    assert sink.dead == [(0, "encode", "TypeError"), (1, "encode", "TypeError")]
    assert workload.calls == 6  # the batch try and two alone per row, each refused


def test_rows_that_failed_decode_never_reach_the_encoder_and_bad_returns_are_retried() -> None:
    workload = Recording()
    sink = run(workload, failed={0: DecodeError("bad")})
    assert workload.given == [1]  # the failed row 0 was not encoded
    assert sink.dead == [(0, "decode", "DecodeError")]
    assert sink.results == [(1, b"ok")]  # the bad return value counted as one failed try


class RegistryGone(Flaky):
    """A schema-managed workload whose echoed fields needed the registry, which was abandoned
    (the process closing): in the batch's answer, and again when a row is tried alone."""

    def encode_many(
        self, records: Sequence[Record], outputs: tuple[np.ndarray, ...]
    ) -> list[Encoded | Exception]:
        return [Encoded(b"batch"), RegistryUnavailable("registry unavailable while closing")]

    def encode(self, record: Record, outputs: tuple[np.ndarray, ...]) -> Encoded:
        raise RegistryUnavailable("registry unavailable while closing")


def test_an_unavailable_registry_at_encode_stops_the_lane_and_dead_letters_nothing() -> None:
    # It was retried and then dead-lettered with stage "encode": a valid record lost to the
    # dead-letter topic for the registry's state. Raised instead, the results thread's fatal
    # path stops the pipeline and nothing of the batch is produced or committed.
    import pytest

    with pytest.raises(RegistryUnavailable):
        run(RegistryGone(failures=0))
