"""One exception tree for streamproc.

::

    StreamprocError
    ├── ConfigError              bad configuration; raised at start-up, names key + allowed values
    ├── BrokerError              the local Apache Kafka broker could not be fetched/started
    ├── RecordError              one input record cannot be processed -> dead-letter topic
    │   ├── DecodeError          stage "decode": malformed, empty, tombstone, oversized input
    │   ├── ModelError           stage "model": the model failed on the record's batch
    │   └── EncodeError          stage "encode": the result could not be serialised
    └── FatalPipelineError       the pipeline must stop (e.g. the dead-letter topic rejects writes)

``RecordError`` subclasses carry ``stage``, written to the ``streamproc.error.stage`` header of
the dead-letter record. Kafka client errors are translated at the source and sink boundaries.
"""

from __future__ import annotations


class StreamprocError(Exception):
    """Root of every error streamproc raises on purpose."""


class ConfigError(StreamprocError):
    """Invalid configuration. The message names the key and the allowed values."""


class BrokerError(StreamprocError):
    """The local broker could not be resolved, started or reached."""


class RegistryUnavailable(StreamprocError):
    """The Schema Registry could not be reached and a writer-schema lookup was abandoned (the
    process is closing). Not a record's fault: no record is dead-lettered for it."""


class RecordError(StreamprocError):
    """One record cannot be processed; it goes to the dead-letter topic."""

    stage: str = "decode"


class DecodeError(RecordError):
    """The input value is malformed, empty, a tombstone or larger than allowed."""

    stage = "decode"


class ModelError(RecordError):
    """The model raised on the batch that held this record."""

    stage = "model"


class EncodeError(RecordError):
    """The model output for this record could not be encoded."""

    stage = "encode"


class FatalPipelineError(StreamprocError):
    """The pipeline cannot go on without losing data; it stops and exits non-zero."""
