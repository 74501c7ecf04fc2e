"""A result the broker refuses for its own reason, under both processing guarantees.

The output topic takes at most 64 KiB per record batch (``max.message.bytes`` 65536); the plug-in
workload ``tests.support.slow:bloated_some`` gives the inputs at offset 50 of each partition a
200 kB incompressible result. Only those results may be dead-lettered (stage ``produce``, the
reason in the headers); every other input gets its result, exactly once under exactly-once, and
the group's committed offsets reach the end of the input, within a deadline. Under exactly-once
this used to abort the same transaction forever (issue 22, item 2).
"""

from __future__ import annotations

import threading

import pytest

from streamproc.config import load_config
from streamproc.kafka.admin import ensure_topics
from streamproc.output.headers import H_CLASS, H_MESSAGE, H_OFFSET, H_PARTITION, H_STAGE
from streamproc.pipeline import Pipeline, RunSummary
from streamproc.tools.replay import produce
from streamproc.tools.verify import read_topic, verify
from tests.integration.conftest import Topics, report

pytestmark = pytest.mark.core

TOTAL = 200
EVERY, AT = 100, 50  # the inputs at offsets o with o % EVERY == AT get an oversized result
DEADLINE_S = 240.0  # a livelock never finishes; a correct run takes seconds


def _run_with_deadline(pipeline: Pipeline, deadline_s: float) -> RunSummary:
    """``pipeline.run(exit_when_idle_s=2)`` on a thread; fail the test if it has not returned
    within ``deadline_s`` (it is stopped and joined first)."""
    summary: list[RunSummary] = []
    runner = threading.Thread(target=lambda: summary.append(pipeline.run(exit_when_idle_s=2)))
    runner.start()
    runner.join(deadline_s)
    if runner.is_alive():
        aborts = pipeline.metrics.registry.get_sample_value("streamproc_commit_failures_total")
        pipeline.request_stop()
        runner.join(120)
        pytest.fail(
            f"the run did not finish within {deadline_s:.0f} s ({aborts} failed commits): "
            "the same work is being retried forever"
        )
    return summary[0]


@pytest.mark.parametrize(
    ("guarantee", "compression"),
    [
        ("at_least_once", "lz4"),
        ("exactly_once", "lz4"),  # refused by the broker: one abort, then dead-lettered
        ("exactly_once", "none"),  # over the topic's limit uncompressed: never produced
    ],
)
def test_a_result_the_broker_refuses_is_dead_lettered_and_the_rest_commit(
    bootstrap_servers: str, topics: Topics, guarantee: str, compression: str
) -> None:
    output = f"{topics.output}.small"
    ensure_topics(bootstrap_servers, {output: 3}, topic_config={"max.message.bytes": "65536"})
    produce("trades", topics.input, bootstrap_servers, 3, limit=TOTAL, progress=False)
    ends = read_topic(bootstrap_servers, topics.input).end_offsets
    oversized = {(p, o) for p, end in ends.items() for o in range(end) if o % EVERY == AT}
    assert oversized, ends  # the scenario needs at least one
    config = load_config(
        overrides={
            "kafka": {
                "bootstrap_servers": bootstrap_servers,
                "group_id": topics.group,
                "commit_interval_ms": 200,
                "producer": {"compression.type": compression},
            },
            "pipelines": [
                {
                    "name": "p",
                    "input_topic": topics.input,
                    "output_topic": output,
                    "workload": "tests.support.slow:bloated_some",
                    "options": {"size_bytes": 200_000, "every": EVERY, "at": AT},
                    "dlq_topic": topics.dlq,
                }
            ],
            "batching": {"max_batch_size": 64, "max_wait_ms": 50},
            "processing_guarantee": guarantee,
            "metrics": {"port": 0},
        }
    )
    pipeline = Pipeline(config)
    summary = _run_with_deadline(pipeline, DEADLINE_S)
    assert summary.exit_code == 0, summary.error
    verdict = verify(bootstrap_servers, topics.input, output, topics.dlq, topics.group)
    report(f"refused result, {guarantee}, compression {compression}", verdict)
    assert verdict.inputs == TOTAL
    assert verdict.missing == [] and verdict.duplicates == 0
    assert verdict.committed_equals_end and verdict.output_stable
    dead = list(read_topic(bootstrap_servers, topics.dlq).records.values())
    assert {(int(h[H_PARTITION]), int(h[H_OFFSET])) for _, _, h, _ in dead} == oversized
    assert len(dead) == len(oversized)  # each once
    for _, _, headers, _ in dead:
        assert headers[H_STAGE] == b"produce"
        assert headers[H_CLASS] == b"KafkaError.MSG_SIZE_TOO_LARGE"
        assert b"too large" in headers[H_MESSAGE].lower()
    assert verdict.results == TOTAL - len(oversized)
    aborts = pipeline.metrics.registry.get_sample_value(
        "streamproc_transaction_aborts_total", {"reason": "MSG_SIZE_TOO_LARGE"}
    )
    if guarantee == "exactly_once" and compression == "lz4":
        # each oversized result is produced in a record batch of its own: its refusal names it
        # at once, so it costs at most one aborted transaction
        assert aborts is not None and 1 <= aborts <= len(oversized)
    else:
        assert not aborts  # refused before it entered a transaction, or no transaction
