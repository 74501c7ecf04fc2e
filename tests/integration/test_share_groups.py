"""Share groups (``kafka.group_type: share``, KIP-932) on the real broker: every record's result
once, acknowledged only once durable (a rerun of the group finds nothing left), and more members
than partitions all taking records."""

from __future__ import annotations

import collections
import re
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ResourceType,
)

from streamproc.kafka.admin import ensure_topics
from streamproc.output.headers import H_OFFSET, H_PARTITION
from streamproc.pipeline import Pipeline
from streamproc.tools.replay import produce
from streamproc.tools.verify import read_topic
from tests.integration.conftest import (
    Topics,
    make_config,
    start_consumer,
    stop_process,
    wait_for,
    write_config,
)

SHARE = {"group_type": "share"}


def _topics(bootstrap: str, partitions: int) -> Topics:
    suffix = uuid.uuid4().hex[:8]
    t = Topics(f"share.{suffix}", f"share.out.{suffix}", f"share.{suffix}.dlq", f"sg-{suffix}")
    ensure_topics(bootstrap, {t.input: partitions, t.output: partitions, t.dlq: 1})
    return t


def _lock_records_for(bootstrap: str, group: str, lock_ms: int) -> None:
    """The share group's record lock (``share.record.lock.duration.ms``, a group setting; the
    broker's floor is ``group.share.min.record.lock.duration.ms``, 15 s by default)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    entry = ConfigEntry(
        "share.record.lock.duration.ms", str(lock_ms), incremental_operation=AlterConfigOpType.SET
    )
    resource = ConfigResource(ResourceType.GROUP, group, incremental_configs=[entry])
    admin.incremental_alter_configs([resource])[resource].result(30)


def _slow_members_config(tmp_path: Path, bootstrap: str, t: Topics) -> Path:
    """The config of ``streamproc run`` share members with a slow model (50 ms per batch),
    polls of 20, JSON logs."""
    slow = {"workload": "tests.support.slow:make_workload", "options": {"delay_s": 0.05}}
    return write_config(
        tmp_path / "c.yaml",
        bootstrap,
        t,
        kafka={**SHARE, "consume_batch_messages": 20},
        pipelines=[{"name": "p", "input_topic": t.input, "output_topic": t.output, **slow}],
        logging={"format": "json"},
    )


def _assigned(log: Path) -> bool:
    """Whether the member logging to ``log`` has been assigned partitions of its share group
    (the log is being written: a line may be half there, so no JSON parsing)."""
    return '"event": "share group assignment"' in log.read_text()


def _results(bootstrap: str, topic: str) -> collections.Counter[tuple[int, int]]:
    """How many results each input (partition, offset) has on ``topic``."""
    dump = read_topic(bootstrap, topic)
    return collections.Counter(
        (int(headers[H_PARTITION]), int(headers[H_OFFSET]))
        for _, _, headers, _ in dump.records.values()
    )


@pytest.mark.core
def test_a_share_group_gives_every_record_one_result_and_a_rerun_finds_none_left(
    bootstrap_servers: str,
) -> None:
    t = _topics(bootstrap_servers, 2)
    total = produce("trades", t.input, bootstrap_servers, 2, limit=1000, progress=False)
    kafka = {"bootstrap_servers": bootstrap_servers, "group_id": t.group, **SHARE}
    pipelines = [
        {"name": "p", "input_topic": t.input, "output_topic": t.output, "workload": "trades"}
    ]
    pipeline = Pipeline(make_config(bootstrap_servers, t, kafka=kafka, pipelines=pipelines))
    summary = pipeline.run(exit_when_idle_s=2)
    assert summary.exit_code == 0, summary.error
    results = _results(bootstrap_servers, t.output)
    print(f"\n[share group] inputs={total} results={sum(results.values())}")
    assert len(results) == total and set(results.values()) == {1}  # each once
    assert read_topic(bootstrap_servers, t.dlq).records == {}
    count = pipeline.metrics.registry.get_sample_value
    assert count("streamproc_share_acknowledged_total", {"topic": t.input}) == total
    assert count("streamproc_share_acknowledgement_failures_total", {"topic": t.input}) is None

    # every acknowledgement reached the broker: the group hands none of them out again
    rerun = Pipeline(make_config(bootstrap_servers, t, kafka=kafka, pipelines=pipelines))
    again = rerun.run(exit_when_idle_s=2)
    assert again.exit_code == 0, again.error
    assert again.outcomes[t.input].read == 0
    assert sum(_results(bootstrap_servers, t.output).values()) == total


@pytest.mark.failures
def test_three_members_on_one_partition_all_take_records(
    bootstrap_servers: str, tmp_path: Path
) -> None:
    """More members than partitions: a consumer group would leave two of them idle."""
    t = _topics(bootstrap_servers, 1)
    config = _slow_members_config(tmp_path, bootstrap_servers, t)
    logs = [tmp_path / f"member-{i}.log" for i in range(3)]
    # a member assigned a heartbeat (5 s) before the last one must not go idle before the
    # records come: an idle share member stops taking records
    members = [start_consumer(config, log, idle_s=10) for log in logs]

    # every member has the partition before the records come: none finds them all taken
    wait_for(lambda: all(_assigned(log) for log in logs), 90, "three members assigned")
    # paced, so that a record batch holds a few records: the broker hands a member whole
    # record batches (one producer batch of 600 goes to one member, whatever its poll size)
    total = produce("trades", t.input, bootstrap_servers, 1, limit=600, rate=300, progress=False)
    codes = [member.wait(180) for member in members]
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0, 0], [text[-2000:] for text in texts]
    taken = []
    for text in texts:
        match = re.search(rf"p: (\d+) consumed from {re.escape(t.input)}", text)
        assert match is not None, text[-2000:]
        taken.append(int(match.group(1)))
    results = _results(bootstrap_servers, t.output)
    print(f"\n[share group, 3 members, 1 partition] taken per member={taken}")
    assert all(n > 0 for n in taken), taken
    assert len(results) == total and set(results.values()) == {1}
    assert sum(taken) == total


@pytest.mark.failures
def test_a_member_stopped_mid_stream_releases_what_it_held_and_nothing_is_lost(
    bootstrap_servers: str, tmp_path: Path
) -> None:
    t = _topics(bootstrap_servers, 1)
    config = _slow_members_config(tmp_path, bootstrap_servers, t)
    total = produce("trades", t.input, bootstrap_servers, 1, limit=400, progress=False)
    first = start_consumer(config, tmp_path / "first.log", idle_s=None)
    wait_for(lambda: len(_results(bootstrap_servers, t.output)) >= 40, 120, "the first results")
    assert stop_process(first) == 0  # SIGTERM mid-stream: what it held goes back
    second = start_consumer(config, tmp_path / "second.log", idle_s=3)
    assert second.wait(180) == 0, (tmp_path / "second.log").read_text()[-2000:]
    results = _results(bootstrap_servers, t.output)
    print(f"\n[share group, SIGTERM mid-stream] results={sum(results.values())} of {total}")
    assert len(results) == total, "records lost"
    # what it held in its rings was released, never run: no result twice
    assert set(results.values()) == {1}, "a record both run and released"


@pytest.mark.failures
def test_a_member_killed_mid_stream_loses_nothing_and_duplicates_only_what_it_held(
    bootstrap_servers: str, tmp_path: Path
) -> None:
    """kill -9 of one of two members mid-stream: nothing is released or acknowledged for what
    it held, so the group delivers those records again once their lock runs out (15 s); the
    survivor runs them. Every record has its result; the only duplicates are records the
    killed member had run but not acknowledged, each counted as delivered again."""
    t = _topics(bootstrap_servers, 1)
    _lock_records_for(bootstrap_servers, t.group, 15_000)
    config = _slow_members_config(tmp_path, bootstrap_servers, t)
    logs = {name: tmp_path / f"{name}.log" for name in ("survivor", "killed")}
    # the survivor outwaits the killed member's locks (15 s) before it goes idle
    survivor = start_consumer(config, logs["survivor"], idle_s=25)
    killed = start_consumer(config, logs["killed"], idle_s=None)

    wait_for(lambda: all(_assigned(log) for log in logs.values()), 90, "both members assigned")
    # paced: record batches of a few records, so that both members take some
    total = produce("trades", t.input, bootstrap_servers, 1, limit=400, rate=200, progress=False)
    wait_for(lambda: len(_results(bootstrap_servers, t.output)) >= 100, 120, "results flowing")
    killed.kill()  # SIGKILL: no release, no acknowledgement, no leave
    assert killed.wait(30) == -9
    assert survivor.wait(240) == 0, logs["survivor"].read_text()[-2000:]
    results = _results(bootstrap_servers, t.output)
    duplicates = sum(results.values()) - len(results)
    summary = re.search(
        rf"p: (\d+) consumed from {re.escape(t.input)}(?: \((\d+) delivered again by the share "
        r"group\))?",
        logs["survivor"].read_text(),
    )
    assert summary is not None, logs["survivor"].read_text()[-2000:]
    again = int(summary.group(2) or 0)
    print(
        f"\n[share group, kill -9 mid-stream] results={len(results)} of {total} "
        f"duplicates={duplicates} delivered again to the survivor={again}"
    )
    assert len(results) == total, "records lost"
    # the kill came mid-stream: the killed member held records (the model's 50 ms per batch
    # bounds a member to about 20 records/s, so 400 records outlast the first 100 results)
    assert again >= 1, "the killed member held nothing: the kill tested no recovery"
    # each duplicate is a record the killed member held and the survivor got again (counted);
    # it held one poll (20) at most, a record batch rounded up
    assert duplicates <= again <= 40, (duplicates, again)


@pytest.mark.failures
def test_a_poison_record_takes_down_few_members_no_valid_record_and_is_dead_lettered_once(
    bootstrap_servers: str, tmp_path: Path
) -> None:
    """A record that kills its member (a native crash in the decoder: no drain, no release)
    comes back with its poll-mates after their lock runs out: in batches once more, then, from
    their third delivery on, alone, so the valid ones finish within two more rounds; the poison
    record alone reaches ``share_max_deliveries`` (5), is dead-lettered instead of run, and is
    rejected: the fifth member exits 0."""
    t = _topics(bootstrap_servers, 1)
    _lock_records_for(bootstrap_servers, t.group, 15_000)
    # real trades in small record batches (paced), the poison record at offset 60
    produce("trades", t.input, bootstrap_servers, 1, limit=60, rate=500, progress=False)
    producer = Producer({"bootstrap.servers": bootstrap_servers})
    producer.produce(t.input, value=b"crash", key=b"poison")
    assert producer.flush(30) == 0
    produce("trades", t.input, bootstrap_servers, 1, limit=59, rate=500, progress=False)
    crashing = {"workload": "tests.support.crashing:make_workload"}
    config = write_config(
        tmp_path / "c.yaml",
        bootstrap_servers,
        t,
        kafka={**SHARE, "consume_batch_messages": 10, "share_max_deliveries": 5},
        pipelines=[{"name": "p", "input_topic": t.input, "output_topic": t.output, **crashing}],
        worker={"decode_inline": "always"},  # the crash takes the whole process, as kill -9
        logging={"format": "json"},
    )
    codes: list[int] = []
    for member in range(6):
        # each member outwaits the dead one's locks (15 s) before it goes idle
        log = tmp_path / f"member-{member}.log"
        codes.append(start_consumer(config, log, idle_s=25).wait(240))
        if codes[-1] != 3:
            break
    assert codes == [3, 3, 3, 3, 0], [
        (tmp_path / f"member-{i}.log").read_text()[-1500:] for i in range(len(codes))
    ]
    results = _results(bootstrap_servers, t.output)
    dead = read_topic(bootstrap_servers, t.dlq).records
    duplicates = sum(results.values()) - len(results)
    print(f"\n[share group, poison record] results={len(results)} duplicates={duplicates}")
    assert set(results) == {(0, o) for o in range(120) if o != 60}, "records lost"
    # duplicates only among what a dead member held unacknowledged: one poll (10) per crash
    assert duplicates <= 4 * 10
    ((_, value, headers, _),) = dead.values()  # the poison record, once; no valid record
    assert value == b"crash"
    assert headers["streamproc.error.stage"] == b"delivery"
    assert headers["streamproc.error.class"] == b"DeliveryCountExceeded"
    assert headers["streamproc.source.offset"] == b"60"
