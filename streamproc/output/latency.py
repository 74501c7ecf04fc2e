"""What the acknowledgement of results says about each lane's latency target: the measured P99
(consume to acknowledgement) beside the target, the time over it, and a warning as a lane starts
being over it.

:class:`LatencyReport` is called by whichever thread runs a batch's delivery callback (the sink
thread, a results thread waiting out a full producer queue, main at flush), once per batch of
results, with the batch's input records. It holds no state of its own: each lane keeps its
target's window and episodes under its lock (:meth:`~streamproc.intake.lane.Lane.delivered`);
this module publishes what the lane reads out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from streamproc.intake.lane import Lane
from streamproc.logs import get_logger
from streamproc.metrics import Metrics
from streamproc.records import Record

log = get_logger(__name__)


class LatencyReport:
    """Publishes the latency target of every lane that has one.

    Args:
        lanes: the lanes by input topic (a lane without a target is left out of every metric).
        metrics: where ``streamproc_latency_target_seconds`` (set here, once),
            ``streamproc_latency_p99_seconds`` and ``streamproc_latency_over_target_seconds_total``
            go, by input topic.
        clock: the monotonic clock of ``Record.consumed_at_s`` (seconds; injected in tests).
    """

    def __init__(
        self,
        lanes: Mapping[str, Lane],
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lanes = {t: lane for t, lane in lanes.items() if lane.latency_target_s is not None}
        self._p99 = {t: metrics.latency_p99.labels(t) for t in self._lanes}
        self._over = {t: metrics.latency_over_target.labels(t) for t in self._lanes}
        for topic, lane in self._lanes.items():
            metrics.latency_target.labels(topic).set(lane.latency_target_s or 0.0)
            self._over[topic].inc(0)  # the series exists from the start
        self._clock = clock

    def acknowledged(self, records: Sequence[Record], cut_s: float | None = None) -> None:
        """The broker acknowledged the results of ``records`` (one batch, one input topic)
        cut at ``cut_s`` (monotonic seconds; None: not known)."""
        if not records:
            return
        topic = records[0].tp.topic
        lane = self._lanes.get(topic)
        if lane is None:
            return
        consumed_s = np.fromiter((r.consumed_at_s for r in records), np.float64, len(records))
        reading = lane.delivered(consumed_s, self._clock(), cut_s)
        if reading is None:
            return
        if reading.p99_s is not None:
            self._p99[topic].set(reading.p99_s)
        if reading.over_target_s:
            self._over[topic].inc(reading.over_target_s)
        if not (reading.went_over or reading.back_within):
            return
        where = {
            "topic": topic,
            "p99_ms": round((reading.p99_s or 0.0) * 1000.0, 1),
            "target_ms": (lane.latency_target_s or 0.0) * 1000.0,
        }
        if reading.went_over:
            log.warning(
                "latency over target",
                **where,
                batch_cap=reading.batch_cap,
                scale=round(reading.scale, 3),
                hint="the batcher shrinks its waits and batches while that helps; see "
                "docs/operations.md (Latency target) when it persists",
            )
        else:
            log.info("latency within target again", **where)
