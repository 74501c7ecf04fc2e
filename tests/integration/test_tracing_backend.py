"""The local trace backend (issue 43's first part): spans exported over OTLP/HTTP to the
OpenTelemetry Collector reach Zipkin, and its query API gives them back as one trace, the parent
relation, the attributes and the span link kept; a stopped backend leaves no process behind.

The spans are built with the OTLP protobuf classes of ``opentelemetry-proto`` (in the lock) and
posted as an OTLP/HTTP export request, as an SDK's exporter would."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from streamproc.tools.kafka_local import alive
from streamproc.tools.tracing_local import LocalTracing
from tests.support.traced import zipkin_trace
from tests.support.waiting import wait_until

pytestmark = pytest.mark.core

TRACE_ID = bytes.fromhex("4bf92f3577b34da6a3ce929d0e0e4736")
PARENT_ID = bytes.fromhex("00f067aa0ba902b7")
CHILD_ID = bytes.fromhex("b7ad6b7169203331")
LINKED = (bytes.fromhex("0af7651916cd43dd8448eb211c80319c"), bytes.fromhex("53995c3f42cd8ad8"))


def _attribute(key: str, value: str) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(string_value=value))


def _export(endpoint: str) -> None:
    """One OTLP/HTTP export: a batch span and its child, the child linked to another trace."""
    now_ns = 1_700_000_000_000_000_000
    parent = Span(
        trace_id=TRACE_ID, span_id=PARENT_ID, name="process trades", kind=Span.SPAN_KIND_CONSUMER,
        start_time_unix_nano=now_ns, end_time_unix_nano=now_ns + 5_000_000,
        attributes=[_attribute("messaging.operation.type", "process")],
    )  # fmt: skip
    child = Span(
        trace_id=TRACE_ID, span_id=CHILD_ID, parent_span_id=PARENT_ID, name="device",
        kind=Span.SPAN_KIND_INTERNAL,
        start_time_unix_nano=now_ns + 1_000_000, end_time_unix_nano=now_ns + 4_000_000,
        links=[Span.Link(trace_id=LINKED[0], span_id=LINKED[1])],
    )  # fmt: skip
    request = ExportTraceServiceRequest(
        resource_spans=[
            ResourceSpans(
                resource=Resource(attributes=[_attribute("service.name", "streamproc-test")]),
                scope_spans=[ScopeSpans(spans=[parent, child])],
            )
        ]
    )
    post = urllib.request.Request(
        f"{endpoint}/v1/traces",
        data=request.SerializeToString(),
        headers={"Content-Type": "application/x-protobuf"},
    )
    with urllib.request.urlopen(post, timeout=10) as reply:
        assert reply.status == 200


def test_spans_sent_over_otlp_come_back_from_zipkin_as_one_trace(
    tracing_backend: LocalTracing,
) -> None:
    _export(tracing_backend.otlp_endpoint)
    wait_until(
        lambda: len(zipkin_trace(tracing_backend.api_url, TRACE_ID.hex())) == 2,
        "both spans in Zipkin",
        30,
    )
    spans = {span["name"]: span for span in zipkin_trace(tracing_backend.api_url, TRACE_ID.hex())}
    assert set(spans) == {"process trades", "device"}
    parent, child = spans["process trades"], spans["device"]
    assert parent["id"] == PARENT_ID.hex() and child["parentId"] == PARENT_ID.hex()
    assert parent["localEndpoint"]["serviceName"] == "streamproc-test"
    assert parent["tags"]["messaging.operation.type"] == "process"
    assert child["duration"] == 3000  # microseconds
    # Zipkin has no links: the exporter keeps each as a tag traceId|spanId|traceState|...
    link = child["tags"]["otlp.link.0"].split("|")
    assert link[:2] == [LINKED[0].hex(), LINKED[1].hex()]


def test_the_ui_is_served_and_stop_leaves_no_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the shell of a user who ran `streamproc kafka start`: Zipkin must not take it as its own
    # Kafka collector's setting (it would report unhealthy, and consume the topic "zipkin")
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9")
    tracing = LocalTracing(tmp_path / "tracing")
    tracing.start(timeout_s=60)
    assert tracing.zipkin is not None and tracing.collector is not None
    pids = [tracing.zipkin.pid, tracing.collector.pid]
    with urllib.request.urlopen(tracing.ui_url, timeout=10) as reply:
        assert reply.status == 200 and b"<html" in reply.read().lower()
    tracing.stop()
    tracing.stop()  # idempotent
    assert all(pid is not None and not alive(pid) for pid in pids)
    assert not any((tmp_path / "tracing").glob("*/*.pid"))


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, as IPv4 and as IPv6


def _listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} writes them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def test_the_servers_listen_on_loopback_only(tracing_backend: LocalTracing) -> None:
    assert tracing_backend.zipkin is not None and tracing_backend.collector is not None
    ports = (
        tracing_backend.zipkin.port,
        tracing_backend.collector.port,
        tracing_backend.collector.grpc_port,
    )
    for port in ports:
        addresses = _listening(port)
        assert addresses and addresses <= LOOPBACK, (port, addresses)
