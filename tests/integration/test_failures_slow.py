"""Longer failure scenarios (`make test-slow`): repeated crashes, scaling out and back, broker
restart, pause/rebalance/resume with small rings, a 10x burst under a slow model."""

from __future__ import annotations

import itertools
import os
import signal
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from streamproc.config import load_config
from streamproc.kafka.admin import ensure_topics
from streamproc.pipeline import Pipeline
from streamproc.tools.kafka_local import LocalKafka, ensure_kafka_jars
from streamproc.tools.replay import produce
from streamproc.tools.verify import committed_offsets, verify
from tests.integration.conftest import (
    Topics,
    end_offset_total,
    ownership_events,
    report,
    start_consumer,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.slow
SLOW = "tests.support.slow:make_workload"


def slow_pipeline(t: Topics, delay_s: float) -> list[dict]:  # type: ignore[type-arg]
    return [
        {
            "name": "p",
            "input_topic": t.input,
            "output_topic": t.output,
            "workload": SLOW,
            "options": {"delay_s": delay_s},
        }
    ]


def test_repeated_kill_9_loses_nothing_and_duplicates_only_in_flight(
    bootstrap_servers: str, topics: Topics, tmp_path: Path
) -> None:
    total = 900
    produce("trades", topics.input, bootstrap_servers, 3, limit=total, progress=False)
    config = write_config(
        tmp_path / "c.yaml", bootstrap_servers, topics, pipelines=slow_pipeline(topics, 0.02)
    )
    log = tmp_path / "consumer.log"
    in_flight_at_kills = []
    for kill in range(3):
        consumer = start_consumer(config, log, idle_s=None)
        try:
            target = 150 * (kill + 1)
            wait_for(
                lambda t=target: end_offset_total(bootstrap_servers, topics.output) >= t,
                180,
                f"{target} results",
            )
            os.kill(consumer.pid, signal.SIGKILL)
            consumer.wait(30)
        finally:
            if consumer.poll() is None:
                consumer.kill()
        written = end_offset_total(bootstrap_servers, topics.output)
        committed = sum(
            max(0, o)
            for o in committed_offsets(
                bootstrap_servers, topics.group, topics.input, [0, 1, 2]
            ).values()
        )
        in_flight_at_kills.append(written - committed)  # produced but not committed
    final = start_consumer(config, log)
    assert final.wait(240) == 0
    verdict = verify(bootstrap_servers, topics.input, topics.output, topics.dlq, topics.group)
    report(f"3x kill -9, produced-not-committed at kills {in_flight_at_kills}", verdict)
    assert verdict.missing == [] and verdict.committed_equals_end
    assert verdict.duplicates <= sum(in_flight_at_kills)


@pytest.mark.parametrize("protocol", ["classic", "consumer"])
def test_scale_out_to_three_and_back_keeps_single_ownership(
    bootstrap_servers: str, tmp_path: Path, protocol: str
) -> None:
    suffix = uuid.uuid4().hex[:6]
    t = Topics(f"scale.{suffix}", f"scale.out.{suffix}", f"scale.{suffix}.dlq", f"g-{suffix}")
    ensure_topics(bootstrap_servers, {t.input: 6, t.output: 6, t.dlq: 1})
    total = 2400
    produce("trades", t.input, bootstrap_servers, 6, limit=total, progress=False)
    kafka: dict[str, object] = {"group_protocol": protocol}
    config = write_config(
        tmp_path / "c.yaml", bootstrap_servers, t, pipelines=slow_pipeline(t, 0.05), kafka=kafka
    )
    logs = [tmp_path / f"member{i}.log" for i in range(3)]
    first = start_consumer(config, logs[0], idle_s=3)
    wait_for(lambda: end_offset_total(bootstrap_servers, t.output) >= 200, 120, "first results")
    extra = [start_consumer(config, logs[i], idle_s=None) for i in (1, 2)]
    wait_for(
        lambda: all(any(e[0] == "assigned" for e in ownership_events(lg)) for lg in logs[1:]),
        120,
        "new members assigned",
    )
    wait_for(lambda: end_offset_total(bootstrap_servers, t.output) >= 1200, 180, "progress")
    for member in extra:  # scale back in
        member.send_signal(signal.SIGTERM)
    assert all(member.wait(60) == 0 for member in extra)
    assert first.wait(300) == 0
    verdict = verify(bootstrap_servers, t.input, t.output, t.dlq, t.group)
    report(f"scale 1 -> 3 -> 1 ({protocol} protocol)", verdict)
    assert verdict.missing == [] and verdict.committed_equals_end
    # each partition is owned by at most one member at any time
    intervals: dict[str, list[tuple[float, float, int]]] = {}
    for member, log in enumerate(logs):
        open_at: dict[str, float] = {}
        for kind, partition, ts in ownership_events(log):
            if kind == "assigned":
                open_at[partition] = ts
            elif partition in open_at:
                intervals.setdefault(partition, []).append((open_at.pop(partition), ts, member))
        for partition, start in open_at.items():
            intervals.setdefault(partition, []).append((start, float("inf"), member))
    moved = sum(len(v) - 1 for v in intervals.values())
    print(f"ownership intervals per partition: { {p: len(v) for p, v in intervals.items()} }")
    assert moved > 0, "no partition moved: the scale-out did not rebalance"
    for partition, spans in intervals.items():
        spans.sort()
        for (_, end_a, a), (start_b, _, b) in itertools.pairwise(spans):
            assert a == b or start_b >= end_a, f"{partition} owned by {a} and {b} at once"


def test_broker_stop_and_start_mid_stream_loses_nothing(tmp_path: Path) -> None:
    broker = LocalKafka(Path(tempfile.mkdtemp(prefix="streamproc-restart-")), ensure_kafka_jars())
    bootstrap = broker.start()
    try:
        suffix = uuid.uuid4().hex[:6]
        t = Topics(
            f"bounce.{suffix}", f"bounce.out.{suffix}", f"bounce.{suffix}.dlq", f"g-{suffix}"
        )
        ensure_topics(bootstrap, {t.input: 3, t.output: 3, t.dlq: 1})
        total = 600
        produce("trades", t.input, bootstrap, 3, limit=total, progress=False)
        config = load_config(
            overrides={
                "kafka": {
                    "bootstrap_servers": bootstrap,
                    "group_id": t.group,
                    "commit_interval_ms": 200,
                },
                "pipelines": slow_pipeline(t, 0.05),
                "metrics": {"port": 0},
            }
        )
        pipeline = Pipeline(config)
        summary: list = []
        runner = threading.Thread(target=lambda: summary.append(pipeline.run(exit_when_idle_s=5)))
        runner.start()
        try:
            wait_for(
                lambda: pipeline.metrics.produced.labels(t.output)._value.get() >= 100,
                120,
                "100 results before the broker stops",
            )
            broker.restart()
            runner.join(300)
        finally:  # a failed wait must not leave the run going past the test
            if runner.is_alive():
                pipeline.request_stop()
                runner.join(120)
        assert summary and summary[0].exit_code == 0, summary
        verdict = verify(bootstrap, t.input, t.output, t.dlq, t.group)
        report("broker stop/start", verdict)
        assert verdict.inputs == total and verdict.missing == []
        assert verdict.committed_equals_end
    finally:
        broker.stop()


def test_pause_rebalance_resume_leaves_no_partition_paused(
    bootstrap_servers: str, topics: Topics, tmp_path: Path
) -> None:
    total = 600
    produce("trades", topics.input, bootstrap_servers, 3, limit=total, progress=False)
    overrides = {
        "pipelines": slow_pipeline(topics, 0.05),
        "buffers": {"ring_capacity": 8, "high_watermark": 0.75, "low_watermark": 0.25},
    }
    config = load_config(
        overrides={
            "kafka": {
                "bootstrap_servers": bootstrap_servers,
                "group_id": topics.group,
                "commit_interval_ms": 200,
            },
            "metrics": {"port": 0},
            **overrides,
        }
    )
    pipeline = Pipeline(config)
    summary: list = []
    runner = threading.Thread(target=lambda: summary.append(pipeline.run(exit_when_idle_s=4)))
    runner.start()
    try:
        wait_for(
            lambda: (
                (pipeline.metrics.registry.get_sample_value("streamproc_paused_partitions") or 0)
                > 0
            ),
            60,
            "a partition paused at the high watermark",
        )
        # a second member joins (revoke + assign while paused), then leaves again
        other_log = tmp_path / "other.log"
        other = start_consumer(
            write_config(tmp_path / "c.yaml", bootstrap_servers, topics, **overrides),
            other_log,
            idle_s=None,
        )
        wait_for(lambda: pipeline.source.assignment.rebalances["revoked"] >= 1, 120, "a rebalance")
        # Leave only once the new member owns a partition. (librdkafka 2.x does not send
        # LeaveGroup when a cooperative member with no partition closes mid-rebalance; the group
        # then waits max.poll.interval.ms for it: see docs/guarantees.md.)
        wait_for(
            lambda: any(kind == "assigned" for kind, _, _ in ownership_events(other_log)),
            120,
            "the new member to own a partition",
        )
        other.send_signal(signal.SIGTERM)
        assert other.wait(60) == 0
        runner.join(300)
    finally:  # a failed wait must not leave the run going past the test
        if runner.is_alive():
            pipeline.request_stop()
            runner.join(120)
    assert summary and summary[0].exit_code == 0
    verdict = verify(bootstrap_servers, topics.input, topics.output, topics.dlq, topics.group)
    report(f"pause+rebalance+resume {pipeline.source.assignment.rebalances}", verdict)
    assert verdict.missing == [] and verdict.committed_equals_end


def test_ten_x_burst_into_one_partition_stays_within_the_memory_bound(
    bootstrap_servers: str, tmp_path: Path
) -> None:
    suffix = uuid.uuid4().hex[:6]
    t = Topics(f"burst.{suffix}", f"burst.out.{suffix}", f"burst.{suffix}.dlq", f"g-{suffix}")
    ensure_topics(bootstrap_servers, {t.input: 1, t.output: 1, t.dlq: 1})
    ring = 32
    config = write_config(
        tmp_path / "c.yaml",
        bootstrap_servers,
        t,
        pipelines=[
            {
                "name": "p",
                "input_topic": t.input,
                "output_topic": t.output,
                "workload": SLOW,
                "options": {"base": "video", "delay_s": 0.05},
            }
        ],
        buffers={"ring_capacity": ring},
        kafka={
            "bootstrap_servers": bootstrap_servers,
            "group_id": t.group,
            "consumer": {"queued.max.messages.kbytes": 4096, "fetch.max.bytes": 4194304},
            "producer": {"queue.buffering.max.kbytes": 16384},
        },
    )
    log = tmp_path / "consumer.log"
    warm_up = 2 * ring  # reach steady state: full rings, full batches, allocator warmed
    produce("video", t.input, bootstrap_servers, 1, limit=warm_up, progress=False)
    consumer = start_consumer(config, log, idle_s=4, env={"MALLOC_ARENA_MAX": "2"})
    proc = psutil.Process(consumer.pid)
    wait_for(lambda: end_offset_total(bootstrap_servers, t.output) >= warm_up, 120, "warm-up")
    baseline = proc.memory_info().rss
    baseline_results = warm_up

    def peak_growth_during(burst: int) -> int:
        nonlocal baseline_results
        samples = [proc.memory_info().rss]
        produce("video", t.input, bootstrap_servers, 1, limit=burst, progress=False)
        target = baseline_results + burst
        deadline_s = time.monotonic() + 300
        while end_offset_total(bootstrap_servers, t.output) < target:
            assert time.monotonic() < deadline_s, "burst not processed in time"
            samples.append(proc.memory_info().rss)
            time.sleep(0.1)  # RSS sampling period, not synchronisation
        baseline_results = target
        return max(samples) - baseline

    small = peak_growth_during(10 * ring)  # a 10x burst into one partition
    large = peak_growth_during(40 * ring)  # four times that
    assert consumer.wait(120) == 0
    frame_bytes = 40_000  # largest replayed JPEG frame is under 40 kB
    # docs/guarantees.md: rings + consume batch + librdkafka fetch queue and one fetch
    # response + producer queue, plus the measured working-set allowance of the runtime
    bound = (ring + 100) * frame_bytes + 4096 * 1024 + 4194304 + 16384 * 1024 + 128 * 2**20
    print(
        f"\n[10x burst] baseline RSS {baseline / 2**20:.0f} MiB; peak growth "
        f"{small / 2**20:.1f} MiB for a 10x burst, {large / 2**20:.1f} MiB for a 40x burst; "
        f"documented bound {bound / 2**20:.1f} MiB"
    )
    assert small <= bound and large <= bound
    assert large <= small + 24 * 2**20  # memory does not grow with the burst: intake pauses
    assert end_offset_total(bootstrap_servers, t.output) == warm_up + 50 * ring
