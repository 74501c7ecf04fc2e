"""The last lines of ``streamproc run`` count what a user can check against the topics: after
an exactly-once run whose transactions aborted and rewound, records read again and records of
aborted transactions are counted apart from what read_committed readers see."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from streamproc.kafka.admin import ensure_topics
from streamproc.tools.replay import produce
from streamproc.tools.verify import read_topic, verify
from tests.integration.conftest import Topics, report, start_consumer, write_config

pytestmark = pytest.mark.core

TOTAL = 200
EVERY, AT = 100, 50  # the inputs at offsets o with o % EVERY == AT get an oversized result
LINE = re.compile(
    r"^p: (?P<read>\d+) consumed from \S+(?: \((?P<again>\d+) again after a rewind\))?, "
    r"(?P<results>\d+) results to \S+, (?P<dead>\d+) dead-lettered to \S+"
    r"(?: \(aborted transactions: (?P<aborted>\d+) results, (?P<aborted_dead>\d+) "
    r"dead-lettered, invisible to read_committed readers\))?$",
    re.MULTILINE,
)


def test_the_exit_summary_of_an_exactly_once_run_with_aborts_matches_the_topics(
    bootstrap_servers: str, topics: Topics, tmp_path: Path
) -> None:
    # it said `1000 consumed from <input>, 397 results to <output>` for 200 inputs and 198
    # results visible to read_committed readers: reads after a rewind and results of aborted
    # transactions were counted as if readers could see them
    output = f"{topics.output}.small"
    ensure_topics(bootstrap_servers, {output: 3}, topic_config={"max.message.bytes": "65536"})
    produce("trades", topics.input, bootstrap_servers, 3, limit=TOTAL, progress=False)
    pipeline = {
        "name": "p",
        "input_topic": topics.input,
        "output_topic": output,
        "workload": "tests.support.slow:bloated_some",
        "options": {"size_bytes": 200_000, "every": EVERY, "at": AT},
        "dlq_topic": topics.dlq,
    }
    config = write_config(
        tmp_path / "c.yaml",
        bootstrap_servers,
        topics,
        kafka={"producer": {"compression.type": "lz4"}},
        pipelines=[pipeline],
        batching={"max_batch_size": 64, "max_wait_ms": 50},
        processing_guarantee="exactly_once",
    )
    log = tmp_path / "consumer.log"
    consumer = start_consumer(config, log, idle_s=2)
    assert consumer.wait(240) == 0, log.read_text()[-3000:]
    text = log.read_text(errors="replace")
    match = LINE.search(text)
    assert match is not None, text[-2000:]
    counts = {k: int(v) for k, v in match.groupdict(default="0").items()}
    verdict = verify(bootstrap_servers, topics.input, output, topics.dlq, topics.group)
    report("exactly-once summary after aborts", verdict)
    assert verdict.missing == [] and verdict.duplicates == 0
    visible_results = len(read_topic(bootstrap_servers, output).records)  # read_committed
    visible_dead = len(read_topic(bootstrap_servers, topics.dlq).records)
    assert counts["aborted"] > 0, match.group(0)  # the scenario aborted transactions
    assert counts["again"] > 0, match.group(0)  # and rewound
    assert counts["read"] - counts["again"] == TOTAL, match.group(0)
    assert counts["results"] == visible_results == TOTAL - visible_dead, match.group(0)
    assert counts["dead"] == visible_dead == verdict.dead_lettered > 0, match.group(0)
