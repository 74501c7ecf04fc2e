"""Consumer groups on the real broker: input written by a transactional producer drains to lag
0 (the commit passes the transaction marker after the last record), under both guarantees and
both group protocols; static membership takes the partitions back without a rebalance."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from confluent_kafka import Producer

from streamproc.tools.replay import messages
from streamproc.tools.verify import verify
from tests.integration.conftest import Topics, report, start_consumer, write_config

TRANSACTION = 25  # records per upstream transaction
TOTAL = 300


def produce_in_transactions(bootstrap: str, topic: str, transactional_id: str) -> None:
    """TOTAL trades into ``topic``'s 3 partitions, TRANSACTION records per transaction, as an
    upstream exactly-once stage writes them: every transaction leaves a commit marker in each
    partition it wrote to, the last one after the last record."""
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": transactional_id})
    producer.init_transactions(60)
    rows = list(itertools.islice(messages("trades"), TOTAL))
    for start in range(0, TOTAL, TRANSACTION):
        producer.begin_transaction()
        for i, row in enumerate(rows[start : start + TRANSACTION], start):
            producer.produce(topic, row.value, row.key, partition=i % 3, headers=list(row.headers))
        producer.commit_transaction(60)


@pytest.mark.parametrize(
    ("guarantee", "protocol"),
    [("at_least_once", "classic"), ("exactly_once", "consumer")],
)
def test_input_of_a_transactional_producer_drains_to_a_lag_of_zero(
    bootstrap_servers: str, topics: Topics, tmp_path: Path, guarantee: str, protocol: str
) -> None:
    # the commit stopped at the last record + 1, one short of the end offset (the marker): a
    # lag of 1 per partition for ever, so a lag-scaled deployment never went to zero replicas
    produce_in_transactions(bootstrap_servers, topics.input, f"upstream-{topics.group}")
    kafka = {
        "bootstrap_servers": bootstrap_servers,
        "group_id": topics.group,
        "commit_interval_ms": 200,
        "group_protocol": protocol,
    }
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
