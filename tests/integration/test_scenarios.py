"""Failure scenarios found by an independent test set, each reproduced against the real broker.

* one oversized result must not drag the valid results of its record batch into the
  dead-letter topic;
* ``run --exit-when-idle-s`` must not count the wait for a first assignment as idle;
* late results (a partition revoked while its batch was in flight) are counted as they happen;
* an unknown librdkafka key is a start-up configuration error, not a traceback.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from confluent_kafka.admin import AdminClient

from streamproc.config import load_config
from streamproc.device.staging import LEAK_EVENT
from streamproc.kafka.admin import ensure_topics
from streamproc.output.headers import H_OFFSET, H_STAGE
from streamproc.pipeline import Pipeline
from streamproc.records import Record, TopicPartition
from streamproc.tools.replay import produce
from streamproc.tools.verify import read_topic, verify
from tests.integration.conftest import (
    Topics,
    members_assigned,
    report,
    start_consumer,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.failures


def test_one_oversized_result_never_dead_letters_its_valid_neighbours(
    bootstrap_servers: str, topics: Topics
) -> None:
    # Output topic limit 64 KiB; the inputs at offsets 50 and 150 of each partition get a
    # 200 kB incompressible result. The broker refuses a whole record batch for one such
    # record; only the oversized results may be dead-lettered (stage produce).
    total = 300
    output = f"{topics.output}.small"
    created = ensure_topics(
        bootstrap_servers, {output: 3}, topic_config={"max.message.bytes": "65536"}
    )
    assert created == [output]
    produce("trades", topics.input, bootstrap_servers, 3, limit=total, progress=False)
    config = load_config(
        overrides={
            "kafka": {
                "bootstrap_servers": bootstrap_servers,
                "group_id": topics.group,
                "commit_interval_ms": 200,
            },
            "pipelines": [
                {
                    "name": "p",
                    "input_topic": topics.input,
                    "output_topic": output,
                    "workload": "tests.support.slow:bloated_some",
                    "options": {"size_bytes": 200_000, "every": 100, "at": 50},
                    "dlq_topic": topics.dlq,
                }
            ],
            "batching": {"max_batch_size": 64, "max_wait_ms": 50},
            "metrics": {"port": 0},
        }
    )
    summary = Pipeline(config).run(exit_when_idle_s=2)
    assert summary.exit_code == 0, summary.error
    verdict = verify(bootstrap_servers, topics.input, output, topics.dlq, topics.group)
    report("oversized neighbour", verdict)
    assert verdict.missing == [] and verdict.duplicates == 0 and verdict.committed_equals_end
    dead = read_topic(bootstrap_servers, topics.dlq).records.values()
    dead_offsets = sorted(int(h[H_OFFSET]) for _, _, h, _ in dead)
    assert all(h[H_STAGE] == b"produce" for _, _, h, _ in dead)
    assert dead_offsets and all(o % 100 == 50 for o in dead_offsets), dead_offsets
    assert verdict.results == total - len(dead_offsets)


def _run_until_idle(config: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``streamproc run --exit-when-idle-s 1`` as a real process, to completion."""
    args = ["run", "--config", str(config), "--exit-when-idle-s", "1"]
    run = subprocess.run(
        [sys.executable, "-m", "streamproc", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert LEAK_EVENT not in run.stdout + run.stderr, run.stderr  # the pool leak check
    return run


def test_exit_when_idle_waits_for_the_first_assignment_after_a_member_died(
    bootstrap_servers: str, topics: Topics, tmp_path: Path
) -> None:
    # A member killed with -9 holds its partitions until the coordinator expires it (its
    # session timeout, 45 s here). A run with --exit-when-idle-s meanwhile is not idle: with an
    # assignment bound shorter than that it fails and says why; without, it waits, processes
    # everything and exits 0. (It used to exit 0 with "0 consumed" after its own session
    # timeout of 6 s.) The input is written before the doomed member joins, which starts at
    # the end (it must hold the partitions, not process them): the impatient run then starts
    # right after the kill, well inside the 45 s even on a loaded machine (with a 15 s session
    # and the input written after the kill, a loaded machine let the member expire first).
    total = 200
    produce("trades", topics.input, bootstrap_servers, 3, limit=total, progress=False)
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    log = tmp_path / "consumer.log"
    kafka = {
        "bootstrap_servers": bootstrap_servers,
        "group_id": topics.group,
        "commit_interval_ms": 200,
        "session_timeout_ms": 6_000,
    }
    doomed_kafka = {**kafka, "session_timeout_ms": 45_000, "auto_offset_reset": "latest"}
    doomed = start_consumer(
        write_config(tmp_path / "doomed.yaml", bootstrap_servers, topics, kafka=doomed_kafka),
        log,
        idle_s=None,
    )
    try:
        wait_for(lambda: members_assigned(admin, topics.group) == 1, 120, "the first member")
    finally:
        doomed.kill()
        doomed.wait(10)
    short = {**kafka, "assignment_timeout_s": 3}
    impatient = write_config(tmp_path / "short.yaml", bootstrap_servers, topics, kafka=short)
    run = _run_until_idle(impatient, timeout_s=120)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "no partition assigned within 3 s" in run.stderr
    assert "0 consumed" in run.stdout
    patient = write_config(tmp_path / "patient.yaml", bootstrap_servers, topics, kafka=kafka)
    run = _run_until_idle(patient, timeout_s=180)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{total} consumed" in run.stdout
    verdict = verify(bootstrap_servers, topics.input, topics.output, topics.dlq, topics.group)
    report("idle exit after a dead member", verdict)
    assert verdict.missing == [] and verdict.committed_equals_end


def test_late_results_move_the_counter_while_the_process_runs(
    bootstrap_servers: str, topics: Topics
) -> None:
    # The tracker's late results reach streamproc_late_results_total as they happen (it was
    # copied from the tracker only at close, after the HTTP endpoint had stopped).
    config = load_config(
        overrides={
            "kafka": {"bootstrap_servers": bootstrap_servers, "group_id": topics.group},
            "pipelines": [
                {
                    "name": "p",
                    "input_topic": topics.input,
                    "output_topic": topics.output,
                    "workload": "trades",
                }
            ],
            "metrics": {"port": 0},
        }
    )
    pipeline = Pipeline(config)
    try:
        tracker, registry = pipeline.tracker, pipeline.metrics.registry
        tp = TopicPartition(topics.input, 0)
        generation = tracker.assign([tp])[tp]
        records = [Record(tp, o, None, b"{}", (), 0, 0.0, generation) for o in range(3)]
        tracker.consumed_many(records)
        tracker.revoke([tp])  # revoked while the batch was in flight
        tracker.done_many(records[:2])
        tracker.done(tp, 2, generation)
        assert registry.get_sample_value("streamproc_late_results_total") == 3
        assert tracker.commit_candidates() == {}
    finally:
        pipeline.close()


def test_an_unknown_librdkafka_key_is_a_start_up_error_naming_it(
    bootstrap_servers: str, topics: Topics, tmp_path: Path
) -> None:
    for section in ("consumer", "producer"):
        path = tmp_path / f"{section}.yaml"
        write_config(
            path,
            bootstrap_servers,
            topics,
            kafka={
                "bootstrap_servers": bootstrap_servers,
                "group_id": topics.group,
                section: {"fetch.max.wait.msec": 5},
            },
        )
        assert yaml.safe_load(path.read_text())["kafka"][section]
        run = subprocess.run(
            [sys.executable, "-m", "streamproc", "run", "--config", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 2, run.stderr
        assert f"kafka.{section}" in run.stderr and "fetch.max.wait.msec" in run.stderr
        assert "Traceback" not in run.stderr
