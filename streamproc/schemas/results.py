"""Results in Avro, framed with the id of a registered result schema, so consumers of the
output topic read them with the stock deserialisers.

The result schema's id is settled once, at start-up (:func:`result_schema_id`): registered under
the subject the naming strategy gives (auto-register on), or looked up there (off). A registry
that cannot be reached is retried until ``startup_timeout_s``; a schema the registry refuses
(HTTP 409: incompatible with the subject's latest version) or cannot find fails the start-up
naming the subject. Each result is then written without a registry call
(:class:`AvroResults`): the Struct the JSON path would serialise, as plain values, written by
fastavro.
"""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Callable, Mapping
from typing import Any

import fastavro
import msgspec
import orjson
from confluent_kafka.schema_registry import (
    Schema,
    SchemaRegistryClient,
    record_subject_name_strategy,
    topic_record_subject_name_strategy,
    topic_subject_name_strategy,
)
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf.message import Message

from streamproc.errors import ConfigError
from streamproc.logs import get_logger
from streamproc.schemas.jsonschema import JSON, JsonSchemaResults, schema_text
from streamproc.schemas.protobuf import ProtobufResults
from streamproc.schemas.wire import frame

log = get_logger(__name__)

SUBJECT_STRATEGIES = {
    "topic": topic_subject_name_strategy,
    "record": record_subject_name_strategy,
    "topic_record": topic_record_subject_name_strategy,
}
"""``schema_registry.subject_name_strategy``: ``<topic>-value``, ``<record full name>``, or
``<topic>-<record full name>`` (Confluent's three strategies)."""


def subject_name(topic: str, full_name: str, strategy: str) -> str:
    """The subject the result schema of ``topic`` (record or message ``full_name``) lives
    under."""
    subject: str | None = SUBJECT_STRATEGIES[strategy](
        SerializationContext(topic, MessageField.VALUE), full_name
    )
    assert subject is not None
    return subject


def avro_full_name(schema: Mapping[str, Any]) -> str:
    """``namespace.name`` of an Avro record schema."""
    namespace, name = schema.get("namespace"), schema["name"]
    return f"{namespace}.{name}" if namespace else str(name)


def protobuf_schema(message_class: type[Message]) -> Schema:
    """The registry schema of a generated message's file: its ``FileDescriptorProto``,
    base64-encoded (what confluent-kafka's ``ProtobufSerializer`` registers)."""
    serialized = message_class.DESCRIPTOR.file.serialized_pb
    return Schema(base64.standard_b64encode(serialized).decode("ascii"), "PROTOBUF")


def result_schema_id(
    settings: Mapping[str, Any],
    topic: str,
    registered: Schema,
    full_name: str,
    strategy: str = "topic",
    auto_register: bool = True,
    startup_timeout_s: float = 60.0,
) -> int:
    """The id results of ``topic`` are framed with: ``registered`` (whose record or message
    is ``full_name``) registered (or, with ``auto_register`` off, looked up) under its
    subject.

    Raises:
        ConfigError: the registry refused the schema or does not hold it (names the subject and
            the registry's answer), or was unreachable for ``startup_timeout_s`` seconds.
    """
    subject = subject_name(topic, full_name, strategy)
    where = str(settings.get("url", "?")).split("@")[-1]  # no user info in messages
    deadline_s = time.monotonic() + startup_timeout_s
    wait_s = 0.2
    with SchemaRegistryClient(dict(settings)) as client:
        while True:
            try:
                if auto_register:
                    return int(client.register_schema(subject, registered))
                return int(client.lookup_schema(subject, registered).schema_id)
            except SchemaRegistryError as exc:
                if exc.http_status_code == 404 and exc.error_code not in (40401, 40402, 40403):
                    raise ConfigError(
                        f"schema_registry.url: {where} answered HTTP 404 ({exc.error_message}): "
                        "not a Confluent-compatible API; allowed: its base URL (Apicurio: "
                        ".../apis/ccompat/v7)"
                    ) from exc
                if exc.http_status_code < 500:
                    what = "refused" if auto_register else "not found"
                    raise ConfigError(
                        f"schema_registry: the result schema of {topic!r} is {what} under "
                        f"subject {subject!r} (HTTP {exc.http_status_code}: {exc.error_message}); "
                        "allowed: a compatible schema, or auto_register_schemas: true"
                    ) from exc
                failure: Exception = exc
            except Exception as exc:  # unreachable: connection refused, timeout
                failure = exc
            if time.monotonic() + wait_s > deadline_s:
                raise ConfigError(
                    f"schema_registry.url: {where} did not answer within "
                    f"{startup_timeout_s:.0f} s (registering the result schema of {topic!r}): "
                    f"{failure}"
                ) from failure
            log.warning("schema registry unavailable at start-up; retrying", error=str(failure))
            time.sleep(wait_s)  # backoff between attempts, not synchronisation
            wait_s = min(wait_s * 2, 5.0)


class AvroResults:
    """Result Structs -> framed Avro values (no registry call per result; thread-safe).

    Args:
        schema: the result schema (an Avro record schema as a dict) whose fields the Struct's
            fields match by name.
        schema_id: its registered id (:func:`result_schema_id`).
    """

    def __init__(self, schema: Mapping[str, Any], schema_id: int) -> None:
        self.schema_id = schema_id
        self._parsed = fastavro.parse_schema(dict(schema))
        self._header = frame(schema_id, b"")

    def __call__(self, result: msgspec.Struct) -> bytes:
        """The framed Avro value of one result.

        Raises:
            ValueError, TypeError: the result does not match the schema (an encode error of
                that result).
        """
        out = io.BytesIO()
        out.write(self._header)
        fastavro.schemaless_writer(out, self._parsed, msgspec.to_builtins(result))
        return out.getvalue()


def result_serializer(
    fmt: str, workload: Any, topic: str, settings: Mapping[str, Any], **registration: Any
) -> Callable[[msgspec.Struct], bytes]:
    """The results serialiser of ``workload`` in ``fmt`` (``avro``, ``protobuf`` or
    ``jsonschema``), its
    schema registered (:func:`result_schema_id`, with ``registration``'s strategy,
    auto_register and startup_timeout_s) for ``topic``.

    Raises:
        ConfigError: the workload has no result schema in ``fmt``, or the registry refused it.
    """
    if fmt == "avro":
        schema = workload.result_schema()
        registered = Schema(orjson.dumps(schema).decode(), "AVRO")
        schema_id = result_schema_id(
            settings, topic, registered, avro_full_name(schema), **registration
        )
        return AvroResults(schema, schema_id)
    if fmt == "protobuf":
        message_class = workload.result_message()
        schema_id = result_schema_id(
            settings,
            topic,
            protobuf_schema(message_class),
            message_class.DESCRIPTOR.full_name,
            **registration,
        )
        return ProtobufResults(message_class, schema_id)
    if fmt == "jsonschema":
        json_doc = workload.result_json_schema()
        registered = Schema(schema_text(json_doc), JSON)
        schema_id = result_schema_id(settings, topic, registered, json_doc["title"], **registration)
        return JsonSchemaResults(schema_id, workload.json_result_encoder())
    raise ConfigError(
        f"pipelines.output_format: {fmt!r} is not one of ['json', 'avro', 'protobuf', 'jsonschema']"
    )
