"""Traces across Kafka, shown by the real backend (issue 43): records produced under a known
producer span run through a pipeline exporting to the local collector, and a downstream
consumer continues from the results' ``traceparent``; Zipkin's query API then gives back one
trace holding the producer's span, the batch's ``process`` span (its parent the producer's span,
its links the records), the batch's stage spans, each output record's ``create`` span and the
downstream consumer's spans. A malformed ``traceparent`` is counted, never dead-lettered. The
backend stopped mid-stream costs no record: the spans it could not take are counted dropped."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from confluent_kafka import Producer

from streamproc.pipeline import Pipeline
from streamproc.tools.tracing_local import LocalCollector, LocalTracing, ensure_collector
from streamproc.workloads.video import video_frames
from tests.integration.conftest import Topics, end_offset_total, make_config
from tests.support.traced import GOOD, round_trip, zipkin_trace
from tests.support.waiting import wait_until

pytestmark = pytest.mark.core


def test_a_records_path_is_one_trace_in_the_backend(
    tracing_backend: LocalTracing, bootstrap_servers: str, topics: Topics
) -> None:
    trip = round_trip(
        tracing_backend.otlp_endpoint,
        bootstrap_servers,
        (topics.input, topics.output, topics.dlq, topics.group),
    )
    trace_id, send_id, metrics, continued = (
        trip.trace_id,
        trip.send_id,
        trip.metrics,
        trip.continued,
    )
    assert trip.exit_code == 0
    assert metrics.counter_value(metrics.trace_context_invalid, topic=topics.input) == 1
    assert metrics.counter_value(metrics.trace_spans_exported) > 0
    assert len(trip.results) == GOOD + 1  # the malformed context cost its record nothing
    assert [m.key() for m in trip.dead] == [b"bad"]
    assert continued == GOOD  # the malformed context's record starts no trace: none on its result
    dead = trip.dead
    dead_parent = dict(dead[0].headers() or [])["traceparent"].decode()
    assert dead_parent.split("-")[1] == trace_id and dead_parent.split("-")[2] != send_id

    def complete() -> bool:
        names = [span["name"] for span in zipkin_trace(tracing_backend.api_url, trace_id)]
        return names.count(f"process {topics.output}") >= continued and "produce" in names

    wait_until(complete, "the whole trace in Zipkin", 60)
    spans = zipkin_trace(tracing_backend.api_url, trace_id)
    names: dict[str, int] = {}
    for span in spans:
        names[span["name"]] = names.get(span["name"], 0) + 1
    print(f"[tracing] trace {trace_id}: {len(spans)} spans {names}")
    by_id = {span["id"]: span for span in spans}
    sends = [s for s in spans if s["name"] == f"send {topics.input}"]
    assert [s["localEndpoint"]["serviceName"] for s in sends] == ["test-producer"]
    batches = [s for s in spans if s["name"] == f"process {topics.input}"]
    assert batches and all(b["parentId"] == send_id for b in batches)
    assert all(b["localEndpoint"]["serviceName"] == "streamproc" for b in batches)
    assert all(b["kind"] == "CONSUMER" for b in batches)
    for batch in batches:  # Zipkin has no links: the collector keeps each as a tag
        assert batch["tags"]["otlp.link.0"].split("|")[:2] == [trace_id, send_id]
        assert batch["tags"]["messaging.operation.type"] == "process"
    batch_ids = {b["id"] for b in batches}
    for stage in ("decode", "device", "encode", "produce"):
        found = [s for s in spans if s["name"] == stage]
        assert found and all(s["parentId"] in batch_ids for s in found), stage
    creates = [s for s in spans if s["name"] == f"create {topics.output}"]
    assert len([c for c in creates if c["parentId"] == send_id]) == GOOD
    dead_create = by_id[dead_parent.split("-")[2]]
    assert dead_create["name"] == f"create {topics.dlq}" and dead_create["parentId"] == send_id
    consumed = [s for s in spans if s["name"] == f"process {topics.output}"]
    assert len(consumed) == continued
    # each downstream span: a child of its result's own create span
    parents = {s["parentId"] for s in consumed}
    assert len(parents) == GOOD
    assert all(by_id[p]["name"] == f"create {topics.output}" for p in parents)


def test_a_backend_stopped_mid_stream_costs_no_record(
    bootstrap_servers: str, topics: Topics, tmp_path: Path
) -> None:
    collector = LocalCollector(tmp_path / "collector", ensure_collector(), "http://127.0.0.1:9")
    endpoint = collector.start(60)
    frames = video_frames()
    half = 24
    producer = Producer({"bootstrap.servers": bootstrap_servers, "acks": "all"})

    def produce(count: int) -> None:
        for i in range(count):  # every record sampled: a root of its own
            traceparent = b"00-%032x-%016x-01" % (i + 1, i + 1)
            producer.produce(
                topics.input,
                key=b"cam",
                value=frames[i % len(frames)].jpeg,
                partition=i % 3,
                headers=[("traceparent", traceparent)],
            )
        assert producer.flush(30) == 0

    produce(half)
    config = make_config(
        bootstrap_servers,
        topics,
        tracing={"endpoint": endpoint, "export_timeout_s": 1.0},
        worker={"torch_threads": 1},
    )
    pipeline = Pipeline(config)
    run = threading.Thread(target=lambda: pipeline.run(exit_when_idle_s=6), daemon=True)
    run.start()
    try:
        wait_until(
            lambda: end_offset_total(bootstrap_servers, topics.output) >= half,
            "the first half's results",
            120,
        )
        metrics = pipeline.metrics
        wait_until(
            lambda: metrics.counter_value(metrics.trace_spans_exported) > 0,
            "spans exported while the backend was up",
            30,
        )
        collector.stop()
        produce(half)
        run.join(180)
        assert not run.is_alive()
    finally:
        collector.stop()
    assert end_offset_total(bootstrap_servers, topics.output) == 2 * half
    dropped = sum(
        metrics.counter_value(metrics.trace_spans_dropped, reason=reason)
        for reason in ("export_failed", "queue_full")
    )
    exported = metrics.counter_value(metrics.trace_spans_exported)
    print(
        f"[tracing] backend stopped mid-stream: spans exported {exported:.0f}, "
        f"dropped {dropped:.0f}"
    )
    assert dropped > 0


def test_the_exactly_once_path_carries_the_same_trace_headers(
    tracing_backend: LocalTracing, bootstrap_servers: str, topics: Topics
) -> None:
    trip = round_trip(
        tracing_backend.otlp_endpoint,
        bootstrap_servers,
        (topics.input, topics.output, topics.dlq, topics.group),
        processing_guarantee="exactly_once",
    )
    assert trip.exit_code == 0 and trip.continued == GOOD
    headers = [dict(m.headers() or []) for m in trip.results]
    parents = [h["traceparent"].decode().split("-") for h in headers if "traceparent" in h]
    assert {p[1] for p in parents} == {trip.trace_id}  # all in the producer's trace
    spans = {p[2] for p in parents}
    assert len(spans) == GOOD and trip.send_id not in spans  # each a create span of its own
    dead = dict(trip.dead[0].headers() or [])["traceparent"].decode().split("-")
    assert dead[1] == trip.trace_id and dead[2] not in spans | {trip.send_id}
