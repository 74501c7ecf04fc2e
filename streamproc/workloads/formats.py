"""The value formats of a workload whose messages are msgspec Structs (trades, iot): JSON by
default; Avro, Protobuf or JSON Schema through a Schema Registry when ``pipelines[].format`` and
``output_format`` say so.

:class:`StructFormats` gives such a workload three attributes its codec reads: ``messages`` (an
object with ``decode_records``, as :class:`~streamproc.workloads.codecs.StrictJsonDecoder`),
``read_head`` (value bytes -> the Struct of the fields a result echoes) and ``encode_result``
(result Struct -> value bytes). The workload's class names its JSON decoders, its Avro schemas
(``.avsc`` files shipped with the package) and its generated Protobuf classes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

import msgspec
import orjson
from google.protobuf.message import Message

from streamproc.errors import ConfigError, RecordError
from streamproc.records import Record
from streamproc.schemas.avro import AvroDecoder
from streamproc.schemas.jsonschema import JsonSchemaDecoder, json_schema
from streamproc.schemas.protobuf import ProtobufDecoder
from streamproc.schemas.writers import WriterSchemas
from streamproc.workloads.codecs import RESULT_ENCODER

FORMATS = ("json", "avro", "protobuf", "jsonschema")
"""``pipelines[].format`` and ``output_format``: the value formats streamproc reads and
writes."""


class MessageDecoder(Protocol):
    """Record values -> message Structs (StrictJsonDecoder, AvroDecoder, ProtobufDecoder)."""

    def decode_records(
        self, records: Sequence[Record]
    ) -> tuple[list[int], list[Any], dict[int, RecordError]]:
        """The indexes that decoded, their messages, and per refused index its error."""
        ...


class FieldDecoder(MessageDecoder, Protocol):
    """A registry-format decoder: also gives a value's plain fields before validation."""

    def fields(self, value: bytes | None) -> Any:
        """The plain field values a framed value holds."""
        ...


@functools.cache
def avro_schema(path: Path) -> dict[str, Any]:
    """The Avro schema in ``path`` (an ``.avsc`` file), parsed once."""
    schema: dict[str, Any] = orjson.loads(path.read_bytes())
    return schema


class StructFormats:
    """Mixin of a workload that decodes its messages into msgspec Structs.

    Class attributes: ``json_messages`` (a :class:`StrictJsonDecoder`), ``json_head`` (a
    msgspec JSON decoder of the head Struct), ``head_schema`` (the head Struct),
    ``avro_reader`` / ``avro_result`` (paths of the input and result ``.avsc`` schemas) and
    ``protobuf_input`` / ``protobuf_result`` (the generated message classes), ``result_struct``
    (the result Struct, whose ``msgspec.json.schema`` is the JSON Schema of the results) and
    ``schema_title`` (the namespace of its JSON Schemas' titles, e.g. ``io.streamproc.trades``).
    """

    json_messages: ClassVar[Any]
    json_head: ClassVar[msgspec.json.Decoder[Any]]
    head_schema: ClassVar[type[msgspec.Struct]]
    avro_reader: ClassVar[Path]
    avro_result: ClassVar[Path]
    protobuf_input: ClassVar[type[Message]]
    protobuf_result: ClassVar[type[Message]]
    result_struct: ClassVar[type[msgspec.Struct]]
    schema_title: ClassVar[str]
    input_formats: ClassVar[tuple[str, ...]] = FORMATS

    messages: MessageDecoder
    read_head: Callable[[bytes], Any]
    encode_result: Callable[[Any], bytes]
    input_format: str = "json"

    def __init__(self) -> None:
        super().__init__()
        self.messages = self.json_messages
        self.read_head = self.json_head.decode
        self.encode_result = RESULT_ENCODER.encode

    def protobuf_fields(self, message: Any) -> Any:
        """The plain values of a parsed input message (default: None, i.e. by field name:
        :func:`~streamproc.schemas.protobuf.field_converter`); a workload whose Protobuf
        shape differs from its JSON one overrides this."""
        return None

    def protobuf_message(self, document: dict[str, Any]) -> Message:
        """The input message of a JSON document (what ``streamproc produce --format protobuf``
        writes); default: the fields by name."""
        return self.protobuf_input(**document)

    def use_input_format(self, name: str, writers: WriterSchemas | None) -> None:
        """Read messages in format ``name`` (``json``, ``avro`` or ``protobuf``); ``writers``
        is the pipeline's registry (required for ``avro`` and ``protobuf``).

        Raises:
            ConfigError: an unknown format, or a registry format without a registry.
        """
        if name == "json":
            self.messages, self.read_head = self.json_messages, self.json_head.decode
            self.input_format = name
            return
        if name not in FORMATS:
            raise ConfigError(f"pipelines.format: {name!r} is not one of {list(FORMATS)}")
        if writers is None:
            raise ConfigError(f"pipelines.format: {name} needs schema_registry.url")
        schema = self.json_messages.schema
        if name == "jsonschema":
            framed: JsonSchemaDecoder[Any] = JsonSchemaDecoder(
                self.json_messages, self.json_head, writers
            )
            self.messages, self.read_head, self.input_format = framed, framed.fields, name
            return
        decoder: FieldDecoder
        if name == "avro":
            decoder = AvroDecoder(schema, avro_schema(self.avro_reader), writers)
        else:
            custom = type(self).protobuf_fields is not StructFormats.protobuf_fields
            to_fields = self.protobuf_fields if custom else None
            decoder = ProtobufDecoder(schema, self.protobuf_input, writers, to_fields)
        head = self.head_schema

        def read_head(value: bytes) -> Any:
            return msgspec.convert(decoder.fields(value), head, strict=True)

        self.messages, self.read_head, self.input_format = decoder, read_head, name

    def result_schema(self) -> dict[str, Any]:
        """The Avro schema of the results (``avro_result``)."""
        return avro_schema(self.avro_result)

    def json_result_encoder(self) -> Callable[[Any], bytes]:
        """The plain JSON serialiser of result Structs (what ``jsonschema`` results frame)."""
        return RESULT_ENCODER.encode

    def result_json_schema(self) -> dict[str, Any]:
        """The JSON Schema of the results (``result_struct``)."""
        return json_schema(self.result_struct, f"{self.schema_title}.{self.result_struct.__name__}")

    def input_json_schema(self) -> dict[str, Any]:
        """The JSON Schema of the input messages (what ``produce --format jsonschema``
        registers)."""
        struct = self.json_messages.schema
        return json_schema(struct, f"{self.schema_title}.{struct.__name__}")

    def result_message(self) -> type[Message]:
        """The generated Protobuf class of the results (``protobuf_result``)."""
        return self.protobuf_result

    def use_output_format(self, name: str, serializer: Callable[[Any], bytes] | None) -> None:
        """Write results as JSON (``serializer`` None) or with ``serializer`` (an
        :class:`~streamproc.schemas.results.AvroResults` of :meth:`result_schema`, or a
        :class:`~streamproc.schemas.protobuf.ProtobufResults` of :meth:`result_message`).

        Raises:
            ConfigError: an unknown format, or a registry format without a serialiser.
        """
        if name == "json":
            self.encode_result = RESULT_ENCODER.encode
        elif name in FORMATS and serializer is not None:
            self.encode_result = serializer
        else:
            raise ConfigError(f"pipelines.output_format: {name!r} is not one of {list(FORMATS)}")
