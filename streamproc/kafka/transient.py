"""Transient broker errors, and one way to call the broker that retries them within a deadline.

A request can fail for a moment for reasons of the cluster, not of the request: a partition's
leader moves (``NOT_LEADER_FOR_PARTITION``, ``LEADER_NOT_AVAILABLE``), a topic created a moment
ago is not yet in every broker's metadata (``UNKNOWN_TOPIC_OR_PART``), a group coordinator is
still loading its offsets (``COORDINATOR_LOAD_IN_PROGRESS``), or a loaded machine answers after
the request's own timeout (``_TIMED_OUT``, ``_TRANSPORT``). Such a failure is retried until a
deadline (tenacity, exponential backoff); anything else is raised at once.

Used by the tools that judge a run from the outside (``streamproc.tools.verify``), by topic
creation (``kafka.admin``), by the rewind after an aborted transaction (reading the committed
offsets while a group coordinator moves: ``intake.rebalance``) and by the test helpers; the
pipeline's other requests are retried inside librdkafka.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka import TopicPartition as KafkaTopicPartition
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential

from streamproc.kafka.protocols import ConsumerClient
from streamproc.logs import get_logger

log = get_logger(__name__)

T = TypeVar("T")

TRANSIENT_CODES = frozenset(
    {
        KafkaError._TIMED_OUT,
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError._WAIT_COORD,
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError.NETWORK_EXCEPTION,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.NOT_COORDINATOR,
        KafkaError.NOT_CONTROLLER,
        KafkaError.KAFKA_STORAGE_ERROR,
    }
)
"""Codes retried even where librdkafka does not flag the error retriable (it flags few of the
ones a request-level API returns, e.g. ``get_watermark_offsets``' ``NOT_LEADER_FOR_PARTITION``)."""


def is_transient(exc: BaseException) -> bool:
    """True for a ``KafkaException`` whose error is retriable or has a transient code, and is
    not fatal."""
    if not isinstance(exc, KafkaException) or not exc.args:
        return False
    err = exc.args[0]
    if not isinstance(err, KafkaError) or err.fatal():
        return False
    return bool(err.retriable()) or err.code() in TRANSIENT_CODES


def raise_error(err: KafkaError | None) -> None:
    """Raise ``KafkaException(err)`` when ``err`` is set: for errors the client returns inside
    a value (a topic's or a partition's metadata, a committed offset), so that
    :func:`retry_transient` retries them like raised ones."""
    if err is not None:
        raise KafkaException(err)


def read_committed(
    consumer: ConsumerClient, partitions: list[KafkaTopicPartition], timeout_s: float
) -> list[KafkaTopicPartition]:
    """The group's committed offsets of ``partitions`` (one request, ``timeout_s`` seconds);
    a partition's own error is raised like a refused request, so that :func:`retry_transient`
    retries it when transient.

    Raises:
        KafkaException: the request or a partition failed."""
    committed = consumer.committed(partitions, timeout=timeout_s)
    for part in committed:
        raise_error(part.error)
    return committed


def retry_transient(call: Callable[[], T], deadline_s: float, what: str) -> T:
    """``call()``, again after each transient error (:func:`is_transient`) until ``deadline_s``
    seconds have passed; backoff 0.1 s doubling up to 2 s.

    Args:
        call: one request (or a few reads that belong together) against the broker.
        deadline_s: how long to keep retrying, in seconds (each attempt keeps its own timeout).
        what: what the call does, for the log line of each retry.

    Raises:
        KafkaException: the last transient error after the deadline, or the first other one.
    """
    retrying = Retrying(
        retry=retry_if_exception(is_transient),
        stop=stop_after_delay(deadline_s),
        wait=wait_exponential(multiplier=0.1, max=2.0),
        before_sleep=lambda state: log.warning(
            "transient broker error; retrying",
            call=what,
            attempt=state.attempt_number,
            error=str(state.outcome.exception() if state.outcome else None),
        ),
        reraise=True,
    )
    return retrying(call)
