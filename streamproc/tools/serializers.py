"""Values in a schema-managed format, written with confluent-kafka's stock serialisers (what a
producer of the user's would use): ``streamproc produce --format avro|protobuf|jsonschema``, the
demo and the tests."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.serialization import MessageField, SerializationContext

from streamproc.records import Headers
from streamproc.workloads.registry import BUILTIN_WORKLOADS

VALUE_FORMATS = ("json", "avro", "protobuf", "jsonschema")
"""``streamproc produce --format``."""


def avro_schema_of(workload: str) -> Path:
    """The Avro schema (``.avsc``) of a built-in workload's messages.

    Raises:
        ValueError: the workload has none (names the workloads that have one).
    """
    path: Path | None = getattr(BUILTIN_WORKLOADS[workload].load_class(), "avro_reader", None)
    if path is None:
        raise ValueError(f"--format avro: workload {workload!r} has no Avro schema; {_having()} do")
    return path


Document = Callable[[bytes | None, bytes, Headers], dict[str, Any]]
"""A replay message (key, value, headers) -> the document its schema describes."""


def json_document(key: bytes | None, value: bytes, headers: Headers) -> dict[str, Any]:
    """The document of a JSON replay message: its value."""
    document: dict[str, Any] = orjson.loads(value)
    return document


def replay_document(workload: str) -> Document:
    """How a built-in workload's replay messages become documents (its ``replay_document``,
    else :func:`json_document`)."""
    found: Document | None = getattr(
        BUILTIN_WORKLOADS[workload].load_class(), "replay_document", None
    )
    return found or json_document


def _having() -> list[str]:
    """The built-in workloads with registry schemas."""
    return [
        name
        for name, builtin in BUILTIN_WORKLOADS.items()
        if getattr(builtin.load_class(), "avro_reader", None) is not None
    ]


def _schema_managed(workload: str, fmt: str) -> Any:
    """An instance of the built-in ``workload``, which must have registry schemas.

    Raises:
        ValueError: it has none (names those that have).
    """
    instance: Any = BUILTIN_WORKLOADS[workload].load_class()()
    if not hasattr(instance, "protobuf_message"):
        raise ValueError(
            f"--format {fmt}: workload {workload!r} has no {fmt} schema; {_having()} do"
        )
    return instance


class RegistryValues:
    """Converts JSON message values into framed values with a stock serialiser (registering the
    schema under ``<topic>-value`` on first use); :meth:`close` (or ``with``) closes the
    registry client's HTTP session.

    Raises (from a call):
        SerializationError: a value does not match the schema, or the registry refused the
            schema (e.g. HTTP 409: incompatible with the subject's latest version).
    """

    def __init__(
        self, topic: str, registry: Mapping[str, Any], document: Document | None = None
    ) -> None:
        self._client = SchemaRegistryClient({"timeout": 10, **registry})
        self._context = SerializationContext(topic, MessageField.VALUE)
        self._serialize: Callable[[Any, SerializationContext], bytes] | None = None
        self._to_message: Callable[[dict[str, Any]], Any] = lambda document: document
        self._document = document or json_document

    def __call__(self, value: bytes, key: bytes | None = None, headers: Headers = ()) -> bytes:
        """The framed value of one replay message (``key`` and ``headers`` feed workloads that
        carry metadata there, as video)."""
        assert self._serialize is not None
        message = self._to_message(self._document(key, value, headers))
        framed: bytes = self._serialize(message, self._context)
        return framed

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> RegistryValues:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AvroValues(RegistryValues):
    """JSON message values -> framed Avro values of ``schema`` (the stock ``AvroSerializer``;
    with ``auto_register`` off, the schema must be registered already)."""

    def __init__(
        self,
        topic: str,
        schema: str,
        registry: Mapping[str, Any],
        auto_register: bool = True,
        document: Document | None = None,
    ) -> None:
        from confluent_kafka.schema_registry.avro import AvroSerializer

        super().__init__(topic, registry, document)
        self._serialize = AvroSerializer(
            self._client, schema, conf={"auto.register.schemas": auto_register}
        )


class ProtobufValues(RegistryValues):
    """JSON message values of a built-in workload -> framed Protobuf values of its input
    message (the stock ``ProtobufSerializer``).

    Raises:
        ValueError: the workload has no Protobuf schema.
    """

    def __init__(self, topic: str, workload: str, registry: Mapping[str, Any]) -> None:
        from confluent_kafka.schema_registry.protobuf import ProtobufSerializer

        instance = _schema_managed(workload, "protobuf")
        super().__init__(topic, registry, replay_document(workload))
        self._to_message = instance.protobuf_message
        self._serialize = ProtobufSerializer(
            type(instance).protobuf_input, self._client, {"use.deprecated.format": False}
        )


class JsonSchemaValues(RegistryValues):
    """JSON message values of a built-in workload -> framed JSON values, validated against its
    input JSON Schema (the stock ``JSONSerializer``).

    Raises:
        ValueError: the workload has no JSON Schema.
    """

    def __init__(self, topic: str, workload: str, registry: Mapping[str, Any]) -> None:
        from confluent_kafka.schema_registry.json_schema import JSONSerializer

        instance = _schema_managed(workload, "jsonschema")
        if not hasattr(instance, "input_json_schema"):
            raise ValueError(f"--format jsonschema: workload {workload!r} has no JSON Schema")
        super().__init__(topic, registry)
        schema = orjson.dumps(instance.input_json_schema()).decode()
        self._serialize = JSONSerializer(schema, self._client)
