"""Versioned models against the real broker: a live swap during a replay, a refused version, an
automatic rollback, shadow scoring, and the admin endpoint.

The pipeline runs the iot workload on the packaged recording; its versions are TorchScript files
of the packaged autoencoder in a model repository folder (``tests/support/model_versions.py``).
"""

from __future__ import annotations

import itertools
import socket
import threading
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from streamproc.config import Config, load_config
from streamproc.errors import ConfigError
from streamproc.output.headers import H_MODEL_VERSION, H_OFFSET, H_PARTITION
from streamproc.output.sink import Sink
from streamproc.pipeline import Pipeline, RunSummary
from streamproc.tools.model_admin import AdminCallFailed, models_state, use_version
from streamproc.tools.replay import produce
from streamproc.tools.verify import TopicDump, Verdict, read_topic, verify
from tests.integration.conftest import (
    Topics,
    committed_results,
    report,
    wait_for,
)
from tests.support import model_versions
from tests.support.model_versions import iot_module, write_version

pytestmark = pytest.mark.models

TOKEN = "s3cret-admin-token"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    write_version(root, "1", iot_module())
    return root


def versioned_config(
    bootstrap: str, t: Topics, repository: Path | None, port: int = 0, **model: Any
) -> Config:
    guarantee = model.pop("guarantee", "at_least_once")
    location = {} if repository is None else {"source": "folder", "repository": str(repository)}
    return load_config(
        overrides={
            "kafka": {
                "bootstrap_servers": bootstrap,
                "group_id": t.group,
                "commit_interval_ms": 200,
            },
            "processing_guarantee": guarantee,
            "pipelines": [
                {
                    "name": "iot",
                    "input_topic": t.input,
                    "output_topic": t.output,
                    "dlq_topic": t.dlq,
                    "workload": "iot",
                    "model": {
                        **location,
                        "name": "iot",
                        "version": "1",
                        "poll_interval_s": 0,
                        **model,
                    },
                }
            ],
            "metrics": {"port": port, "host": "127.0.0.1"},
            "admin": {"token": TOKEN},
            "worker": {"device": "cpu"},
            "batching": {"max_batch_size": 32, "max_wait_ms": 20},
        }
    )


class Running:
    """A pipeline running on a thread until idle."""

    def __init__(self, pipeline: Pipeline, idle_s: float = 4.0) -> None:
        self.pipeline = pipeline
        self.summary: list[RunSummary] = []
        self._thread = threading.Thread(
            target=lambda: self.summary.append(pipeline.run(exit_when_idle_s=idle_s))
        )
        self._thread.start()

    def metric(self, name: str, **labels: str) -> float:
        value = self.pipeline.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def join(self, timeout_s: float = 180.0) -> RunSummary:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the pipeline did not stop"
        return self.summary[0]


def replay(bootstrap: str, topic: str, limit: int, rate: float | None = None) -> threading.Thread:
    thread = threading.Thread(
        target=produce,
        args=("iot", topic, bootstrap),
        kwargs={"limit": limit, "rate": rate, "progress": False, "partitions": 3},
    )
    thread.start()
    return thread


def verified(bootstrap: str, t: Topics) -> tuple[TopicDump, Verdict]:
    """The output topic and the verifier's counts (missing, duplicates, committed offsets)."""
    outputs = read_topic(bootstrap, t.output)
    return outputs, verify(bootstrap, t.input, t.output, t.dlq, t.group, outputs=outputs)


def finished(
    producer: threading.Thread, running: Running, bootstrap: str, t: Topics
) -> tuple[TopicDump, Verdict]:
    """Once the replay is written and the pipeline has exited 0 (idle), :func:`verified`."""
    producer.join(120)
    assert not producer.is_alive(), "the replay did not finish"
    summary = running.join()
    assert summary.exit_code == 0, summary.error
    return verified(bootstrap, t)


def versions_by_partition(dump: TopicDump) -> dict[int, list[tuple[int, str]]]:
    """Per input partition, (input offset, model version) of each result in offset order."""
    found: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for _, _, headers, _ in dump.records.values():
        found[int(headers[H_PARTITION])].append(
            (int(headers[H_OFFSET]), headers[H_MODEL_VERSION].decode())
        )
    return {p: sorted(v) for p, v in found.items()}


@pytest.fixture
def versions_per_transaction(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[int, set[str]]]:
    """Per transaction (its index: commits + aborts before it), the model versions of the
    results produced in it (instruments the sink and the transactions)."""
    from streamproc.offsets.transactions import Transactions

    seen: dict[int, set[str]] = defaultdict(set)
    current = threading.local()
    send_results, produce_many = Sink.send_results, Transactions.produce_many

    def send(
        self: Sink,
        topic: str,
        records: Any,
        values: Any,
        headers: Any,
        dlq: str,
        *rest: Any,
        **options: Any,
    ) -> Any:
        current.versions = {dict(h)[H_MODEL_VERSION].decode() for h in headers}
        try:
            return send_results(self, topic, records, values, headers, dlq, *rest, **options)
        finally:
            current.versions = set()

    def produce_rows(self: Transactions, produce_fn: Any, rows: Any) -> Any:
        with self.lock:
            seen[self.commits + self.aborts].update(getattr(current, "versions", set()))
            return produce_many(self, produce_fn, rows)

    monkeypatch.setattr(Sink, "send_results", send)
    monkeypatch.setattr(Transactions, "produce_many", produce_rows)
    yield seen


@pytest.mark.parametrize("guarantee", ["at_least_once", "exactly_once"])
def test_a_swap_during_a_replay_loses_nothing_and_changes_version_once_per_partition(
    bootstrap_servers: str,
    topics: Topics,
    repository: Path,
    guarantee: str,
    versions_per_transaction: dict[int, set[str]],
) -> None:
    write_version(repository, "2", iot_module(scale=1.2))
    port = free_port()
    config = versioned_config(bootstrap_servers, topics, repository, port, guarantee=guarantee)
    running = Running(Pipeline(config))
    total = 3000
    producer = replay(bootstrap_servers, topics.input, total, rate=500)
    topic = topics.input
    wait_for(
        lambda: running.metric("streamproc_model_batches_total", topic=topic, version="1") >= 10,
        120,
        "batches of version 1",
    )
    source = running.pipeline.stages.source
    generations = dict(source.assignment.generations)
    answer = use_version(f"http://127.0.0.1:{port}", TOKEN, "iot", "2")
    assert answer == {"pipeline": "iot", "version": "2", "done": "pending"}
    wait_for(
        lambda: running.metric("streamproc_model_batches_total", topic=topic, version="2") >= 5,
        120,
        "batches of version 2",
    )
    state = models_state(f"http://127.0.0.1:{port}")["iot"]
    assert state["serving"] == "2" and state["previous"] == "1"  # in probation
    assert dict(source.assignment.generations) == generations  # no rebalance, no rewind
    outputs, verdict = finished(producer, running, bootstrap_servers, topics)
    report(f"swap during a replay, {guarantee}", verdict)
    assert verdict.inputs == total and verdict.dead_lettered == 0 and verdict.missing == []
    assert verdict.committed_equals_end
    if guarantee == "exactly_once":
        assert verdict.duplicates == 0
    events = running.pipeline.stages.managers[0].versions.state()["events"]
    assert not any(e["kind"] == "rolled_back" for e in events), events
    for partition, seq in versions_by_partition(outputs).items():
        names = [version for _, version in seq]
        assert set(names) <= {"1", "2"}
        changes = sum(a != b for a, b in itertools.pairwise(names))
        assert changes == 1 and names[0] == "1" and names[-1] == "2", (partition, changes)
    assert running.metric("streamproc_model_swaps_total", topic=topic, reason="operator") == 1
    assert running.metric("streamproc_model_swap_pause_seconds_count", topic=topic) == 1
    pause = running.metric("streamproc_model_swap_pause_seconds_sum", topic=topic)
    print(
        f"\n[swap pause, {guarantee}] {pause * 1000:.1f} ms between the last result of 1 "
        "and the first of 2"
    )
    if guarantee == "exactly_once":
        mixed = {index: v for index, v in versions_per_transaction.items() if len(v) > 1}
        assert not mixed, f"transactions holding two versions: {mixed}"
        assert len(versions_per_transaction) > 1


def test_a_broken_version_is_refused_and_the_serving_one_goes_on(
    bootstrap_servers: str, topics: Topics, repository: Path
) -> None:
    write_version(repository, "2", None)  # not a TorchScript file
    write_version(repository, "3", "tests.support.model_versions:raises_always")
    port = free_port()
    config = versioned_config(bootstrap_servers, topics, repository, port)
    running = Running(Pipeline(config))
    total = 600
    producer = replay(bootstrap_servers, topics.input, total, rate=200)
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(AdminCallFailed) as refused:
        use_version(url, TOKEN, "iot", "2")
    assert refused.value.status == 422 and "does not load" in str(refused.value)
    with pytest.raises(AdminCallFailed) as refused_warmup:
        use_version(url, TOKEN, "iot", "3")
    assert refused_warmup.value.status == 422 and "warm-up" in str(refused_warmup.value)
    with pytest.raises(AdminCallFailed) as unauthorised:
        use_version(url, "wrong", "iot", "1")
    assert unauthorised.value.status == 401
    outputs, verdict = finished(producer, running, bootstrap_servers, topics)
    assert verdict.results == total and verdict.missing == [] and verdict.dead_lettered == 0
    assert {v for seq in versions_by_partition(outputs).values() for _, v in seq} == {"1"}
    topic = topics.input
    refused = "streamproc_model_refused_versions_total"
    assert running.metric(refused, topic=topic, reason="load", attempt="first") == 1
    assert running.metric(refused, topic=topic, reason="warmup", attempt="first") == 1
    assert running.metric("streamproc_model_serving", topic=topic, version="1") == 1


def test_a_version_that_raises_once_serving_is_rolled_back_automatically(
    bootstrap_servers: str, topics: Topics, repository: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_version(repository, "3", "tests.support.model_versions:fails_on_live")
    total = 1500
    produce(
        "iot", topics.input, bootstrap_servers, partitions=3, limit=total, progress=False
    )  # a backlog: full batches from the start
    config = versioned_config(
        bootstrap_servers,
        topics,
        repository,
        rollback={"min_batches": 3, "max_error_share": 0.2, "window_batches": 50},
    )
    pipeline = Pipeline(config)
    pipeline.start()
    manager = pipeline.stages.managers[0]
    assert manager.request("3").result(120) == {
        "pipeline": "iot",
        "version": "3",
        "done": "pending",
    }
    topic = topics.input
    summary_holder: list[RunSummary] = []
    runner = threading.Thread(
        target=lambda: summary_holder.append(pipeline.run(exit_when_idle_s=3))
    )
    runner.start()
    runner.join(180)
    assert summary_holder and summary_holder[0].exit_code == 0, summary_holder
    registry = pipeline.metrics.registry

    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, {"topic": topic, **labels}) or 0.0

    outputs, verdict = verified(bootstrap_servers, topics)
    report("rollback on errors", verdict)
    # every batch version 3 raised on ran on version 1 instead: nothing dead-lettered
    assert verdict.results == total and verdict.missing == [] and verdict.dead_lettered == 0
    assert {v for seq in versions_by_partition(outputs).values() for _, v in seq} == {"1"}
    assert value("streamproc_model_rollbacks_total", reason="errors") == 1
    assert value("streamproc_model_fallback_batches_total", version="1") >= 3
    assert value("streamproc_model_serving", version="1") == 1
    assert value("streamproc_model_serving", version="3") == 0
    state = manager.versions.state()
    assert state["serving"] == "1" and "3" in state["refused"]
    assert any(e["kind"] == "rolled_back" and e["version"] == "3" for e in state["events"])


def test_a_version_that_served_well_then_breaks_is_rolled_back_and_dead_letters_nothing(
    bootstrap_servers: str, topics: Topics, repository: Path
) -> None:
    """Issue 39: version 2 passed its probation, then raised on every call; by default no row
    goes to the dead-letter topic: version 1 is reloaded from the repository and serves."""
    config = versioned_config(
        bootstrap_servers,
        topics,
        repository,
        guarantee="exactly_once",
        version="latest",
        poll_interval_s=0.2,
        rollback={"window_batches": 5, "min_batches": 2},
    )
    pipeline = Pipeline(config)
    topic = topics.input
    versions = pipeline.stages.managers[0].versions
    registry = pipeline.metrics.registry
    summary: list[RunSummary] = []
    runner = threading.Thread(target=lambda: summary.append(pipeline.run()))
    produced = 0

    def feed(count: int) -> None:
        nonlocal produced
        produce("iot", topic, bootstrap_servers, partitions=3, limit=count, progress=False)
        produced += count

    def passed_probation(name: str) -> bool:
        feed(32)  # traffic while waiting: the new version serves its window
        events = versions.state()["events"]
        return any(e["kind"] == "probation_passed" and e["version"] == name for e in events)

    try:
        runner.start()
        feed(300)
        wait_for(
            lambda: (
                (
                    registry.get_sample_value(
                        "streamproc_model_batches_total", {"topic": topic, "version": "1"}
                    )
                    or 0
                )
                >= 3
            ),
            120,
            "batches of version 1",
        )
        write_version(repository, "2", "tests.support.model_versions:breaks_on_signal")
        wait_for(lambda: passed_probation("2"), 180, "version 2 through its probation")
        assert versions.resident() == ("2",)  # version 1 let go: only the source has it
        model_versions.BREAK.set()  # version 2 raises on every call from now on
        feed(1500)
        wait_for(
            lambda: committed_results(bootstrap_servers, topics) >= produced,
            180,
            f"{produced} results",
        )
    finally:
        model_versions.BREAK.clear()
        pipeline.request_stop()
        runner.join(120)
    assert summary and summary[0].exit_code == 0, summary
    outputs, verdict = verified(bootstrap_servers, topics)
    report("a version that served well breaks, exactly-once, hold", verdict)
    assert verdict.inputs == produced and verdict.results == produced
    assert verdict.dead_lettered == 0  # not one valid record dead-lettered
    assert verdict.missing == [] and verdict.duplicates == 0 and verdict.committed_equals_end
    for partition, seq in versions_by_partition(outputs).items():
        names = [name for _, name in seq]
        assert names[0] == "1" and names[-1] == "1" and "2" in names, partition
    state = versions.state()
    assert state["serving"] == "1" and "2" in state["refused"]
    assert any(e["kind"] == "rolled_back" and e["version"] == "2" for e in state["events"])
    assert (
        registry.get_sample_value(
            "streamproc_model_rollbacks_total", {"topic": topic, "reason": "broken"}
        )
        == 1
    )
    assert (
        registry.get_sample_value("streamproc_model_held", {"topic": topic, "device": "cpu:0"}) == 0
    )


@pytest.mark.parametrize("same_weights", [False, True])
def test_shadow_scoring_produces_nothing_and_measures_agreement(
    bootstrap_servers: str, topics: Topics, repository: Path, same_weights: bool
) -> None:
    config = versioned_config(
        bootstrap_servers,
        topics,
        repository,
        poll_interval_s=0.2,
        version="latest",
        mode="shadow",
        shadow={"sample": 1.0, "promote_after_batches": 20, "promote_max_latency_ratio": 100.0},
    )
    running = Running(Pipeline(config))
    topic = topics.input
    write_version(repository, "2", iot_module(scale=1.0 if same_weights else 1.2))
    total = 2000
    producer = replay(bootstrap_servers, topics.input, total, rate=400)
    wait_for(
        lambda: running.metric("streamproc_shadow_batches_total", topic=topic, version="2") >= 20,
        120,
        "shadowed batches",
    )
    outputs, verdict = finished(producer, running, bootstrap_servers, topics)
    assert verdict.results == total and verdict.missing == []
    agreement = running.metric("streamproc_shadow_agreement_ratio", topic=topic, version="2")
    made_by = [v for seq in versions_by_partition(outputs).values() for _, v in seq]
    print(
        f"\n[shadow, same weights {same_weights}] agreement {agreement:.4f}, "
        f"results by version {dict((v, made_by.count(v)) for v in set(made_by))}"
    )
    if same_weights:
        assert agreement == 1.0
        # promoted once 20 shadowed batches all agreed: later results come from version 2
        assert running.metric("streamproc_model_swaps_total", topic=topic, reason="promoted") == 1
        assert made_by.count("2") > 0
    else:
        assert agreement < 0.99  # other weights: the candidate disagrees, never promoted
        assert set(made_by) == {"1"}  # the candidate's results never reached the output topic
        assert running.metric("streamproc_model_swaps_total", topic=topic, reason="promoted") == 0


def test_an_mlflow_alias_moved_during_a_replay_swaps_the_version_live(
    bootstrap_servers: str, topics: Topics, mlflow_server: str, tmp_path: Path
) -> None:
    from streamproc.models.mlflow_source import register_version

    name = f"iot-{topics.group}"
    files = tmp_path / "files"
    for version, scale in (("1", 1.0), ("2", 1.2)):
        write_version(files, version, iot_module(scale))
    first = register_version(mlflow_server, name, files / "iot" / "1" / "model.pt2", "champion")
    config = versioned_config(
        bootstrap_servers,
        topics,
        None,
        source="mlflow",
        tracking_uri=mlflow_server,
        name=name,
        version="@champion",
        poll_interval_s=0.5,
    )
    running = Running(Pipeline(config))
    topic = topics.input
    total = 2400
    producer = replay(bootstrap_servers, topics.input, total, rate=400)
    wait_for(
        lambda: running.metric("streamproc_model_batches_total", topic=topic, version=first) >= 5,
        120,
        "batches of the first version",
    )
    second = register_version(mlflow_server, name, files / "iot" / "2" / "model.pt2", "champion")
    wait_for(
        lambda: running.metric("streamproc_model_batches_total", topic=topic, version=second) >= 5,
        120,
        "batches of the version the alias moved to",
    )
    outputs, verdict = finished(producer, running, bootstrap_servers, topics)
    report("mlflow alias moved", verdict)
    assert verdict.inputs == total and verdict.missing == [] and verdict.dead_lettered == 0
    for seq in versions_by_partition(outputs).values():
        names = [v for _, v in seq]
        assert names[0] == first and names[-1] == second
        assert sum(a != b for a, b in itertools.pairwise(names)) == 1
    assert running.metric("streamproc_model_swaps_total", topic=topic, reason="new") == 1


def test_a_newest_version_that_does_not_load_is_passed_over_at_start_up(
    bootstrap_servers: str, topics: Topics, repository: Path
) -> None:
    broken = write_version(repository, "2", None)  # the newest: not a model at all
    config = versioned_config(
        bootstrap_servers, topics, repository, version="latest", poll_interval_s=0.05
    )
    pipeline = Pipeline(config)  # builds every stage: the model versions among them
    try:
        manager = pipeline.stages.managers[0]
        versions = manager.versions
        assert versions.serving == "1" and versions.resident() == ("1",)
        assert "2" in versions.refused  # polling does not try it again until its files change
        assert versions.state()["events"][-1]["kind"] == "refused"
        torch.export.save(iot_module(), str(broken / "model.pt2"))  # fixed in place
        manager.start()
        wait_for(lambda: versions.resident() == ("1", "2"), 60, "version 2 tried again")
    finally:
        pipeline.close()
    with pytest.raises(ConfigError, match=r"pipelines\['iot'\]\.model\.repository: model folder"):
        Pipeline(versioned_config(bootstrap_servers, topics, repository / "nowhere"))
