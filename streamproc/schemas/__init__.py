"""Schema-managed topics: the Confluent wire format, writer schemas from a Schema Registry, and
decoders that turn Avro payloads into a workload's message Structs.

A schema-managed value is ``0x00`` (magic byte), a 4-byte big-endian schema id, then the payload
(:mod:`streamproc.schemas.wire`). The writer schema of an id is read once from the registry and
cached (:class:`~streamproc.schemas.writers.WriterSchemas`); a registry that cannot be reached is
retried with backoff, never counted against the record. A decode plan per writer schema id
(:class:`~streamproc.schemas.avro.AvroDecoder`) resolves it against the workload's reader
schema once and then decodes payloads; the same msgspec Struct the JSON path builds validates
the fields, so a message is accepted or refused for the same reasons in every format.
"""

from streamproc.schemas.wire import frame, split
from streamproc.schemas.writers import RegistryUnavailable, WriterSchemas

__all__ = ["RegistryUnavailable", "WriterSchemas", "frame", "split"]
