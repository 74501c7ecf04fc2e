"""The Protobuf decode path without a registry server: the index path of the framing, the
workloads' messages decoding to the rows and results of the same JSON, the reasons of refused
values, results framed for the stock deserialiser, and the generated code matching the
``.proto`` files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from confluent_kafka.schema_registry import Schema
from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from streamproc.errors import DecodeError
from streamproc.records import TopicPartition
from streamproc.schemas.protobuf import (
    ProtobufResults,
    field_converter,
    index_path,
    read_indexes,
)
from streamproc.schemas.wire import frame
from streamproc.schemas.writers import WriterSchemas
from streamproc.tools.replay import messages
from streamproc.workloads.iot import IotWorkload
from streamproc.workloads.schemas import iot_pb2, trades_pb2
from streamproc.workloads.trades import TradesWorkload
from tests.unit.fakes import make_records

ROOT = Path(__file__).resolve().parents[3]
TP = TopicPartition("in", 0)


class Registry:
    """A ``SchemaRegistryClient`` stand-in holding schemas by id and type."""

    def __init__(self, schemas: dict[int, str]) -> None:
        self.schemas = schemas

    def get_schema(self, schema_id: int) -> Schema:
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        if schema_id not in self.schemas:
            raise SchemaRegistryError(404, 40403, "not found")
        return Schema("x", self.schemas[schema_id])

    def close(self) -> None:
        pass


def docs(workload: str, count: int) -> list[dict[str, Any]]:
    stream = messages(workload)
    return [orjson.loads(next(stream).value) for _ in range(count)]


def framed(schema_id: int, message: Any) -> bytes:
    return frame(schema_id, index_path(message.DESCRIPTOR) + message.SerializeToString())


def test_index_paths_round_trip_and_a_truncated_one_is_refused() -> None:
    assert index_path(trades_pb2.Trade.DESCRIPTOR) == b"\x00"
    for message in (trades_pb2.TradeResult, iot_pb2.SensorWindowResult, iot_pb2.SensorWindow):
        path = index_path(message.DESCRIPTOR)
        indexes, start = read_indexes(memoryview(path + b"rest"))
        position = list(message.DESCRIPTOR.file.message_types_by_name).index(message.__name__)
        assert indexes == [position] and start == len(path)
    with pytest.raises(DecodeError, match="truncated message index path"):
        read_indexes(memoryview(b"\x80"))
    with pytest.raises(DecodeError, match="index path of length"):
        read_indexes(memoryview(b"\x7f"))  # zigzag -64: a negative count


@pytest.mark.parametrize("workload_class", [TradesWorkload, IotWorkload])
def test_protobuf_messages_write_the_rows_and_results_of_the_same_json(
    workload_class: type[Any],
) -> None:
    as_json, as_protobuf = workload_class(), workload_class()
    as_protobuf.use_input_format("protobuf", WriterSchemas({}, client=Registry({3: "PROTOBUF"})))
    documents = docs(workload_class.name, 40)
    json_records, protobuf_records = make_records(TP, range(40)), make_records(TP, range(40))
    for doc, j, p in zip(documents, json_records, protobuf_records, strict=True):
        j.value = orjson.dumps(doc)
        p.value = framed(3, as_protobuf.protobuf_message(doc))
    shape = (40, *workload_class.item_shape)
    rows_json, rows_protobuf = np.zeros(shape, np.float32), np.ones(shape, np.float32)
    assert as_json.decode_many(json_records, rows_json) == {}
    assert as_protobuf.decode_many(protobuf_records, rows_protobuf) == {}
    np.testing.assert_array_equal(rows_json, rows_protobuf)
    outputs: tuple[np.ndarray, ...] = (np.arange(40, dtype=np.float32), np.zeros(40, bool))
    if workload_class is TradesWorkload:
        outputs = (*outputs, rows_json)
    assert as_json.encode_many(json_records, outputs) == as_protobuf.encode_many(
        protobuf_records, outputs
    )


def test_refused_protobuf_values_name_their_reason() -> None:
    workload = TradesWorkload()
    registry = Registry({1: "PROTOBUF", 2: "AVRO"})
    workload.use_input_format("protobuf", WriterSchemas({}, client=registry))
    doc = docs("trades", 1)[0]
    good = workload.protobuf_message(doc)
    cases = {
        "schema id 2 is AVRO, not Protobuf": framed(2, good),
        "unknown schema id 7": framed(7, good),
        "malformed Protobuf": frame(1, b"\x00\xff\xff"),
        "Expected `int` >= 1 - at `$.size`": framed(
            1, workload.protobuf_message({**doc, "size": 0})
        ),
        "Invalid enum value 'hold' - at `$.side`": framed(
            1, workload.protobuf_message({**doc, "side": "hold"})
        ),
    }
    records = make_records(TP, range(len(cases)))
    for record, value in zip(records, cases.values(), strict=True):
        record.value = value
    indexes, _, failed = workload.messages.decode_records(records)
    assert indexes == []
    for index, reason in enumerate(cases):
        assert reason in str(failed[index]), (reason, failed[index])


def test_results_are_framed_for_the_stock_deserialiser() -> None:
    workload = TradesWorkload()
    workload.use_output_format("protobuf", ProtobufResults(trades_pb2.TradeResult, 41))
    records = make_records(TP, range(2))
    for record, doc in zip(records, docs("trades", 2), strict=True):
        record.value = orjson.dumps(doc)
    outputs = (
        np.array([0.5, 2.0], np.float32),
        np.array([False, True]),
        np.ones((2, 4), np.float32),
    )
    encoded = workload.encode_many(records, outputs)
    json_results = TradesWorkload().encode_many(records, outputs)
    stock = ProtobufDeserializer(trades_pb2.TradeResult, {"use.deprecated.format": False})
    context = SerializationContext("out", MessageField.VALUE)
    as_fields = field_converter(trades_pb2.TradeResult.DESCRIPTOR)
    for result, expected in zip(encoded, json_results, strict=True):
        assert not isinstance(result, Exception) and not isinstance(expected, Exception)
        assert result.value[:5] == b"\x00\x00\x00\x00\x29"  # magic byte, schema id 41
        assert as_fields(stock(result.value, context)) == orjson.loads(expected.value)


def test_the_generated_code_matches_the_proto_files(tmp_path: Path) -> None:
    script = ROOT / "scripts" / "generate_protos.sh"
    result = subprocess.run(
        [str(script), str(tmp_path)],
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    generated = sorted(p.name for p in tmp_path.iterdir())
    assert generated == [
        "iot_pb2.py",
        "iot_pb2.pyi",
        "trades_pb2.py",
        "trades_pb2.pyi",
        "video_pb2.py",
        "video_pb2.pyi",
    ]
    for name in generated:
        checked_in = ROOT / "streamproc" / "workloads" / "schemas" / name
        assert (tmp_path / name).read_text() == checked_in.read_text(), (
            f"{name} is stale: run scripts/generate_protos.sh"
        )


@pytest.mark.parametrize("workload_class", [TradesWorkload, IotWorkload])
def test_json_schema_values_write_the_rows_and_results_of_plain_json(
    workload_class: type[Any],
) -> None:
    from streamproc.schemas.jsonschema import JsonSchemaResults

    plain, framed = workload_class(), workload_class()
    framed.use_input_format(
        "jsonschema", WriterSchemas({}, client=Registry({4: "JSON", 5: "AVRO"}))
    )
    framed.use_output_format("jsonschema", JsonSchemaResults(9, framed.json_result_encoder()))
    documents = docs(workload_class.name, 20)
    plain_records, framed_records = make_records(TP, range(21)), make_records(TP, range(21))
    for doc, j, f in zip(documents, plain_records[:20], framed_records[:20], strict=True):
        j.value = orjson.dumps(doc)
        f.value = frame(4, j.value)
    plain_records[20].value = orjson.dumps(documents[0])
    framed_records[20].value = frame(5, plain_records[20].value)  # an Avro id
    shape = (21, *workload_class.item_shape)
    rows_plain, rows_framed = np.zeros(shape, np.float32), np.ones(shape, np.float32)
    assert plain.decode_many(plain_records, rows_plain) == {}
    failed = framed.decode_many(framed_records, rows_framed)
    assert list(failed) == [20] and "schema id 5 is AVRO, not JSON Schema" in str(failed[20])
    np.testing.assert_array_equal(rows_plain[:20], rows_framed[:20])
    outputs: tuple[np.ndarray, ...] = (np.arange(20, dtype=np.float32), np.zeros(20, bool))
    if workload_class is TradesWorkload:
        outputs = (*outputs, rows_plain[:20])
    for p, f in zip(
        plain.encode_many(plain_records[:20], outputs),
        framed.encode_many(framed_records[:20], outputs),
        strict=True,
    ):
        assert not isinstance(p, Exception) and not isinstance(f, Exception)
        assert f.value == frame(9, p.value)
    schema = framed.result_json_schema()
    assert schema["title"].startswith("io.streamproc.") and "$defs" in schema
