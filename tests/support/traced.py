"""A traced round trip through a pipeline, shared by the tracing test and the screenshot script
(``scripts/trace_screenshot.py``): records produced under a known producer span, run through
a pipeline that exports to a trace backend, and a downstream consumer that continues each
result's trace."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, Message, Producer
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.propagate import extract
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from streamproc.config import load_config
from streamproc.metrics import Metrics
from streamproc.pipeline import Pipeline
from streamproc.workloads.video import video_frames
from tests.support.waiting import wait_until

GOOD = 6
"""Video frames produced under the producer's span."""
CORRUPT = b"\xff\xd8 not a JPEG"
MALFORMED = b"00-zz-not-a-context-01"


@dataclass(frozen=True)
class RoundTrip:
    """What :func:`round_trip` did: the producer span's trace and span ids (hex), the
    pipeline's metrics and exit code, the results and dead-letter records read back, and how
    many results the downstream consumer continued."""

    trace_id: str
    send_id: str
    metrics: Metrics
    exit_code: int
    results: list[Message]
    dead: list[Message]
    continued: int


def provider(endpoint: str, service: str) -> TracerProvider:
    """A tracer provider of ``service`` exporting every span at once to ``endpoint``."""
    found = TracerProvider(resource=Resource.create({"service.name": service}))
    found.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(f"{endpoint}/v1/traces")))
    return found


def zipkin_trace(api_url: str, trace_id: str) -> list[dict[str, Any]]:
    """The spans Zipkin's query API (``.../api/v2``) holds for ``trace_id`` ([] while none)."""
    try:
        with urllib.request.urlopen(f"{api_url}/trace/{trace_id}", timeout=5) as reply:
            spans: list[dict[str, Any]] = json.load(reply)
            return spans
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return []
        raise


def read_all(bootstrap: str, topic: str, count: int) -> list[Message]:
    """At least ``count`` records of ``topic`` from its start (60 s at most)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"read-{topic}",
            "auto.offset.reset": "earliest",
        }
    )
    consumer.subscribe([topic])
    found: list[Message] = []
    try:
        wait_until(
            lambda: (
                found.extend(m for m in consumer.consume(100, 0.5) if not m.error())
                or len(found) >= count
            ),
            f"{count} records on {topic}",
            60,
        )
    finally:
        consumer.close()
    return found


def round_trip(
    endpoint: str, bootstrap: str, topics: tuple[str, str, str, str], **config: Any
) -> RoundTrip:
    """Produce :data:`GOOD` video frames and a corrupt one under one producer span (and a frame
    with a malformed ``traceparent``) to the input of ``topics`` (input, output, dead-letter,
    group), run a pipeline exporting to ``endpoint`` until idle, then continue every result's
    trace in a downstream consumer. ``config``: more of the pipeline's config."""
    source, output, dlq, group = topics
    tracer = provider(endpoint, "test-producer").get_tracer("test")
    with tracer.start_as_current_span(f"send {source}", kind=SpanKind.PRODUCER) as send:
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)
    context = send.get_span_context()
    traced = [(k, v.encode()) for k, v in carrier.items()]
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all"})
    frames = video_frames()
    for frame in frames[:GOOD]:
        producer.produce(source, key=b"cam", value=frame.jpeg, partition=0, headers=traced)
    producer.produce(source, key=b"bad", value=CORRUPT, partition=0, headers=traced)
    odd = [("traceparent", MALFORMED)]
    producer.produce(source, key=b"odd", value=frames[0].jpeg, partition=0, headers=odd)
    assert producer.flush(30) == 0
    pipeline = Pipeline(
        load_config(
            overrides={
                "kafka": {"bootstrap_servers": bootstrap, "group_id": group},
                "pipelines": [
                    {"name": "frames", "input_topic": source, "output_topic": output,
                     "dlq_topic": dlq, "workload": "video"}
                ],
                "metrics": {"port": 0},
                "batching": {"max_batch_size": 4, "max_wait_ms": 10},
                "tracing": {"endpoint": endpoint, "sample_ratio": 0.0},
                "worker": {"torch_threads": 1},
                **config,
            }
        )
    )  # fmt: skip
    exit_code = pipeline.run(exit_when_idle_s=2).exit_code
    results = read_all(bootstrap, output, GOOD + 1)
    dead = read_all(bootstrap, dlq, 1)
    downstream = provider(endpoint, "test-downstream").get_tracer("test")
    continued = 0
    for message in results:
        headers = {k: v.decode() for k, v in message.headers() or []}
        if "traceparent" in headers:
            span = downstream.start_span(
                f"process {output}", context=extract(headers), kind=SpanKind.CONSUMER
            )
            span.end()
            continued += 1
    return RoundTrip(
        f"{context.trace_id:032x}",
        f"{context.span_id:016x}",
        pipeline.metrics,
        exit_code,
        results,
        dead,
        continued,
    )
