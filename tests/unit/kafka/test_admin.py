"""Topic administration against an in-test admin client: the start-up read of the output
topics' ``max.message.bytes`` while a broker is down."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from streamproc.kafka.admin import max_message_bytes


@dataclass
class Entry:
    value: str | None


@dataclass
class Admin:
    """``describe_configs`` answers from ``answers`` in turn: a dict of entries, an error, or
    None for a request that is never answered (it went to a broker that is down)."""

    answers: list[dict[str, Entry] | KafkaError | None]
    requests: list[float | None] = field(default_factory=list)

    def describe_configs(self, resources: list[Any], **kwargs: Any) -> dict[Any, Any]:
        self.requests.append(kwargs.get("request_timeout"))
        future: concurrent.futures.Future[dict[str, Entry]] = concurrent.futures.Future()
        answer = self.answers.pop(0)
        if isinstance(answer, KafkaError):
            future.set_exception(KafkaException(answer))
        elif answer is not None:
            future.set_result(answer)
        return {resources[0]: future}


def read(admin: Admin, timeout_s: float) -> dict[str, int]:
    return max_message_bytes("fake:9092", ["out"], timeout_s, admin_factory=lambda _: admin)


def test_an_unanswered_request_is_sent_again_not_raised() -> None:
    # faults run L: the second consumer started while the group coordinator's broker was down;
    # the read was never answered and its TimeoutError stopped the process (exit 1)
    admin = Admin([None, {"max.message.bytes": Entry("2048")}])
    assert read(admin, timeout_s=0.6) == {"out": 2048}
    assert admin.requests == [pytest.approx(0.2)] * 2  # each attempt a third of the deadline


def test_a_transient_refusal_is_retried_and_a_lasting_one_leaves_the_topic_out() -> None:
    retried = Admin([KafkaError(KafkaError._TRANSPORT), {"max.message.bytes": Entry("10")}])
    assert read(retried, timeout_s=3) == {"out": 10}
    denied = Admin([KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)])
    assert read(denied, timeout_s=3) == {}  # the broker answers per record instead
    assert len(denied.requests) == 1


def test_a_topic_without_the_setting_is_left_out() -> None:
    assert read(Admin([{"max.message.bytes": Entry(None)}]), timeout_s=3) == {}
    assert read(Admin([{}]), timeout_s=3) == {}
