"""A record's trace context from its W3C Trace Context headers (``traceparent``,
``tracestate``), read with OpenTelemetry's propagator."""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.trace import INVALID_SPAN_CONTEXT, SpanContext, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from streamproc.records import Headers, Record

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
TRACE_HEADERS = frozenset({TRACEPARENT, TRACESTATE})
"""The headers a record's trace context travels in (W3C Trace Context over Kafka headers)."""

_PROPAGATOR = TraceContextTextMapPropagator()

MALFORMED = INVALID_SPAN_CONTEXT
"""What :func:`record_context` returns for a ``traceparent`` it cannot read."""


def record_context(record: Record) -> SpanContext | None:
    """The trace context ``record``'s headers carry (``is_remote``): None when it has no
    ``traceparent``; :data:`MALFORMED` (not valid) when its first ``traceparent`` cannot be
    read (a wrong version, length, or hex; all-zero ids). Several ``tracestate`` headers are
    joined (W3C: one list). Header values are read as Latin-1, so no bytes raise."""
    headers = record.headers
    if not headers:
        return None
    parent = None
    states: list[bytes] = []
    for key, value in headers:
        if key == TRACEPARENT and parent is None:
            parent = value
        elif key == TRACESTATE and value:
            states.append(value)
    if parent is None:
        return None
    carrier = {TRACEPARENT: parent.decode("latin-1")}
    if states:
        carrier[TRACESTATE] = b",".join(states).decode("latin-1")
    found = get_current_span(_PROPAGATOR.extract(carrier)).get_span_context()
    return found if found.is_valid else MALFORMED


def own_trace_headers(headers: Sequence[tuple[str, bytes]]) -> Headers:
    """The trace headers among an output record's ``headers`` (its own context, when traced):
    what its dead-letter record carries instead of the input's."""
    return tuple(h for h in headers if h[0] in TRACE_HEADERS)


def traceparent(context: SpanContext) -> bytes:
    """``context`` as a ``traceparent`` header value (version 00)."""
    return b"00-%032x-%016x-%02x" % (context.trace_id, context.span_id, context.trace_flags)


def trace_headers(context: SpanContext) -> tuple[tuple[str, bytes], ...]:
    """The ``traceparent`` (and, when it has one, ``tracestate``) headers of ``context``."""
    parent = ((TRACEPARENT, traceparent(context)),)
    if not context.trace_state:
        return parent
    return (*parent, (TRACESTATE, context.trace_state.to_header().encode("latin-1")))
