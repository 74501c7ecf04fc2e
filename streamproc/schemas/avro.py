"""Avro values from a Schema Registry into a workload's message Structs.

One :class:`AvroDecoder` per pipeline holds the workload's reader schema and, per writer schema
id met on the topic, a decode plan compiled once: the writer schema parsed by fastavro, which
resolves it against the reader schema as it reads (Avro schema resolution: fields the reader does
not name are skipped, fields the writer lacks take the reader's default, promotions such as
int -> long -> double apply). A payload is read by fastavro's compiled reader projected onto the
reader's fields, then converted into the workload's msgspec Struct with the same constraints the
JSON path checks (``msgspec.convert``), so v1 and v2 records of one topic decode to the same
rows, and a value is refused for the same reasons in JSON and in Avro.

Dead-letter reasons (the record's fault)::

    not in the schema registry wire format: ...     no magic byte / shorter than the header
    schema: unknown schema id N (the registry has none)
    schema: writer schema N is incompatible with the reader schema: ...
    malformed Avro: ...                             the payload does not match its schema
    schema: ...                                     a field out of range (msgspec's message)
"""

from __future__ import annotations

import io
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar

import fastavro
import msgspec
import orjson
from fastavro.read import SchemaResolutionError

from streamproc.errors import DecodeError, RecordError
from streamproc.records import Record
from streamproc.schemas.wire import decode_each, split
from streamproc.schemas.writers import WriterSchemas

S = TypeVar("S", bound=msgspec.Struct)

AVRO = "AVRO"


class _Plan:
    """How to read payloads of one writer schema id: the parsed writer schema and the reader
    schema to resolve it against (None when they are the same schema: fastavro then reads
    without resolution, a fifth less CPU per trade), or why the id cannot be read."""

    __slots__ = ("reader", "refusal", "writer")

    def __init__(self, writer: Any, reader: Any, refusal: str | None) -> None:
        self.writer = writer
        self.reader = reader
        self.refusal = refusal


class AvroDecoder(Generic[S]):
    """Decode framed Avro values into ``schema`` instances (thread-safe: plans are built once
    per id under a lock and then only read).

    Args:
        schema: the msgspec Struct the workload's JSON path decodes into (its constraints
            validate every Avro value too).
        reader: the workload's reader schema (an Avro record schema as a dict); it names the
            fields the workload uses.
        writers: the writer schemas by id (the pipeline's registry).
    """

    def __init__(self, schema: type[S], reader: Mapping[str, Any], writers: WriterSchemas) -> None:
        self.schema = schema
        self.reader = fastavro.parse_schema(dict(reader))
        self.writers = writers
        self._plans: dict[int, _Plan] = {}
        self._lock = threading.Lock()

    def plan(self, schema_id: int) -> _Plan:
        """The decode plan of ``schema_id`` (built on first use).

        Raises:
            UnknownSchema: the registry has no such id.
            RegistryUnavailable: the registry did not answer before it was closed.
        """
        plan = self._plans.get(schema_id)
        if plan is not None:
            return plan
        with self._lock:
            plan = self._plans.get(schema_id)
            if plan is None:
                plan = self._compile(schema_id)
                self._plans[schema_id] = plan
        return plan

    def _compile(self, schema_id: int) -> _Plan:
        registered = self.writers.get(schema_id)
        if (registered.schema_type or AVRO) != AVRO:
            refusal = f"schema: schema id {schema_id} is {registered.schema_type}, not Avro"
            return _Plan(None, None, refusal)
        try:
            writer = fastavro.parse_schema(orjson.loads(registered.schema_str or ""))
        except Exception as exc:
            return _Plan(None, None, f"schema: writer schema {schema_id} does not parse: {exc}")
        return _Plan(writer, None if writer == self.reader else self.reader, None)

    def decode(self, value: bytes | None) -> S:
        """The ``schema`` instance a framed Avro value holds.

        Raises:
            DecodeError: one of the reasons in the module docstring.
            RegistryUnavailable: the registry did not answer before it was closed.
        """
        try:
            return msgspec.convert(self.fields(value), self.schema, strict=True)
        except msgspec.ValidationError as exc:
            raise DecodeError(f"schema: {exc}") from exc

    def fields(self, value: bytes | None) -> dict[str, Any]:
        """The reader-schema fields of a framed Avro value (one dict, before validation).

        Raises:
            DecodeError, RegistryUnavailable: as :meth:`decode`.
        """
        schema_id, payload = split(value)
        plan = self.plan(schema_id)
        if plan.refusal:
            raise DecodeError(plan.refusal)
        stream = io.BytesIO(payload)
        try:
            fields = fastavro.schemaless_reader(stream, plan.writer, plan.reader)
        except SchemaResolutionError as exc:
            raise DecodeError(
                f"schema: writer schema {schema_id} is incompatible with the reader schema: {exc}"
            ) from exc
        except Exception as exc:  # EOFError, UnicodeDecodeError, ValueError, IndexError
            raise DecodeError(f"malformed Avro: {type(exc).__name__}: {exc}") from exc
        if stream.tell() != len(payload):
            raise DecodeError(
                f"malformed Avro: {len(payload) - stream.tell()} bytes after the record"
            )
        if not isinstance(fields, dict):
            raise DecodeError(f"schema: writer schema {schema_id} is not a record schema")
        return fields

    def decode_records(
        self, records: Sequence[Record]
    ) -> tuple[list[int], list[S], dict[int, RecordError]]:
        """:meth:`decode` of every record (the same answer as the JSON decoder's:
        :func:`~streamproc.schemas.wire.decode_each`)."""
        return decode_each(records, self.decode)
