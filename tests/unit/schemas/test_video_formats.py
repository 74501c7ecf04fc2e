"""The video workload schema-managed (no registry server): a ``Frame`` record in Avro or
Protobuf decodes to the row of the plain image value, and results written as ``FrameResult``
read back with the stock deserialisers into the fields of the plain JSON result."""

from __future__ import annotations

import io
from typing import Any

import fastavro
import numpy as np
import orjson
import pytest
from confluent_kafka.schema_registry import Schema
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from streamproc.records import Record, TopicPartition
from streamproc.schemas.avro import AvroDecoder
from streamproc.schemas.protobuf import ProtobufResults, field_converter, index_path
from streamproc.schemas.results import AvroResults
from streamproc.schemas.wire import frame
from streamproc.schemas.writers import WriterSchemas
from streamproc.tools.replay import messages
from streamproc.workloads.formats import avro_schema
from streamproc.workloads.schemas import video_pb2
from streamproc.workloads.video import VideoWorkload

TP = TopicPartition("frames", 0)


class Registry:
    """Schemas by id (``SchemaRegistryClient`` stand-in)."""

    def __init__(self, schemas: dict[int, Schema]) -> None:
        self.schemas = schemas

    def get_schema(self, schema_id: int) -> Schema:
        if schema_id not in self.schemas:
            raise SchemaRegistryError(404, 40403, "not found")
        return self.schemas[schema_id]

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def replayed() -> list[Record]:
    stream = messages("video")
    return [
        Record(TP, offset, m.key, m.value, m.headers, 0, 0.0, 1)
        for offset, m in ((o, next(stream)) for o in range(3))
    ]


def framed_value(fmt: str, record: Record) -> bytes:
    document = VideoWorkload.replay_document(record.key, record.value or b"", record.headers)
    if fmt == "avro":
        out = io.BytesIO()
        fastavro.schemaless_writer(out, avro_schema(VideoWorkload.avro_reader), document)
        return frame(7, out.getvalue())
    message = video_pb2.Frame(**document)
    return frame(8, index_path(message.DESCRIPTOR) + message.SerializeToString())


@pytest.mark.parametrize("fmt", ["avro", "protobuf"])
def test_a_frame_record_decodes_and_scores_like_the_plain_image(
    fmt: str, replayed: list[Record]
) -> None:
    avro_text = orjson.dumps(avro_schema(VideoWorkload.avro_reader)).decode()
    registry = Registry({7: Schema(avro_text, "AVRO"), 8: Schema("x", "PROTOBUF")})
    plain, managed = VideoWorkload(), VideoWorkload()
    managed.use_input_format(fmt, WriterSchemas({}, client=registry))
    assert isinstance(managed.frames, AvroDecoder) == (fmt == "avro")
    outputs = (np.array([0.6, 0.2, 0.1, 0.05, 0.05], np.float32), np.array([1, 2, 3, 4, 5]))
    for record in replayed:
        schema_managed = Record(TP, record.offset, None, framed_value(fmt, record), (), 0, 0.0, 1)
        rows = np.zeros((2, 224, 224, 3), np.uint8)
        plain.decode(record, rows[0])
        managed.decode(schema_managed, rows[1])
        np.testing.assert_array_equal(rows[0], rows[1])
        # the result's camera and frame come from the record, not a key or headers
        assert managed.encode(schema_managed, outputs) == plain.encode(record, outputs)


def test_results_in_avro_and_protobuf_hold_the_json_result(replayed: list[Record]) -> None:
    outputs = (np.array([0.6, 0.2, 0.1, 0.05, 0.05], np.float32), np.array([1, 2, 3, 4, 5]))
    record = replayed[1]
    expected: dict[str, Any] = orjson.loads(VideoWorkload().encode(record, outputs).value)
    as_avro = VideoWorkload()
    as_avro.use_output_format("avro", AvroResults(as_avro.result_schema(), 12))
    value = as_avro.encode(record, outputs).value
    assert value[:5] == frame(12, b"")
    read = fastavro.schemaless_reader(io.BytesIO(value[5:]), avro_schema(VideoWorkload.avro_result))
    assert read == expected
    as_protobuf = VideoWorkload()
    as_protobuf.use_output_format("protobuf", ProtobufResults(video_pb2.FrameResult, 13))
    stock = ProtobufDeserializer(video_pb2.FrameResult, {"use.deprecated.format": False})
    message = stock(
        as_protobuf.encode(record, outputs).value, SerializationContext("o", MessageField.VALUE)
    )
    assert field_converter(video_pb2.FrameResult.DESCRIPTOR)(message) == expected
