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

from streamproc.errors import DecodeError, RecordError, RegistryUnavailable
from streamproc.records import Record
from streamproc.schemas.wire import decode_each, split
from streamproc.schemas.writers import UnknownSchema, WriterSchemas

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
            raw = orjson.loads(registered.schema_str or "")
            danger = unsafe(raw)
            if danger:
                return _Plan(None, None, f"schema: writer schema {schema_id} {danger}")
            named: dict[str, Any] = {}  # the types its schema references define
            for reference in registered.references or []:
                if reference.subject is None or reference.version is None:
                    return _Plan(
                        None, None, f"schema: writer schema {schema_id} has an empty reference"
                    )
                text = self.writers.reference(reference.subject, reference.version)
                fastavro.parse_schema(without_logical_types(orjson.loads(text)), named)
            writer = fastavro.parse_schema(without_logical_types(raw), named)
        except (UnknownSchema, RegistryUnavailable):
            raise
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


def without_logical_types(schema: Any) -> Any:
    """``schema`` with every ``logicalType`` left out: the reader schemas name plain types
    (``ts_ms`` is a ``long``), so a writer's ``timestamp-millis`` must read as its long, not as
    the ``datetime`` fastavro would make of it."""
    if isinstance(schema, dict):
        return {k: without_logical_types(v) for k, v in schema.items() if k != "logicalType"}
    if isinstance(schema, list):
        return [without_logical_types(item) for item in schema]
    return schema


def unsafe(schema: Any) -> str | None:
    """Why a writer schema must not be read, or None: a recursive named type (a deep value
    overflows fastavro's compiled reader: the process dies) or an array or map of items that
    take no bytes (a 48-byte value then holds 2**62 items: the reader spins). Neither is
    needed by any workload's reader schema."""
    defined: dict[str, Any] = {}

    def named(node: dict[str, Any]) -> list[str]:
        name = str(node.get("name", ""))
        namespace = node.get("namespace")
        return [name, f"{namespace}.{name}"] if namespace else [name]

    def walk(node: Any, path: frozenset[str]) -> str | None:
        if isinstance(node, str):
            return f"is recursive (type {node} holds itself)" if node in path else None
        if isinstance(node, list):
            return next((r for r in (walk(branch, path) for branch in node) if r), None)
        if not isinstance(node, dict):
            return None
        kind = node.get("type")
        if kind in ("record", "error", "enum", "fixed"):
            names = named(node)
            for name in names:
                defined[name] = node
            if kind in ("record", "error"):
                inner = path | frozenset(names)
                fields = node.get("fields", [])
                return next((r for r in (walk(f.get("type"), inner) for f in fields) if r), None)
            return None
        if kind in ("array", "map"):
            items = node.get("items" if kind == "array" else "values")
            if _takes_no_bytes(items, defined, frozenset()):
                return f"has an {kind} of items that take no bytes"
            return walk(items, path)
        return walk(kind, path) if isinstance(kind, (dict, list)) else None

    return walk(schema, frozenset())


def _takes_no_bytes(node: Any, defined: dict[str, Any], seen: frozenset[str]) -> bool:
    if node == "null":
        return True
    if isinstance(node, str):
        if node in seen or node not in defined:
            return False
        return _takes_no_bytes(defined[node], defined, seen | {node})
    if isinstance(node, dict):
        kind = node.get("type")
        if kind in ("record", "error"):
            return all(
                _takes_no_bytes(f.get("type"), defined, seen) for f in node.get("fields", [])
            )
        if kind == "fixed":
            return int(node.get("size", 1)) == 0
        return (
            _takes_no_bytes(kind, defined, seen)
            if isinstance(kind, str) and kind not in ("array", "map", "enum")
            else False
        )
    return False  # a union: its branch index takes a byte
