"""The input formats of a workload whose messages are msgspec Structs (trades, iot): JSON by
default, Avro from a Schema Registry when ``pipelines[].format`` says so.

:class:`StructFormats` gives such a workload two attributes its codec reads: ``messages`` (an
object with ``decode_records``, as :class:`~streamproc.workloads.codecs.StrictJsonDecoder`) and
``read_head`` (bytes -> the Struct of the fields a result echoes). The workload's class names
its JSON decoders and its Avro reader schema (an ``.avsc`` file shipped with the package).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

import msgspec
import orjson

from streamproc.errors import ConfigError, RecordError
from streamproc.records import Record
from streamproc.schemas.avro import AvroDecoder
from streamproc.schemas.writers import WriterSchemas
from streamproc.workloads.codecs import RESULT_ENCODER

INPUT_FORMATS = ("json", "avro")
"""``pipelines[].format``: the value formats streamproc reads."""


class MessageDecoder(Protocol):
    """Record values -> message Structs (JSON: StrictJsonDecoder; Avro: AvroDecoder)."""

    def decode_records(
        self, records: Sequence[Record]
    ) -> tuple[list[int], list[Any], dict[int, RecordError]]:
        """The indexes that decoded, their messages, and per refused index its error."""
        ...


@functools.cache
def avro_schema(path: Path) -> dict[str, Any]:
    """The Avro schema in ``path`` (an ``.avsc`` file), parsed once."""
    schema: dict[str, Any] = orjson.loads(path.read_bytes())
    return schema


class StructFormats:
    """Mixin of a workload that decodes its messages into msgspec Structs.

    Class attributes: ``json_messages`` (a :class:`StrictJsonDecoder`), ``json_head`` (a
    msgspec JSON decoder of the head Struct), ``head_schema`` (the head Struct) and
    ``avro_reader`` (the path of the reader schema, ``.avsc``).
    """

    json_messages: ClassVar[Any]
    json_head: ClassVar[msgspec.json.Decoder[Any]]
    head_schema: ClassVar[type[msgspec.Struct]]
    avro_reader: ClassVar[Path]
    avro_result: ClassVar[Path]
    input_formats: ClassVar[tuple[str, ...]] = INPUT_FORMATS

    messages: MessageDecoder
    read_head: Callable[[bytes], Any]
    encode_result: Callable[[Any], bytes]
    input_format: str = "json"

    def __init__(self) -> None:
        super().__init__()
        self.messages = self.json_messages
        self.read_head = self.json_head.decode
        self.encode_result = RESULT_ENCODER.encode

    def result_schema(self) -> dict[str, Any]:
        """The Avro schema of the results (``avro_result``)."""
        return avro_schema(self.avro_result)

    def use_output_format(self, name: str, serializer: Callable[[Any], bytes] | None) -> None:
        """Write results as JSON (``serializer`` None) or with ``serializer`` (Avro: an
        :class:`~streamproc.schemas.results.AvroResults` of :meth:`result_schema`).

        Raises:
            ConfigError: an unknown format, or ``avro`` without a serialiser.
        """
        if name == "json":
            self.encode_result = RESULT_ENCODER.encode
        elif name == "avro" and serializer is not None:
            self.encode_result = serializer
        else:
            raise ConfigError(
                f"pipelines.output_format: {name!r} is not one of {list(self.input_formats)}"
            )

    def use_input_format(self, name: str, writers: WriterSchemas | None) -> None:
        """Read messages in format ``name`` (``json`` or ``avro``); ``writers`` is the
        pipeline's registry (required for ``avro``).

        Raises:
            ConfigError: an unknown format, or ``avro`` without a registry.
        """
        if name == "json":
            self.messages, self.read_head = self.json_messages, self.json_head.decode
        elif name == "avro":
            if writers is None:
                raise ConfigError("pipelines.format: avro needs schema_registry.url")
            decoder = AvroDecoder(self.json_messages.schema, avro_schema(self.avro_reader), writers)
            head = self.head_schema

            def read_head(value: bytes) -> Any:
                return msgspec.convert(decoder.fields(value), head, strict=True)

            self.messages, self.read_head = decoder, read_head
        else:
            raise ConfigError(
                f"pipelines.format: {name!r} is not one of {list(self.input_formats)}"
            )
        self.input_format = name
