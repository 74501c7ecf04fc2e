"""Values in a schema-managed format, written with confluent-kafka's stock serialisers (what a
producer of the user's would use): ``streamproc produce --format avro`` and the tests."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

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
        having = [
            name
            for name, builtin in BUILTIN_WORKLOADS.items()
            if getattr(builtin.load_class(), "avro_reader", None) is not None
        ]
        raise ValueError(f"--format avro: workload {workload!r} has no Avro schema; {having} do")
    return path


class AvroValues:
    """Converts JSON message values into framed Avro values of ``schema`` (registered under
    ``<topic>-value`` on first use when ``auto_register``); :meth:`close` (or ``with``) closes
    the registry client's HTTP session.

    Raises (from a call):
        SerializationError: a value does not match the schema, or the registry refused the
            schema (e.g. HTTP 409: incompatible with the subject's latest version).
    """

    def __init__(
        self, topic: str, schema: str, registry: Mapping[str, Any], auto_register: bool = True
    ) -> None:
        self._client = SchemaRegistryClient({"timeout": 10, **registry})
        self._serializer = AvroSerializer(
            self._client, schema, conf={"auto.register.schemas": auto_register}
        )
        self._context = SerializationContext(topic, MessageField.VALUE)

    def __call__(self, value: bytes) -> bytes:
        framed: bytes = self._serializer(orjson.loads(value), self._context)
        return framed

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> AvroValues:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ProtobufValues:
    """Converts JSON message values of a built-in workload into framed Protobuf values of its
    input message (confluent-kafka's stock ``ProtobufSerializer``; the schema file registered
    under ``<topic>-value`` on first use); :meth:`close` closes the registry client."""

    def __init__(self, topic: str, workload: str, registry: Mapping[str, Any]) -> None:
        from confluent_kafka.schema_registry.protobuf import ProtobufSerializer

        instance: Any = BUILTIN_WORKLOADS[workload].load_class()()
        if not hasattr(instance, "protobuf_message"):
            raise ValueError(
                f"--format protobuf: workload {workload!r} has no Protobuf schema; "
                f"{[n for n in BUILTIN_WORKLOADS if n != 'video']} do"
            )
        self._to_message = instance.protobuf_message
        self._client = SchemaRegistryClient({"timeout": 10, **registry})
        self._serializer = ProtobufSerializer(
            type(instance).protobuf_input, self._client, {"use.deprecated.format": False}
        )
        self._context = SerializationContext(topic, MessageField.VALUE)

    def __call__(self, value: bytes) -> bytes:
        framed: bytes = self._serializer(self._to_message(orjson.loads(value)), self._context)
        return framed

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> ProtobufValues:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class JsonSchemaValues:
    """Converts JSON message values of a built-in workload into framed JSON values validated
    against its input JSON Schema (confluent-kafka's stock ``JSONSerializer``; the schema
    registered under ``<topic>-value`` on first use); :meth:`close` closes the registry
    client."""

    def __init__(self, topic: str, workload: str, registry: Mapping[str, Any]) -> None:
        from confluent_kafka.schema_registry.json_schema import JSONSerializer

        instance: Any = BUILTIN_WORKLOADS[workload].load_class()()
        if not hasattr(instance, "input_json_schema"):
            raise ValueError(
                f"--format jsonschema: workload {workload!r} has no JSON Schema; "
                f"{[n for n in BUILTIN_WORKLOADS if n != 'video']} do"
            )
        self._client = SchemaRegistryClient({"timeout": 10, **registry})
        schema = orjson.dumps(instance.input_json_schema()).decode()
        self._serializer = JSONSerializer(schema, self._client)
        self._context = SerializationContext(topic, MessageField.VALUE)

    def __call__(self, value: bytes) -> bytes:
        framed: bytes = self._serializer(orjson.loads(value), self._context)
        return framed

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> JsonSchemaValues:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
