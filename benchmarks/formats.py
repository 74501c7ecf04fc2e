"""Decode CPU cost per message of the value formats (issue 25): JSON, Avro, Protobuf and JSON
Schema on the same real trades and iot messages, and the usual way to read registry formats (the
stock confluent-kafka deserialiser, one dict per message, then the same validation) beside ours.

    .venv/bin/python benchmarks/formats.py [--repeats 7] [--batches 10]
    .venv/bin/python benchmarks/formats.py --smoke     # one batch, one repetition (seconds)

For each workload, ``--batches`` batches of 256 real messages from its ``replay_messages()``,
each written in every format (Avro and Protobuf framed with a schema id as the stock
serialisers write them; no Kafka, and no registry server: the writer schemas come from
confluent-kafka's in-process ``mock://`` client, cached after the first batch as in
production). Measured:
``decode_many`` into a (256, *item_shape) float32 slab, the whole path a decode thread runs
(framing, writer schema lookup, parse, validation with the workload's msgspec Struct, features).
Contenders alternate within each repetition; the cost is thread CPU time
(``time.thread_time_ns``) per message in microseconds; printed: median and range over the
repetitions, and each one's ratio to JSON. Numbers: docs/benchmarks.md, "Value formats".

Contenders:

* ``json``: msgspec's typed JSON decoder (the default format).
* ``avro``: ours, a plan per writer schema id (fastavro's compiled reader resolving the writer
  schema against the workload's reader schema, projected on its fields) + ``msgspec.convert``.
* ``avro-stock``: confluent-kafka's ``AvroDeserializer`` (a dict per message) + the same
  ``msgspec.convert``: what a consumer written against the stock client does.
* ``jsonschema``: JSON framed with a schema id: the id checked, then the same msgspec decoder as
  ``json``.
* ``protobuf``: ours, the generated class parses, a converter compiled per descriptor gives the
  values + ``msgspec.convert``.
* ``protobuf-stock``: confluent-kafka's ``ProtobufDeserializer`` + ``MessageToDict`` (the stock
  way to a dict; it writes int64 fields as strings, so ``msgspec.convert`` runs lax there) +
  the same Struct (iot: its own message-to-values function, as ours).
"""

from __future__ import annotations

import argparse
import io
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import fastavro
import msgspec
import numpy as np
import orjson
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf.json_format import MessageToDict

from streamproc.errors import DecodeError, RecordError
from streamproc.records import Record, TopicPartition
from streamproc.schemas.protobuf import index_path
from streamproc.schemas.results import protobuf_schema
from streamproc.schemas.wire import frame
from streamproc.schemas.writers import WriterSchemas
from streamproc.workloads import iot, trades
from streamproc.workloads.formats import StructFormats, avro_schema

ROWS = 256
TP = TopicPartition("formats", 0)


def registry(workload_class: type[Any], url: str) -> tuple[Any, int, int, int]:
    """confluent-kafka's in-process registry client (``mock://``: no server; the cost
    measured is the decode path's, writer schemas cached as in production) holding the
    workload's Avro and Protobuf input schemas; returns it and their ids."""
    client = SchemaRegistryClient.new_client({"url": url})
    avro_text = orjson.dumps(avro_schema(workload_class.avro_reader)).decode()
    avro_id = client.register_schema("formats-avro", Schema(avro_text, "AVRO"))
    protobuf_id = client.register_schema(
        "formats-protobuf", protobuf_schema(workload_class.protobuf_input)
    )
    json_text = orjson.dumps(workload_class().input_json_schema()).decode()
    json_id = client.register_schema("formats-jsonschema", Schema(json_text, "JSON"))
    return client, avro_id, protobuf_id, json_id


class StockDecoder:
    """The stock way to a message Struct: a confluent-kafka deserialiser gives a dict (Avro)
    or a message turned into one by ``MessageToDict`` (Protobuf), then ``msgspec.convert``
    validates it into the workload's Struct, as ours does."""

    def __init__(
        self, schema: type[msgspec.Struct], to_dict: Callable[[bytes], Any], strict: bool = True
    ) -> None:
        self.schema = schema
        self.to_dict = to_dict
        self.strict = strict

    def decode_records(
        self, records: Sequence[Record]
    ) -> tuple[list[int], list[Any], dict[int, RecordError]]:
        indexes: list[int] = []
        messages: list[Any] = []
        failed: dict[int, RecordError] = {}
        for index, record in enumerate(records):
            try:
                fields = self.to_dict(record.value or b"")
                messages.append(msgspec.convert(fields, self.schema, strict=self.strict))
            except Exception as exc:
                failed[index] = DecodeError(str(exc))
                continue
            indexes.append(index)
        return indexes, messages, failed


def encoded(
    workload: StructFormats, name: str, batches: int, ids: tuple[int, int, int]
) -> dict[str, list[list[Record]]]:
    """``batches`` batches of real messages of ``name`` in each format (as records)."""
    from streamproc.tools.replay import messages

    avro_id, protobuf_id, json_id = ids
    parsed = fastavro.parse_schema(avro_schema(workload.avro_reader))
    documents = [orjson.loads(m.value) for m in itertools.islice(messages(name), ROWS * batches)]

    def avro(doc: dict[str, Any]) -> bytes:
        out = io.BytesIO()
        fastavro.schemaless_writer(out, parsed, doc)
        return frame(avro_id, out.getvalue())

    def protobuf(doc: dict[str, Any]) -> bytes:
        message = workload.protobuf_message(doc)
        return frame(protobuf_id, index_path(message.DESCRIPTOR) + message.SerializeToString())

    writers: dict[str, Callable[[dict[str, Any]], bytes]] = {
        "json": orjson.dumps,
        "avro": avro,
        "protobuf": protobuf,
        "jsonschema": lambda doc: frame(json_id, orjson.dumps(doc)),
    }
    out: dict[str, list[list[Record]]] = {}
    for fmt, write in writers.items():
        values = [write(doc) for doc in documents]
        records = [
            Record(TP, offset, None, value, (), 0, 0.0, 1) for offset, value in enumerate(values)
        ]
        out[fmt] = [records[i : i + ROWS] for i in range(0, len(records), ROWS)]
    return out


def contenders(workload_class: type[Any], client: Any) -> dict[str, tuple[Any, str]]:
    """Per contender: a workload reading that way, and the format of its records."""
    avro_text = orjson.dumps(avro_schema(workload_class.avro_reader)).decode()
    writers = WriterSchemas({}, client=client)
    made: dict[str, tuple[Any, str]] = {}
    for fmt in ("json", "avro", "protobuf", "jsonschema"):
        workload = workload_class()
        workload.use_input_format(fmt, writers)
        made[fmt] = (workload, fmt)
    context = SerializationContext("formats", MessageField.VALUE)
    schema = workload_class.json_messages.schema
    stock_avro = AvroDeserializer(client, avro_text)
    stock_protobuf = ProtobufDeserializer(
        workload_class.protobuf_input, {"use.deprecated.format": False}
    )
    as_json_fields = workload_class().protobuf_fields

    def protobuf_dict(value: bytes) -> Any:
        message = stock_protobuf(value, context)
        custom = as_json_fields(message)  # iot's window: lists per sample, as JSON
        if custom is not None:
            return custom
        return MessageToDict(
            message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )

    for fmt, to_dict, strict in (
        ("avro", lambda value: stock_avro(value, context), True),
        ("protobuf", protobuf_dict, False),  # MessageToDict writes int64 as strings
    ):
        workload = workload_class()
        workload.messages = StockDecoder(schema, to_dict, strict)
        made[f"{fmt}-stock"] = (workload, fmt)
    return made


def decoding(workload: Any, batches: list[list[Record]], slab: np.ndarray) -> Callable[[], object]:
    """A run: ``workload.decode_many`` of every batch into ``slab``; every message must decode."""

    def decode_all() -> object:
        for records in batches:
            failed = workload.decode_many(records, slab[: len(records)])
            assert not failed, next(iter(failed.values()))
        return None

    return decode_all


def measure(
    runs: dict[str, Callable[[], object]], messages: int, repeats: int
) -> dict[str, list[float]]:
    """CPU us per message of each run, alternating, after one warm-up each."""
    for run in runs.values():
        run()
    costs: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(repeats):
        for label, run in runs.items():
            start = time.thread_time_ns()
            run()
            costs[label].append((time.thread_time_ns() - start) / 1000 / messages)
    return costs


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batches", type=int, default=10, help="batches of 256 messages")
    parser.add_argument("--smoke", action="store_true", help="1 batch, 1 repetition: a check")
    args = parser.parse_args(argv)
    if args.smoke:
        args.repeats, args.batches = 1, 1
    print(
        f"decode_many CPU us per message (thread_time_ns), {args.batches} batches x {ROWS} real "
        f"messages, {args.repeats} repetitions alternating: median [min - max], ratio to json"
    )
    medians: dict[str, dict[str, float]] = {}
    for name, workload_class in (("trades", trades.TradesWorkload), ("iot", iot.IotWorkload)):
        client, *ids = registry(workload_class, f"mock://formats-{name}")
        data = encoded(workload_class(), name, args.batches, (ids[0], ids[1], ids[2]))
        slab = np.zeros((ROWS, *workload_class.item_shape), dtype=workload_class.item_dtype)

        made = contenders(workload_class, client)
        runs = {label: decoding(w, data[fmt], slab) for label, (w, fmt) in made.items()}
        costs = measure(runs, ROWS * args.batches, args.repeats)
        medians[name] = {label: statistics.median(c) for label, c in costs.items()}
        for label, c in costs.items():
            ratio = medians[name][label] / medians[name]["json"]
            print(
                f"{name:6s} {label:15s} {medians[name][label]:6.2f} "
                f"[{min(c):6.2f} - {max(c):6.2f}]  {ratio:4.2f}x json"
            )
    return medians


if __name__ == "__main__":
    main()
