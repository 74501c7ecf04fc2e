"""Flow control against the real broker: pause at the high watermark, resume in time.

A paused partition's prefetched messages are dropped by librdkafka, so after a resume the
partition is fetched again; the resume must reach the consumer while the ring still holds
enough to feed the device for that refetch.
"""

from __future__ import annotations

from typing import Any

import pytest

from streamproc.config import load_config
from streamproc.kafka.admin import ensure_topics
from streamproc.pipeline import Pipeline
from streamproc.tools.replay import produce
from streamproc.tools.verify import verify
from tests.integration.conftest import Topics, report

pytestmark = pytest.mark.core


def test_a_backlog_larger_than_the_ring_is_cut_in_full_batches_across_resumes(
    bootstrap_servers: str, topics: Topics
) -> None:
    # 320 queued messages in one partition, batches of 16 on a 20 ms model, rings of 256
    # pausing at 192 and resuming at 64: the ring must never run dry while the partition is
    # fetched again after its resume (a 400 ms max wait turns any such stall into a short
    # batch: the old source applied resumes only after a blocking consume returned, and a
    # batch of 1 waited 560-600 ms).
    total = 320
    single = f"{topics.input}.one"
    ensure_topics(bootstrap_servers, {single: 1})
    produce("trades", single, bootstrap_servers, 1, limit=total, progress=False)
    config = load_config(
        overrides={
            "kafka": {
                "bootstrap_servers": bootstrap_servers,
                "group_id": topics.group,
                "commit_interval_ms": 60_000,  # gauges must not wait for a commit cycle
                "consume_batch_messages": 4,
            },
            "pipelines": [
                {
                    "name": "p",
                    "input_topic": single,
                    "output_topic": topics.output,
                    "workload": "tests.support.slow:make_workload",
                    "options": {"delay_s": 0.02},
                    "priority": "normal",
                    # the longest target: its wait share (15 min) leaves the 400 ms max wait in
                    # force (normal's default, 100 ms, waits at most 25 ms x the feedback's
                    # scale: a refetch slower than that on a loaded machine cut a short batch,
                    # CI on d798501)
                    "latency_target_ms": 3_600_000,
                }
            ],
            "batching": {
                "max_batch_size": 16,
                "adaptive_batch_size": False,
                "max_wait_ms": 400,
                "priority_max_wait_ms": {"high": 400, "low": 400},
            },
            "buffers": {"ring_capacity": 256, "high_watermark": 0.75, "low_watermark": 0.25},
            "metrics": {"port": 0},
        }
    )
    pipeline = Pipeline(config)
    metrics = pipeline.metrics
    fill = _Recorded(metrics.ring_fill.labels(single, "0"))
    paused = _Recorded(metrics.paused)
    # every value the source exports, as a scrape at that moment would read it (sampling the
    # registry from a thread missed the peak when that thread was starved on a loaded machine)
    metrics.ring_fill = _Labels(metrics.ring_fill, {(single, "0"): fill})  # type: ignore[assignment]
    metrics.paused = paused  # type: ignore[assignment]
    summary = pipeline.run(exit_when_idle_s=1.0)
    assert summary.exit_code == 0, summary.error
    verdict = verify(bootstrap_servers, single, topics.output, topics.dlq, topics.group)
    report("backlog across resumes", verdict)
    assert verdict.missing == [] and verdict.committed_equals_end
    # the gauges moved while it ran (they were refreshed only once per commit interval)
    assert max(paused.values) == 1.0
    assert max(fill.values) >= 0.75
    assert summary.batch_sizes[single] == {16: total // 16}


class _Recorded:
    """A gauge (child) that keeps every value set on it, then sets it."""

    def __init__(self, gauge: Any) -> None:
        self._gauge = gauge
        self.values: list[float] = [0.0]

    def set(self, value: float) -> None:
        self.values.append(value)
        self._gauge.set(value)


class _Labels:
    """A labelled gauge whose chosen children are :class:`_Recorded`."""

    def __init__(self, gauge: Any, recorded: dict[tuple[str, str], _Recorded]) -> None:
        self._gauge = gauge
        self._recorded = recorded

    def labels(self, *values: str) -> Any:
        return self._recorded.get(values) or self._gauge.labels(*values)

    def remove(self, *values: str) -> None:
        self._gauge.remove(*values)
