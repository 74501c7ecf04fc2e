"""Tracing (``streamproc.tracing``) over the real OpenTelemetry SDK with an in-memory exporter:
a batch's process span is a child of its records' context and links every record (capped,
counted), its stage spans are its children at the clock's times, each output record gets a
traceparent of its own (a child of its input's context), a malformed traceparent is counted
and ignored, the export queue drops (and counts) rather than waits, and the latency histograms
carry the trace id as an exemplar."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pytest
from confluent_kafka import KafkaError, KafkaException
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

from streamproc.config import load_config
from streamproc.config.sections import PipelineConfig, TracingConfig
from streamproc.device import DeviceResult
from streamproc.errors import ConfigError
from streamproc.histograms import BatchHistogram
from streamproc.metrics import Metrics
from streamproc.output.headers import dead_letter_headers
from streamproc.output.results import ResultHandler
from streamproc.records import Batch, Record, TopicPartition
from streamproc.stages import StageRecorder
from streamproc.tracing.batch import BatchTracer
from streamproc.tracing.export import Tracing
from streamproc.workloads import Encoded, Workload

TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
PARENT_ID = 0xB7AD6B7169203331
SAMPLED = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
UNSAMPLED = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def record(offset: int, headers: tuple[tuple[str, bytes], ...] = (), partition: int = 0) -> Record:
    return Record(TopicPartition("in", partition), offset, b"k", b"v", headers, 0, 0.0)


def tracing(
    ratio: float = 0.0, max_links: int = 128, exporter: SpanExporter | None = None
) -> tuple[Tracing, InMemorySpanExporter | SpanExporter, Metrics]:
    metrics = Metrics()
    exporter = exporter or InMemorySpanExporter()
    config = TracingConfig(sample_ratio=ratio, max_links=max_links)
    return Tracing(config, metrics, exporter), exporter, metrics


def tracer_of(found: Tracing, metrics: Metrics, clock: Clock, max_links: int = 128) -> BatchTracer:
    return BatchTracer(
        found.tracer,
        "in",
        "group",
        max_links,
        metrics.trace_context_invalid.labels("in"),
        metrics.trace_links_dropped.labels("in"),
        clock=clock,
        wall_clock_ns=lambda: 1_000_000_000_000 + int(clock() * 1e9),
    )


def spans(found: Tracing, exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    found.flush()
    return {span.name: span for span in exporter.get_finished_spans()}


def traced_stages() -> tuple[Tracing, InMemorySpanExporter, Metrics, Clock, StageRecorder]:
    """A stage recorder of topic ``in`` whose batches are traced into an in-memory exporter,
    on a clock the test moves."""
    found, exporter, metrics = tracing()
    assert isinstance(exporter, InMemorySpanExporter)
    clock = Clock()
    stages = StageRecorder(metrics.stage, "in", clock, tracer=tracer_of(found, metrics, clock))
    return found, exporter, metrics, clock, stages


def test_a_batch_span_is_a_child_of_its_records_context_with_a_link_and_stage_children() -> None:
    found, exporter, metrics, clock, stages = traced_stages()
    records = [record(offset, (("traceparent", SAMPLED),)) for offset in range(3)]
    records.append(record(3))  # no context: not linked, its result untraced
    consumed = np.zeros(len(records))
    stage_clock = stages.cut(records, consumed, 100.0, 100.0)
    trace = stage_clock.trace
    assert trace is not None and trace.exemplar == {"trace_id": f"{TRACE_ID:032x}"}
    for stage, seconds in (("decode", 0.01), ("device", 0.05)):
        clock.now_s += seconds
        stage_clock.lap(stage)
    trace.device_time(0.02)
    out = [dict(trace.out(r, "out")) for r in records]
    clock.now_s += 0.003
    stage_clock.lap("encode")
    clock.now_s += 0.1
    stage_clock.lap("produce")
    by_name = spans(found, exporter)
    batch = by_name["process in"]
    assert batch.kind is SpanKind.CONSUMER
    assert batch.parent is not None and batch.parent.span_id == PARENT_ID
    assert batch.context.trace_id == TRACE_ID
    assert [link.context.span_id for link in batch.links] == [PARENT_ID] * 3
    assert [link.attributes["messaging.kafka.offset"] for link in batch.links] == [0, 1, 2]
    assert batch.attributes["messaging.operation.type"] == "process"
    assert batch.attributes["messaging.batch.message_count"] == 4
    assert batch.attributes["messaging.destination.name"] == "in"
    # the stage spans: children of the batch span, at the clock's times (device split in two)
    expected = {
        "decode": (0.0, 0.01),
        "device.wait": (0.01, 0.04),
        "device": (0.04, 0.06),
        "encode": (0.06, 0.063),
        "produce": (0.063, 0.163),
    }
    for name, (start_s, end_s) in expected.items():
        child = by_name[name]
        assert child.parent is not None and child.parent.span_id == batch.context.span_id
        assert child.start_time is not None and batch.start_time is not None
        assert abs((child.start_time - batch.start_time) / 1e9 - start_s) < 1e-6, name
        assert child.end_time is not None
        assert abs((child.end_time - batch.start_time) / 1e9 - end_s) < 1e-6, name
    assert batch.end_time == by_name["produce"].end_time
    # context out: each result's own span, a child of its input's context (the batch span for
    # the record without one), in the same trace
    creates = [s for s in exporter.get_finished_spans() if s.name == "create out"]
    assert len(creates) == 3  # one per record with a context
    for headers, span in zip(out[:3], creates, strict=True):
        assert headers["traceparent"] == b"00-%032x-%016x-01" % (TRACE_ID, span.context.span_id)
        assert span.kind is SpanKind.PRODUCER
        assert span.parent is not None and span.parent.span_id == PARENT_ID
        assert [link.context.span_id for link in span.links] == [batch.context.span_id]
    # the record without a context starts no trace: its result carries none
    assert out[3] == {}
    assert metrics.counter_value(metrics.trace_context_invalid, topic="in") == 0


class Constant(Workload):
    def encode(self, record: Record, outputs: tuple[np.ndarray, ...]) -> Encoded:
        return Encoded(b"ok")


class BrokenSink:
    """A sink whose producer cannot go on: ``send_results`` raises."""

    def send_results(self, *args: object, **kwargs: object) -> None:
        raise KafkaException(KafkaError(KafkaError._FENCED, "fenced", fatal=True))

    def dead_letter(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("nothing is dead-lettered here")


def test_a_batch_whose_results_cannot_be_sent_ends_its_span_with_an_error() -> None:
    found, exporter, metrics, clock, stages = traced_stages()
    records = [record(offset, (("traceparent", SAMPLED),)) for offset in range(2)]
    stage_clock = stages.cut(records, np.zeros(2), 100.0, 100.0)
    for stage in ("decode", "device"):
        clock.now_s += 0.01
        stage_clock.lap(stage)
    batch = Batch(1, tuple(records), 100.0, "size", clock=stage_clock)
    spec = PipelineConfig(name="p", input_topic="in", output_topic="out", workload="x:y")
    handler = ResultHandler(spec, Constant(), BrokenSink(), metrics)  # type: ignore[arg-type]
    with pytest.raises(KafkaException):
        handler(DeviceResult(batch, (np.zeros((2, 1)),), {}, None, 0.005))
    by_name = spans(found, exporter)  # the batch span ended: it is exported
    span = by_name["process in"]
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description is not None and "KafkaException" in span.status.description
    assert [event.name for event in span.events] == ["exception"]
    assert {"decode", "device"} <= set(by_name)  # the stages that ended, as children


def test_a_malformed_traceparent_is_counted_and_ignored() -> None:
    found, _, metrics = tracing(ratio=0.0)
    clock = Clock()
    tracer = tracer_of(found, metrics, clock)
    bad = [
        record(0, (("traceparent", b"00-not-hex-01"),)),
        record(1, (("traceparent", b"\xff\xfe"),)),
        record(2, (("traceparent", b"00-00000000000000000000000000000000-b7ad6b7169203331-01"),)),
        record(3),
    ]
    assert tracer.start(bad, 100.0) is None  # no context, no root sampled: no trace
    assert metrics.counter_value(metrics.trace_context_invalid, topic="in") == 3


def test_links_past_the_cap_are_counted() -> None:
    found, exporter, metrics = tracing()
    assert isinstance(exporter, InMemorySpanExporter)
    clock = Clock()
    tracer = tracer_of(found, metrics, clock, max_links=2)
    trace = tracer.start([record(n, (("traceparent", SAMPLED),)) for n in range(5)], 100.0)
    assert trace is not None
    trace.finish()
    assert len(spans(found, exporter)["process in"].links) == 2
    assert metrics.counter_value(metrics.trace_links_dropped, topic="in") == 3


def test_more_links_than_the_sdks_default_are_kept_up_to_the_cap() -> None:
    found, exporter, metrics = tracing(max_links=300)
    assert isinstance(exporter, InMemorySpanExporter)
    tracer = tracer_of(found, metrics, Clock(), max_links=300)
    trace = tracer.start([record(n, (("traceparent", SAMPLED),)) for n in range(200)], 100.0)
    assert trace is not None
    trace.finish()
    assert len(spans(found, exporter)["process in"].links) == 200
    assert metrics.counter_value(metrics.trace_links_dropped, topic="in") == 0


def test_a_record_without_a_context_never_joins_another_records_trace() -> None:
    found, _, metrics = tracing(ratio=1.0)
    traced, bare = record(0, (("traceparent", SAMPLED),)), record(1)
    trace = tracer_of(found, metrics, Clock()).start([traced, bare], 100.0)
    assert trace is not None and trace.exemplar is not None  # the batch: in the record's trace
    assert trace.out(bare, "out") == ()
    assert dict(trace.out(traced, "out"))["traceparent"].split(b"-")[1] == b"%032x" % TRACE_ID


def test_the_first_traceparent_counts_and_tracestates_join() -> None:
    from streamproc.tracing.context import record_context

    found = record_context(
        record(0, (("traceparent", SAMPLED), ("tracestate", b"a=1"), ("traceparent", b"x"),
                   ("tracestate", b"b=2")))
    )  # fmt: skip
    assert found is not None and found.span_id == PARENT_ID
    assert found.trace_state.to_header() == "a=1,b=2"


def test_a_record_dead_lettered_outside_a_batch_gets_a_create_span_of_its_own() -> None:
    found, exporter, _ = tracing()
    assert isinstance(exporter, InMemorySpanExporter)
    header = dict(found.out_of(record(0, (("traceparent", SAMPLED),)), "in.dlq"))["traceparent"]
    (span,) = spans(found, exporter).values()
    assert span.name == "create in.dlq" and span.parent is not None
    assert span.parent.span_id == PARENT_ID
    assert header == b"00-%032x-%016x-01" % (TRACE_ID, span.context.span_id)
    assert found.out_of(record(1), "in.dlq") == ()
    assert found.out_of(record(2, (("traceparent", b"junk"),)), "in.dlq") == ()


def test_roots_are_sampled_at_the_ratio() -> None:
    clock = Clock()
    for ratio, traced in ((0.0, False), (1.0, True)):
        found, _, metrics = tracing(ratio=ratio)
        trace = tracer_of(found, metrics, clock).start([record(0)], 100.0)
        assert (trace is not None) is traced


def test_an_unsampled_context_goes_on_unsampled_with_a_span_id_of_its_own() -> None:
    found, exporter, metrics = tracing(ratio=1.0)
    assert isinstance(exporter, InMemorySpanExporter)
    clock = Clock()
    source, other = record(0, (("traceparent", UNSAMPLED),)), record(1)
    trace = tracer_of(found, metrics, clock).start([source, other], 100.0)
    assert trace is not None and trace.exemplar is None
    version, trace_id, span_id, flags = dict(trace.out(source, "out"))["traceparent"].split(b"-")
    assert (version, trace_id, flags) == (b"00", b"%032x" % TRACE_ID, b"00")
    assert int(span_id, 16) != PARENT_ID
    assert trace.out(other, "out") == ()  # no context, the batch not sampled: none
    trace.finish()
    assert spans(found, exporter) == {}  # the parent said: not sampled


def test_a_dead_letter_record_carries_its_own_traceparent_not_its_inputs() -> None:
    source = record(0, (("traceparent", SAMPLED), ("tracestate", b"a=1"), ("x", b"y")))
    own = (("traceparent", b"00-%032x-%016x-01" % (TRACE_ID, 7)),)
    headers = dead_letter_headers(source, "decode", "ValueError", "bad", False, own)
    assert [h for h in headers if h[0] in ("traceparent", "tracestate")] == list(own)
    assert ("x", b"y") in headers
    kept = dead_letter_headers(source, "decode", "ValueError", "bad", False)
    assert ("traceparent", SAMPLED) in kept  # tracing off: the input's headers unchanged


class Blocked(SpanExporter):
    """An exporter that does not return until released: a backend that hangs."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        self.release.wait(10)
        return SpanExportResult.FAILURE


def test_a_hung_backend_drops_and_counts_spans_and_never_blocks_the_caller() -> None:
    exporter = Blocked()
    metrics = Metrics()
    config = TracingConfig(sample_ratio=1.0, max_queue_spans=16)
    found = Tracing(config, metrics, exporter)
    tracer = found.tracer
    for _ in range(20):  # the export thread wakes at 16 queued spans and hangs in export
        tracer.start_span("s").end()
    assert exporter.entered.wait(10)
    for _ in range(100):
        tracer.start_span("s").end()
    dropped = metrics.counter_value(metrics.trace_spans_dropped, reason="queue_full")
    assert dropped >= 100 - 16
    exporter.release.set()
    found.shutdown()
    failed = metrics.counter_value(metrics.trace_spans_dropped, reason="export_failed")
    assert failed > 0 and metrics.counter_value(metrics.trace_spans_exported) == 0


def test_the_latency_histograms_carry_the_trace_id_as_an_exemplar() -> None:
    registry = CollectorRegistry()
    histogram = BatchHistogram("latency_seconds", "h", ("topic",), (0.1, 1.0), registry)
    histogram.labels("in").observe_many(np.array([0.05, 0.5]), {"trace_id": "ab" * 16})
    histogram.labels("in").observe_repeated(0.01, 3, {"trace_id": "cd" * 16})
    text = openmetrics_latest(registry).decode()
    assert 'le="1.0",topic="in"} 5.0 # {trace_id="' + "ab" * 16 + '"} 0.5 ' in text
    assert 'le="0.1",topic="in"} 4.0 # {trace_id="' + "cd" * 16 + '"} 0.01 ' in text
    assert 'le="+Inf",topic="in"} 5.0\n' in text  # no exemplar where none was given


def test_tracing_is_on_only_with_an_endpoint_and_bad_values_name_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pipelines = [{"name": "p", "input_topic": "i", "output_topic": "o", "workload": "trades"}]
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    assert not load_config(overrides={"pipelines": pipelines}).tracing.active
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    config = load_config(overrides={"pipelines": pipelines})
    assert config.tracing.active and config.tracing.endpoint == "http://127.0.0.1:4318"
    off = load_config(overrides={"pipelines": pipelines, "tracing": {"enabled": False}})
    assert not off.tracing.active
    with pytest.raises(ConfigError, match=r"tracing\.sample_ratio"):
        load_config(overrides={"pipelines": pipelines, "tracing": {"sample_ratio": 2}})
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "localhost:4318")  # not silently ignored
    with pytest.raises(ConfigError, match=r"tracing\.endpoint.*an http:// or https:// URL"):
        load_config(overrides={"pipelines": pipelines})
