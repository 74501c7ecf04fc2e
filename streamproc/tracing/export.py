"""The process's tracer provider and its export: OTLP over HTTP (protobuf) from a bounded
queue on the SDK's export thread, every span that does not reach the backend counted."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Tracer

from streamproc.config.sections import TracingConfig
from streamproc.metrics import Metrics
from streamproc.records import Headers, Record
from streamproc.tracing.batch import created
from streamproc.tracing.context import MALFORMED, record_context

TRACES_PATH = "/v1/traces"
"""Appended to ``tracing.endpoint`` (a base URL, as ``$OTEL_EXPORTER_OTLP_ENDPOINT`` is)."""
INSTRUMENTATION_NAME = "streamproc"


class CountingExporter(SpanExporter):
    """Exports through ``exporter`` and counts what it did: exported, or dropped
    (``export_failed``). Called on the SDK's export thread only.

    Args:
        exporter: the OTLP exporter (tests pass an in-memory one).
        metrics: ``streamproc_trace_spans_exported_total`` and ``..._dropped_total``.
    """

    def __init__(self, exporter: SpanExporter, metrics: Metrics) -> None:
        self._exporter = exporter
        self._exported = metrics.trace_spans_exported
        self._failed = metrics.trace_spans_dropped.labels("export_failed")
        self.handed = 0
        """Spans handed to :meth:`export` so far (the queue's count of what left it)."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.handed += len(spans)
        try:
            result = self._exporter.export(spans)
        except Exception:  # a broken exporter loses these spans, never the export thread
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self._exported.inc(len(spans))
        else:
            self._failed.inc(len(spans))
        return result

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporter.force_flush(timeout_millis)


class BoundedSpanProcessor(BatchSpanProcessor):
    """The SDK's batching processor, with its queue's bound kept by refusing the new span
    (counted ``queue_full``) rather than the SDK's eviction of the oldest, uncounted.

    Args:
        exporter: the counting exporter (its ``handed`` tells what left the queue).
        max_queue_spans: the queue's bound.
        metrics: ``streamproc_trace_spans_dropped_total{reason="queue_full"}``.
        schedule_delay_ms: the longest a span waits in the queue before an export.
    """

    def __init__(
        self,
        exporter: CountingExporter,
        max_queue_spans: int,
        metrics: Metrics,
        schedule_delay_ms: float = 1000.0,
    ) -> None:
        super().__init__(
            exporter,
            max_queue_size=max_queue_spans,
            schedule_delay_millis=schedule_delay_ms,
            max_export_batch_size=min(512, max_queue_spans),
        )
        self._counting = exporter
        self._max_queue_spans = max_queue_spans
        self._full = metrics.trace_spans_dropped.labels("queue_full")
        self._lock = threading.Lock()
        self._queued = 0

    def on_end(self, span: ReadableSpan) -> None:
        context = span.context
        if context is None or not context.trace_flags.sampled:
            return
        with self._lock:  # spans end on several threads
            if self._queued - self._counting.handed >= self._max_queue_spans:
                self._full.inc()
                return
            self._queued += 1
        super().on_end(span)

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return


class Tracing:
    """The process's tracer: a tracer provider with a parent-based sampler
    (``tracing.sample_ratio`` for roots) and the bounded OTLP export. Its spans are exported
    from the SDK's export thread; :meth:`shutdown` flushes what is queued.

    Args:
        config: the ``tracing`` section (active: an endpoint known).
        metrics: the process metrics (span counts).
        exporter: where spans go (default: OTLP/HTTP to ``config.endpoint``; tests pass an
            in-memory exporter).

    Raises:
        ValueError: ``config`` has no endpoint and no ``exporter`` is given.
    """

    def __init__(
        self, config: TracingConfig, metrics: Metrics, exporter: SpanExporter | None = None
    ) -> None:
        if exporter is None:
            if config.endpoint is None:
                raise ValueError("tracing.endpoint is not set")
            endpoint = config.endpoint.rstrip("/")
            exporter = OTLPSpanExporter(
                endpoint=endpoint if endpoint.endswith(TRACES_PATH) else endpoint + TRACES_PATH,
                headers={k: v.get_secret_value() for k, v in config.headers.items()},
                timeout=config.export_timeout_s,
            )
        self.config = config
        self.metrics = metrics
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": config.service_name}),
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
            # the SDK's default keeps 128 links: tracing.max_links counts what it leaves out
            span_limits=SpanLimits(max_links=max(config.max_links, 1)),
        )
        # the API warns once per record whose tracestate breaks W3C's rules (the entry is
        # dropped, the context kept): a producer's habit must not flood the log
        logging.getLogger("opentelemetry.trace.span").setLevel(logging.ERROR)
        self.provider.add_span_processor(
            BoundedSpanProcessor(
                CountingExporter(exporter, metrics), config.max_queue_spans, metrics
            )
        )
        self.tracer: Tracer = self.provider.get_tracer(INSTRUMENTATION_NAME)

    def out_of(self, record: Record, topic: str) -> Headers:
        """The trace headers of an output record of ``record`` made outside any batch (a
        share group's dead-letter record of a record delivered too often): a ``create
        <topic>`` span, a child of ``record``'s context; empty when it has none (or a
        malformed one)."""
        context = record_context(record)
        if context is None or context is MALFORMED:
            return ()
        return created(self.tracer, context, topic)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Export every span ended so far; False when ``timeout_s`` passed first."""
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Export what is queued, then stop exporting (idempotent). Waits at most
        ``timeout_s`` (None: twice ``tracing.export_timeout_s``): the SDK's own shutdown waits
        up to 30 s for a backend that is down, so it runs on a daemon thread given up on after
        that (``timeout_s`` never lengthens the wait)."""
        wait_s = 2 * self.config.export_timeout_s
        if timeout_s is not None:
            wait_s = min(wait_s, timeout_s)
        closing = threading.Thread(target=self.provider.shutdown, name="trace-close", daemon=True)
        closing.start()
        closing.join(wait_s)
