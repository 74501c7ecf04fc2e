"""What the thread that acknowledges results publishes about a lane's latency target: the
P99 gauge beside the target gauge, the time over target, one warning as it starts being over
(``streamproc.output.latency``)."""

from __future__ import annotations

import pytest
import structlog
from prometheus_client import generate_latest

from streamproc.intake.batcher import Batcher
from streamproc.intake.lane import Lane
from streamproc.intake.rings import PartitionBuffers
from streamproc.metrics import Metrics
from streamproc.offsets.tracker import OffsetTracker
from streamproc.output.latency import LatencyReport
from streamproc.records import TopicPartition
from tests.support.kafka_fakes import FakeClock
from tests.unit.fakes import make_records

A = TopicPartition("in", 0)


def test_the_report_publishes_p99_target_and_time_over_and_warns_once() -> None:
    clock = FakeClock(100.0)
    tracker = OffsetTracker()
    targeted = Batcher(4, 1 << 20, 0.02, latency_target_s=0.010)
    lane = Lane("in", PartitionBuffers(8, 1.0, 0.0), targeted, tracker)
    untargeted = Lane("other", PartitionBuffers(8, 1.0, 0.0), Batcher(4, 1 << 20, 0.02), tracker)
    metrics = Metrics()
    report = LatencyReport({"in": lane, "other": untargeted}, metrics, clock=clock)
    text = generate_latest(metrics.registry).decode()
    assert 'streamproc_latency_target_seconds{topic="in"} 0.01' in text
    assert 'topic="other"' not in text  # no target: no series

    slow = make_records(A, range(10), consumed_at_s=100.0 - 0.050)  # 50 ms ago
    with structlog.testing.capture_logs() as logs:
        report.acknowledged(slow)
        clock.advance(0.5)
        report.acknowledged(make_records(A, range(10, 20), consumed_at_s=clock.now_s - 0.050))
    value = metrics.registry.get_sample_value
    assert value("streamproc_latency_p99_seconds", {"topic": "in"}) == pytest.approx(0.050)
    over = value("streamproc_latency_over_target_seconds_total", {"topic": "in"})
    assert over == pytest.approx(0.5)  # over from the first reading to the second
    warnings = [e for e in logs if e["event"] == "latency over target"]
    assert len(warnings) == 1 and warnings[0]["log_level"] == "warning"
    assert warnings[0]["topic"] == "in" and warnings[0]["target_ms"] == 10.0
    report.acknowledged(make_records(TopicPartition("other", 0), range(3), consumed_at_s=0.0))
    assert (
        'streamproc_latency_p99_seconds{topic="other"}'
        not in generate_latest(metrics.registry).decode()
    )


def test_the_report_hands_the_lane_each_batch_s_time_from_cut_to_acknowledgement() -> None:
    # what the lane's predicted expiry (pipelines[].expire_when: predicted) reads as its lead
    clock = FakeClock(100.0)
    batcher = Batcher(4, 1 << 20, 0.02, latency_target_s=0.010)
    lane = Lane("in", PartitionBuffers(8, 1.0, 0.0), batcher, OffsetTracker())
    report = LatencyReport({"in": lane}, Metrics(), clock=clock)
    assert batcher.expiry_lead_s(4, 100.0) == 0.0  # nothing measured
    report.acknowledged(make_records(A, range(4), consumed_at_s=99.9), cut_s=99.97)
    report.acknowledged(make_records(A, range(4, 8), consumed_at_s=99.9))  # cut not known
    assert batcher.expiry_lead_s(4, 100.0) == pytest.approx(0.03)
