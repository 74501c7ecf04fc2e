"""``streamproc demo``: local broker + replay of every built-in workload + one consumer + report.

1. Start a local Apache Kafka broker (or use ``$KAFKA_BOOTSTRAP_SERVERS``).
2. Create one input topic per built-in workload (the registry's: video, iot, trades; 4
   partitions each), their output and dead-letter topics.
3. Start one consumer process-in-a-thread serving all their pipelines, and replay the real
   recordings concurrently, each at its own rate (open loop).
4. Run until idle, then verify from the broker, per topic: one result per input, no duplicates,
   committed offsets == end offsets; print throughput, end-to-end latency percentiles, batch
   sizes and example results.
5. Stop the broker.

With a trace backend (``streamproc demo --tracing``: the one of ``streamproc tracing start``,
started when it is not running and left running), a tenth of the batches are traced and the
report ends with the UI URL of one trace per workload.

With ``value_format`` ``avro``, ``protobuf`` or ``jsonschema`` (``streamproc demo --format``),
the workloads that read that format (all three for avro and protobuf, trades and iot for
jsonschema) run schema-managed: a local Schema Registry is
started (or ``$SCHEMA_REGISTRY_URL`` used), their recordings are replayed in that format, and
their results are written in it too (read back for the report with the stock deserialisers).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from streamproc.config import load_config
from streamproc.kafka.admin import ensure_topics
from streamproc.pipeline import Pipeline, RunSummary
from streamproc.tools.kafka_local import LocalKafka, ensure_kafka_jars
from streamproc.tools.replay import produce, recording_size
from streamproc.tools.tracing_local import find_trace
from streamproc.tools.verify import Verdict, verify
from streamproc.workloads.registry import BUILTIN_WORKLOADS

# workload -> (messages, rate msg/s), every built-in workload as the registry sizes it
DEFAULT_PLAN = {
    name: (workload.demo_messages, workload.demo_rate_msg_s)
    for name, workload in BUILTIN_WORKLOADS.items()
}
IDLE_S = 3.0
TRACE_RATIO = 0.1
"""``demo --tracing``: the share of batches traced (the replays' records carry no context)."""


@dataclass(frozen=True)
class TraceBackend:
    """A running trace backend (``streamproc tracing start``): where spans go, and Zipkin's
    UI (``.../zipkin/``) and query API (``.../api/v2``)."""

    otlp_endpoint: str
    ui_url: str
    api_url: str


def _describe(workload: str, doc: dict[str, Any]) -> str:
    src = doc["source"]
    where = f"[{src['partition']}@{src['offset']}]"
    if workload == "video":
        labels = ", ".join(f"{t['label']} {t['score']:.2f}" for t in doc["top5"][:3])
        return f"{doc['camera_id']:<14} frame {doc['frame_no']:>4} {where:>9}  {labels}"
    if workload == "iot":
        return (
            f"{doc['device_id']:<14} window {doc['window_id']:>4} {where:>9}  "
            f"score {doc['score']:.3f} anomaly={doc['anomaly']}"
        )
    return (
        f"{doc['trade_id']:<22} {where:>9}  score {doc['score']:.4f} "
        f"anomaly={doc['anomaly']} ret={doc['features']['log_return_vs_prev_close']:+.3f}"
    )


@dataclass
class DemoReport:
    verdicts: dict[str, Verdict]
    summary: RunSummary
    processing_s: float
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    formats: dict[str, str] = field(default_factory=dict)
    traces: dict[str, str | None] = field(default_factory=dict)
    """With tracing: per workload, the UI URL of one batch's trace (None: none arrived)."""

    @property
    def ok(self) -> bool:
        return self.summary.exit_code == 0 and all(
            v.ok and v.inputs > 0 for v in self.verdicts.values()
        )

    def render(self) -> str:
        lines = [
            "streamproc demo report",
            "======================",
            f"one consumer process, {len(self.verdicts)} pipelines, "
            f"{self.processing_s:.1f} s from start to idle",
            "",
        ]
        header = (
            f"{'workload':<8} {'format':<8} {'in':>6} {'out':>6} {'dlq':>4} {'missing':>7} "
            f"{'dup':>4} "
            f"{'msg/s':>7} {'P50 ms':>7} {'P95 ms':>7} {'P99 ms':>7}  committed==end"
        )
        lines += [header, "-" * len(header)]
        for workload, v in self.verdicts.items():
            pct = v.latency_percentiles()
            lines.append(
                f"{workload:<8} {self.formats.get(workload, 'json'):<8} {v.inputs:>6} "
                f"{v.results:>6} {v.dead_lettered:>4} "
                f"{len(v.missing):>7} {v.duplicates:>4} {v.inputs / self.processing_s:>7.1f} "
                f"{pct.get('p50', 0):>7.0f} {pct.get('p95', 0):>7.0f} {pct.get('p99', 0):>7.0f}"
                f"  {v.committed_equals_end}"
            )
        lines.append("")
        for workload, v in self.verdicts.items():
            sizes = self.summary.batch_sizes.get(v.topic, {})
            lines.append(
                f"{workload} batch sizes (size:count)  "
                + "  ".join(f"{s}:{c}" for s, c in sorted(sizes.items()))
            )
            lines.append(
                f"{workload} committed {_offsets(v.committed)} "
                f"end {_offsets(v.end_offsets)}  (per partition; '-' = nothing committed)"
            )
        lines.append("")
        lines.append("example results:")
        for workload, v in self.verdicts.items():
            documents = self.examples.get(workload) or [orjson.loads(e) for e in v.examples]
            for doc in documents:
                lines.append(f"  {workload:<7} {_describe(workload, doc)}")
        if self.traces:
            lines.append("")
            lines.append(
                "one trace per workload (a batch sampled as a root: the replays' records carry "
                "no traceparent; its stages as child spans):"
            )
            for workload, url in self.traces.items():
                lines.append(f"  {workload:<7} {url or 'none arrived in Zipkin'}")
        lines.append(f"RESULT  {'PASS' if self.ok else 'FAIL'}")
        return "\n".join(lines)


def _format_of(workload: str, value_format: str) -> str:
    """``value_format`` where the built-in ``workload`` reads it, else ``json``."""
    readable = BUILTIN_WORKLOADS[workload].load_class().input_formats
    return value_format if value_format in readable else "json"


@contextmanager
def registry_unless_given(url: str | None, directory: Path) -> Iterator[str]:
    """``url`` when given; else a local Schema Registry in ``directory`` for the ``with``
    block. Yields the registry's URL."""
    if url:
        yield url
        return
    from streamproc.tools.registry_local import LocalRegistry, ensure_registry_app

    print("starting a local Schema Registry (Apicurio; fetched with Maven once) ...", flush=True)
    registry = LocalRegistry(directory, ensure_registry_app())
    try:
        yield registry.start()
    finally:
        registry.stop()


def read_results(
    fmt: str, workload: str, topic: str, values: list[bytes], registry_url: str
) -> list[dict[str, Any]]:
    """Result ``values`` of ``topic`` in ``fmt`` as documents (the stock deserialisers)."""
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.serialization import MessageField, SerializationContext

    context = SerializationContext(topic, MessageField.VALUE)
    if fmt == "jsonschema":
        from confluent_kafka.schema_registry.json_schema import JSONDeserializer

        with SchemaRegistryClient({"url": registry_url}) as client:
            stock_json = JSONDeserializer(None, schema_registry_client=client)
            return [dict(stock_json(value, context)) for value in values]
    if fmt == "protobuf":
        from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer

        from streamproc.schemas.protobuf import field_converter
        from streamproc.workloads import load_workload

        result_class = load_workload(workload).result_message()
        stock = ProtobufDeserializer(result_class, {"use.deprecated.format": False})
        as_fields = field_converter(result_class.DESCRIPTOR)
        return [as_fields(stock(value, context)) for value in values]
    from confluent_kafka.schema_registry.avro import AvroDeserializer

    with SchemaRegistryClient({"url": registry_url}) as client:
        avro = AvroDeserializer(client)
        return [dict(avro(value, context)) for value in values]


def run_demo(
    bootstrap_servers: str | None = None,
    plan: dict[str, tuple[int, float]] | None = None,
    partitions: int = 4,
    work_dir: Path | None = None,
    value_format: str = "json",
    tracing: TraceBackend | None = None,
) -> DemoReport:
    """Run the whole demo; see the module docstring. Stops the broker (and the registry) it
    started.

    Args:
        plan: workload -> (message count, replay rate msg/s); default :data:`DEFAULT_PLAN`.
        value_format: ``json``, or ``avro`` / ``protobuf`` / ``jsonschema`` for the workloads
            that read it (through a Schema Registry; the others stay ``json``).
        tracing: a running trace backend: the pipelines trace a tenth of their batches to it,
            and the report gives the UI URL of one trace per workload.
    """
    plan = plan or DEFAULT_PLAN
    formats = {w: _format_of(w, value_format) for w in plan}
    broker: LocalKafka | None = None
    bootstrap = bootstrap_servers or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    run_dir = work_dir or Path(tempfile.mkdtemp(prefix="streamproc-demo-"))
    passed = False
    stack = ExitStack()
    try:
        if not bootstrap:
            print(
                "starting a local Apache Kafka broker (first run fetches it with Maven) ...",
                flush=True,
            )
            broker = LocalKafka(run_dir / "kafka", ensure_kafka_jars())
            bootstrap = broker.start()
            print(f"broker up at {bootstrap}; log: {broker.log_path}", flush=True)
        suffix = uuid.uuid4().hex[:6]
        topics = {w: (f"demo.{w}.{suffix}", f"demo.{w}.results.{suffix}") for w in plan}
        ensure_topics(
            bootstrap,
            {
                name: (1 if name.endswith(".dlq") else partitions)
                for w, (inp, out) in topics.items()
                for name in (inp, out, f"{inp}.dlq")
            },
        )
        group_id = f"streamproc-demo-{suffix}"
        managed = any(f != "json" for f in formats.values())
        registry_url = ""
        if managed:
            registry_url = stack.enter_context(
                registry_unless_given(os.environ.get("SCHEMA_REGISTRY_URL"), run_dir / "registry")
            )
        config = load_config(
            overrides={
                "kafka": {"bootstrap_servers": bootstrap, "group_id": group_id},
                "pipelines": [
                    {
                        "name": w,
                        "input_topic": inp,
                        "output_topic": out,
                        "workload": w,
                        "format": formats[w],
                    }
                    for w, (inp, out) in topics.items()
                ],
                "metrics": {"port": 0},
                **({"schema_registry": {"url": registry_url}} if managed else {}),
                "tracing": {"enabled": False}
                if tracing is None
                else {"endpoint": tracing.otlp_endpoint, "sample_ratio": TRACE_RATIO},
            }
        )
        for workload, (count, rate) in plan.items():
            recording_size(workload)  # load and encode the recordings before the clock starts
            print(
                f"replaying {count} real {workload} messages ({formats[workload]}) at "
                f"{rate:g} msg/s into {topics[workload][0]}",
                flush=True,
            )
        pipeline = Pipeline(config)
        pipeline.start()
        started_s = time.monotonic()
        errors: list[BaseException] = []

        def replay(workload: str, count: int, rate: float) -> None:
            try:
                produce(
                    workload,
                    topics[workload][0],
                    bootstrap,
                    partitions,
                    count,
                    rate,
                    progress=False,
                    value_format=formats[workload],
                    registry_url=registry_url or None,
                )
            except BaseException as exc:
                errors.append(exc)

        producers = [
            threading.Thread(target=replay, args=(w, c, r), name=f"replay-{w}")
            for w, (c, r) in plan.items()
        ]
        for thread in producers:
            thread.start()
        for thread in producers:
            thread.join()
        if errors:
            pipeline.request_stop()
            pipeline.run()
            raise errors[0]
        summary = pipeline.run(exit_when_idle_s=IDLE_S)
        processing_s = max(1e-9, time.monotonic() - started_s - IDLE_S)
        verdicts = {
            w: verify(bootstrap, inp, out, f"{inp}.dlq", group_id, examples=2)
            for w, (inp, out) in topics.items()
        }
        examples = {
            w: read_results(formats[w], w, out, verdicts[w].examples, registry_url)
            for w, (_, out) in topics.items()
            if formats[w] != "json"
        }
        traces: dict[str, str | None] = {}
        if tracing is not None:
            for w, (inp, _) in topics.items():
                found = find_trace(tracing.api_url, "streamproc", f"process {inp}")
                traces[w] = None if found is None else f"{tracing.ui_url}traces/{found}"
        report = DemoReport(verdicts, summary, processing_s, examples, formats, traces)
        passed = report.ok
        return report
    finally:
        stack.close()
        if broker is not None:
            broker.stop()
        if passed and work_dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)
        elif broker is not None:
            print(f"broker files kept for inspection: {run_dir}", flush=True)


def _offsets(offsets: dict[int, int]) -> str:
    """``{partition: offset}`` with librdkafka's "no offset" (negative) shown as ``-``."""
    return "{" + ", ".join(f"{p}: {o if o >= 0 else '-'}" for p, o in sorted(offsets.items())) + "}"
