"""One exception tree for streamproc: every exception class of the package, where it is
defined when not here.

::

    StreamprocError
    ├── ConfigError                 bad configuration, at start-up: names key + allowed values
    ├── BrokerError                 the local Apache Kafka broker could not be fetched/started
    ├── RegistryUnavailable         registry unreachable while closing: not a record's fault
    ├── ModelSourceError            models.sources: a model version cannot be found or read
    ├── VersionRefused              models.loading: a version that must not serve
    ├── RecordError                 one input record cannot be processed -> dead-letter topic
    │   ├── DecodeError             stage "decode": malformed, empty, tombstone, too large
    │   │   └── UnknownSchema       schemas.writers: no schema with the record's id
    │   ├── ModelError              stage "model": the model failed on the record's batch
    │   └── EncodeError             stage "encode": the result could not be serialised
    └── FatalPipelineError          the pipeline must stop (e.g. the DLQ rejects writes)
        ├── DeviceOutOfMemoryError  device.recovery: one row does not fit on the device
        └── BrokenModelError        device.recovery: model fails every row, policy stop

Signals between the package's own parts, caught where they are raised or one call above (never
an error of the pipeline)::

    Exception
    ├── ModelHeld                   device.recovery: model judged broken, batch held
    ├── HoldAbandoned               device.hold: the worker closes while a batch is held
    ├── WedgedCall                  offsets.transactions: a transactional call did not return
    └── AdminCallFailed             tools.model_admin: the admin endpoint answered an error

``RecordError`` subclasses carry ``stage``, written to the ``streamproc.error.stage`` header of
the dead-letter record. Kafka client errors are translated at the source and sink boundaries.
``tests/unit/test_errors.py`` checks that every exception class of the package is drawn here,
under its base class.
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
