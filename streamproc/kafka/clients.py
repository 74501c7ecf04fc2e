"""Building the Kafka clients: a bad librdkafka setting becomes a :class:`ConfigError`.

librdkafka checks its settings when a client is built and raises ``KafkaException`` with
``_INVALID_ARG`` ("No such configuration property", "Invalid value ... for configuration
property"). Raw keys pass through under ``kafka.consumer`` and ``kafka.producer``, so that
error is a configuration error of ours: it names the section and librdkafka's reason, and the
CLI reports it at start-up like any other bad key (exit 2, no traceback).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from streamproc.errors import ConfigError
from streamproc.kafka.protocols import AdminClientLike
from streamproc.logs import kafka_logger

ClientT = TypeVar("ClientT")


def build_client(
    factory: Callable[[dict[str, Any]], ClientT], settings: dict[str, Any], section: str
) -> ClientT:
    """``factory(settings)``; an invalid setting raises :class:`ConfigError` naming ``section``.

    Raises:
        ConfigError: librdkafka refused a key or value (message: section, key, reason).
    """
    try:
        return factory(settings)
    except KafkaException as exc:
        err = exc.args[0] if exc.args else None
        code = err.code() if isinstance(err, KafkaError) else None
        if code not in (KafkaError._INVALID_ARG, KafkaError.INVALID_CONFIG):
            raise
        reason = err.str() if isinstance(err, KafkaError) else str(exc)
        raise ConfigError(
            f"{section}: {reason} (keys under {section} are librdkafka settings: see "
            "librdkafka's CONFIGURATION.md for the allowed keys and values)"
        ) from exc
    except (TypeError, ValueError) as exc:  # e.g. a value of a type librdkafka cannot take
        raise ConfigError(f"{section}: {exc}") from exc


def build_admin(settings: dict[str, Any]) -> AdminClientLike:
    """The admin client for ``settings`` (librdkafka's log lines go to our logger)."""
    # the logger is a keyword argument: confluent_kafka types the settings as scalars
    return AdminClient(settings, logger=kafka_logger())
