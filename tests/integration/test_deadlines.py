"""Deadlines on a real broker: records already past their ``streamproc.deadline`` never reach
the model, each still gets an expired result or a dead-letter record, and every offset commits,
under both guarantees."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import Producer

from streamproc.device import DeviceResult
from streamproc.dispatch.fusion import FusedRun, StagedRun
from streamproc.intake import lane as lane_module
from streamproc.intake.deadlines import DEADLINE_HEADER
from streamproc.output.headers import H_OFFSET, H_PARTITION, H_RESULT_KIND, H_STAGE
from streamproc.pipeline import Pipeline
from streamproc.records import Batch
from streamproc.tools.verify import read_topic, verify
from streamproc.workloads.trades import trade_messages
from tests.integration.conftest import Topics, make_config, report
from tests.support import counting

pytestmark = pytest.mark.core

RECORDS = 60


def produce_with_deadlines(bootstrap: str, topic: str) -> dict[str, set[tuple[int, int]]]:
    """Trades round-robin over three partitions in runs of 12: past deadlines (a minute ago),
    future ones (an hour ahead), none (every other with a header that does not parse), past,
    future. Each partition's first four records are past: with at most 4 expired records set
    apart per cut (the test patches ``MAX_EXPIRED_PER_CUT``) the first cut expires whole.
    Returns the (partition, offset) of each kind ("invalid" among "none")."""
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all"})
    now_ms = int(time.time() * 1000)
    kinds: dict[str, set[tuple[int, int]]] = {
        "past": set(), "future": set(), "none": set(), "invalid": set()
    }  # fmt: skip
    offsets = [0, 0, 0]
    messages = trade_messages()
    for i in range(RECORDS):
        key, value = next(messages)
        partition = i % 3
        where = (partition, offsets[partition])
        offsets[partition] += 1
        kind = ("past", "future", "none")[(i // 12) % 3]
        headers: list[tuple[str, bytes]] = []
        if kind == "past":
            headers = [(DEADLINE_HEADER, b"%d" % (now_ms - 60_000))]
        elif kind == "future":
            headers = [(DEADLINE_HEADER, b"%d" % (now_ms + 3_600_000))]
        elif i % 2 == 0:
            headers = [(DEADLINE_HEADER, b"soon")]
            kinds["invalid"].add(where)
        kinds[kind].add(where)
        producer.produce(topic, value, key, partition=partition, headers=headers)
    assert producer.flush(30) == 0
    return kinds


def _counted(
    pass_over: Callable[[Any, DeviceResult], None], whole_cuts: list[Batch]
) -> Callable[[Any, DeviceResult], None]:
    """``pass_over`` that also notes each batch it passes over in ``whole_cuts``."""

    def counted(self: Any, result: DeviceResult) -> None:
        whole_cuts.append(result.batch)
        pass_over(self, result)

    return counted


@pytest.mark.parametrize(
    ("guarantee", "on_expired", "fused_lane"),
    [
        ("at_least_once", "result", "auto"),
        ("exactly_once", "result", "never"),
        ("exactly_once", "dead_letter", "always"),
    ],
)
def test_records_past_their_deadline_are_not_run_but_answered_and_committed(
    bootstrap_servers: str,
    topics: Topics,
    guarantee: str,
    on_expired: str,
    fused_lane: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``fused_lane``: a cut whose every record expired goes to the resequencer's queue on the
    staged route (``never``) and is handed over on the dispatcher thread on the fused one."""
    kinds = produce_with_deadlines(bootstrap_servers, topics.input)
    # an expired record takes no live one's place, so a cut expires whole only when it meets
    # its bound of expired records before any live one: 4 here, the first four of a partition
    monkeypatch.setattr(lane_module, "MAX_EXPIRED_PER_CUT", 4)
    whole_cuts: list[Batch] = []
    for run in (StagedRun, FusedRun):  # either route's pass-over of a cut that expired whole
        monkeypatch.setattr(run, "pass_over", _counted(run.pass_over, whole_cuts))
    counting.DECODED.clear()
    config = make_config(
        bootstrap_servers,
        topics,
        processing_guarantee=guarantee,
        worker={"fused_lane": fused_lane},
        pipelines=[
            {
                "name": "p",
                "input_topic": topics.input,
                "output_topic": topics.output,
                "workload": "tests.support.counting:make_workload",
                "on_expired": on_expired,
            }
        ],
    )
    pipeline = Pipeline(config)
    summary = pipeline.run(exit_when_idle_s=2)
    assert summary.exit_code == 0, summary.error

    assert whole_cuts  # the first cut expired whole: it ran nowhere
    # the expired ones never reached the model; every other one did
    assert counting.DECODED.isdisjoint(kinds["past"])
    assert kinds["future"] | kinds["none"] <= counting.DECODED

    outputs = read_topic(bootstrap_servers, topics.output)  # read_committed
    verdict = verify(
        bootstrap_servers, topics.input, topics.output, topics.dlq, topics.group, outputs=outputs
    )
    report(f"deadlines {guarantee} {on_expired} {fused_lane}", verdict)
    assert verdict.inputs == RECORDS
    assert verdict.missing == [] and verdict.duplicates == 0
    assert verdict.committed_equals_end

    def coord(headers: dict[str, bytes]) -> tuple[int, int]:
        return int(headers[H_PARTITION]), int(headers[H_OFFSET])

    inputs = read_topic(bootstrap_servers, topics.input).records
    expired_results = {
        coord(headers): (key, value)
        for key, value, headers, _ in outputs.records.values()
        if headers.get(H_RESULT_KIND) == b"expired"
    }
    dead = {
        coord(headers): headers[H_STAGE]
        for _, _, headers, _ in read_topic(bootstrap_servers, topics.dlq).records.values()
    }
    if on_expired == "result":
        assert set(expired_results) == kinds["past"] and dead == {}
        for where, (key, value) in expired_results.items():
            assert value == b"" and key == inputs[where][0]  # the input key kept
    else:
        assert expired_results == {}
        assert dead == dict.fromkeys(kinds["past"], b"deadline")
    metrics = pipeline.metrics
    assert metrics.counter_value(metrics.expired, topic=topics.input) == len(kinds["past"])
    invalid = metrics.counter_value(metrics.deadline_header_invalid, topic=topics.input)
    assert invalid == len(kinds["invalid"]) > 0


def test_max_age_expires_records_older_than_it_by_their_timestamp(
    bootstrap_servers: str, topics: Topics
) -> None:
    """``max_age_ms`` counts from the record's Kafka timestamp (CreateTime, set by the
    producer here): records written a minute before their timestamp's max age of 30 s are
    expired at the cut, records stamped now run; the earlier of header and max age applies."""
    producer = Producer({"bootstrap.servers": bootstrap_servers, "acks": "all"})
    now_ms = int(time.time() * 1000)
    messages = trade_messages()
    old: set[tuple[int, int]] = set()
    offsets = [0, 0, 0]
    for i in range(30):
        key, value = next(messages)
        partition = i % 3
        stale = i % 2 == 0
        if stale:
            old.add((partition, offsets[partition]))
        offsets[partition] += 1
        producer.produce(
            topics.input,
            value,
            key,
            partition=partition,
            timestamp=now_ms - 60_000 if stale else now_ms,
            # a later header deadline does not extend max_age_ms
            headers=[(DEADLINE_HEADER, b"%d" % (now_ms + 3_600_000))],
        )
    assert producer.flush(30) == 0
    counting.DECODED.clear()
    config = make_config(
        bootstrap_servers,
        topics,
        pipelines=[
            {
                "name": "p",
                "input_topic": topics.input,
                "output_topic": topics.output,
                "workload": "tests.support.counting:make_workload",
                "max_age_ms": 30_000,
            }
        ],
    )
    pipeline = Pipeline(config)
    summary = pipeline.run(exit_when_idle_s=2)
    assert summary.exit_code == 0, summary.error

    assert counting.DECODED.isdisjoint(old) and len(counting.DECODED) == 30 - len(old)
    outputs = read_topic(bootstrap_servers, topics.output)
    verdict = verify(
        bootstrap_servers, topics.input, topics.output, topics.dlq, topics.group, outputs=outputs
    )
    report("deadlines max_age_ms", verdict)
    assert verdict.inputs == 30 and verdict.missing == [] and verdict.duplicates == 0
    assert verdict.committed_equals_end and verdict.dead_lettered == 0
    expired = {
        (int(headers[H_PARTITION]), int(headers[H_OFFSET]))
        for _, _, headers, _ in outputs.records.values()
        if headers.get(H_RESULT_KIND) == b"expired"
    }
    assert expired == old
    metrics = pipeline.metrics
    assert metrics.counter_value(metrics.expired, topic=topics.input) == len(old)
