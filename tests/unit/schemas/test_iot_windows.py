"""The iot window read straight from Avro or Protobuf bytes (streamproc/workloads/iot_windows.py)
against the general way (fastavro or the generated class, the message Struct, the JSON path's
checks): the same rows on every recorded window, and never a value the general way refuses."""

from __future__ import annotations

import io
import itertools
import random
from typing import Any

import fastavro
import numpy as np
import orjson
import pytest
from confluent_kafka.schema_registry import Schema

from streamproc.errors import DecodeError
from streamproc.records import Record, TopicPartition
from streamproc.schemas.protobuf import index_path
from streamproc.schemas.wire import frame, split
from streamproc.schemas.writers import WriterSchemas
from streamproc.tools.replay import messages
from streamproc.workloads.formats import avro_schema
from streamproc.workloads.iot import IotWorkload, _window

TP = TopicPartition("iot", 0)


class Registry:
    def __init__(self, schemas: dict[int, Schema]) -> None:
        self.schemas = schemas

    def get_schema(self, schema_id: int) -> Schema:
        return self.schemas[schema_id]

    def close(self) -> None:
        pass


def setup(
    fmt: str, count: int
) -> tuple[IotWorkload, IotWorkload, list[dict[str, Any]], list[bytes]]:
    reader = avro_schema(IotWorkload.avro_reader)
    registry = Registry(
        {1: Schema(orjson.dumps(reader).decode(), "AVRO"), 2: Schema("x", "PROTOBUF")}
    )
    as_avro, as_json = IotWorkload(), IotWorkload()
    as_avro.use_input_format(fmt, WriterSchemas({}, client=registry))
    docs = [orjson.loads(m.value) for m in itertools.islice(messages("iot"), count)]
    parsed = fastavro.parse_schema(reader)
    values = []
    for doc in docs:
        if fmt == "protobuf":
            message = as_json.protobuf_message(doc)
            values.append(frame(2, index_path(message.DESCRIPTOR) + message.SerializeToString()))
            continue
        out = io.BytesIO()
        fastavro.schemaless_writer(out, parsed, doc)
        values.append(frame(1, out.getvalue()))
    return as_avro, as_json, docs, values


def records(values: list[bytes]) -> list[Record]:
    return [Record(TP, i, None, v, (), 0, 0.0, 1) for i, v in enumerate(values)]


@pytest.mark.parametrize("fmt", ["avro", "protobuf"])
def test_every_recorded_window_is_read_straight_and_equals_the_json_row(fmt: str) -> None:
    as_avro, as_json, docs, values = setup(fmt, 400)
    windows = as_avro.straight_windows
    assert windows is not None
    assert all(windows.read(split(v)[1]) is not None for v in values)  # the fast way, each
    rows_avro = np.zeros((400, 32, 4), np.float32)
    rows_json = np.ones((400, 32, 4), np.float32)
    assert as_avro.decode_many(records(values), rows_avro) == {}
    assert as_json.decode_many(records([orjson.dumps(d) for d in docs]), rows_json) == {}
    np.testing.assert_array_equal(rows_avro, rows_json)


@pytest.mark.parametrize("fmt", ["avro", "protobuf"])
def test_the_straight_read_never_accepts_what_the_general_way_refuses(fmt: str) -> None:
    as_avro, _, _, values = setup(fmt, 40)
    windows = as_avro.straight_windows
    assert windows is not None
    general = windows.general
    rng = random.Random(25)
    accepted = 0
    for _ in range(3000):
        value = bytearray(rng.choice(values))
        kind = rng.randrange(4)
        position = rng.randrange(5, len(value))
        if kind == 0:
            value[position] = rng.randrange(256)
        elif kind == 1:
            del value[position:]
        elif kind == 2:
            value[position:position] = bytes([rng.randrange(256)])
        else:
            value[position : position + 8] = rng.randbytes(8)
        straight = windows.read(split(bytes(value))[1])
        if straight is None:
            continue
        try:
            expected = np.asarray(_window(general.decode(bytes(value))), dtype=np.float64)
        except DecodeError as exc:
            raise AssertionError(f"read straight, refused by the general way: {exc}") from exc
        np.testing.assert_array_equal(straight, expected)
        accepted += 1
    assert accepted > 100  # mutated doubles stay valid values: the comparison ran
