"""A model that raises, against the real broker: poison rows, a broken model, device memory.

The models are plug-in workloads (``tests/support/faulty.py``) named in config. Each scenario
ends with the verifier (output and dead-letter topics read read_committed, committed offsets).
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import Producer

from streamproc.config import Config, load_config
from streamproc.output.headers import H_CLASS, H_MESSAGE, H_OFFSET, H_PARTITION, H_STAGE
from streamproc.pipeline import Pipeline, RunSummary
from streamproc.tools.verify import read_topic, verify
from tests.integration.conftest import (
    Topics,
    committed_results,
    end_offset_total,
    report,
    wait_for,
)
from tests.support import faulty

pytestmark = pytest.mark.models

POISON = 666.0


def produce_values(bootstrap: str, topic: str, values: list[float], partitions: int = 3) -> None:
    """One message per value (ASCII decimal), round-robin over ``partitions``, acknowledged."""
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    try:
        for i, value in enumerate(values):
            while True:
                try:
                    producer.produce(topic, b"%g" % value, key=b"%d" % i, partition=i % partitions)
                    break
                except BufferError:
                    producer.poll(0.1)
        assert producer.flush(60) == 0, "messages left unacknowledged"
    finally:
        producer.flush(10)


def config_for(bootstrap: str, t: Topics, workload: str, **overrides: Any) -> Config:
    data: dict[str, Any] = {
        "kafka": {"bootstrap_servers": bootstrap, "group_id": t.group, "commit_interval_ms": 200},
        "pipelines": [
            {
                "name": "p",
                "input_topic": t.input,
                "output_topic": t.output,
                "workload": workload,
                **overrides.pop("pipeline", {}),
            }
        ],
        "metrics": {"port": 0},
        "worker": {"device": "cpu", **overrides.pop("worker", {})},
        "batching": {"max_batch_size": 32, "max_wait_ms": 50, **overrides.pop("batching", {})},
    }
    data.update(overrides)
    return load_config(overrides=data)


FULL_BATCHES = {"max_batch_size": 32, "max_wait_ms": 1000, "adaptive_batch_size": False}
"""Batches of a backlog cut full: a model that fails on every row is judged broken on the first
batch (its 32 rows fail in a row; streamproc.device.recovery.BROKEN_AFTER_ROWS is 16). With the
adaptive batch size, a loaded machine calibrated a target of 1 (measured in CI: "batch size
calibrated target=1"): the first 15 single-row batches failed before the verdict and were
dead-lettered as poison rows, as the recovery's rules say rows failing before a verdict are.
The wait is long (1 s) and :data:`LONGEST_TARGET` keeps it in force: a first fetch of one
record with the next one later than the wait cut a batch of 1 (CI on 6492079: the normal
priority's default latency target of 100 ms capped a 50 ms wait at 25 ms)."""
LONGEST_TARGET = {"latency_target_ms": 3_600_000}
"""A pipeline's longest latency target: its wait share (15 min) leaves ``max_wait_ms`` in force."""


def metric(pipeline: Pipeline, name: str, topic: str) -> float:
    value = pipeline.metrics.registry.get_sample_value(name, {"topic": topic, "device": "cpu:0"})
    return 0.0 if value is None else value


def assert_offset_order(bootstrap: str, output_topic: str) -> None:
    """Within each output partition, results of one input partition are in offset order."""
    records = read_topic(bootstrap, output_topic).records
    last: dict[tuple[int, int], int] = {}
    for (out_partition, _), (_, _, headers, _) in sorted(records.items()):
        source = (out_partition, int(headers[H_PARTITION]))
        offset = int(headers[H_OFFSET])
        assert offset > last.get(source, -1), f"out of order in {source}: {offset}"
        last[source] = offset


@pytest.mark.parametrize("guarantee", ["at_least_once", "exactly_once"])
def test_poison_rows_alone_are_dead_lettered_and_their_batches_get_results(
    bootstrap_servers: str, topics: Topics, guarantee: str
) -> None:
    total = 400
    values = [float(i) for i in range(total)]
    values[100] = values[301] = POISON  # two rows the model cannot handle
    produce_values(bootstrap_servers, topics.input, values)  # a backlog: full batches of 32
    config = config_for(
        bootstrap_servers,
        topics,
        "tests.support.faulty:poison",
        processing_guarantee=guarantee,
    )
    pipeline = Pipeline(config)
    summary = pipeline.run(exit_when_idle_s=3)
    assert summary.exit_code == 0, summary.error
    verdict = verify(bootstrap_servers, topics.input, topics.output, topics.dlq, topics.group)
    report(f"two poison rows, {guarantee}", verdict)
    assert verdict.inputs == total
    assert verdict.dead_lettered == 2 and verdict.results == total - 2
    assert verdict.missing == [] and verdict.duplicates == 0 and verdict.committed_equals_end
    dead = read_topic(bootstrap_servers, topics.dlq).records.values()
    assert [value for _, value, _, _ in dead] == [b"666", b"666"]
    for _, _, headers, _ in dead:
        assert headers[H_STAGE] == b"model" and headers[H_CLASS] == b"ModelError"
        assert b"ValueError('cannot handle x=666')" in headers[H_MESSAGE]
    for _, value, _, _ in read_topic(bootstrap_servers, topics.output).records.values():
        result = orjson.loads(value or b"")
        assert result["x"] != POISON and result["y"] == 2 * result["x"]
    assert_offset_order(bootstrap_servers, topics.output)
    topic = topics.input
    assert metric(pipeline, "streamproc_model_isolated_rows_total", topic) == 2
    retries = metric(pipeline, "streamproc_model_retry_calls_total", topic)
    # 2 poison rows, batches <= 32: the halving, and one more try of each row failing alone
    assert 0 < retries <= 2 * 2 * math.ceil(math.log2(32)) + 2


def test_under_hold_a_run_of_poison_rows_after_rows_that_ran_is_dead_lettered_not_held(
    bootstrap_servers: str, topics: Topics
) -> None:
    # one partition: 64 rows that run, then 40 poison rows in a row (more than the 16 that
    # judged the model broken before the canary), then 64 rows that run
    values = [float(i + 1) for i in range(64)] + [POISON] * 40 + [float(i + 100) for i in range(64)]
    produce_values(bootstrap_servers, topics.input, values, partitions=1)
    config = config_for(bootstrap_servers, topics, "tests.support.faulty:poison")
    assert config.worker.on_model_failure == "hold"
    pipeline = Pipeline(config)
    summary: list[RunSummary] = []
    runner = threading.Thread(target=lambda: summary.append(pipeline.run(exit_when_idle_s=3)))
    runner.start()
    try:
        runner.join(120)
        assert not runner.is_alive(), "the lane is held: the poison rows were never dead-lettered"
    finally:
        pipeline.request_stop()
        runner.join(60)
    assert summary and summary[0].exit_code == 0, summary
    verdict = verify(bootstrap_servers, topics.input, topics.output, topics.dlq, topics.group)
    report("40 poison rows in a row after rows that ran, hold", verdict)
    assert verdict.inputs == len(values) and verdict.missing == [] and verdict.duplicates == 0
    assert verdict.dead_lettered == 40 and verdict.results == 128 and verdict.committed_equals_end
    dead = read_topic(bootstrap_servers, topics.dlq).records.values()
    assert all(value == b"666" for _, value, _, _ in dead)
    assert metric(pipeline, "streamproc_model_held", topics.input) == 0


def test_a_broken_builtin_model_holds_the_lane_dead_letters_nothing_and_resumes_by_itself(
    bootstrap_servers: str, topics: Topics
) -> None:
    total = 600
    config = config_for(
        bootstrap_servers,
        topics,
        "tests.support.faulty:switchable",
        processing_guarantee="exactly_once",
        buffers={"ring_capacity": 32},  # 200 records per partition fill the rings: paused
        batching=FULL_BATCHES,
        pipeline=LONGEST_TARGET,
    )
    pipeline = Pipeline(config)
    topic = topics.input
    summary: list[RunSummary] = []
    runner = threading.Thread(target=lambda: summary.append(pipeline.run()))
    faulty.BROKEN.set()  # the model loads and warms up, then fails on every row
    # produced first: the first batch is full (see FULL_BATCHES)
    produce_values(bootstrap_servers, topic, [float(i + 1) for i in range(total)])
    try:
        runner.start()
        wait_for(lambda: metric(pipeline, "streamproc_model_held", topic) == 1, 120, "a hold")
        registry = pipeline.metrics.registry
        wait_for(
            lambda: (registry.get_sample_value("streamproc_paused_partitions") or 0) >= 1,
            120,
            "partitions paused",
        )
        ready, why = pipeline.readiness()
        assert not ready and "device lost" in why, why
        assert end_offset_total(bootstrap_servers, topics.output) == 0  # nothing produced
        committed = verify(bootstrap_servers, topic, topics.output, topics.dlq, topics.group)
        assert committed.dead_lettered == 0 and committed.results == 0
        assert all(offset <= 0 for offset in committed.committed.values())  # no result yet
        faulty.BROKEN.clear()  # the model works again: the held batch runs, the lane resumes
        wait_for(
            lambda: committed_results(bootstrap_servers, topics) >= total,
            180,
            f"{total} results",
        )
        assert metric(pipeline, "streamproc_model_held", topic) == 0
        assert pipeline.readiness()[0]
    finally:
        faulty.BROKEN.clear()
        pipeline.request_stop()
        runner.join(120)
    assert summary and summary[0].exit_code == 0, summary
    verdict = verify(bootstrap_servers, topic, topics.output, topics.dlq, topics.group)
    report("a builtin model broken for a while, hold", verdict)
    assert verdict.inputs == total and verdict.results == total and verdict.dead_lettered == 0
    assert verdict.missing == [] and verdict.duplicates == 0 and verdict.committed_equals_end
    assert metric(pipeline, "streamproc_model_broken_batches_total", topic) == 0


@pytest.mark.parametrize("policy", ["dead_letter", "stop"])
def test_a_broken_model_dead_letters_every_row_or_stops_the_pipeline(
    bootstrap_servers: str, topics: Topics, policy: str
) -> None:
    total = 120
    produce_values(bootstrap_servers, topics.input, [float(i + 1) for i in range(total)])
    config = config_for(
        bootstrap_servers,
        topics,
        "tests.support.faulty:broken",
        worker={"on_model_failure": policy},
        batching=FULL_BATCHES,
        pipeline=LONGEST_TARGET,
    )
    pipeline = Pipeline(config)
    summary = pipeline.run(exit_when_idle_s=3)
    verdict = verify(bootstrap_servers, topics.input, topics.output, topics.dlq, topics.group)
    report(f"broken model, {policy}", verdict)
    assert verdict.results == 0 and verdict.duplicates == 0
    if policy == "dead_letter":
        assert summary.exit_code == 0, summary.error
        assert verdict.dead_lettered == total and verdict.missing == []
        assert verdict.committed_equals_end
        for _, _, headers, _ in read_topic(bootstrap_servers, topics.dlq).records.values():
            assert headers[H_STAGE] == b"model" and b"weights missing" in headers[H_MESSAGE]
        # judged broken: later batches are dead-lettered whole, not narrowed down
        assert metric(pipeline, "streamproc_model_broken_batches_total", topics.input) >= 1
    else:
        assert summary.exit_code == 1
        assert summary.error is not None and "worker.on_model_failure is stop" in summary.error
        assert "weights missing" in summary.error
        assert verdict.dead_lettered == 0  # nothing dead-lettered: the offsets stay uncommitted
        assert not verdict.committed_equals_end


def test_out_of_memory_from_the_start_caps_batches_at_warm_up_and_loses_nothing(
    bootstrap_servers: str, topics: Topics
) -> None:
    total = 300
    produce_values(bootstrap_servers, topics.input, [float(i) for i in range(total)])
    config = config_for(
        bootstrap_servers,
        topics,
        "tests.support.faulty:out_of_memory",
        pipeline={"options": {"fits": 12}},
        batching={"max_batch_size": 64, "max_wait_ms": 200, "adaptive_batch_size": False},
    )
    pipeline = Pipeline(config)
    summary = pipeline.run(exit_when_idle_s=3)
    assert summary.exit_code == 0, summary.error
    verdict = verify(bootstrap_servers, topics.input, topics.output, topics.dlq, topics.group)
    report("out of memory above 12 rows from the start", verdict)
    assert verdict.results == total and verdict.dead_lettered == 0
    assert verdict.missing == [] and verdict.duplicates == 0 and verdict.committed_equals_end
    assert metric(pipeline, "streamproc_batch_size_cap", topics.input) == 12
    sizes = summary.batch_sizes[topics.input]
    assert max(sizes) == 12  # the cap reached the batcher: no batch was cut larger
    assert metric(pipeline, "streamproc_device_out_of_memory_total", topics.input) == 0


def test_out_of_memory_that_comes_later_splits_batches_and_the_cap_recovers_when_it_goes(
    bootstrap_servers: str, topics: Topics, tmp_path: Path
) -> None:
    pressure = tmp_path / "pressure"
    config = config_for(
        bootstrap_servers,
        topics,
        "tests.support.faulty:out_of_memory",
        pipeline={"options": {"fits": 12, "pressure_file": str(pressure)}, **LONGEST_TARGET},
        # a burst forms batches above 12 rows even when the producer is slowed by load (the
        # longest target keeps the 500 ms wait in force: normal's default target caps it at 25)
        batching={"max_batch_size": 64, "max_wait_ms": 500, "adaptive_batch_size": False},
        worker={"oom_recovery_s": 1.0},
    )
    pipeline = Pipeline(config)
    topic = topics.input
    summary: list[RunSummary] = []
    runner = threading.Thread(target=lambda: summary.append(pipeline.run()))
    runner.start()
    produced = 0
    lowest = math.inf

    def cap() -> float:
        nonlocal lowest
        value = metric(pipeline, "streamproc_batch_size_cap", topic)
        lowest = min(lowest, value)
        return value

    def send(count: int) -> None:
        nonlocal produced
        produce_values(bootstrap_servers, topic, [float(produced + i) for i in range(count)])
        produced += count
        wait_for(
            lambda: end_offset_total(bootstrap_servers, topics.output) >= produced,
            120,
            f"{produced} results",
        )

    try:
        send(200)  # no pressure: full batches, the cap stays at 64
        assert cap() == 64
        pressure.touch()  # memory pressure appears
        send(300)
        assert cap() <= 12  # fell to at most what fits
        assert metric(pipeline, "streamproc_device_out_of_memory_total", topic) >= 1
        pressure.unlink()  # and goes
        wait_for(lambda: (send(40), cap())[1] == 64, 180, "the cap back at 64")
    finally:
        pipeline.request_stop()
        runner.join(120)
    assert summary and summary[0].exit_code == 0, summary
    assert lowest <= 12
    verdict = verify(bootstrap_servers, topic, topics.output, topics.dlq, topics.group)
    report("out of memory above 12 rows for a while", verdict)
    assert verdict.inputs == produced and verdict.results == produced
    assert verdict.dead_lettered == 0  # an out-of-memory error is never the rows' fault
    assert verdict.missing == [] and verdict.duplicates == 0 and verdict.committed_equals_end
