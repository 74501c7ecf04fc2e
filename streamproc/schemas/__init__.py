"""Schema-managed values: the Confluent wire format, writer schemas from a Schema Registry, and
the Avro and Protobuf decode plans and result serialisers.

A schema-managed value is ``0x00`` (magic byte), a 4-byte big-endian schema id, then the payload
(:mod:`streamproc.schemas.wire`). The writer schema of an id is read once from the registry and
cached (:class:`~streamproc.schemas.writers.WriterSchemas`); a registry that cannot be reached is
retried with backoff, never counted against the record. A decode plan per writer schema id
(:class:`~streamproc.schemas.avro.AvroDecoder`,
:class:`~streamproc.schemas.protobuf.ProtobufDecoder`) turns payloads into the values a
workload's msgspec Struct validates, so a message is accepted or refused for the same reasons in
every format; :mod:`streamproc.schemas.results` registers a result schema at start-up and frames
results with its id. The workload side (which Struct, which schema
files) is :mod:`streamproc.workloads.formats`; this package imports no workload.
"""

from streamproc.schemas.wire import frame, split
from streamproc.schemas.writers import RegistryUnavailable, WriterSchemas

__all__ = ["RegistryUnavailable", "WriterSchemas", "frame", "split"]
