"""Protobuf values from a Schema Registry into a workload's message Structs, and results out.

Confluent's Protobuf framing: after the 5-byte header, the message's index path in its schema
file (a zigzag varint count, then that many zigzag varints; a single ``0`` byte means the first
message), then the message. Protobuf needs no writer schema to read a message (fields travel by
number: a field the reader does not know is skipped, one the writer lacks reads as its default),
so the writer schema is only checked to exist and to be Protobuf; the message is parsed by the
workload's generated class and converted, per descriptor, into the plain values its msgspec
Struct validates (the same Struct, and the same reasons, as JSON and Avro).

Dead-letter reasons (the record's fault)::

    not in the schema registry wire format: ...
    schema: unknown schema id N (the registry has none)
    schema: schema id N is AVRO, not Protobuf
    malformed Protobuf: ...                     a bad index path or message
    schema: ...                                 a field out of range (msgspec's message)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import msgspec
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError as ProtobufDecodeError
from google.protobuf.message import Message

from streamproc.errors import DecodeError, RecordError
from streamproc.records import Record
from streamproc.schemas.wire import decode_each, frame, read_zigzag, split, zigzag
from streamproc.schemas.writers import WriterSchemas

S = TypeVar("S", bound=msgspec.Struct)

PROTOBUF = "PROTOBUF"
MAX_INDEXES = 64


def read_indexes(payload: memoryview) -> tuple[list[int], int]:
    """The message index path at the start of ``payload`` and the offset of the message.

    Raises:
        DecodeError: truncated or implausible varints (``malformed Protobuf: ...``).
    """
    try:
        count, position = read_zigzag(payload, 0)
        if count == 0:
            return [0], position
        if not 0 < count <= MAX_INDEXES:
            raise DecodeError(f"malformed Protobuf: message index path of length {count}")
        indexes = []
        for _ in range(count):
            index, position = read_zigzag(payload, position)
            indexes.append(index)
    except (IndexError, ValueError) as exc:
        raise DecodeError("malformed Protobuf: truncated message index path") from exc
    return indexes, position


def index_path(descriptor: Any) -> bytes:
    """The framed index path of ``descriptor`` (a message class's ``DESCRIPTOR``; a top-level
    message of its file): ``0`` for the first message, else the count 1 and its index."""
    index = list(descriptor.file.message_types_by_name).index(descriptor.name)
    return b"\x00" if index == 0 else zigzag(1) + zigzag(index)


def field_converter(descriptor: Any) -> Callable[[Message], dict[str, Any]]:
    """A converter, compiled once per message type (``descriptor``: its ``DESCRIPTOR``), of a
    message into plain values: scalars
    as they are, repeated fields as lists, messages as dicts, unset optional fields as None."""
    steps: list[tuple[str, Callable[[Any], Any] | None, bool, bool]] = []
    for field in descriptor.fields:
        nested = (
            field_converter(field.message_type)
            if field.type == FieldDescriptor.TYPE_MESSAGE
            else None
        )
        repeated = field.is_repeated
        optional = field.has_presence and field.type != FieldDescriptor.TYPE_MESSAGE
        steps.append((field.name, nested, repeated, optional))

    def convert(message: Message) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, nested, repeated, optional in steps:
            value = getattr(message, name)
            if repeated:
                out[name] = [nested(v) for v in value] if nested else list(value)
            elif nested is not None:
                out[name] = nested(value) if message.HasField(name) else None
            elif optional and not message.HasField(name):
                out[name] = None
            else:
                out[name] = value
        return out

    return convert


class ProtobufDecoder(Generic[S]):
    """Decode framed Protobuf values into ``schema`` instances (thread-safe).

    Args:
        schema: the msgspec Struct the workload's JSON path decodes into.
        message_class: the generated class of the workload's input message.
        writers: the writer schemas by id (the pipeline's registry).
        to_fields: message -> the plain values ``schema`` validates (default: one dict per
            message, by field name, see :func:`field_converter`).
    """

    def __init__(
        self,
        schema: type[S],
        message_class: type[Message],
        writers: WriterSchemas,
        to_fields: Callable[[Message], Any] | None = None,
    ) -> None:
        self.schema = schema
        self.message_class = message_class
        self.writers = writers
        self.to_fields = to_fields or field_converter(message_class.DESCRIPTOR)
        self._refusals: dict[int, str | None] = {}
        self._lock = threading.Lock()

    def refusal(self, schema_id: int) -> str | None:
        """Why values of ``schema_id`` cannot be read (not Protobuf), or None (looked up once).

        Raises:
            UnknownSchema, RegistryUnavailable: as the registry lookup.
        """
        if schema_id in self._refusals:
            return self._refusals[schema_id]
        with self._lock:
            if schema_id not in self._refusals:
                kind = self.writers.get(schema_id).schema_type or "AVRO"
                refusal = (
                    None
                    if kind == PROTOBUF
                    else f"schema: schema id {schema_id} is {kind}, not Protobuf"
                )
                self._refusals[schema_id] = refusal
        return self._refusals[schema_id]

    def message(self, value: bytes | None) -> Message:
        """The parsed message of a framed value.

        Raises:
            DecodeError: one of the reasons in the module docstring.
            RegistryUnavailable: the registry did not answer before it was closed.
        """
        schema_id, payload = split(value)
        refusal = self.refusal(schema_id)
        if refusal:
            raise DecodeError(refusal)
        _, start = read_indexes(payload)
        try:
            return self.message_class.FromString(payload[start:])  # type: ignore[arg-type]  # upb parses any buffer: no copy
        except ProtobufDecodeError as exc:
            raise DecodeError(f"malformed Protobuf: {exc}") from exc

    def fields(self, value: bytes | None) -> Any:
        """The plain values of a framed value's message (before validation)."""
        return self.to_fields(self.message(value))

    def decode(self, value: bytes | None) -> S:
        """The ``schema`` instance a framed Protobuf value holds.

        Raises:
            DecodeError, RegistryUnavailable: as :meth:`message`; ``schema: ...`` for a
                field out of range.
        """
        try:
            return msgspec.convert(self.fields(value), self.schema, strict=True)
        except msgspec.ValidationError as exc:
            raise DecodeError(f"schema: {exc}") from exc

    def decode_records(
        self, records: Sequence[Record]
    ) -> tuple[list[int], list[S], dict[int, RecordError]]:
        """:meth:`decode` of every record (the same answer as the JSON decoder's:
        :func:`~streamproc.schemas.wire.decode_each`)."""
        return decode_each(records, self.decode)


class ProtobufResults:
    """Result Structs -> framed Protobuf values of ``message_class`` (no registry call per
    result; thread-safe).

    Args:
        message_class: the generated class of the result message (a top-level message of its
            file); its fields match the Struct's by name.
        schema_id: the registered id of its schema file (:func:`result_schema_id`).

    The Struct's plain values are the message's keyword arguments: nested dicts fill nested
    messages, a None leaves its field unset.
    """

    def __init__(self, message_class: type[Message], schema_id: int) -> None:
        self.schema_id = schema_id
        self.message_class = message_class
        self._header = frame(schema_id, index_path(message_class.DESCRIPTOR))

    def __call__(self, result: msgspec.Struct) -> bytes:
        values = {k: v for k, v in msgspec.to_builtins(result).items() if v is not None}
        return self._header + self.message_class(**values).SerializeToString()
