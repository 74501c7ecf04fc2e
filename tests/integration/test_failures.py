"""Delivery guarantees under failure, with real processes against the real broker.

Each scenario ends with the verifier: it reads the output and dead-letter topics
(read_committed) and the group's committed offsets, and counts missing and duplicate inputs.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import orjson
import pytest

from streamproc.config import load_config
from streamproc.kafka.admin import ensure_topics
from streamproc.output.headers import H_MESSAGE, H_STAGE
from streamproc.pipeline import Pipeline
from streamproc.tools.replay import produce
from streamproc.tools.verify import read_topic, verify
from tests.integration.conftest import (
    Topics,
    end_offset_total,
    report,
    start_consumer,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.failures

LANE_ENV = "STREAMPROC_WORKER__FUSED_LANE"
"""Set by `make test-lanes` for every test; the tests that choose their route drop it."""


@pytest.mark.parametrize("lane", ["always", "never"])  # worker.fused_lane: fused, staged
def test_sigterm_with_batches_in_flight_drains_and_restart_has_no_duplicates(
    bootstrap_servers: str,
    topics: Topics,
    tmp_path: Path,
    lane: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(LANE_ENV, raising=False)  # `make test-lanes` sets it: this test's wins
    total = 300
    produce("trades", topics.input, bootstrap_servers, 3, limit=total, progress=False)
    config = write_config(
        tmp_path / "c.yaml",
        bootstrap_servers,
        topics,
        pipelines=[
            {
                "name": "p",
                "input_topic": topics.input,
                "output_topic": topics.output,
                "workload": "tests.support.slow:make_workload",
                "options": {"delay_s": 0.05},
            }
        ],
        shutdown_timeout_s=20,
        worker={"fused_lane": lane},
    )
    log = tmp_path / "consumer.log"
    consumer = start_consumer(config, log, idle_s=None)
    try:
        wait_for(
            lambda: end_offset_total(bootstrap_servers, topics.output) >= 40,
            120,
            "40 results before SIGTERM",
        )
        sent_s = time.monotonic()
        consumer.send_signal(signal.SIGTERM)
        assert consumer.wait(30) == 0, log.read_text()[-2000:]
        drain_s = time.monotonic() - sent_s
    finally:
        if consumer.poll() is None:
            consumer.kill()
    written = end_offset_total(bootstrap_servers, topics.output)
    assert written < total, "SIGTERM came too late to test anything"
    restart = start_consumer(config, log)
    assert restart.wait(120) == 0, log.read_text()[-2000:]
    verdict = verify(bootstrap_servers, topics.input, topics.output, topics.dlq, topics.group)
    report(f"sigterm after {written} results, drained in {drain_s:.1f} s ({lane})", verdict)
    assert verdict.missing == [] and verdict.duplicates == 0
    assert verdict.committed_equals_end


def test_output_failures_are_dead_lettered_and_never_committed_past(
    bootstrap_servers: str, topics: Topics
) -> None:
    # Results of 50 kB against a producer limit of 20 kB: every result is rejected for good
    # (MSG_SIZE_TOO_LARGE) and must go to the dead-letter topic before its offset commits.
    produce("trades", topics.input, bootstrap_servers, 3, limit=60, progress=False)
    config = load_config(
        overrides={
            "kafka": {
                "bootstrap_servers": bootstrap_servers,
                "group_id": topics.group,
                "commit_interval_ms": 200,
                "producer": {"message.max.bytes": 20_000},
            },
            "pipelines": [
                {
                    "name": "p",
                    "input_topic": topics.input,
                    "output_topic": topics.output,
                    "workload": "tests.support.slow:bloated",
                    "options": {"size_bytes": 50_000},
                }
            ],
            "metrics": {"port": 0},
        }
    )
    summary = Pipeline(config).run(exit_when_idle_s=2)
    assert summary.exit_code == 0, summary.error
    verdict = verify(bootstrap_servers, topics.input, topics.output, topics.dlq, topics.group)
    report("oversized results", verdict)
    assert verdict.results == 0 and verdict.dead_lettered == 60
    assert verdict.missing == [] and verdict.committed_equals_end
    for _, _, headers, _ in read_topic(bootstrap_servers, topics.dlq).records.values():
        assert headers[H_STAGE] == b"produce"
        assert b"too large" in headers[H_MESSAGE].lower()


def test_missing_output_topic_is_dead_lettered_after_the_delivery_timeout(
    bootstrap_servers: str, topics: Topics
) -> None:
    produce("trades", topics.input, bootstrap_servers, 3, limit=20, progress=False)
    missing = f"{topics.output}.absent"
    config = load_config(
        overrides={
            "kafka": {
                "bootstrap_servers": bootstrap_servers,
                "group_id": topics.group,
                "create_topics": False,
                "commit_interval_ms": 200,
                "producer": {"message.timeout.ms": 3000},
            },
            "pipelines": [
                {
                    "name": "p",
                    "input_topic": topics.input,
                    "output_topic": missing,
                    "workload": "trades",
                }
            ],
            "metrics": {"port": 0},
        }
    )
    pipeline = Pipeline(config)
    pipeline.start()
    # while the results are failing, nothing may be committed
    wait_for(
        lambda: pipeline.metrics.consumed.labels(topics.input)._value.get() == 20,
        60,
        "all inputs consumed",
    )
    assert pipeline.tracker.commit_candidates() == {} or all(
        o == 0 for o in pipeline.tracker.commit_candidates().values()
    )
    summary = pipeline.run(exit_when_idle_s=2)
    assert summary.exit_code == 0, summary.error
    verdict = verify(bootstrap_servers, topics.input, missing, topics.dlq, topics.group)
    report("missing output topic", verdict)
    assert verdict.dead_lettered == 20 and verdict.missing == []
    assert verdict.committed_equals_end


def test_batch_slower_than_max_poll_interval_keeps_group_membership(
    bootstrap_servers: str, topics: Topics
) -> None:
    produce("trades", topics.input, bootstrap_servers, 3, limit=8, progress=False)
    config = load_config(
        overrides={
            "kafka": {
                "bootstrap_servers": bootstrap_servers,
                "group_id": topics.group,
                "session_timeout_ms": 6000,
                "max_poll_interval_ms": 6000,
            },
            "pipelines": [
                {
                    "name": "p",
                    "input_topic": topics.input,
                    "output_topic": topics.output,
                    "workload": "tests.support.slow:make_workload",
                    "options": {"delay_s": 7.5},
                }
            ],
            "batching": {"max_batch_size": 4, "max_wait_ms": 1},
            "metrics": {"port": 0},
        }
    )
    pipeline = Pipeline(config)
    summary = pipeline.run(exit_when_idle_s=1)
    assert summary.exit_code == 0, summary.error
    counts = pipeline.source.assignment.rebalances
    print(f"\n[slow batch 7.5 s > max.poll.interval 6 s] rebalances={counts}")
    assert counts["lost"] == 0
    assert counts["assigned"] == 1  # never kicked out and re-joined
    verdict = verify(bootstrap_servers, topics.input, topics.output, topics.dlq, topics.group)
    assert verdict.missing == [] and verdict.duplicates == 0 and verdict.committed_equals_end


@pytest.mark.parametrize(  # worker.fused_lane: always = fused, never = staged
    ("protocol", "lane"), [("classic", "always"), ("classic", "never"), ("consumer", "auto")]
)
def test_exactly_once_with_kill_9_has_no_missing_and_no_duplicates(
    bootstrap_servers: str,
    topics: Topics,
    tmp_path: Path,
    protocol: str,
    lane: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(LANE_ENV, raising=False)  # `make test-lanes` sets it: this test's wins
    total, kills = 600, 2
    produce("trades", topics.input, bootstrap_servers, 3, limit=total, progress=False)
    kafka: dict[str, object] = {"group_protocol": protocol}
    config = write_config(
        tmp_path / "c.yaml",
        bootstrap_servers,
        topics,
        processing_guarantee="exactly_once",
        kafka=kafka,
        worker={"fused_lane": lane},
    )
    env = {"STREAMPROC_INSTANCE_ID": "eos-0"}  # the restart fences the killed instance
    log = tmp_path / "consumer.log"
    for kill in range(kills):
        consumer = start_consumer(config, log, idle_s=None, env=env)
        try:
            threshold = 100 * (kill + 1)
            wait_for(
                lambda t=threshold: end_offset_total(bootstrap_servers, topics.output) > t,
                120,
                f"{threshold} records before kill -9",
            )
            os.kill(consumer.pid, signal.SIGKILL)
            assert consumer.wait(30) == -signal.SIGKILL
        finally:
            if consumer.poll() is None:
                consumer.kill()
    final = start_consumer(config, log, env=env)
    assert final.wait(180) == 0, log.read_text()[-3000:]
    verdict = verify(bootstrap_servers, topics.input, topics.output, topics.dlq, topics.group)
    report(f"exactly-once, {kills} kill -9 ({protocol} protocol, fused_lane {lane})", verdict)
    assert verdict.inputs == total
    assert verdict.missing == [] and verdict.duplicates == 0
    assert verdict.output_stable  # no transaction left open
    assert verdict.committed_equals_end
    ids = [
        orjson.loads(v)["trade_id"]
        for _, v, _, _ in read_topic(bootstrap_servers, topics.output).records.values()
    ]
    assert len(ids) == len(set(ids)) == total


@pytest.mark.parametrize("limit", ["producer", "topic"])
def test_values_too_large_for_the_dead_letter_topic_are_dead_lettered_without_them(
    bootstrap_servers: str, topics: Topics, limit: str
) -> None:
    # Undecodable 15 kB values must be dead-lettered, but the dead-letter record cannot carry
    # them: either the producer's message.max.bytes (10 kB) refuses them before sending, or
    # the dead-letter topic's max.message.bytes (10 kB) refuses them at the broker. Neither may
    # stop the consumer: the record goes without its value, saying so, and commits advance.
    from confluent_kafka import Producer

    from streamproc.output.headers import H_VALUE_OMITTED

    dlq = f"{topics.dlq}.small"
    topic_config = {"max.message.bytes": "10000"} if limit == "topic" else {}
    assert ensure_topics(bootstrap_servers, {dlq: 1}, topic_config=topic_config) == [dlq]
    producer = Producer({"bootstrap.servers": bootstrap_servers})
    for i in range(6):
        # random bytes: incompressible (the producer compresses with lz4), and not JSON
        value = os.urandom(15_000) if i % 2 else b'{"not": "a trade"}'
        producer.produce(topics.input, key=b"k%d" % i, value=value, partition=i % 3)
    assert producer.flush(30) == 0
    kafka = {
        "bootstrap_servers": bootstrap_servers,
        "group_id": topics.group,
        "commit_interval_ms": 200,
    }
    if limit == "producer":
        kafka["producer"] = {"message.max.bytes": 10_000}
    config = load_config(
        overrides={
            "kafka": kafka,
            "pipelines": [
                {
                    "name": "p",
                    "input_topic": topics.input,
                    "output_topic": topics.output,
                    "workload": "trades",
                    "dlq_topic": dlq,
                }
            ],
            "metrics": {"port": 0},
        }
    )
    summary = Pipeline(config).run(exit_when_idle_s=2)
    assert summary.exit_code == 0, summary.error
    verdict = verify(bootstrap_servers, topics.input, topics.output, dlq, topics.group)
    report(f"dead-letter value over the {limit} limit", verdict)
    assert verdict.dead_lettered == 6 and verdict.missing == [] and verdict.committed_equals_end
    dead = read_topic(bootstrap_servers, dlq).records.values()
    omitted = [(value, headers) for _, value, headers, _ in dead if H_VALUE_OMITTED in headers]
    assert len(omitted) == 3  # the three 15 kB values; the small ones kept theirs
    assert all(v is None and h[H_VALUE_OMITTED] == b"15000" for v, h in omitted)
    assert all(h[H_STAGE] == b"decode" for _, h in omitted)
