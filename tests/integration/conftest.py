"""Integration helpers: unique topics per test, config builder, output counting, and the pool
leak check after every test that ran a pipeline (in this process or as ``streamproc run``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from confluent_kafka import Consumer, KafkaException
from confluent_kafka import TopicPartition as KafkaTopicPartition
from confluent_kafka.admin import AdminClient

from streamproc.config import Config, load_config
from streamproc.device.staging import LEAK_EVENT
from streamproc.kafka.admin import ensure_topics
from streamproc.kafka.transient import raise_error, retry_transient
from streamproc.pipeline import Pipeline, State
from streamproc.tools.tracing_local import LocalTracing
from streamproc.tools.verify import Verdict, verify

_CONSUMER_LOGS: list[Path] = []  # logs of `streamproc run` processes started by this test
_PROCESSES: list[subprocess.Popen[bytes]] = []  # processes started by this test
STOP_GRACE_S = 20.0  # SIGTERM -> SIGKILL at teardown: a drain on a loaded machine takes a while


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> int:
    """Stop ``proc`` if it still runs (SIGTERM, SIGKILL after ``grace_s``) and reap it; returns
    its exit status. Safe to call on a process that already ended."""
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


@pytest.fixture(autouse=True)
def no_pool_leaks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Pipeline]]:
    """After the test: every process it started through :func:`start_consumer` is stopped
    and reaped (whether the test passed or failed: no process outlives its test, none is left
    for the garbage collector to warn about in a later test); every pipeline it created and
    closed gave every staging slab and output buffer set back (``Pipeline.leaks`` is empty),
    and no ``streamproc run`` process it started through :func:`start_consumer` (or
    :func:`watch_consumer_log`) logged a pool leak."""
    created: list[Pipeline] = []
    original = Pipeline.__init__

    def record(self: Pipeline, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        created.append(self)

    monkeypatch.setattr(Pipeline, "__init__", record)
    _CONSUMER_LOGS.clear()
    _PROCESSES.clear()
    try:
        yield created
    finally:
        while _PROCESSES:
            stop_process(_PROCESSES.pop())
    leaked = [p.leaks for p in created if p.state is State.CLOSED and p.leaks]
    assert not leaked, f"pool leak at close: {leaked}"
    for path in _CONSUMER_LOGS:
        text = path.read_text(errors="replace") if path.exists() else ""
        lines = [line for line in text.splitlines() if LEAK_EVENT in line]
        assert not lines, f"pool leak in {path}:\n" + "\n".join(lines)


def watch_consumer_log(log: Path) -> Path:
    """Have the leak check read the output of a ``streamproc run`` process at the end of the
    test (returns ``log``)."""
    _CONSUMER_LOGS.append(log)
    return log


@dataclass(frozen=True)
class Topics:
    input: str
    output: str
    dlq: str
    group: str


@pytest.fixture
def topics(bootstrap_servers: str) -> Topics:
    suffix = uuid.uuid4().hex[:8]
    t = Topics(f"frames.{suffix}", f"labels.{suffix}", f"frames.{suffix}.dlq", f"g-{suffix}")
    ensure_topics(bootstrap_servers, {t.input: 3, t.output: 3, t.dlq: 1})
    return t


def make_config(bootstrap: str, t: Topics, **overrides: Any) -> Config:
    data: dict[str, Any] = {
        "kafka": {"bootstrap_servers": bootstrap, "group_id": t.group, "commit_interval_ms": 200},
        "pipelines": [
            {
                "name": "frames",
                "input_topic": t.input,
                "output_topic": t.output,
                "workload": "video",
            }
        ],
        "metrics": {"port": 0},
        "batching": {"max_batch_size": 4, "max_wait_ms": 10},
    }
    data.update(overrides)
    return load_config(overrides=data)


def write_config(
    path: Path,
    bootstrap: str,
    t: Topics,
    kafka: dict[str, Any] | None = None,
    **overrides: Any,
) -> Path:
    """Write a YAML config for a consumer subprocess; ``kafka`` adds to (or replaces keys of)
    the kafka section, ``overrides`` replace top-level keys."""
    data: dict[str, Any] = {
        "kafka": {
            "bootstrap_servers": bootstrap,
            "group_id": t.group,
            "commit_interval_ms": 200,
            **(kafka or {}),
        },
        "pipelines": [
            {"name": "p", "input_topic": t.input, "output_topic": t.output, "workload": "trades"}
        ],
        "metrics": {"port": 0},
        "batching": {"max_batch_size": 4, "max_wait_ms": 10},
    }
    data.update(overrides)
    path.write_text(yaml.safe_dump(data))
    return path


def start_consumer(
    config: Path, log: Path, idle_s: float | None = 2.0, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """``streamproc run`` as a real process (output appended to ``log``); stopped and reaped
    at the end of the test if it still runs (:func:`no_pool_leaks`)."""
    args = [sys.executable, "-m", "streamproc", "run", "--config", str(config)]
    if idle_s is not None:
        args += ["--exit-when-idle-s", str(idle_s)]
    watch_consumer_log(log)
    with log.open("ab") as out:  # the child holds its own copy of the descriptor
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    _PROCESSES.append(proc)
    return proc


def end_offset_total(bootstrap: str, topic: str, deadline_s: float = 60.0) -> int:
    """Sum of the topic's high watermarks (records written so far); transient broker errors
    (a leader moving, a coordinator loading, a request timing out on a loaded machine) are
    retried for up to ``deadline_s`` seconds."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "probe"})

    def total() -> int:
        metadata = consumer.list_topics(topic, timeout=10).topics[topic]
        raise_error(metadata.error)
        return sum(
            consumer.get_watermark_offsets(KafkaTopicPartition(topic, p), timeout=10)[1]
            for p in metadata.partitions
        )

    try:
        return retry_transient(total, deadline_s, f"end offsets of {topic}")
    finally:
        consumer.close()


def committed_results(bootstrap: str, topics: Topics) -> int:
    """Results on ``topics.output`` that a ``read_committed`` reader sees (the verifier's
    count). Under exactly-once a wait for "every result" must count these, not the end offsets:
    each committed transaction also writes a marker to every output partition it touched, so
    the end offsets reach the input's count while results are still to come (CI on 749f31c:
    end offsets at 600 with 8 results left, cut only at the next max wait)."""
    return verify(bootstrap, topics.input, topics.output, topics.dlq, topics.group).results


def report(name: str, verdict: Verdict) -> None:
    """Print the verifier's counts for one scenario (visible with -s and in CI logs)."""
    print(
        f"\n[{name}] inputs={verdict.inputs} results={verdict.results} "
        f"dead={verdict.dead_lettered} missing={len(verdict.missing)} "
        f"duplicates={verdict.duplicates} committed==end={verdict.committed_equals_end} "
        f"stable={verdict.output_stable}"
    )


def members_assigned(admin: AdminClient, group: str) -> int:
    """Members of ``group`` that hold at least one partition, as the coordinator says."""
    try:
        description = admin.describe_consumer_groups([group])[group].result(10)
    except KafkaException:
        return 0
    return sum(1 for m in description.members if m.assignment.topic_partitions)


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``condition`` until true; fail the test after ``timeout_s``."""
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline_s:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)


def ownership_events(log: Path) -> list[tuple[str, str, float]]:
    """``(assigned | revoked | lost, "topic[partition]", epoch seconds)`` from a consumer's JSON
    log, in order."""
    events = []
    for line in log.read_text().splitlines():
        if not line.startswith("{"):
            continue
        doc = json.loads(line)
        if doc.get("event") in ("partitions assigned", "partitions revoked", "partitions lost"):
            ts = datetime.fromisoformat(doc["timestamp"].replace("Z", "+00:00")).timestamp()
            for partition in doc["partitions"]:
                events.append((doc["event"].split()[1], partition, ts))
    return events


@pytest.fixture(scope="session")
def tracing_backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalTracing]:
    """The local trace backend (Zipkin behind the collector) for the tracing tests."""
    tracing = LocalTracing(tmp_path_factory.mktemp("tracing"))
    tracing.start()
    try:
        yield tracing
    finally:
        tracing.stop()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real MLflow tracking server (SQLite store, loopback) for the session, shared by every
    module that needs one (each test registers models of its own name); yields its tracking
    URI."""
    from streamproc.tools.mlflow_local import LocalMlflow, ensure_mlflow_server

    server = LocalMlflow(tmp_path_factory.mktemp("mlflow"), ensure_mlflow_server())
    server.start()
    try:
        yield server.tracking_uri
    finally:
        server.stop()
