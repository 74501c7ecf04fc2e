"""A lane: one pipeline's rings and batch-cut policy under one lock, between the source and the
pipeline's dispatcher (one lane per ``pipelines[]`` entry; "lane" means nothing else).

A :class:`Lane` owns its input topic's per-partition rings (:class:`PartitionBuffers`), the
batch-cut policy (:class:`Batcher`, with its adaptive size and arrival gaps) and the one lock
that guards both. No other module takes that lock: every thread goes through the small method
set below, each of which takes it once.

========================  ===================  ==============================================
method                    called by            does
========================  ===================  ==============================================
:meth:`offer_runs`        source thread        push records, track them as consumed
:meth:`assign`            source thread        fresh rings for newly assigned partitions
:meth:`revoke`            source thread        drop rings, count what they held
:meth:`next_cut`          dispatcher thread    wait for a cut, take its records
:meth:`observe`           result thread        feed one batch's device time to the batcher
:meth:`delivered`         whichever thread     results acknowledged: the latency target's
                          polls the producer   measurement (consume to acknowledgement)
                          (sink, results,
                          main at flush)
:meth:`cap_batch`         device threads,      a device's batch cap moved (out of memory,
                          start-up (warm-up)   recovery): the batcher cuts at most the
                                               smallest cap of the lane's devices
:meth:`calibrate`         start-up (main)      time the batch sizes the adaptive model needs
:meth:`wake`              main (close)         wake a dispatcher waiting for a cut
:meth:`fill_ratios`       source thread        ring fill per partition (gauges)
========================  ===================  ==============================================

Lock order: a lane's lock may be held while the offset tracker's lock is taken (``offer``
tracks records as consumed under the lane lock, so a record is never in a ring untracked);
never the other way round. :meth:`delivered` may be called under the transaction lock (a
delivery report run by ``produce()`` or a flush inside it): the transaction lock comes before a
lane's, and nothing under a lane's lock takes the transaction lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from streamproc.intake.batcher import NEAR_BEST, Batcher, Cut
from streamproc.intake.deadlines import Deadlines
from streamproc.intake.latency import LatencyReading
from streamproc.intake.rings import FlowControl, PartitionBuffers
from streamproc.offsets.tracker import OffsetTracker
from streamproc.records import Priority, Record, TopicPartition

MAX_EXPIRED_PER_CUT = 1024
"""A cut stops after setting this many expired records apart (it takes them besides its batch,
:meth:`PartitionBuffers.take_live`): their expired results go out with the batch's, so the
bound keeps one cut's shedding (a few ms of produce calls) from delaying its live records
without limit."""


@dataclass(frozen=True, slots=True)
class Offered:
    """What :meth:`Lane.offer_runs` did with one poll's records of a lane.

    Attributes:
        runs: per partition, its records now in its ring (tracked as consumed), in offset
            order; a partition none of whose records was taken is absent.
        refused: per partition whose ring was full (or not assigned), the first refused
            offset: the source pauses it and seeks back there.
        pause: partitions that reached the ring's high watermark.
    """

    runs: dict[TopicPartition, list[Record]]
    refused: dict[TopicPartition, int]
    pause: tuple[TopicPartition, ...]

    @property
    def accepted(self) -> list[Record]:
        """Every record taken, partition by partition."""
        return [record for run in self.runs.values() for record in run]


def _probe(expired: list[Record], now_s: float) -> list[Record]:
    """A probe (:meth:`~streamproc.intake.latency.LatencyTarget.probe_due`): of a cut whose
    every record the lead expired, the one due last among those not yet past their deadline at
    ``now_s`` is served after all (taken out of ``expired``, which stays in offset order);
    none when every one had passed. One record: the lead it measures may well hold, and its
    record then comes late."""
    due = (record for record in expired if record.deadline_s > now_s)
    probe = max(due, key=lambda record: record.deadline_s, default=None)
    if probe is None:
        return []
    expired.remove(probe)
    return [probe]


@dataclass(frozen=True, slots=True)
class CutRecords:
    """The records :meth:`Lane.next_cut` took in one cut; the dispatcher numbers them into a
    :class:`~streamproc.records.Batch`.

    Attributes:
        records: the records to run, in the order the batcher chose (offset order within a
            partition); empty only where every record of the cut expired.
        flow: partitions now at or below the low watermark, to resume.
        cut_at_s: monotonic seconds of the cut.
        consumed_s: the consume times of every record taken, expired ones included (float64,
            shape ``(len(records) + len(expired),)``).
        reason: why it was cut ("size", "bytes", "deadline" or "sparse").
        expired: the records taken whose deadline (``Record.deadline_s``) had passed at
            ``cut_at_s``, in the same order; never run on a device.
        ready_s: monotonic seconds when the dispatcher began waiting for this cut (a record
            consumed before it waited in its ring for the dispatcher; after it, for the
            batcher: the ``ring`` and ``batch`` stages of :mod:`streamproc.stages`).
    """

    records: list[Record]
    flow: FlowControl
    cut_at_s: float
    consumed_s: np.ndarray
    reason: str
    expired: list[Record] = field(default_factory=list)
    ready_s: float = 0.0


class Lane:
    """One input topic's rings, batch-cut policy and their lock.

    Args:
        topic: the input topic.
        buffers: the topic's per-partition rings.
        batcher: the cut policy (owned from now on: only this lane calls it).
        tracker: the offset tracker (accepted records are tracked as consumed).
        default_priority: the class of a message without a ``priority`` header.
        clock: monotonic clock in seconds (injected for tests).
        max_age_ms: the pipeline's ``max_age_ms`` (None: records expire only by their
            ``streamproc.deadline`` header); the source reads it as :attr:`deadlines`.
        predict_expiry: the pipeline's ``expire_when`` is ``predicted``: a record also
            expires at the cut when its batch is expected to be acknowledged after its
            deadline (:meth:`Batcher.expiry_lead_s` after the cut); else only when its deadline
            has passed.
    """

    def __init__(
        self,
        topic: str,
        buffers: PartitionBuffers,
        batcher: Batcher,
        tracker: OffsetTracker,
        default_priority: Priority = Priority.NORMAL,
        clock: Callable[[], float] = time.monotonic,
        max_age_ms: int | None = None,
        predict_expiry: bool = False,
    ) -> None:
        self.topic = topic
        self._predict_expiry = predict_expiry
        self.default_priority = default_priority
        self.deadlines = Deadlines(max_age_ms)
        self._buffers = buffers
        self._batcher = batcher
        self._tracker = tracker
        self._clock = clock
        self._cond = threading.Condition()
        self._caps: dict[str, int] = {}  # device label -> its batch cap (under _cond)
        self._whole = False  # the adaptive batch size learns whole batch times (fused)
        # some record offered so far has a deadline (under _cond): only then does a cut look
        # for expired records, so a lane without deadlines pays nothing per record
        self._deadlines = False

    # -- source thread ---------------------------------------------------------------------
    def offer(self, records: Sequence[Record], deadlines: bool = False) -> Offered:
        """:meth:`offer_runs` of ``records`` in any order, grouped by partition here (each
        partition's records in offset order)."""
        runs: dict[TopicPartition, list[Record]] = {}
        for record in records:
            run = runs.get(record.tp)
            if run is None:
                runs[record.tp] = [record]
            else:
                run.append(record)
        return self.offer_runs(runs, deadlines)

    def offer_runs(
        self, runs: Mapping[TopicPartition, list[Record]], deadlines: bool = False
    ) -> Offered:
        """Push one poll's records of this lane, per partition a run in offset order, into
        their rings (one lock acquisition, one ring push and one tracker pass per partition).

        A partition whose ring refuses a record (full, or no longer assigned) refuses the rest
        of its run; accepted records are tracked as consumed before the lock is released, and
        a waiting dispatcher is woken. ``deadlines``: some record has a deadline
        (``Record.deadline_s`` finite); from then on every cut looks for expired records.
        """
        refused: dict[TopicPartition, int] = {}
        pause: list[TopicPartition] = []
        accepted: dict[TopicPartition, list[Record]] = {}
        buffers = self._buffers
        with self._cond:
            if deadlines:
                self._deadlines = True
            for tp, run in runs.items():
                kept, paused = buffers.push_run(tp, run)
                if kept < len(run):
                    refused[tp] = run[kept].offset
                    run = run[:kept]
                if paused:
                    pause.append(tp)
                if kept:
                    accepted[tp] = run
            if accepted:
                self._tracker.consumed_runs(accepted)
                self._cond.notify()
        return Offered(accepted, refused, tuple(pause))

    def assign(self, tps: Iterable[TopicPartition]) -> None:
        """A fresh, empty ring per partition (whatever it held before is gone)."""
        fresh = tuple(tps)
        with self._cond:
            self._buffers.revoke(fresh)
            self._buffers.assign(fresh)
            self._cond.notify_all()

    def revoke(self, tps: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """Drop the rings of ``tps``; returns per partition how many records they still held
        (those were never dispatched: their offsets stay pending and uncommitted)."""
        with self._cond:
            dropped = self._buffers.revoke(tps)
            self._cond.notify_all()
        return {tp: len(records) for tp, records in dropped.items()}

    def fill_ratios(self) -> dict[TopicPartition, float]:
        """Fill of each ring as a fraction of its capacity."""
        with self._cond:
            return self._buffers.fill_ratios()

    # -- dispatcher thread -----------------------------------------------------------------
    def next_cut(self, stop: threading.Event) -> CutRecords | None:
        """Wait until the batcher says cut, then take the batch's records; None once ``stop``
        is set (records still in the rings stay there, uncommitted). Records past their
        deadline at the cut are set apart in :attr:`CutRecords.expired`."""
        batcher, buffers, cond = self._batcher, self._buffers, self._cond
        ready_s = self._clock()
        with cond:
            while not stop.is_set():
                now_s = self._clock()
                decision = batcher.decide(buffers.views(), now_s)
                if isinstance(decision, Cut):
                    expired: list[Record] = []
                    if self._deadlines:
                        # an expired record takes no live record's place: shed a batch size
                        # per cut, each cost a whole cut (congestion collapse under overload)
                        lead_s = 0.0
                        if self._predict_expiry:  # late by the time its batch is done
                            lead_s = batcher.expiry_lead_s(decision.count, now_s)
                        records, expired, flow = buffers.take_live(
                            decision.count,
                            batcher.max_batch_bytes,
                            batcher.max_wait_s,
                            now_s + lead_s,
                            MAX_EXPIRED_PER_CUT,
                        )
                        if self._predict_expiry:
                            probe = not records and batcher.probe_due(lead_s, now_s)
                            if probe:
                                records = _probe(expired, now_s)
                            if records:  # the lead's measure
                                batcher.served(now_s, probe)
                    else:
                        records, flow = buffers.take(
                            decision.count, batcher.max_batch_bytes, batcher.max_wait_s
                        )
                    taken = records + expired if expired else records
                    consumed_s = np.fromiter(
                        (r.consumed_at_s for r in taken), np.float64, len(taken)
                    )
                    batcher.cut(consumed_s)
                    return CutRecords(
                        records, flow, now_s, consumed_s, decision.reason, expired, ready_s
                    )
                cond.wait(None if decision.until_s is None else decision.until_s - now_s)
        return None

    def wake(self) -> None:
        """Wake a dispatcher waiting in :meth:`next_cut` (after its ``stop`` was set)."""
        with self._cond:
            self._cond.notify_all()

    # -- result thread / start-up ------------------------------------------------------------
    def observe(self, size: int, service_s: float, whole: bool = False) -> None:
        """One batch of ``size`` messages took ``service_s`` seconds: on the device, or
        ``whole``, its whole time on a fused lane's thread. The adaptive batch size learns only
        the kind its lane runs now (:meth:`aim_for_throughput`); a probe's batches of the other
        route are left out (their seconds are on another scale). A waiting dispatcher is woken when
        the size aimed for fell (a smaller batch may be ready)."""
        with self._cond:
            if whole == self._whole:
                batcher = self._batcher
                before = batcher.target
                batcher.observe(size, service_s)
                if batcher.target < before:  # the latency cap or the adaptive size fell:
                    self._cond.notify()  # a smaller batch may be ready now

    def delivered(
        self, consumed_s: np.ndarray, now_s: float, cut_s: float | None = None
    ) -> LatencyReading | None:
        """Results of records consumed at ``consumed_s`` (monotonic seconds, shape ``(n,)``)
        and cut at ``cut_s`` (None: not known) were acknowledged at ``now_s``: the latency
        target's measurement (see :meth:`Batcher.acknowledged`). Returns its reading when one
        is due; None without a target. A waiting dispatcher is woken when the waits or the cap
        moved."""
        with self._cond:
            batcher = self._batcher
            if batcher.latency is None:
                return None
            before = (batcher.waits_s, batcher.latency_cap)
            reading = batcher.acknowledged(consumed_s, now_s, cut_s)
            if (batcher.waits_s, batcher.latency_cap) != before:
                self._cond.notify()  # a shorter wait may have passed, a smaller batch be ready
            return reading

    @property
    def latency_target_s(self) -> float | None:
        """The pipeline's latency target in seconds (None: none)."""
        latency = self._batcher.latency  # set once at construction
        return None if latency is None else latency.target_s

    def cap_batch(self, device: str, cap: int) -> None:
        """``device`` can run at most ``cap`` rows per batch now; batches are cut no larger
        than the smallest cap of the lane's devices (a batch may go to any of them)."""
        with self._cond:
            self._caps[device] = cap
            self._batcher.set_cap(min(self._caps.values()))
            self._cond.notify_all()

    def aim_for_throughput(self, throughput: bool) -> None:
        """With the adaptive batch size: aim for the throughput-optimal size and learn whole
        batch times (a fused lane: each batch's time is the lane thread's whole work on it), or,
        False, the smallest size within 5 % of the best and learn device times (a staged lane:
        lower latency for the same device throughput)."""
        with self._cond:
            self._whole = throughput
            sizer = self._batcher.sizer
            if sizer is not None:
                sizer.set_near_best(1.0 if throughput else NEAR_BEST)

    @property
    def cap(self) -> int:
        """The largest batch cut now (rows)."""
        with self._cond:
            return self._batcher.cap

    def calibrate(self, time_batch: Callable[[int], float], max_batches: int = 64) -> int:
        """Start-up: time the batch sizes the adaptive model needs measured (until it knows
        its target, at most ``max_batches``) with ``time_batch(size) -> device seconds`` (the
        device worker's :meth:`~streamproc.device.DeviceWorker.time_batch`); returns the
        batches timed. Without the adaptive model nothing needs measuring."""
        runs = 0
        while runs < max_batches:
            with self._cond:
                size = self._batcher.unmeasured()
            if size is None:
                break
            seconds = time_batch(size)  # timed outside the lock
            with self._cond:  # device seconds, whatever the route: stale after a few batches
                self._batcher.observe(size, seconds)
            runs += 1
        return runs

    @property
    def target(self) -> int:
        """The batch size aimed for now."""
        with self._cond:
            return self._batcher.target
