"""Consumer groups on the real broker: input written by a transactional producer drains to lag
0 (the commit passes the transaction marker after the last record), under both guarantees and
both group protocols; static membership takes the partitions back without a rebalance."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from streamproc.tools.replay import produce
from streamproc.tools.verify import verify
from tests.integration.conftest import (
    Topics,
    ownership_events,
    report,
    start_consumer,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.core

TOTAL = 300


@pytest.mark.parametrize(
    ("guarantee", "protocol"),
    [("at_least_once", "classic"), ("exactly_once", "consumer")],
)
def test_input_of_a_transactional_producer_drains_to_a_lag_of_zero(
    bootstrap_servers: str, topics: Topics, tmp_path: Path, guarantee: str, protocol: str
) -> None:
    # the commit stopped at the last record + 1, one short of the end offset (the marker): a
    # lag of 1 per partition for ever, so a lag-scaled deployment never went to zero replicas
    # written as an upstream exactly-once stage writes: transactions of 25, each leaving a
    # commit marker in every partition it wrote to, the last one after the last record
    produce("trades", topics.input, bootstrap_servers, 3, TOTAL, transaction_size=25)
    kafka: dict[str, object] = {"group_protocol": protocol}
    config = write_config(
        tmp_path / "c.yaml", bootstrap_servers, topics, processing_guarantee=guarantee, kafka=kafka
    )
    log = tmp_path / "consumer.log"
    consumer = start_consumer(config, log, idle_s=3)
    assert consumer.wait(180) == 0, log.read_text()[-3000:]
    verdict = verify(bootstrap_servers, topics.input, topics.output, topics.dlq, topics.group)
    report(f"transactional input, {guarantee}, {protocol} protocol", verdict)
    assert verdict.inputs == TOTAL
    assert verdict.missing == [] and verdict.duplicates == 0
    assert verdict.committed_equals_end, (verdict.committed, verdict.end_offsets)


@pytest.mark.parametrize("protocol", ["classic", "consumer"])
def test_a_static_member_restarted_within_the_session_timeout_moves_no_partition(
    bootstrap_servers: str, topics: Topics, tmp_path: Path, protocol: str
) -> None:
    # two members with stable instance ids (as StatefulSet pods); one restarts (SIGTERM, then
    # the same id again, as a rolling update does): the group must not rebalance, so the other
    # member neither gives up nor gains a partition and the restarted one gets its own back
    kafka: dict[str, object] = {"group_protocol": protocol}
    if protocol == "classic":  # consumer protocol: the broker's 45 s session timeout
        kafka["session_timeout_ms"] = 45_000
    config = write_config(tmp_path / "c.yaml", bootstrap_servers, topics, kafka=kafka)
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b")}

    def member(name: str) -> subprocess.Popen[bytes]:
        env = {"STREAMPROC_KAFKA__GROUP_INSTANCE_ID": f"member-{name}"}
        return start_consumer(config, logs[name], idle_s=None, env=env)

    def held(name: str) -> set[str]:
        owned: set[str] = set()
        for kind, partition, _ in ownership_events(logs[name]):
            if kind == "assigned":
                owned.add(partition)
            else:
                owned.discard(partition)
        return owned

    members = {name: member(name) for name in logs}
    wait_for(
        lambda: len(held("a")) + len(held("b")) == 3 and held("a") and held("b"),
        120,
        "both members to own partitions",
    )
    before = {name: held(name) for name in logs}
    a_events = len(ownership_events(logs["a"]))
    members["b"].send_signal(signal.SIGTERM)
    assert members["b"].wait(60) == 0
    members["b"] = member("b")
    wait_for(lambda: held("b") == before["b"], 120, "the restarted member to own its partitions")
    produce("trades", topics.input, bootstrap_servers, 3, limit=300, progress=False)
    wait_for(
        lambda: (
            verify(
                bootstrap_servers, topics.input, topics.output, topics.dlq, topics.group
            ).committed_equals_end
        ),
        120,
        "every input committed",
    )
    assert len(ownership_events(logs["a"])) == a_events, ownership_events(logs["a"])[a_events:]
    assert held("a") == before["a"]
    for proc in members.values():
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    verdict = verify(bootstrap_servers, topics.input, topics.output, topics.dlq, topics.group)
    assert verdict.missing == [] and verdict.duplicates == 0
