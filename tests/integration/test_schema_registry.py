"""Schema-managed topics on a real Schema Registry (Apicurio, Confluent-compatible API) and a
real broker: Avro inputs decode to the same results as JSON, v1 and v2 writer schemas
interleave on one partition, bad values are dead-lettered with their reasons, and a registry
that stops answering for 20 s holds records back without losing or dead-lettering any."""

from __future__ import annotations

import io
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fastavro
import orjson
import pytest
from confluent_kafka import Producer
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.schema_registry.json_schema import JSONDeserializer
from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from streamproc.errors import ConfigError
from streamproc.kafka.admin import ensure_topics
from streamproc.output.headers import H_MESSAGE, H_OFFSET, H_PARTITION
from streamproc.pipeline import Pipeline, RunSummary
from streamproc.schemas.protobuf import field_converter
from streamproc.schemas.wire import frame, split
from streamproc.tools.registry_local import LocalRegistry, ensure_registry_app
from streamproc.tools.replay import messages, produce
from streamproc.tools.serializers import AvroValues, ProtobufValues, avro_schema_of
from streamproc.tools.verify import read_topic, verify
from streamproc.workloads.schemas.trades_pb2 import TradeResult
from streamproc.workloads.schemas.video_pb2 import FrameResult
from tests.integration.conftest import Topics, make_config, report, wait_for

pytestmark = pytest.mark.registry

TRADES = 240
INLINE_OFF = {"thread": {"decode_inline": "never"}}  # decode on the pool's threads, not inline


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRegistry]:
    local = LocalRegistry(tmp_path_factory.mktemp("registry"), ensure_registry_app())
    local.start()
    _URL.append(local.url)
    try:
        yield local
    finally:
        local.stop()


def new_topics(bootstrap: str, name: str, partitions: int = 3) -> Topics:
    suffix = uuid.uuid4().hex[:8]
    t = Topics(f"{name}.{suffix}", f"{name}.out.{suffix}", f"{name}.{suffix}.dlq", f"g-{suffix}")
    ensure_topics(bootstrap, {t.input: partitions, t.output: 3, t.dlq: 1})
    return t


def pipeline_entry(name: str, t: Topics, workload: str, fmt: str) -> dict[str, Any]:
    return {
        "name": name,
        "input_topic": t.input,
        "output_topic": t.output,
        "dlq_topic": t.dlq,
        "workload": workload,
        "format": fmt,
    }


def documents(
    bootstrap: str, topic: str, registry_url: str | None = None, fmt: str = "avro"
) -> list[dict[str, Any]]:
    """The result values of ``topic``: JSON, or (with ``registry_url``) framed Avro or
    Protobuf (``fmt``) read by confluent-kafka's stock deserialisers."""
    values = [v for _, v, _, _ in read_topic(bootstrap, topic).records.values()]
    if registry_url is None:
        return [orjson.loads(v) for v in values]
    context = SerializationContext(topic, MessageField.VALUE)
    if fmt == "jsonschema":
        with SchemaRegistryClient({"url": registry_url}) as client:
            stock_json = JSONDeserializer(None, schema_registry_client=client)  # validates too
            return [stock_json(v, context) for v in values]
    if fmt == "protobuf":
        stock_protobuf = ProtobufDeserializer(TradeResult, {"use.deprecated.format": False})
        as_fields = field_converter(TradeResult.DESCRIPTOR)
        return [as_fields(stock_protobuf(v, context)) for v in values]
    with SchemaRegistryClient({"url": registry_url}) as client:
        stock = AvroDeserializer(client)
        return [stock(v, context) for v in values]


def results_by(
    bootstrap: str, topic: str, key: str, registry_url: str | None = None, fmt: str = "avro"
) -> dict[Any, dict[str, Any]]:
    return {doc[key]: doc for doc in documents(bootstrap, topic, registry_url, fmt)}


def send(bootstrap: str, topic: str, values: list[bytes], partition: int | None = None) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for value in values:
        if partition is None:
            producer.produce(topic, value=value)
        else:
            producer.produce(topic, value=value, partition=partition)
    assert producer.flush(30) == 0


_URL: list[str] = []  # the module's registry, for writer()


def writer(topic: str, schema: str | None = None) -> AvroValues:
    """A stock Avro serialiser of trades for ``topic`` (the shipped schema unless ``schema``)."""
    return AvroValues(topic, schema or avro_schema_of("trades").read_text(), {"url": _URL[-1]})


def trade_documents(count: int) -> list[dict[str, Any]]:
    return [orjson.loads(m.value) for m in _take(messages("trades"), count)]


def _take(iterator: Iterator[Any], count: int) -> list[Any]:
    return [next(iterator) for _ in range(count)]


@pytest.mark.parametrize(
    ("fmt", "guarantee"),
    [("avro", "at_least_once"), ("avro", "exactly_once"), ("protobuf", "at_least_once"),
     ("protobuf", "exactly_once"), ("jsonschema", "at_least_once"),
     ("jsonschema", "exactly_once")],
)  # fmt: skip
def test_registry_inputs_give_the_results_of_the_same_json_inputs(
    bootstrap_servers: str, registry: LocalRegistry, fmt: str, guarantee: str
) -> None:
    as_json = new_topics(bootstrap_servers, "trades-json")
    as_avro = new_topics(bootstrap_servers, f"trades-{fmt}")
    iot = new_topics(bootstrap_servers, f"iot-{fmt}")
    assert produce("trades", as_json.input, bootstrap_servers, 3, TRADES, progress=False) == TRADES
    avro = {"value_format": fmt, "registry_url": registry.url, "progress": False}
    assert produce("trades", as_avro.input, bootstrap_servers, 3, TRADES, **avro) == TRADES
    assert produce("iot", iot.input, bootstrap_servers, 3, 60, **avro) == 60
    # the values on the topic are framed Avro, not JSON
    first = next(iter(read_topic(bootstrap_servers, as_avro.input).records.values()))
    schema_id, _ = split(first[1])
    with SchemaRegistryClient({"url": registry.url}) as client:
        expected_type = {"avro": "AVRO", "protobuf": "PROTOBUF", "jsonschema": "JSON"}[fmt]
        assert (client.get_schema(schema_id).schema_type or "AVRO") == expected_type

    config = make_config(
        bootstrap_servers,
        as_json,
        processing_guarantee=guarantee,
        schema_registry={"url": registry.url},
        pipelines=[
            pipeline_entry("json", as_json, "trades", "json"),
            {**pipeline_entry("registry", as_avro, "trades", fmt), "output_format": fmt},
            {**pipeline_entry("iot", iot, "iot", fmt), "output_format": "json"},
        ],
    )
    summary = Pipeline(config).run(exit_when_idle_s=3)
    assert summary.exit_code == 0, summary.error
    for t, count in ((as_json, TRADES), (as_avro, TRADES), (iot, 60)):
        verdict = verify(bootstrap_servers, t.input, t.output, t.dlq, as_json.group)
        report(t.input, verdict)
        assert verdict.inputs == verdict.results == count and verdict.dead_lettered == 0
        assert verdict.missing == [] and verdict.duplicates == 0
        assert verdict.committed_equals_end
    from_json = results_by(bootstrap_servers, as_json.output, "trade_id")
    # results in the registry format, read by the stock deserialiser
    from_avro = results_by(bootstrap_servers, as_avro.output, "trade_id", registry.url, fmt)
    assert from_json.keys() == from_avro.keys() and len(from_json) == TRADES
    for trade_id, doc in from_avro.items():
        expected = from_json[trade_id]
        assert doc["features"] == pytest.approx(expected["features"], rel=1e-6)
        assert doc["score"] == pytest.approx(expected["score"], rel=1e-4, abs=1e-7)
        assert (doc["symbol"], doc["ts_ms"]) == (expected["symbol"], expected["ts_ms"])
    windows = documents(bootstrap_servers, iot.output)  # Avro or Protobuf in, JSON out
    assert len({(doc["device_id"], doc["window_id"]) for doc in windows}) == 60


def trades_v2() -> str:
    """The trades schema with one more field (a default, so v1 readers resolve it) and the
    price written as float (promoted to the reader's double)."""
    schema = orjson.loads(avro_schema_of("trades").read_bytes())
    fields = [dict(f) for f in schema["fields"]]
    schema["fields"] = [*fields, {"name": "venue", "type": "string", "default": "XNAS"}]
    return orjson.dumps(schema).decode()


@pytest.mark.parametrize("decode_mode", ["thread", "process"])
def test_v1_and_v2_writer_schemas_interleaved_on_one_partition_decode_to_the_same_rows(
    bootstrap_servers: str, registry: LocalRegistry, decode_mode: str
) -> None:
    # decode processes read writer schemas with their own registry client
    t = new_topics(bootstrap_servers, "trades-evolve", partitions=1)
    values = []
    with writer(t.input) as v1, writer(t.input, trades_v2()) as v2:
        for doc in trade_documents(100):
            values.append(v1(orjson.dumps(doc)))
            twin = {**doc, "trade_id": f"{doc['trade_id']}-v2", "venue": "XNYS"}
            values.append(v2(orjson.dumps(twin)))
    ids = {split(value)[0] for value in values}
    assert len(ids) == 2  # two writer schemas, one subject (v2 passed the BACKWARD check)
    send(bootstrap_servers, t.input, values, partition=0)

    config = make_config(
        bootstrap_servers,
        t,
        schema_registry={"url": registry.url},
        pipelines=[pipeline_entry("evolve", t, "trades", "avro")],
        worker={"decode_mode": decode_mode, **INLINE_OFF.get(decode_mode, {})},
    )
    summary = Pipeline(config).run(exit_when_idle_s=3)
    assert summary.exit_code == 0, summary.error
    verdict = verify(bootstrap_servers, t.input, t.output, t.dlq, t.group)
    report("evolution", verdict)
    assert verdict.results == 200 and verdict.dead_lettered == 0 and verdict.missing == []
    docs = results_by(bootstrap_servers, t.output, "trade_id", registry.url)  # Avro results
    for trade_id, doc in docs.items():
        if not trade_id.endswith("-v2"):
            twin = docs[f"{trade_id}-v2"]
            assert twin["features"] == doc["features"]
            assert twin["score"] == pytest.approx(doc["score"], rel=1e-4, abs=1e-7)


def test_unknown_ids_incompatible_schemas_and_corrupt_payloads_are_dead_lettered_with_reasons(
    bootstrap_servers: str, registry: LocalRegistry
) -> None:
    t = new_topics(bootstrap_servers, "trades-bad", partitions=1)
    docs = trade_documents(21)
    with writer(t.input) as good:
        valid = [good(orjson.dumps(doc)) for doc in docs[:20]]
        negative_size = good(orjson.dumps({**docs[20], "trade_id": "negative", "size": -5}))
    one = valid[0]
    schema_id, payload = split(one)
    # a schema registered under another subject: price is a string there, which no reader
    # double resolves
    incompatible = orjson.loads(avro_schema_of("trades").read_bytes())
    incompatible["fields"] = [
        {**f, "type": "string"} if f["name"] == "price" else f for f in incompatible["fields"]
    ]
    with writer(f"other-{t.input}", orjson.dumps(incompatible).decode()) as other:
        wrong_type = other(orjson.dumps({**docs[20], "price": "12.5"}))
    bad = {
        "unknown schema id 987654": frame(987654, bytes(payload)),
        "malformed Avro": frame(schema_id, bytes(payload)[:7]),
        "bytes after the record": one + b"\x00\x01",
        "not in the schema registry wire format": b'{"symbol": "AAPL"}',
        "is incompatible with the reader schema": wrong_type,
        "schema: Expected `int` >= 1": negative_size,
    }
    values = valid[:10] + list(bad.values()) + valid[10:]
    send(bootstrap_servers, t.input, values, partition=0)

    config = make_config(
        bootstrap_servers,
        t,
        schema_registry={"url": registry.url},
        pipelines=[pipeline_entry("bad", t, "trades", "avro")],
    )
    summary = Pipeline(config).run(exit_when_idle_s=3)
    assert summary.exit_code == 0, summary.error
    verdict = verify(bootstrap_servers, t.input, t.output, t.dlq, t.group)
    report("bad values", verdict)
    assert verdict.results == 20 and verdict.dead_lettered == len(bad)
    assert verdict.missing == [] and verdict.committed_equals_end
    dead = read_topic(bootstrap_servers, t.dlq).records.values()
    reasons = {int(h[H_OFFSET]): h[H_MESSAGE].decode() for _, _, h, _ in dead}
    originals = {int(h[H_OFFSET]): v for _, v, h, _ in dead if int(h[H_PARTITION]) == 0}
    for position, (expected, value) in enumerate(bad.items()):
        offset = 10 + position
        assert expected in reasons[offset], (offset, reasons[offset])
        assert originals[offset] == value  # dead-letter records keep the original bytes


def test_a_registry_that_stops_answering_for_20_s_holds_records_back_and_loses_none(
    bootstrap_servers: str, registry: LocalRegistry
) -> None:
    t = new_topics(bootstrap_servers, "trades-outage")
    docs = trade_documents(200)
    with writer(t.input) as v1, writer(t.input, trades_v2()) as v2:
        first = [v1(orjson.dumps(doc)) for doc in docs[:100]]
        later = [v2(orjson.dumps(doc)) for doc in docs[100:]]  # registered now, read later
    send(bootstrap_servers, t.input, first)
    config = make_config(
        bootstrap_servers,
        t,
        schema_registry={"url": registry.url, "retry_backoff_max_s": 1.0},
        pipelines=[pipeline_entry("outage", t, "trades", "avro")],
    )
    pipeline = Pipeline(config)
    produced = pipeline.metrics.produced

    def results() -> float:
        return sum(s.value for m in produced.collect() for s in m.samples if "_total" in s.name)

    def dead_lettered() -> float:
        counter = pipeline.metrics.dead_lettered
        return sum(s.value for m in counter.collect() for s in m.samples if "_total" in s.name)

    summary: list[RunSummary] = []
    runner = threading.Thread(target=lambda: summary.append(pipeline.run()))
    runner.start()
    try:
        wait_for(lambda: results() >= 100, 120, "the results of the v1 records")
        registry.pause()
        try:
            send(bootstrap_servers, t.input, later)  # a writer schema id not yet cached
            schemas = pipeline.stages.shared.schemas
            assert schemas is not None
            wait_for(lambda: schemas.outages >= 1, 60, "a lookup waiting for the registry")
            time.sleep(20.0)  # the outage lasts 20 s: the scenario itself, not a synchronisation
            assert results() == 100 and dead_lettered() == 0  # held back, not dead-lettered
        finally:
            registry.resume()
        wait_for(lambda: results() >= 200, 120, "the results after the registry came back")
    finally:
        pipeline.request_stop()
        runner.join(120)
    assert summary and summary[0].exit_code == 0, summary
    verdict = verify(bootstrap_servers, t.input, t.output, t.dlq, t.group)
    report("registry outage", verdict)
    assert verdict.results == 200 and verdict.dead_lettered == 0
    assert verdict.missing == [] and verdict.duplicates == 0 and verdict.committed_equals_end


def test_registry_start_and_stop_from_the_command_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    directory = tmp_path / "registry"
    cli = [sys.executable, "-m", "streamproc", "registry"]
    started = subprocess.run(
        [*cli, "start", "--dir", str(directory)], capture_output=True, text=True, timeout=180
    )
    try:
        assert started.returncode == 0, started.stderr
        url = started.stdout.strip().splitlines()[-1].removeprefix("SCHEMA_REGISTRY_URL=")
        assert url.startswith("http://127.0.0.1:") and url.endswith("/apis/ccompat/v7")
        with SchemaRegistryClient({"url": url}) as client:
            schema = Schema(avro_schema_of("iot").read_text(), "AVRO")
            registered = client.register_schema("cli-check-value", schema)
            assert client.get_schema(registered).schema_str
    finally:
        stopped = subprocess.run(
            [*cli, "stop", "--dir", str(directory)], capture_output=True, text=True, timeout=60
        )
    assert stopped.returncode == 0 and "stopped registry pid" in stopped.stdout
    assert not (directory / "registry.pid").exists()


def test_a_result_schema_the_registry_lacks_or_refuses_fails_the_start_up_naming_the_subject(
    bootstrap_servers: str, registry: LocalRegistry
) -> None:
    t = new_topics(bootstrap_servers, "trades-results")
    entry = {**pipeline_entry("results", t, "trades", "json"), "output_format": "avro"}
    off = {"url": registry.url, "auto_register_schemas": False}
    config = make_config(bootstrap_servers, t, schema_registry=off, pipelines=[entry])
    with pytest.raises(ConfigError, match=rf"not found under subject '{t.output}-value'"):
        Pipeline(config)
    # a result schema incompatible with the subject's latest version (BACKWARD): refused
    with SchemaRegistryClient({"url": registry.url}) as client:
        other = {"type": "record", "name": "Other", "fields": [{"name": "n", "type": "long"}]}
        client.register_schema(f"{t.output}-value", Schema(orjson.dumps(other).decode(), "AVRO"))
    on = {"url": registry.url}
    config = make_config(bootstrap_servers, t, schema_registry=on, pipelines=[entry])
    with pytest.raises(ConfigError, match=rf"refused under subject '{t.output}-value' \(HTTP 409"):
        Pipeline(config)


def test_bad_protobuf_values_are_dead_lettered_with_reasons(
    bootstrap_servers: str, registry: LocalRegistry
) -> None:
    t = new_topics(bootstrap_servers, "trades-bad-protobuf", partitions=1)
    docs = trade_documents(11)
    with ProtobufValues(t.input, "trades", {"url": registry.url}) as good:
        valid = [good(orjson.dumps(doc)) for doc in docs[:10]]
        zero_size = good(orjson.dumps({**docs[10], "trade_id": "zero", "size": 0}))
    with writer(f"avro-{t.input}") as avro:
        avro_value = avro(orjson.dumps(docs[10]))
    schema_id, payload = split(valid[0])
    bad = {
        "is AVRO, not Protobuf": avro_value,
        "malformed Protobuf": frame(schema_id, b"\x00\xff\xff\xff"),
        "malformed Protobuf: truncated message index path": frame(schema_id, b"\x80"),
        "unknown schema id 987655": frame(987655, bytes(payload)),
        "schema: Expected `int` >= 1": zero_size,
    }
    send(bootstrap_servers, t.input, valid[:5] + list(bad.values()) + valid[5:], partition=0)
    config = make_config(
        bootstrap_servers,
        t,
        schema_registry={"url": registry.url},
        pipelines=[pipeline_entry("bad", t, "trades", "protobuf")],
    )
    summary = Pipeline(config).run(exit_when_idle_s=3)
    assert summary.exit_code == 0, summary.error
    verdict = verify(bootstrap_servers, t.input, t.output, t.dlq, t.group)
    report("bad protobuf values", verdict)
    assert verdict.results == 10 and verdict.dead_lettered == len(bad)
    assert verdict.missing == [] and verdict.committed_equals_end
    dead = read_topic(bootstrap_servers, t.dlq).records.values()
    reasons = {int(h[H_OFFSET]): h[H_MESSAGE].decode() for _, _, h, _ in dead}
    for position, expected in enumerate(bad):
        assert expected in reasons[5 + position], (expected, reasons[5 + position])


def test_the_demo_runs_trades_and_iot_schema_managed(
    bootstrap_servers: str, registry: LocalRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamproc.tools.demo import run_demo

    monkeypatch.setenv("SCHEMA_REGISTRY_URL", registry.url)
    plan = {"trades": (120, 400.0), "iot": (24, 200.0)}
    report = run_demo(bootstrap_servers, plan, partitions=2, value_format="protobuf")
    assert report.ok, report.render()
    assert report.formats == {"trades": "protobuf", "iot": "protobuf"}
    assert {w: v.results for w, v in report.verdicts.items()} == {"trades": 120, "iot": 24}
    rendered = report.render()
    assert "trades   protobuf" in rendered and "RESULT  PASS" in rendered
    # the example results were read back from Protobuf by the stock deserialiser
    assert all(doc["model"] for docs in report.examples.values() for doc in docs)


@pytest.mark.parametrize("fmt", ["avro", "protobuf"])
def test_video_frames_round_trip_schema_managed(
    bootstrap_servers: str, registry: LocalRegistry, fmt: str
) -> None:
    # the image and its metadata in one Frame record, results as FrameResult records
    t = new_topics(bootstrap_servers, f"video-{fmt}")
    replayed = {"value_format": fmt, "registry_url": registry.url, "progress": False}
    assert produce("video", t.input, bootstrap_servers, 3, 12, **replayed) == 12
    config = make_config(
        bootstrap_servers,
        t,
        schema_registry={"url": registry.url},
        pipelines=[pipeline_entry("frames", t, "video", fmt)],
    )
    summary = Pipeline(config).run(exit_when_idle_s=3)
    assert summary.exit_code == 0, summary.error
    verdict = verify(bootstrap_servers, t.input, t.output, t.dlq, t.group)
    report(f"video {fmt}", verdict)
    assert verdict.results == 12 and verdict.dead_lettered == 0 and verdict.missing == []
    values = [v for _, v, _, _ in read_topic(bootstrap_servers, t.output).records.values()]
    context = SerializationContext(t.output, MessageField.VALUE)
    if fmt == "avro":
        with SchemaRegistryClient({"url": registry.url}) as client:
            stock = AvroDeserializer(client)
            docs = [stock(v, context) for v in values]
    else:
        stock_protobuf = ProtobufDeserializer(FrameResult, {"use.deprecated.format": False})
        as_fields = field_converter(FrameResult.DESCRIPTOR)
        docs = [as_fields(stock_protobuf(v, context)) for v in values]
    assert {doc["frame_no"] for doc in docs} == set(range(12))
    assert all(len(doc["top5"]) == 5 and doc["camera_id"].startswith("bikes") for doc in docs)


def test_a_writer_schema_with_references_reads_through_the_registry(
    bootstrap_servers: str, registry: LocalRegistry
) -> None:
    # Confluent schema references: a Venue record registered as a subject of its own, the
    # trade writer schema naming it for an extra field (which the reader skips)
    from confluent_kafka.schema_registry import SchemaReference

    t = new_topics(bootstrap_servers, "trades-refs", partitions=1)
    base = orjson.loads(avro_schema_of("trades").read_bytes())
    venue = {
        "type": "record",
        "name": "Venue",
        "namespace": "io.streamproc.refs",
        "fields": [{"name": "mic", "type": "string"}],
    }
    venue_subject = f"venue-{t.input}"
    with SchemaRegistryClient({"url": registry.url}) as client:
        client.register_schema(venue_subject, Schema(orjson.dumps(venue).decode(), "AVRO"))
        version = client.get_latest_version(venue_subject).version
        referring = {
            **base,
            "fields": [*base["fields"], {"name": "venue", "type": "io.streamproc.refs.Venue"}],
        }
        reference = SchemaReference("io.streamproc.refs.Venue", venue_subject, version)
        schema = Schema(orjson.dumps(referring).decode(), "AVRO", [reference])
        schema_id = client.register_schema(f"{t.input}-value", schema)
    parsed: dict[str, Any] = {}
    fastavro.parse_schema(venue, parsed)
    writer = fastavro.parse_schema(referring, parsed)
    values = []
    for doc in trade_documents(20):
        out = io.BytesIO()
        fastavro.schemaless_writer(out, writer, {**doc, "venue": {"mic": "XNAS"}})
        values.append(frame(schema_id, out.getvalue()))
    send(bootstrap_servers, t.input, values, partition=0)
    config = make_config(
        bootstrap_servers,
        t,
        schema_registry={"url": registry.url},
        pipelines=[{**pipeline_entry("refs", t, "trades", "avro"), "output_format": "json"}],
    )
    summary = Pipeline(config).run(exit_when_idle_s=3)
    assert summary.exit_code == 0, summary.error
    verdict = verify(bootstrap_servers, t.input, t.output, t.dlq, t.group)
    report("schema references", verdict)
    assert verdict.results == 20 and verdict.dead_lettered == 0 and verdict.missing == []
