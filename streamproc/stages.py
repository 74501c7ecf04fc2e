"""Where an input record's time goes: its latency stage by stage
(``streamproc_stage_seconds{topic,stage}``).

The stages are back to back (each begins where the one before it ended), so a record's
stages up to ``produce`` add up to its end-to-end latency (record timestamp to
acknowledgement, ``streamproc_end_to_end_seconds``) and whichever stage owns a tail shows it::

    stage     from                          to                                  counted
    consume   the record's timestamp        polled by the source                per record
    ring      polled                        the lane's dispatcher ready to cut  per record
    batch     (the later of the two above)  the batch cut                       per record
    decode    the cut                       decoded into its staging slab       per batch
    device    decoded                       the batch's done event seen         per batch
    encode    done                          the batch's first produce call      per batch
    produce   the first produce call        the batch's last delivery report    per batch
    commit    acknowledged                  the commit covering its offset      per batch
                                                                                and partition

What each stage holds besides its own work:

* ``consume``: the time in the broker and in the consumer's fetch queue (a consumer that falls
  behind, partitions paused by flow control); a producer's clock skew under ``CreateTime``
  (a negative difference counts 0).
* ``ring``: the wait in the partition's ring while the dispatcher was busy with earlier batches
  or waited for a device with room (``worker.max_in_flight_batches``): queueing behind the lane.
* ``batch``: the wait for the batcher to cut (its size target, ``max_wait_ms``): batching.
* ``decode``: a staging slab's lease and the decode (inline, or on the decode pool).
* ``device``: the wait for the device (its job queue, an output buffer set, the admission of
  lanes sharing it), then copy in, model, copy out; ``streamproc_inference_seconds`` has the
  device time alone.
* ``encode``: the wait for the lane's results thread and for earlier batches (cut order), the
  encode and the batch's dead-letter records.
* ``produce``: the produce calls (a full producer queue waits here), ``linger.ms`` and the
  broker's ``acks=all`` acknowledgement.
* ``commit``: the wait for the next commit (``kafka.commit_interval_ms``; at-least-once counts
  the commit request sent, exactly-once the transaction committed).

A batch's stages are counted once per record of it (its records and its expired ones), so each
stage's quantiles are per record, like the end-to-end latency's. The cost is per batch (a
:class:`StageClock` per batch, one bucket search per stage) but for the first three stages
(a few numpy operations over the batch at the cut) and the commit ledger (a dictionary update
per acknowledged record, in the offset tracker).

A batch's clock crosses the threads with its batch (:attr:`streamproc.records.Batch.clock`):
each stage's thread laps it in turn (dispatcher: decode; device or completion thread: device;
results thread, or a fused lane's dispatcher: encode; whichever thread polls the producer:
produce), each after the one before, ordered by the hand-over of the batch itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from operator import attrgetter

import numpy as np
from attrs import define, field

from streamproc.histograms import BatchHistogram, BatchHistogramSeries
from streamproc.metrics import Metrics
from streamproc.records import Record
from streamproc.tracing.batch import BatchTrace, BatchTracer

STAGES = ("consume", "ring", "batch", "decode", "device", "encode", "produce", "commit")
"""The stages of the record path in order (the ``stage`` label's values)."""

CommitWait = tuple[str, float, int]
"""``(input topic, seconds from acknowledgement to commit, records)``: one acknowledged run of
a partition's records that a commit covered
(:meth:`~streamproc.offsets.tracker.OffsetTracker.mark_committed`)."""

BATCH_STAGES = ("decode", "device", "encode", "produce")
"""The stages a batch's :class:`StageClock` laps, in order."""


_TIMESTAMP_MS: Callable[[Record], int] = attrgetter("timestamp_ms")


@define(eq=False)
class StageClock:
    """One batch's clock: the end of its latest stage, and how many records it counts for
    (slotted: one per batch).

    Args:
        series: the topic's stage histogram series, by stage.
        clock: monotonic seconds (injected for tests).
        last_s: when the batch's latest stage ended (the cut), monotonic seconds.
        count: the batch's records (run and expired): each stage counts once per record.
        trace: the batch's trace (:mod:`streamproc.tracing.batch`; None: not traced): each lap
            is handed to it, and its sampled trace id is the laps' exemplar.

    Attributes:
        lapped: the stages lapped so far, in order (tests and checks read it).
    """

    _series: dict[str, BatchHistogramSeries]
    _clock: Callable[[], float]
    last_s: float
    count: int
    trace: BatchTrace | None = None
    lapped: list[str] = field(init=False, factory=list)

    def lap(self, stage: str) -> float:
        """``stage`` ended now: count its seconds (since the previous stage ended) once per
        record of the batch; returns now (monotonic seconds).

        Raises:
            KeyError: ``stage`` is not one of :data:`BATCH_STAGES`.
        """
        now_s = self._clock()
        trace = self.trace
        exemplar = None if trace is None else trace.exemplar
        self._series[stage].observe_repeated(max(0.0, now_s - self.last_s), self.count, exemplar)
        if trace is not None:
            trace.lap(stage, self.last_s, now_s)
        self.last_s = now_s
        self.lapped.append(stage)
        return now_s


class StageRecorder:
    """The stage histograms of one input topic: the first three stages per record at the cut,
    and a :class:`StageClock` for the rest of each batch's stages.

    Args:
        stage: ``streamproc_stage_seconds`` (:attr:`Metrics.stage`).
        topic: the input topic.
        clock: monotonic seconds (the clock of the records' ``consumed_at_s``).
        wall_clock: seconds since the epoch (the records' timestamps are epoch milliseconds).
        tracer: starts each batch's trace at the cut (None: tracing off).
    """

    def __init__(
        self,
        stage: BatchHistogram,
        topic: str,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        tracer: BatchTracer | None = None,
    ) -> None:
        self.topic = topic
        self._tracer = tracer
        self._clock = clock
        self._wall_clock = wall_clock
        self._series = {name: stage.labels(topic, name) for name in STAGES}
        self._batch_series = {name: self._series[name] for name in BATCH_STAGES}

    def cut(
        self,
        records: Sequence[Record],
        consumed_s: np.ndarray,
        ready_s: float,
        cut_s: float,
    ) -> StageClock:
        """A batch was cut at ``cut_s`` from ``records`` (run and expired) by a dispatcher
        ready to cut since ``ready_s`` (monotonic seconds): count their ``consume``, ``ring``
        and ``batch`` stages and return the batch's clock, started at the cut.

        Args:
            records: the cut's records, run and expired, in any order.
            consumed_s: their ``consumed_at_s`` in the same order (float64, ``(len(records),)``).
            ready_s: when the dispatcher began waiting for this cut (its previous batch handed
                on and a device with room).
            cut_s: the cut.
        """
        count = len(records)
        timestamps_s = np.fromiter(map(_TIMESTAMP_MS, records), np.float64, count) / 1000.0
        wall_offset_s = self._wall_clock() - self._clock()  # monotonic -> epoch seconds
        series = self._series
        series["consume"].observe_many(np.maximum(0.0, consumed_s + wall_offset_s - timestamps_s))
        taken_s = np.maximum(consumed_s, ready_s)
        series["ring"].observe_many(taken_s - consumed_s)
        series["batch"].observe_many(np.maximum(0.0, cut_s - taken_s))
        trace = None if self._tracer is None else self._tracer.start(records, cut_s)
        return StageClock(self._batch_series, self._clock, cut_s, count, trace)


def observe_commits(metrics: Metrics, waits: Iterable[CommitWait]) -> None:
    """Count the ``commit`` stage of what a commit covered (:data:`CommitWait` runs)."""
    for topic, wait_s, count in waits:
        metrics.stage.labels(topic, "commit").observe_repeated(max(0.0, wait_s), count)


def stage_quantiles(
    stage: BatchHistogram, topic: str, quantiles: Sequence[float] = (0.5, 0.99)
) -> dict[str, list[float | None]]:
    """Per stage of ``topic``, the ``quantiles`` in seconds estimated from the buckets
    (:meth:`BatchHistogramSeries.quantile`: PromQL's ``histogram_quantile``); None for a stage
    nothing was counted in."""
    return {name: [stage.labels(topic, name).quantile(q) for q in quantiles] for name in STAGES}
