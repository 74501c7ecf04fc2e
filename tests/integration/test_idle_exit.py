"""``run --exit-when-idle-s`` across a lost assignment (issue 22, item 4), on a broker these tests
own: its only node stops mid-stream for longer than the consumer's session, so the group
session times out ("partitions lost") and the consumer holds no partition until the broker is
back and the coordinator has expired the old member. That time is not idle: the run either
waits, rejoins and processes every input (exit 0), or, past ``kafka.assignment_timeout_s``,
exits 1 naming the timeout. (It used to exit 0 a few seconds after the loss with most inputs
never processed.)

And with a second member that holds partitions without processing them (issue 39, item 2): a
run whose own partitions are drained is not done while the group's committed offset of any
input partition is short of its end offset; it waits (and takes those partitions over when the
other member leaves), or exits 1 naming them and their lag after ``kafka.assignment_timeout_s``
without progress. (It used to exit 0 with the other member's share never processed.)

And a partition that holds only an aborted transaction (issue 39, defect 3): a read_committed
consumer is delivered nothing from it, but its position passes the aborted records and the
abort marker; the owner commits that position, so the group's committed offset reaches the end
and the run exits 0. (It used to exit 1 on every run: nothing was ever committed there.)
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka import TopicPartition as KafkaTopicPartition
from confluent_kafka.admin import AdminClient

from streamproc.kafka.admin import ensure_topics
from streamproc.pipeline import Pipeline, RunSummary
from streamproc.records import TopicPartition
from streamproc.tools.kafka_local import LocalKafka, ensure_kafka_jars
from streamproc.tools.replay import produce
from streamproc.tools.verify import verify
from tests.integration.conftest import Topics, make_config, members_assigned, report, wait_for

# a broker of their own, stopped and started again
pytestmark = [pytest.mark.failures, pytest.mark.timeout(600)]
TOTAL = 600
IDLE_S = 2.0
SESSION_TIMEOUT_MS = 6_000  # the broker's group.min.session.timeout.ms: a short test


@pytest.fixture(scope="module")
def broker() -> Iterator[LocalKafka]:
    """A broker of this module's own, so its tests can stop it; running again after each."""
    run_dir = Path(tempfile.mkdtemp(prefix="streamproc-idle-exit-"))
    kafka = LocalKafka(run_dir, ensure_kafka_jars())
    kafka.start()
    try:
        yield kafka
    finally:
        kafka.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def _topics(bootstrap: str) -> Topics:
    suffix = uuid.uuid4().hex[:6]
    t = Topics(f"lost.{suffix}", f"lost.out.{suffix}", f"lost.{suffix}.dlq", f"g-{suffix}")
    ensure_topics(bootstrap, {t.input: 3, t.output: 3, t.dlq: 1})
    produce("trades", t.input, bootstrap, 3, limit=TOTAL, progress=False)
    return t


def _pipeline(
    bootstrap: str, t: Topics, guarantee: str = "at_least_once", **kafka: Any
) -> Pipeline:
    """A slow model (50 ms per batch of 4): the broker stops while most input waits."""
    settings = {"bootstrap_servers": bootstrap, "group_id": t.group, "commit_interval_ms": 200}
    slow = {"workload": "tests.support.slow:make_workload", "options": {"delay_s": 0.05}}
    pipeline = {"name": "p", "input_topic": t.input, "output_topic": t.output, **slow}
    return Pipeline(
        make_config(
            bootstrap,
            t,
            kafka={**settings, "session_timeout_ms": SESSION_TIMEOUT_MS, **kafka},
            pipelines=[pipeline],
            shutdown_timeout_s=10,
            processing_guarantee=guarantee,
        )
    )


class _Run:
    """``pipeline.run(exit_when_idle_s=IDLE_S)`` on a thread; joined by the test's teardown."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.summary: list[RunSummary] = []
        self.thread = threading.Thread(
            target=lambda: self.summary.append(pipeline.run(exit_when_idle_s=IDLE_S))
        )
        self.thread.start()

    def results(self, topic: str) -> float:
        metrics = self.pipeline.metrics
        return metrics.counter_value(metrics.produced, topic=topic)

    def lost(self) -> bool:
        return self.pipeline.source.assignment.rebalances["lost"] >= 1

    def finish(self, timeout_s: float) -> RunSummary:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"the run did not end within {timeout_s:.0f} s"
        assert self.summary, "the run raised (see the log)"
        return self.summary[0]

    def stop(self) -> None:
        """Teardown: stop the run if the test failed while it ran."""
        if self.thread.is_alive():
            self.pipeline.request_stop()
            self.thread.join(120)


def _stop_mid_stream_until_lost(broker: LocalKafka, run: _Run, topic: str) -> None:
    wait_for(
        lambda: run.results(topic) >= 100 or not run.thread.is_alive(),
        180,
        "100 results before the broker stops",
    )
    assert run.thread.is_alive(), (
        f"the run ended before the broker stopped: {run.summary} after "
        f"{run.results(topic):.0f} of {TOTAL} results"
    )
    assert run.results(topic) < TOTAL, "the stream ended before the broker stopped"
    broker.stop()
    wait_for(run.lost, 120, "the consumer's session to time out (partitions lost)")


def test_time_without_partitions_after_a_loss_is_not_idle(broker: LocalKafka) -> None:
    bootstrap = broker.bootstrap_servers
    t = _topics(bootstrap)
    run = _Run(_pipeline(bootstrap, t))
    try:
        _stop_mid_stream_until_lost(broker, run, t.output)
        # Quiet and nothing in flight (the lost partitions' records were dropped), but no
        # partition assigned: many idle windows pass and the run must still be running.
        run.thread.join(5 * IDLE_S)
        assert run.thread.is_alive(), (
            f"the run ended while no partition was assigned: {run.summary} after "
            f"{run.results(t.output):.0f} of {TOTAL} results"
        )
    finally:
        broker.restart()
    try:
        summary = run.finish(300)  # rejoin (the coordinator expires the old member), drain
    finally:
        run.stop()
    assert summary.exit_code == 0, summary.error
    verdict = verify(bootstrap, t.input, t.output, t.dlq, t.group)
    report("idle exit after a lost assignment", verdict)
    assert verdict.inputs == TOTAL and verdict.missing == [] and verdict.committed_equals_end
    assert run.pipeline.source.assignment.rebalances["assigned"] >= 2  # assigned again


def test_no_partition_within_the_assignment_timeout_after_a_loss_exits_1_naming_it(
    broker: LocalKafka,
) -> None:
    bootstrap = broker.bootstrap_servers
    t = _topics(bootstrap)
    run = _Run(_pipeline(bootstrap, t, assignment_timeout_s=8))
    try:
        try:
            _stop_mid_stream_until_lost(broker, run, t.output)
            summary = run.finish(120)  # the broker stays down: no rejoin within 8 s
        finally:
            broker.restart()
    finally:
        run.stop()
    assert summary.exit_code == 1, summary
    assert summary.error is not None
    assert (
        "no partition assigned within 8 s (kafka.assignment_timeout_s) after the group lost "
        "its partitions" in summary.error
    ), summary.error
    # Nothing was lost: a run after the broker is back processes the rest.
    again = _Run(_pipeline(bootstrap, t))
    try:
        assert again.finish(300).exit_code == 0
    finally:
        again.stop()
    verdict = verify(bootstrap, t.input, t.output, t.dlq, t.group)
    report("assignment timeout after a lost assignment, then a second run", verdict)
    assert verdict.inputs == TOTAL and verdict.missing == [] and verdict.committed_equals_end


class _StalledMember:
    """A plain consumer of the group that joins, takes its share of the partitions and then
    stops polling (a member hung in its model, or stopped with SIGSTOP): librdkafka's
    background thread keeps heartbeating, so it holds those partitions, committing nothing,
    until its ``max.poll.interval.ms`` (300 s) or :meth:`close`. It starts at the end offset
    (``auto.offset.reset: latest``), so it fetches none of the input written before it."""

    def __init__(self, bootstrap: str, t: Topics) -> None:
        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": t.group,
                "enable.auto.commit": False,
                "auto.offset.reset": "latest",
                "partition.assignment.strategy": "cooperative-sticky",  # as streamproc's
                "session.timeout.ms": SESSION_TIMEOUT_MS,
                "max.poll.interval.ms": 300_000,
            }
        )
        self.consumer.subscribe([t.input])
        self._stall = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="stalled-member")
        self._thread.start()

    def _poll(self) -> None:
        while not self._stall.is_set():
            self.consumer.poll(0.1)  # takes part in rebalances until stalled

    def stall(self) -> dict[TopicPartition, int]:
        """Stop polling; return the partitions held, each with its end offset (all of it is
        left to process: the group has no committed offset there)."""
        self._stall.set()
        self._thread.join(30)
        held = {}
        for ktp in self.consumer.assignment():
            _, end = self.consumer.get_watermark_offsets(
                KafkaTopicPartition(ktp.topic, ktp.partition), timeout=10
            )
            held[TopicPartition(ktp.topic, ktp.partition)] = end
        return held

    def close(self) -> None:
        """Leave the group (its partitions go to the other member at once)."""
        self._stall.set()
        self._thread.join(30)
        self.consumer.close()


def _stalled_member_and_a_run(
    bootstrap: str, t: Topics, **kafka: Any
) -> tuple[_StalledMember, _Run, dict[TopicPartition, int]]:
    """The stalled member joins first; the run joins the group and gets its share; the member
    stalls. Returns both and the member's partitions with their end offsets."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    member = _StalledMember(bootstrap, t)
    wait_for(lambda: members_assigned(admin, t.group) == 1, 120, "the first member")
    run = _Run(_pipeline(bootstrap, t, **kafka))
    wait_for(lambda: members_assigned(admin, t.group) == 2, 120, "both members assigned")
    held = member.stall()
    assert held and 0 < sum(held.values()) < TOTAL, held  # both members hold input
    return member, run, held


def test_a_run_whose_own_partitions_are_drained_waits_for_the_group(broker: LocalKafka) -> None:
    bootstrap = broker.bootstrap_servers
    t = _topics(bootstrap)
    member, run = None, None
    try:
        member, run, held = _stalled_member_and_a_run(bootstrap, t)
        own = TOTAL - sum(held.values())
        wait_for(
            lambda: run.results(t.output) >= own or not run.thread.is_alive(),
            180,
            f"the run's own {own} results",
        )
        # Its own partitions are drained, but the group's work is not done: several idle
        # windows pass and the run must still be running.
        run.thread.join(3 * IDLE_S)
        assert run.thread.is_alive(), (
            f"the run ended with the other member's {sum(held.values())} inputs undone: "
            f"{run.summary}"
        )
        member.close()  # the other member leaves: the run takes its partitions and finishes
        summary = run.finish(300)
    finally:
        if run is not None:
            run.stop()
        if member is not None:
            member.close()
    assert summary.exit_code == 0, summary.error
    verdict = verify(bootstrap, t.input, t.output, t.dlq, t.group)
    report("idle exit waits for a stalled member's partitions", verdict)
    assert verdict.inputs == TOTAL and verdict.missing == [] and verdict.committed_equals_end


def test_a_group_behind_past_the_assignment_timeout_exits_1_naming_partitions_and_lag(
    broker: LocalKafka,
) -> None:
    bootstrap = broker.bootstrap_servers
    t = _topics(bootstrap)
    member, run = None, None
    try:
        member, run, held = _stalled_member_and_a_run(bootstrap, t, assignment_timeout_s=10)
        summary = run.finish(180)
    finally:
        if run is not None:
            run.stop()
        if member is not None:
            member.close()
    assert summary.exit_code == 1, summary
    assert summary.error is not None
    print(f"\n[group behind past the assignment timeout] {summary.error}")
    assert "10 s (kafka.assignment_timeout_s)" in summary.error, summary.error
    for tp, end in held.items():  # nothing of theirs committed: the lag is the end offset
        assert f"{tp.topic}[{tp.partition}] lag {end} " in summary.error, summary.error
    assert run.results(t.output) == TOTAL - sum(held.values())  # its own share was done


def _abort_a_transaction(bootstrap: str, topic: str, partition: int, records: int) -> None:
    """Write ``records`` records into ``partition`` in a transaction, then abort it."""
    producer = Producer(
        {"bootstrap.servers": bootstrap, "transactional.id": f"aborter-{uuid.uuid4().hex[:8]}"}
    )
    producer.init_transactions(60)
    producer.begin_transaction()
    for i in range(records):
        producer.produce(topic, b'{"aborted": %d}' % i, partition=partition)
    producer.flush(30)
    producer.abort_transaction(60)


@pytest.mark.parametrize("guarantee", ["at_least_once", "exactly_once"])
def test_a_partition_of_only_aborted_records_is_committed_to_its_end(
    broker: LocalKafka, guarantee: str
) -> None:
    bootstrap = broker.bootstrap_servers
    suffix = uuid.uuid4().hex[:6]
    t = Topics(f"ab.{suffix}", f"ab.out.{suffix}", f"ab.{suffix}.dlq", f"atk-{suffix}")
    ensure_topics(bootstrap, {t.input: 3, t.output: 3, t.dlq: 1})
    produce("trades", t.input, bootstrap, 2, limit=40, progress=False, spread=True)  # 0 and 1
    _abort_a_transaction(bootstrap, t.input, 2, 5)  # partition 2: 5 aborted records, a marker
    _abort_a_transaction(bootstrap, t.input, 1, 3)  # partition 1: records, then aborted ones
    run = _Run(_pipeline(bootstrap, t, guarantee, assignment_timeout_s=15))
    try:
        summary = run.finish(180)
    finally:
        run.stop()
    assert summary.exit_code == 0, summary.error
    verdict = verify(bootstrap, t.input, t.output, t.dlq, t.group)
    report(f"idle exit with an aborted-only partition ({guarantee})", verdict)
    assert verdict.end_offsets[2] == 6, verdict.end_offsets
    assert verdict.inputs == 40 and verdict.missing == [] and verdict.committed_equals_end
    assert verdict.committed[2] == 6
