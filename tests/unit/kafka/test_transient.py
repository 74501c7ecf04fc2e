"""Transient broker errors are retried within the deadline; others are raised at once."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from confluent_kafka import KafkaError, KafkaException

from streamproc.kafka.transient import is_transient, raise_error, retry_transient


def _failing(*codes: int) -> tuple[list[int], Callable[[], str]]:
    calls: list[int] = []
    errors = list(codes)

    def call() -> str:
        calls.append(1)
        if errors:
            raise KafkaException(KafkaError(errors.pop(0)))
        return "answer"

    return calls, call


def test_transient_errors_are_retried_until_the_call_succeeds() -> None:
    # the two errors of issue 22 (item 5) and a coordinator still loading its offsets
    calls, call = _failing(
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError._TIMED_OUT,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    )
    assert retry_transient(call, 30.0, "probe") == "answer"
    assert len(calls) == 4


def test_other_errors_are_raised_at_once_and_transient_ones_after_the_deadline() -> None:
    calls, call = _failing(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    with pytest.raises(KafkaException):
        retry_transient(call, 30.0, "probe")
    assert len(calls) == 1
    calls, call = _failing(*[KafkaError.LEADER_NOT_AVAILABLE] * 1000)
    started_s = time.monotonic()
    with pytest.raises(KafkaException) as raised:
        retry_transient(call, 0.5, "probe")
    assert raised.value.args[0].code() == KafkaError.LEADER_NOT_AVAILABLE
    assert time.monotonic() - started_s < 10.0 and len(calls) > 1


def test_errors_returned_in_values_are_raised_to_be_retried() -> None:
    raise_error(None)  # no error: nothing raised
    with pytest.raises(KafkaException) as raised:
        raise_error(KafkaError(KafkaError.LEADER_NOT_AVAILABLE))
    assert is_transient(raised.value)
    assert not is_transient(ValueError("not a Kafka error"))
    assert not is_transient(KafkaException(KafkaError(KafkaError.INVALID_CONFIG)))
