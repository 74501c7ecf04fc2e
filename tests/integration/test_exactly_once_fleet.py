"""Exactly-once processes of one host, started from one config with nothing set by hand (no
``kafka.transactional_id``, no ``STREAMPROC_INSTANCE_ID``): they never fence each other, and
a process killed -9 and started again takes its predecessor's ``transactional.id`` back (so
its ``init_transactions`` aborts the transaction the dead one left open at once)."""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path

import pytest

from streamproc.kafka.admin import ensure_topics
from streamproc.tools.replay import produce
from streamproc.tools.verify import verify
from tests.integration.conftest import (
    Topics,
    end_offset_total,
    report,
    start_consumer,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.failures

PARTITIONS = 6
FENCED = ("_FENCED", "PRODUCER_FENCED", "fenced")


@pytest.fixture
def six_partitions(bootstrap_servers: str) -> Topics:
    """Fresh topics; the input has six partitions (the output is created by the consumers)."""
    suffix = uuid.uuid4().hex[:8]
    t = Topics(f"iot.{suffix}", f"scores.{suffix}", f"iot.{suffix}.dlq", f"g-{suffix}")
    ensure_topics(bootstrap_servers, {t.input: PARTITIONS})
    return t


@pytest.fixture
def no_instance_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """The consumers inherit no ``STREAMPROC_INSTANCE_ID`` (the default id is under test)."""
    monkeypatch.delenv("STREAMPROC_INSTANCE_ID", raising=False)


def exactly_once_iot(path: Path, bootstrap: str, topics: Topics) -> Path:
    """A config of one iot pipeline under exactly-once, no transactional id set."""
    pipeline = {
        "name": "p",
        "input_topic": topics.input,
        "output_topic": topics.output,
        "workload": "iot",
        "dlq_topic": topics.dlq,
    }
    return write_config(
        path, bootstrap, topics, processing_guarantee="exactly_once", pipelines=[pipeline]
    )


def events(log: Path, name: str) -> list[dict[str, object]]:
    """The JSON log lines of event ``name`` the consumer writing ``log`` logged, in order."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            doc = json.loads(line)
            if doc.get("event") == name:
                found.append(doc)
    return found


def chosen_ids(log: Path) -> list[str]:
    """The ``transactional.id`` each start of the consumer writing ``log`` chose, in order."""
    return [str(doc["transactional_id"]) for doc in events(log, "transactional id chosen")]


@pytest.mark.usefixtures("no_instance_id")
def test_exactly_once_processes_of_one_host_never_fence_each_other(
    bootstrap_servers: str, six_partitions: Topics, tmp_path: Path
) -> None:
    # three `streamproc run` of one config on one host shared `<group>-<host name>`: each
    # start fenced the one before (exit 1, `_FENCED`), or a fenced one held its partitions
    # until its session expired while the others exited 0 with half the input unprocessed
    topics, total = six_partitions, 1200
    config = exactly_once_iot(tmp_path / "c.yaml", bootstrap_servers, topics)
    logs = [tmp_path / f"consumer-{i}.log" for i in range(3)]
    consumers = [start_consumer(config, log, idle_s=20) for log in logs]
    # every producer initialised (with the old shared id, the last one fenced the others)
    wait_for(lambda: all(events(log, "pipeline running") for log in logs), 180, "3 running")
    produce("iot", topics.input, bootstrap_servers, PARTITIONS, total, progress=False)
    codes = [consumer.wait(300) for consumer in consumers]
    texts = [log.read_text(errors="replace") for log in logs]
    assert codes == [0, 0, 0], "\n".join(t[-2000:] for t in texts)
    for text in texts:
        assert not any(word in text for word in FENCED), text[-3000:]
    ids = [i for log in logs for i in chosen_ids(log)]
    assert len(ids) == 3 and len(set(ids)) == 3, ids
    verdict = verify(bootstrap_servers, topics.input, topics.output, topics.dlq, topics.group)
    report("exactly-once, three processes of one host, no id set", verdict)
    assert verdict.inputs == total
    assert verdict.missing == [] and verdict.duplicates == 0
    assert verdict.output_stable and verdict.committed_equals_end


@pytest.mark.usefixtures("no_instance_id")
def test_a_process_killed_and_started_again_takes_its_transactional_id_back(
    bootstrap_servers: str, six_partitions: Topics, tmp_path: Path
) -> None:
    # with an id of its own per process, a restarted process could not abort the transaction
    # its killed predecessor left open: read_committed readers would wait for
    # transaction.timeout.ms; with host slots it gets the dead one's id (and fences it)
    topics, total = six_partitions, 600
    produce("iot", topics.input, bootstrap_servers, PARTITIONS, total, progress=False)
    config = exactly_once_iot(tmp_path / "c.yaml", bootstrap_servers, topics)
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    first = start_consumer(config, first_log, idle_s=None)
    second = start_consumer(config, second_log, idle_s=None)
    wait_for(lambda: len(chosen_ids(first_log)) == len(chosen_ids(second_log)) == 1, 120, "ids")
    wait_for(lambda: end_offset_total(bootstrap_servers, topics.output) > 0, 180, "results")
    os.kill(first.pid, signal.SIGKILL)
    assert first.wait(30) == -signal.SIGKILL
    restarted = start_consumer(config, first_log, idle_s=8)
    wait_for(lambda: len(chosen_ids(first_log)) == 2, 120, "the restart's id")
    killed_id, restart_id = chosen_ids(first_log)
    assert restart_id == killed_id != chosen_ids(second_log)[0]
    assert restarted.wait(300) == 0, first_log.read_text()[-3000:]
    second.send_signal(signal.SIGTERM)
    assert second.wait(120) == 0, second_log.read_text()[-3000:]
    verdict = verify(bootstrap_servers, topics.input, topics.output, topics.dlq, topics.group)
    report("exactly-once, one of two processes killed -9 and started again", verdict)
    assert verdict.inputs == total
    assert verdict.missing == [] and verdict.duplicates == 0
    assert verdict.output_stable and verdict.committed_equals_end
