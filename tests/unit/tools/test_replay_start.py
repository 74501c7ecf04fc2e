"""A paced replay starts its clock only once its idempotent producer holds its producer id:
librdkafka holds the first messages of a producer without one (measured: 500-570 ms), and
their timestamps, set at ``produce()``, would read as the consumer's latency."""

from __future__ import annotations

import json
from typing import Any

from streamproc.tools.replay import ProducerIdentity


class StatsProducer:
    """Serves the statistics callback with one ``eos.idemp_state`` per ``poll``."""

    def __init__(self, identity: ProducerIdentity, states: list[str]) -> None:
        self._on_stats = identity.settings["stats_cb"]
        self._states = iter(states)
        self.polls = 0

    def poll(self, timeout: float = 0.0) -> int:
        self.polls += 1
        state = next(self._states, "WaitPID")
        stats: dict[str, Any] = {"name": "rdkafka#producer-1", "eos": {"idemp_state": state}}
        self._on_stats(json.dumps(stats))
        return 0


def test_the_wait_ends_when_the_producer_id_is_assigned() -> None:
    identity = ProducerIdentity()
    producer = StatsProducer(identity, ["Init", "RequestPID", "WaitPID", "Assigned", "Assigned"])
    assert identity.wait(producer, timeout_s=30.0) is True  # type: ignore[arg-type]
    assert producer.polls == 4


def test_a_producer_id_never_assigned_gives_up_after_the_timeout() -> None:
    identity = ProducerIdentity()
    producer = StatsProducer(identity, [])
    assert identity.wait(producer, timeout_s=0.1) is False  # type: ignore[arg-type]
    assert producer.polls >= 1


def test_the_settings_ask_for_statistics() -> None:
    settings = ProducerIdentity().settings
    assert settings["statistics.interval.ms"] > 0 and callable(settings["stats_cb"])
