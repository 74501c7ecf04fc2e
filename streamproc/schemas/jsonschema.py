"""JSON Schema values from a Schema Registry: JSON framed with a schema id.

The payload is the same JSON the plain format carries, so it is decoded by the workload's own
msgspec decoder (the same strict checks and reasons as plain JSON); the writer id is only
checked to exist and to be a JSON Schema. JSON needs no writer schema to read (fields travel by
name; a field the workload does not name is ignored, as in plain JSON). Results are the JSON
results, framed with the id of the result schema registered at start-up (the workload's result
Struct described by ``msgspec.json.schema``), so the stock ``JSONDeserializer`` reads and
validates them.

Dead-letter reasons (the record's fault)::

    not in the schema registry wire format: ...
    schema: unknown schema id N (the registry has none)
    schema: schema id N is AVRO, not JSON Schema
    malformed JSON: ...    schema: ...            as plain JSON
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import msgspec
import orjson

from streamproc.errors import DecodeError, RecordError
from streamproc.records import Record
from streamproc.schemas.wire import decode_each, frame, split
from streamproc.schemas.writers import WriterSchemas

S = TypeVar("S", bound=msgspec.Struct)

JSON = "JSON"


def json_schema(struct: type[msgspec.Struct], title: str) -> dict[str, Any]:
    """The JSON Schema of ``struct`` (``msgspec.json.schema``, draft 2020-12), titled ``title``
    (the record name the ``record`` subject strategy uses)."""
    schema: dict[str, Any] = msgspec.json.schema(struct)
    # "$schema" names the draft (msgspec writes 2020-12); registries detect the type by it
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": title, **schema}


class JsonSchemaDecoder(Generic[S]):
    """Decode framed JSON values with the workload's JSON decoder (thread-safe).

    Args:
        messages: the workload's JSON message decoder (``StrictJsonDecoder``: ``decode`` and
            ``schema``).
        head: the decoder of the fields a result echoes (``msgspec.json.Decoder``).
        writers: the writer schemas by id (the pipeline's registry).
    """

    def __init__(self, messages: Any, head: msgspec.json.Decoder[Any], writers: WriterSchemas):
        self.schema = messages.schema
        self._messages = messages
        self._head = head
        self.writers = writers
        self._refusals: dict[int, str | None] = {}
        self._lock = threading.Lock()

    def _payload(self, value: bytes | None) -> memoryview:
        schema_id, payload = split(value)
        if schema_id not in self._refusals:
            with self._lock:
                if schema_id not in self._refusals:
                    kind = self.writers.get(schema_id).schema_type or "AVRO"
                    self._refusals[schema_id] = (
                        None
                        if kind == JSON
                        else f"schema: schema id {schema_id} is {kind}, not JSON Schema"
                    )
        refusal = self._refusals[schema_id]
        if refusal:
            raise DecodeError(refusal)
        return payload

    def decode(self, value: bytes | None) -> S:
        """The message a framed JSON value holds.

        Raises:
            DecodeError: one of the reasons in the module docstring.
            RegistryUnavailable: the registry did not answer before it was closed.
        """
        message: S = self._messages.decode(self._payload(value))
        return message

    def fields(self, value: bytes | None) -> Any:
        """The fields a result echoes (the head Struct), read from a framed value."""
        return self._head.decode(self._payload(value))

    def decode_records(
        self, records: Sequence[Record]
    ) -> tuple[list[int], list[S], dict[int, RecordError]]:
        """:meth:`decode` of every record (the same answer as the JSON decoder's:
        :func:`~streamproc.schemas.wire.decode_each`)."""
        return decode_each(records, self.decode)


class JsonSchemaResults:
    """Result Structs -> framed JSON values (no registry call per result; thread-safe)."""

    def __init__(self, schema_id: int, encode: Callable[[msgspec.Struct], bytes]) -> None:
        self.schema_id = schema_id
        self._header = frame(schema_id, b"")
        self._encode = encode

    def __call__(self, result: msgspec.Struct) -> bytes:
        return self._header + self._encode(result)


def schema_text(schema: dict[str, Any]) -> str:
    """``schema`` as the registry stores it."""
    return orjson.dumps(schema).decode()
