"""The Avro decode path without a registry server: the wire format, the writer-schema cache
(its three outcomes: schema, unknown id, wait while unreachable), the decoder's reasons, and a
workload switched to Avro giving the rows and results of the same JSON messages."""

from __future__ import annotations

import io
import threading
from typing import Any

import fastavro
import numpy as np
import orjson
import pytest
from confluent_kafka.schema_registry import Schema
from confluent_kafka.schema_registry.error import SchemaRegistryError

from streamproc.config import load_config
from streamproc.errors import ConfigError, DecodeError, RegistryUnavailable
from streamproc.records import TopicPartition
from streamproc.schemas.avro import AvroDecoder
from streamproc.schemas.wire import frame, split
from streamproc.schemas.writers import UnknownSchema, WriterSchemas
from streamproc.tools.replay import messages
from streamproc.workloads import load_workload
from streamproc.workloads.formats import avro_schema
from streamproc.workloads.trades import TradeMessage, TradesWorkload
from tests.unit.fakes import make_records

TP = TopicPartition("trades", 0)


class FakeRegistryClient:
    """A ``SchemaRegistryClient`` stand-in: schemas by id, and a switch that makes every
    lookup fail as an unreachable server does (a connection error)."""

    def __init__(self, schemas: dict[int, str]) -> None:
        self.schemas = schemas
        self.unreachable = threading.Event()
        self.calls: list[int] = []
        self.closed = False

    def get_schema(self, schema_id: int) -> Schema:
        self.calls.append(schema_id)
        if self.unreachable.is_set():
            raise ConnectionRefusedError(111, "Connection refused")
        if schema_id not in self.schemas:
            raise SchemaRegistryError(
                404, 40403, f"No content with id/hash 'contentId-{schema_id}'"
            )
        return Schema(self.schemas[schema_id], "AVRO")

    def close(self) -> None:
        self.closed = True


def trades_schema() -> dict[str, Any]:
    return avro_schema(TradesWorkload.avro_reader)


def avro_payload(schema: dict[str, Any], doc: dict[str, Any]) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), doc)
    return out.getvalue()


def trade_docs(count: int) -> list[dict[str, Any]]:
    stream = messages("trades")
    return [orjson.loads(next(stream).value) for _ in range(count)]


def test_the_wire_format_round_trips_and_refuses_what_is_not_framed() -> None:
    schema_id, payload = split(frame(70000, b"abc"))
    assert (schema_id, bytes(payload)) == (70000, b"abc")
    for value, reason in (
        (b"\x00\x00\x01", "shorter than the 5-byte header"),
        (b'{"a": 1}', "magic byte 123, expected 0"),
        (None, "tombstone"),
    ):
        with pytest.raises(DecodeError, match=reason):
            split(value)


def test_writer_schemas_are_read_once_per_id_and_an_unknown_id_is_the_records_fault() -> None:
    client = FakeRegistryClient({1: orjson.dumps(trades_schema()).decode()})
    writers = WriterSchemas({}, client=client)
    assert writers.get(1).schema_str == writers.get(1).schema_str
    assert client.calls == [1]
    with pytest.raises(UnknownSchema, match="unknown schema id 2"):
        writers.get(2)
    assert isinstance(UnknownSchema("x"), DecodeError)  # dead-lettered


def test_an_unreachable_registry_is_waited_for_then_answers() -> None:
    client = FakeRegistryClient({1: orjson.dumps(trades_schema()).decode()})
    writers = WriterSchemas({}, backoff_s=0.001, max_backoff_s=0.01, client=client)
    client.unreachable.set()
    found: list[Schema] = []
    lookup = threading.Thread(target=lambda: found.append(writers.get(1)))
    lookup.start()
    tick = threading.Event()
    for _ in range(1000):  # at most 10 s: several failed attempts, the lookup retries
        if len(client.calls) >= 3 or tick.wait(0.01):
            break
    assert len(client.calls) >= 3
    assert not found and writers.outages == 1
    client.unreachable.clear()
    lookup.join(10)
    assert found and found[0].schema_type == "AVRO"


def test_closing_abandons_a_lookup_waiting_for_the_registry_without_refusing_the_record() -> None:
    client = FakeRegistryClient({})
    client.unreachable.set()
    writers = WriterSchemas({}, backoff_s=0.001, max_backoff_s=0.01, client=client)
    errors: list[BaseException] = []

    def lookup() -> None:
        try:
            writers.get(1)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=lookup)
    thread.start()
    tick = threading.Event()
    for _ in range(1000):  # at most 10 s: until the lookup has failed once
        if client.calls or tick.wait(0.01):
            break
    writers.close()
    thread.join(10)
    assert len(errors) == 1 and isinstance(errors[0], RegistryUnavailable)
    assert not isinstance(errors[0], DecodeError) and client.closed


def test_the_decoder_names_each_reason() -> None:
    v1 = trades_schema()
    wrong = {
        **v1,
        "fields": [{**f, "type": "string"} if f["name"] == "price" else f for f in v1["fields"]],
    }
    client = FakeRegistryClient({1: orjson.dumps(v1).decode(), 2: orjson.dumps(wrong).decode()})
    decoder = AvroDecoder(TradeMessage, v1, WriterSchemas({}, client=client))
    doc = trade_docs(1)[0]
    good = avro_payload(v1, doc)
    assert decoder.decode(frame(1, good)).price == doc["price"]
    cases = {
        "unknown schema id 9": frame(9, good),
        "malformed Avro": frame(1, good[:6]),
        "2 bytes after the record": frame(1, good + b"\x00\x00"),
        "writer schema 2 is incompatible with the reader schema": frame(
            2, avro_payload(wrong, {**doc, "price": "1.5"})
        ),
        "Expected `int` >= 1 - at `$.size`": frame(1, avro_payload(v1, {**doc, "size": 0})),
    }
    records = make_records(TP, range(len(cases)))
    for record, value in zip(records, cases.values(), strict=True):
        record.value = value
    indexes, decoded, failed = decoder.decode_records(records)
    assert indexes == [] and decoded == []
    for index, reason in enumerate(cases):
        assert reason in str(failed[index]), (reason, failed[index])


def test_a_workload_reading_avro_writes_the_rows_and_results_of_the_same_json() -> None:
    v1 = trades_schema()
    client = FakeRegistryClient({5: orjson.dumps(v1).decode()})
    as_json, as_avro = TradesWorkload(), TradesWorkload()
    as_avro.use_input_format("avro", WriterSchemas({}, client=client))
    docs = trade_docs(50)
    json_records = make_records(TP, range(50))
    avro_records = make_records(TP, range(50))
    for doc, j, a in zip(docs, json_records, avro_records, strict=True):
        j.value = orjson.dumps(doc)
        a.value = frame(5, avro_payload(v1, doc))
    rows_json = np.zeros((50, 4), np.float32)
    rows_avro = np.ones((50, 4), np.float32)
    assert as_json.decode_many(json_records, rows_json) == {}
    assert as_avro.decode_many(avro_records, rows_avro) == {}
    np.testing.assert_array_equal(rows_json, rows_avro)
    outputs = (np.arange(50, dtype=np.float32), np.zeros(50, bool), rows_json)
    assert as_json.encode_many(json_records, outputs) == as_avro.encode_many(avro_records, outputs)


def test_a_workload_without_avro_and_a_pipeline_without_a_registry_are_refused_at_start_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SCHEMA_REGISTRY_URL", raising=False)
    video = load_workload("video")
    with pytest.raises(
        ConfigError, match=r"workload 'video' reads \[.*'protobuf'\], not 'jsonschema'"
    ):
        video.use_input_format("jsonschema", None)
    with pytest.raises(ConfigError, match=r"writes .*, not 'jsonschema'"):
        video.use_output_format("jsonschema", None)
    with pytest.raises(ConfigError, match="has no JSON Schema of its results"):
        video.result_json_schema()
    with pytest.raises(ConfigError, match=r"avro needs schema_registry\.url"):
        TradesWorkload().use_input_format("avro", None)
    pipeline = {"name": "t", "input_topic": "i", "output_topic": "o", "workload": "trades"}
    with pytest.raises(ConfigError, match=r"schema_registry.url: pipelines \['t'\]"):
        load_config(overrides={"pipelines": [{**pipeline, "format": "avro"}]})
    with pytest.raises(ConfigError, match="format"):
        load_config(overrides={"pipelines": [{**pipeline, "format": "xml"}]})


def test_the_registry_password_is_never_in_the_config_repr() -> None:
    pipeline = {"name": "t", "input_topic": "i", "output_topic": "o", "workload": "trades"}
    config = load_config(
        overrides={
            "pipelines": [{**pipeline, "format": "avro"}],
            "schema_registry": {
                "url": "https://registry.example:8081",
                "basic_auth_user_info": "svc:s3cr3t-pw",
                "ssl_ca_location": "/etc/ca.pem",
            },
        }
    )
    assert "s3cr3t-pw" not in repr(config) and "s3cr3t-pw" not in str(config.model_dump())
    settings = config.schema_registry.client_settings()
    assert settings["basic.auth.user.info"] == "svc:s3cr3t-pw"
    assert settings["ssl.ca.location"] == "/etc/ca.pem"


class WrongPathClient(FakeRegistryClient):
    """A registry URL with a wrong path: every request answers 404 without the registry's own
    error code (a proxy's or a web server's page), until ``fixed``."""

    def __init__(self, schemas: dict[int, str]) -> None:
        super().__init__(schemas)
        self.fixed = threading.Event()

    def get_schema(self, schema_id: int) -> Schema:
        self.calls.append(schema_id)
        if not self.fixed.is_set():
            raise SchemaRegistryError(404, -1, "HTTP 404 Not Found")
        return super().get_schema(schema_id)

    def get_subjects(self) -> list[str]:
        raise SchemaRegistryError(404, -1, "HTTP 404 Not Found")


def test_a_404_that_is_not_the_registrys_unknown_id_waits_and_fails_the_start_up_probe() -> None:
    client = WrongPathClient({1: orjson.dumps(trades_schema()).decode()})
    writers = WriterSchemas({"url": "http://r:8081/wrong"}, backoff_s=0.001, client=client)
    with pytest.raises(
        ConfigError, match=r"schema_registry\.url: http://r:8081/wrong answered HTTP 404"
    ):
        writers.probe()
    found: list[Schema] = []
    lookup = threading.Thread(target=lambda: found.append(writers.get(1)))
    lookup.start()
    tick = threading.Event()
    for _ in range(1000):
        if len(client.calls) >= 3 or tick.wait(0.01):
            break
    assert not found and len(client.calls) >= 3  # waiting, not "unknown schema id"
    client.fixed.set()
    lookup.join(10)
    assert found


def test_writer_schemas_that_would_crash_or_spin_the_reader_are_refused() -> None:
    base = trades_schema()
    node = {
        "type": "record",
        "name": "Node",
        "fields": [{"name": "next", "type": ["null", "Node"]}],
    }
    recursive = {**base, "fields": [*base["fields"], {"name": "pad", "type": ["null", node]}]}
    nothing = {"type": "array", "items": "null"}
    spinning = {**base, "fields": [*base["fields"], {"name": "pad", "type": nothing}]}
    client = FakeRegistryClient(
        {1: orjson.dumps(recursive).decode(), 2: orjson.dumps(spinning).decode()}
    )
    decoder = AvroDecoder(TradeMessage, base, WriterSchemas({}, client=client))
    doc = trade_docs(1)[0]
    payload = avro_payload(base, doc)
    with pytest.raises(DecodeError, match="writer schema 1 is recursive"):
        decoder.decode(frame(1, payload + b"\x02" * 50 + b"\x00"))
    with pytest.raises(
        DecodeError, match="writer schema 2 has an array of items that take no bytes"
    ):
        decoder.decode(frame(2, payload + b"\x02\x00"))


def test_a_writer_timestamp_logical_type_reads_as_the_readers_long() -> None:
    base = trades_schema()
    timestamp = {"type": "long", "logicalType": "timestamp-millis"}
    typed = {
        **base,
        "fields": [{**f, "type": timestamp} if f["name"] == "ts_ms" else f for f in base["fields"]],
    }
    client = FakeRegistryClient({3: orjson.dumps(typed).decode()})
    decoder = AvroDecoder(TradeMessage, base, WriterSchemas({}, client=client))
    doc = trade_docs(1)[0]
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(typed), {**doc, "ts_ms": doc["ts_ms"]})
    assert decoder.decode(frame(3, out.getvalue())).ts_ms == doc["ts_ms"]


def test_the_registry_url_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # what `streamproc registry start` prints, as produce and demo read it
    pipeline = {"name": "t", "input_topic": "i", "output_topic": "o", "workload": "trades"}
    monkeypatch.setenv("SCHEMA_REGISTRY_URL", "http://127.0.0.1:8081/apis/ccompat/v7")
    config = load_config(overrides={"pipelines": [{**pipeline, "format": "avro"}]})
    assert config.schema_registry.url == "http://127.0.0.1:8081/apis/ccompat/v7"
    monkeypatch.setenv("SCHEMA_REGISTRY_URL", "registry:8081")  # not a URL: left alone
    with pytest.raises(ConfigError, match=r"schema_registry\.url: pipelines \['t'\]"):
        load_config(overrides={"pipelines": [{**pipeline, "format": "avro"}]})
    assert load_config(overrides={"pipelines": [pipeline]}).schema_registry.url is None
