"""A batch's trace: its ``process`` span, linked to every record's context, the child spans of
its stages, and the context each of its output records carries on.

A :class:`BatchTrace` is started at the cut (:meth:`BatchTracer.start`, on the lane's
dispatcher thread) and travels with the batch's stage clock (:class:`streamproc.stages.
StageClock`), so each stage's thread touches it in turn, after the one before, ordered by the
hand-over of the batch itself (the clock's own rule): it needs no lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from opentelemetry.context import Context
from opentelemetry.semconv._incubating.attributes.messaging_attributes import (
    MESSAGING_BATCH_MESSAGE_COUNT,
    MESSAGING_CONSUMER_GROUP_NAME,
    MESSAGING_DESTINATION_NAME,
    MESSAGING_DESTINATION_PARTITION_ID,
    MESSAGING_KAFKA_OFFSET,
    MESSAGING_OPERATION_NAME,
    MESSAGING_OPERATION_TYPE,
    MESSAGING_SYSTEM,
)
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    Tracer,
    set_span_in_context,
)
from prometheus_client import Counter

from streamproc.records import Headers, Record
from streamproc.tracing.context import MALFORMED, record_context, trace_headers

PROCESS = "process"
CREATE = "create"
KAFKA = "kafka"
STAGE_SPANS = ("decode", "device", "encode", "produce")
"""The batch stages that get a child span of the ``process`` span (``device`` splits in two:
``device.wait`` until the model call, then ``device``, the measured device time)."""
EMPTY_CONTEXT = Context()


def created(tracer: Tracer, parent: SpanContext, topic: str, links: Sequence[Link] = ()) -> Headers:
    """The trace headers of an output record to ``topic`` whose input's context is ``parent``:
    those of a ``create <topic>`` span (kind ``PRODUCER``, ended at once), a child of
    ``parent`` with ``links``; its context is unsampled (and no span exported) when
    ``parent``'s is."""
    span = tracer.start_span(
        f"{CREATE} {topic}",
        context=set_span_in_context(NonRecordingSpan(parent), EMPTY_CONTEXT),
        kind=SpanKind.PRODUCER,
        links=links,
        attributes={
            MESSAGING_SYSTEM: KAFKA,
            MESSAGING_OPERATION_NAME: CREATE,
            MESSAGING_OPERATION_TYPE: CREATE,
            MESSAGING_DESTINATION_NAME: topic,
        },
    )
    span.end()
    return trace_headers(span.get_span_context())


class BatchTrace:
    """One batch's trace (see the module docstring). Built by :meth:`BatchTracer.start`.

    Attributes:
        span: the batch's ``process`` span (a non-recording one when not sampled).
        exemplar: ``{"trace_id": <32 hex digits>}`` when the span is sampled, else None: the
            exemplar of the batch's latency observations.
    """

    __slots__ = (
        "_batch_headers",
        "_contexts",
        "_inference_s",
        "_stages",
        "_tracer",
        "_wall_offset_ns",
        "exemplar",
        "span",
    )

    def __init__(
        self,
        tracer: Tracer,
        span: Span,
        contexts: dict[Record, SpanContext],
        wall_offset_ns: int,
    ) -> None:
        self._tracer = tracer
        self.span = span
        self._contexts = contexts
        self._wall_offset_ns = wall_offset_ns
        self._stages: list[tuple[str, float, float]] = []
        self._inference_s: float | None = None
        context = span.get_span_context()
        self.exemplar = {"trace_id": f"{context.trace_id:032x}"} if span.is_recording() else None
        # only a root batch's: its records had no context of their own to continue
        self._batch_headers = trace_headers(context) if self.exemplar and not contexts else ()

    def lap(self, stage: str, start_s: float, end_s: float) -> None:
        """The batch's ``stage`` ran from ``start_s`` to ``end_s`` (monotonic seconds); its
        ``produce`` stage ends the trace (:meth:`finish`)."""
        if self.exemplar is None:
            return
        self._stages.append((stage, start_s, end_s))
        if stage == "produce":
            self.finish(end_s)

    def device_time(self, seconds: float) -> None:
        """The batch's model call took ``seconds`` of device time (measured by the device
        worker: CUDA events, or the CPU clock around the call)."""
        self._inference_s = seconds

    def out(self, record: Record, topic: str) -> Headers:
        """The trace headers of the output record of ``record`` produced to ``topic`` (a
        result or a dead-letter record): for a record with a context, a ``create <topic>``
        span's, a child of that context linked to the batch span; for a record without one in
        a batch sampled as a root (no record of it had a context), the batch span's own (no
        span per record: 256 of them per sampled batch made 1 % sampling cost about 4 % CPU
        per message, docs/benchmarks.md "Tracing"); else empty: a record without a context
        never joins another record's trace."""
        parent = self._contexts.get(record)
        if parent is None:
            return self._batch_headers
        links = (Link(self.span.get_span_context()),) if self.exemplar is not None else ()
        return created(self._tracer, parent, topic, links)

    def finish(self, end_s: float | None = None) -> None:
        """End the batch span at ``end_s`` (monotonic seconds; None: now), after its stages'
        child spans (idempotent)."""
        span = self.span
        if not span.is_recording():
            return
        parent = set_span_in_context(span, EMPTY_CONTEXT)
        for stage, start_s, stage_end_s in self._stages:
            if stage == "device" and self._inference_s is not None:
                device_s = max(stage_end_s - self._inference_s, start_s)
                if device_s > start_s:
                    self._child("device.wait", parent, start_s, device_s)
                start_s = device_s
            self._child(stage, parent, start_s, stage_end_s)
        self._stages.clear()
        span.end(None if end_s is None else self._ns(end_s))

    def fail(self, error: BaseException) -> None:
        """The batch's results were not all handed to the producer: ``error`` (an exception
        that stops the pipeline) was raised on the way. End the batch span now with an error
        status and the exception recorded, after the child spans of the stages that did end,
        so the trace of the failure is exported, not left open (idempotent, as
        :meth:`finish`)."""
        span = self.span
        if not span.is_recording():
            return
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        self.finish()

    def _child(self, name: str, parent: Context, start_s: float, end_s: float) -> None:
        child = self._tracer.start_span(name, context=parent, start_time=self._ns(start_s))
        child.end(self._ns(end_s))

    def _ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._wall_offset_ns


class BatchTracer:
    """Starts the trace of each batch of one input topic. Not thread-safe: the lane's
    dispatcher thread owns it.

    Args:
        tracer: the process's tracer (:attr:`streamproc.tracing.export.Tracing.tracer`).
        topic: the input topic.
        group_id: the consumer (or share) group.
        max_links: the most record links of one batch span (``tracing.max_links``).
        invalid: ``streamproc_trace_context_invalid_total{topic}``.
        links_dropped: ``streamproc_trace_links_dropped_total{topic}``.
        clock, wall_clock_ns: monotonic seconds and epoch nanoseconds (injected for tests).
    """

    def __init__(
        self,
        tracer: Tracer,
        topic: str,
        group_id: str,
        max_links: int,
        invalid: Counter,
        links_dropped: Counter,
        clock: Callable[[], float] = time.monotonic,
        wall_clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self._tracer = tracer
        self._topic = topic
        self._name = f"{PROCESS} {topic}"
        self._group_id = group_id
        self._max_links = max_links
        self._invalid = invalid
        self._links_dropped = links_dropped
        self._clock = clock
        self._wall_clock_ns = wall_clock_ns

    def start(self, records: Sequence[Record], cut_s: float) -> BatchTrace | None:
        """The trace of the batch cut at ``cut_s`` (monotonic seconds) from ``records`` (run
        and expired); None when it has none: no record carries a context and the sampler
        started no root trace. A malformed ``traceparent`` is counted and ignored."""
        contexts: dict[Record, SpanContext] = {}
        invalid = 0
        for record in records:
            if not record.headers:
                continue
            found = record_context(record)
            if found is None:
                continue
            if found is MALFORMED:
                invalid += 1
            else:
                contexts[record] = found
        if invalid:
            self._invalid.inc(invalid)
        parent = next((c for c in contexts.values() if c.trace_flags.sampled), None)
        if parent is None and contexts:
            parent = next(iter(contexts.values()))
        links: list[Link] = []
        for record, context in contexts.items():
            if len(links) == self._max_links:
                self._links_dropped.inc(len(contexts) - len(links))
                break
            links.append(
                Link(
                    context,
                    {
                        MESSAGING_DESTINATION_PARTITION_ID: str(record.tp.partition),
                        MESSAGING_KAFKA_OFFSET: record.offset,
                    },
                )
            )
        wall_offset_ns = self._wall_clock_ns() - int(self._clock() * 1e9)
        partitions = sorted({record.tp.partition for record in records})
        span = self._tracer.start_span(
            self._name,
            context=EMPTY_CONTEXT
            if parent is None
            else set_span_in_context(NonRecordingSpan(parent), EMPTY_CONTEXT),
            kind=SpanKind.CONSUMER,
            links=links,
            start_time=int(cut_s * 1e9) + wall_offset_ns,
            attributes={
                MESSAGING_SYSTEM: KAFKA,
                MESSAGING_OPERATION_NAME: PROCESS,
                MESSAGING_OPERATION_TYPE: PROCESS,
                MESSAGING_DESTINATION_NAME: self._topic,
                MESSAGING_CONSUMER_GROUP_NAME: self._group_id,
                MESSAGING_BATCH_MESSAGE_COUNT: len(records),
                "streamproc.partitions": [str(p) for p in partitions],
            },
        )
        if not contexts and not span.is_recording():
            return None
        return BatchTrace(self._tracer, span, contexts, wall_offset_ns)
