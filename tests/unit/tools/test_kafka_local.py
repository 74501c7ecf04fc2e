from __future__ import annotations

import os
from pathlib import Path

import pytest

from streamproc.errors import BrokerError
from streamproc.tools.kafka_local import MARKER, LocalKafka


def test_refuses_a_folder_with_user_files(tmp_path: Path) -> None:
    precious = tmp_path / "notes.txt"
    precious.write_text("keep me")
    with pytest.raises(BrokerError, match="not created by streamproc"):
        LocalKafka(tmp_path, tmp_path / "libs").start()
    assert precious.read_text() == "keep me"


def test_claims_new_and_own_folders(tmp_path: Path) -> None:
    broker = LocalKafka(tmp_path / "new", tmp_path / "libs")
    broker._claim_run_dir()
    assert (tmp_path / "new" / MARKER).exists()
    (tmp_path / "new" / "data").mkdir()
    broker._claim_run_dir()  # ours: accepted again


def test_broker_starts_with_kafkas_own_jvm_options(tmp_path: Path) -> None:
    # kafka-run-class.sh's KAFKA_JVM_PERFORMANCE_OPTS: without the 20-ms pause target G1 aims
    # at 200 ms, and a young collection held records back ~90 ms on a busy host
    command = LocalKafka(tmp_path, tmp_path / "libs", heap_mb=384)._broker_command()
    options = command[1 : command.index("-cp")]
    assert "-XX:MaxGCPauseMillis=20" in options
    assert "-XX:InitiatingHeapOccupancyPercent=35" in options
    assert {"-server", "-XX:+UseG1GC", "-XX:+ExplicitGCInvokesConcurrent"} <= set(options)
    assert {"-Xmx384m", "-Xms256m"} <= set(options)
    assert command[command.index("-cp") + 2] == "kafka.Kafka"


def test_the_broker_writes_a_gc_log_and_the_storage_tool_none(tmp_path: Path) -> None:
    broker = LocalKafka(tmp_path, tmp_path / "libs")
    assert broker.gc_log_path == tmp_path / "logs" / "kafkaServer-gc.log"
    gc_logs = [
        [option for option in command if option.startswith("-Xlog:gc")]
        for command in (broker._broker_command(), broker._java("kafka.tools.StorageTool"))
    ]
    option = f'-Xlog:gc:file="{broker.gc_log_path}":time,tags:filecount=10,filesize=100M'
    assert gc_logs == [[option], []]


def test_cluster_ids_never_look_like_an_option() -> None:
    from streamproc.tools.kafka_local import _cluster_id

    ids = [_cluster_id() for _ in range(2000)]  # about 31 would start with "-" unguarded
    assert not [i for i in ids if i.startswith("-")]
    assert all(len(i) == 22 for i in ids)
    assert len(set(ids)) == len(ids)


def test_node_properties_of_a_cluster_node(tmp_path: Path) -> None:
    from streamproc.tools.kafka_local import CLUSTER_SETTINGS, node_properties

    text = node_properties(
        2,
        9100,
        9101,
        "1@127.0.0.1:9001,2@127.0.0.1:9101,3@127.0.0.1:9201",
        tmp_path / "data",
        CLUSTER_SETTINGS,
        broker_port=9102,
    )
    props = dict(line.split("=", 1) for line in text.splitlines() if line)
    assert props["node.id"] == "2"
    assert props["process.roles"] == "broker,controller"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:9001,2@127.0.0.1:9101,3@127.0.0.1:9201"
    assert props["listeners"] == (
        "PLAINTEXT://127.0.0.1:9100,BROKER://127.0.0.1:9102,CONTROLLER://127.0.0.1:9101"
    )
    # clients and replication on separate ports (a client's route can be cut alone)
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:9100,BROKER://127.0.0.1:9102"
    assert props["inter.broker.listener.name"] == "BROKER"
    assert "BROKER:PLAINTEXT" in props["listener.security.protocol.map"].split(",")
    # every address is loopback
    for key in ("listeners", "advertised.listeners", "controller.quorum.voters"):
        hosts = {
            part.split("//")[-1].split("@")[-1].rsplit(":", 1)[0] for part in props[key].split(",")
        }
        assert hosts == {"127.0.0.1"}, key
    # production replication for user and internal topics
    for key, want in {
        "default.replication.factor": "3",
        "min.insync.replicas": "2",
        "offsets.topic.replication.factor": "3",
        "transaction.state.log.replication.factor": "3",
        "transaction.state.log.min.isr": "2",
        "unclean.leader.election.enable": "false",
    }.items():
        assert props[key] == want, key
    assert props["log.dirs"] == str(tmp_path / "data")


def test_single_node_properties_keep_one_listener_for_brokers(tmp_path: Path) -> None:
    from streamproc.tools.kafka_local import SINGLE_NODE_SETTINGS, node_properties

    text = node_properties(1, 9100, 9101, "1@127.0.0.1:9101", tmp_path, SINGLE_NODE_SETTINGS)
    props = dict(line.split("=", 1) for line in text.splitlines() if line)
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:9100,CONTROLLER://127.0.0.1:9101"
    assert props["inter.broker.listener.name"] == "PLAINTEXT"
    assert props["offsets.topic.replication.factor"] == "1"


def test_cluster_refuses_zero_nodes(tmp_path: Path) -> None:
    from streamproc.tools.kafka_local import LocalCluster

    with pytest.raises(BrokerError, match="at least one node"):
        LocalCluster(tmp_path / "c", tmp_path / "libs", size=0).start()


def test_cluster_node_lookup_names_the_range(tmp_path: Path) -> None:
    from streamproc.tools.kafka_local import LocalCluster

    cluster = LocalCluster(tmp_path, tmp_path / "libs")
    cluster.nodes = [LocalKafka(tmp_path / f"n{i}", tmp_path, node_id=i) for i in (1, 2, 3)]
    assert cluster.node(2).node_id == 2
    with pytest.raises(KeyError, match=r"1\.\.3"):
        cluster.node(4)


def test_coordinator_partition_is_kafkas() -> None:
    from streamproc.tools.nemesis import coordinator_partition, java_string_hash

    # values printed by java.lang.String.hashCode (Java 17)
    assert java_string_hash("") == 0
    assert java_string_hash("hello") == 99162322
    assert java_string_hash("streamproc") == -1193921834
    assert java_string_hash("polygenelubricants") == -(1 << 31)
    assert coordinator_partition("polygenelubricants", 4) == 0  # Utils.abs(MIN_VALUE) == 0
    assert coordinator_partition("streamproc", 4) == 1193921834 % 4
    assert coordinator_partition("é", 50) == 233 % 50  # one UTF-16 code unit


def test_cut_rules_touch_only_loopback_and_one_port() -> None:
    from streamproc.tools.nemesis import _cut_rules

    rules = _cut_rules(19092)
    assert len(rules) == 2
    for rule in rules:
        assert rule[rule.index("-o") + 1] == "lo"
        assert rule[-2:] == ["-j", "DROP"]
    assert {r[r.index("--dport") + 1] for r in rules if "--dport" in r} == {"19092"}
    assert {r[r.index("--sport") + 1] for r in rules if "--sport" in r} == {"19092"}


def test_kafka_start_refuses_two_brokers(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from streamproc.cli import app

    result = CliRunner().invoke(app, ["kafka", "start", "--brokers", "2", "--dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "--brokers: 1, or 3 and more" in result.output
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


def test_kafka_stop_stops_every_recorded_node(tmp_path: Path) -> None:
    import subprocess
    import sys

    from typer.testing import CliRunner

    from streamproc.cli import app

    sleepers = []
    for node in (1, 2, 3):
        (tmp_path / f"node-{node}").mkdir()
        proc = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
        )
        sleepers.append(proc)
        (tmp_path / f"node-{node}" / "broker.pid").write_text(str(proc.pid))
    try:
        result = CliRunner().invoke(app, ["kafka", "stop", "--dir", str(tmp_path)])
        assert result.exit_code == 0, result.output
        assert all(proc.wait(30) is not None for proc in sleepers)
        assert not list(tmp_path.glob("node-*/broker.pid"))
    finally:
        for proc in sleepers:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


FAKE_MVN = """#!/usr/bin/env bash
# A stand-in for Maven's dependency:copy: counts its runs, waits (bounded) for a second run to
# start beside it, then writes the registry archive into -DoutputDirectory.
set -eu
echo run >> "$FAKE_MVN_RUNS"
for _ in $(seq 30); do
  [ "$(wc -l < "$FAKE_MVN_RUNS")" -ge 2 ] && break
  sleep 0.1
done
for arg in "$@"; do case "$arg" in -DoutputDirectory=*) out="${arg#*=}" ;; esac; done
mkdir -p "$out" "$FAKE_MVN_WORK/app"
echo jar > "$FAKE_MVN_WORK/app/$FAKE_RUNNER"
tar -czf "$out/app-all.tar.gz" -C "$FAKE_MVN_WORK/app" .
"""


def test_two_first_uses_at_once_install_the_registry_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes on one host starting a local registry for the first time (a test session
    beside `make images`) once failed with "... holds no ...-runner.jar": each deleted the
    other's download folder. Now the second waits for the first and finds the install done."""
    from concurrent.futures import ThreadPoolExecutor

    from streamproc.tools.registry_local import RUNNER, ensure_registry_app

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "mvn").write_text(FAKE_MVN)
    (bin_dir / "mvn").chmod(0o755)
    runs = tmp_path / "runs"
    runs.touch()
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MVN_RUNS", str(runs))
    monkeypatch.setenv("FAKE_MVN_WORK", str(tmp_path / "work"))
    monkeypatch.setenv("FAKE_RUNNER", RUNNER)
    cache = tmp_path / "cache"
    with ThreadPoolExecutor(2) as pool:
        apps = list(pool.map(lambda _: ensure_registry_app(cache), range(2)))
    assert apps[0] == apps[1]
    assert (apps[0] / RUNNER).read_text() == "jar\n"
    assert runs.read_text().splitlines() == ["run"]  # Maven ran once
