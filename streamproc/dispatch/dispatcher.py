"""The dispatcher: cut a batch when a device can take one, decode it into a staging slab, and
place it on the device expected to finish it first.

One dispatcher thread per lane (input topic)::

    DeviceLoad.wait_capacity (some device below its in-flight limit)
      -> Lane.next_cut (the batcher decides, under the lane's lock)
      -> lease a staging slab (held by the batch id) -> the Decoder fills it (threads or
         processes, straight into the slab)
      -> DeviceLoad.place (expected finish first; see device.placement) -> DeviceWorker.submit

On a lane that runs fused (one CPU device; :mod:`streamproc.dispatch.fusion`), the dispatcher
also runs each batch's model and hands its result over itself, after the decode: no device or
results thread takes part. ``worker.fused_lane`` fixes the route, or a
:class:`~streamproc.dispatch.fusion.LaneRoutePolicy` picks it by measured cost, batch by batch.

Batch ids count 1, 2, 3, ... per lane without gaps: the lane's resequencer hands results over in
that order. A device's in-flight slot is freed once the batch's results were handed to the sink
(:meth:`~streamproc.dispatch.placement.DeviceLoad.released`), so at most
``max_in_flight_batches`` batches per device are between cut and produce. Decode failures (and
oversized values) travel with the batch as per-row errors and are dead-lettered by the result
handler, in order with the other results.

Deadlines: records past their deadline at the cut (``Record.deadline_s``) are counted in
``streamproc_expired_total{topic}`` and travel in their batch's ``expired``, never decoded nor
run; the result handler produces what they become, in order with the batch's results. A cut
whose every record expired takes a batch id like any other but no staging slab, device or
in-flight slot: it goes straight to the lane's resequencer (handed over here on the fused
route, queued behind the batches in flight on the staged one).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from streamproc.decode import Decoder
from streamproc.device import DeviceJob, DeviceResult, DeviceWorker, StagingPool
from streamproc.device.hold import HoldAbandoned
from streamproc.dispatch.fusion import (
    FusedRun,
    LaneRoute,
    LaneRoutePolicy,
    LaneRouter,
    LaneRun,
    StagedRun,
)
from streamproc.dispatch.placement import DeviceLoad
from streamproc.intake.lane import Lane
from streamproc.intake.rings import FlowControl
from streamproc.logs import get_logger
from streamproc.metrics import Metrics
from streamproc.output.resequencer import Resequencer
from streamproc.records import Batch
from streamproc.stages import StageRecorder

log = get_logger(__name__)

FULL_CUTS = frozenset({"size", "bytes"})
"""Cut reasons of a batch that found a backlog (its target or byte limit reached), as opposed
to a deadline or a sparse stream (:class:`~streamproc.intake.batcher.Cut`)."""

STALL_CHECK_PERIOD_S = 0.5
"""The dispatcher checks for stalled devices at most this often, in seconds (the lag thread
checks on every tick too)."""


class Dispatcher:
    """Feeds one lane's device workers.

    Args:
        lane: the lane whose cuts it takes.
        decoder: fills a leased slab from the batch's records.
        pool: the lane's staging slabs.
        workers: one device worker per device, in the order of ``load.labels``.
        load: the lane's placement state (capacity, device choice).
        apply_flow: hands resume decisions to the source thread.
        metrics: process metrics.
        on_fatal: called with an exception that stops the dispatcher.
        fused: the lane's fused route (None: staged only).
        route: ``"staged"``, ``"fused"`` (needs ``fused``), or a :class:`LaneRoutePolicy`
            that picks one per batch (needs ``fused``).
        on_route: called with the route the lane runs, at start and after each change.
        bind: called with each decoded batch and the index of the device it goes to, before
            it is handed over: binds it to the model version that serves it (a versioned
            pipeline's :meth:`~streamproc.models.versions.ModelVersions.bind`); None: the
            workers' own models.
        resequencer: the lane's resequencer, where a batch whose every record expired goes
            (None: such a batch raises; a lane built without deadlines never cuts one).
        stages: the lane's stage recorder (:mod:`streamproc.stages`; default: one over
            ``metrics`` on the monotonic clock, the clock of the records' consume times).

    Raises:
        ValueError: ``workers`` and ``load`` disagree on the number of devices, or a fused
            route without ``fused``.
    """

    def __init__(
        self,
        lane: Lane,
        decoder: Decoder,
        pool: StagingPool,
        workers: Sequence[DeviceWorker],
        load: DeviceLoad,
        apply_flow: Callable[[FlowControl], None],
        metrics: Metrics,
        on_fatal: Callable[[BaseException], None],
        fused: FusedRun | None = None,
        route: LaneRoute | LaneRoutePolicy = "staged",
        on_route: Callable[[LaneRoute], None] | None = None,
        bind: Callable[[DeviceJob, int], None] | None = None,
        resequencer: Resequencer | None = None,
        stages: StageRecorder | None = None,
    ) -> None:
        if len(workers) != len(load.labels):
            raise ValueError(f"{len(workers)} workers for devices {load.labels}")
        if fused is None and route != "staged":
            raise ValueError("a fused route needs the lane's FusedRun")
        self._runs: dict[LaneRoute, LaneRun] = {"staged": StagedRun(workers, resequencer)}
        if fused is not None:
            self._runs["fused"] = fused
        self._router = LaneRouter(
            lane.topic,
            route,
            decoder,
            fused.thread_idents if fused is not None else tuple,
            workers[0].max_in_flight,
            on_route or (lambda route: None),
        )
        topic = self.topic = lane.topic
        self._lane = lane
        self._decoder = decoder
        self._pool = pool
        self._workers = tuple(workers)
        self._load = load
        self._apply_flow = apply_flow
        self._metrics = metrics
        self._on_fatal = on_fatal
        self._bind = bind
        self._expired = metrics.expired.labels(topic)
        self._batch_size = metrics.batch_size.labels(topic)
        self._queue_wait = metrics.queue_wait.labels(topic)
        self._stages = stages or StageRecorder(metrics.stage, topic)
        self._pool_in_use = metrics.pool_in_use.labels(topic)
        self._stop = threading.Event()
        self._next_batch_id = 0
        self._next_stall_check_s = 0.0
        self.batch_sizes: dict[int, int] = {}
        self._thread = threading.Thread(target=self._run, name=f"dispatch-{topic}", daemon=True)

    def start(self) -> None:
        log.info(
            "lane route",
            topic=self.topic,
            route=self.route,
            chosen="by measuring both (worker.fused_lane: auto)"
            if self._router.measuring
            else "fixed",
        )
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Stop cutting batches (rings keep their records, uncommitted) and join; a batch a
        worker holds (a model judged broken) is abandoned, uncommitted."""
        self._stop.set()
        for worker in self._workers:
            worker.halt()  # a fused lane holds on this thread
        self._lane.wake()
        self._load.wake()  # a dispatcher waiting for a device with room
        self._thread.join(timeout_s)

    @property
    def route(self) -> LaneRoute:
        """The route the lane runs outside probes (``fused`` or ``staged``)."""
        return self._router.settled

    def _run(self) -> None:
        router = self._router
        try:
            while self._load.wait_capacity(self._stop):
                route = router.next_route()
                run = self._runs[route]
                if not run.ready(self._next_batch_id + 1, self._stop):
                    return
                batch = self._next_batch()
                if batch is None:
                    return
                if not batch.records:  # every record expired: nothing to decode or run
                    if batch.clock is not None:  # neither stage takes any time
                        batch.clock.lap("decode")
                        batch.clock.lap("device")
                    run.pass_over(DeviceResult(batch, (), {}, None, 0.0, model_calls=0))
                    router.previous = route
                    continue
                job = self._decode(batch)
                device = self._load.place(batch.batch_id, len(batch))
                if self._bind is not None:
                    self._bind(job, device)
                run.run(job, device, batch.cut_at_s)
                now_s = time.monotonic()
                router.done(route, len(batch), batch.reason in FULL_CUTS, now_s)
                if now_s >= self._next_stall_check_s:  # the lag thread checks every tick too
                    self._next_stall_check_s = now_s + STALL_CHECK_PERIOD_S
                    self._load.check_stalls()
        except HoldAbandoned:
            return  # stopping while a fused batch was held: it stays uncommitted
        except BaseException as exc:
            self._on_fatal(exc)

    def _next_batch(self) -> Batch | None:
        cut = self._lane.next_cut(self._stop)
        if cut is None:
            return None
        self._apply_flow(cut.flow)
        self._next_batch_id += 1
        self._queue_wait.observe_many(cut.cut_at_s - cut.consumed_s)
        if cut.expired:
            self._expired.inc(len(cut.expired))
        n = len(cut.records)
        if n:
            self.batch_sizes[n] = self.batch_sizes.get(n, 0) + 1
            self._batch_size.observe(n)
        taken = [*cut.records, *cut.expired] if cut.expired else cut.records  # consumed_s's order
        clock = self._stages.cut(taken, cut.consumed_s, cut.ready_s, cut.cut_at_s)
        return Batch(
            self._next_batch_id,
            tuple(cut.records),
            cut.cut_at_s,
            cut.reason,
            tuple(cut.expired),
            clock,
        )

    def _decode(self, batch: Batch) -> DeviceJob:
        slab = self._pool.lease(batch_id=batch.batch_id)
        assert slab is not None
        self._pool_in_use.set(self._pool.in_use)
        try:
            decoded = self._decoder.decode(batch.records, slab)
        except BaseException:
            self._pool.release(slab)  # e.g. the schema registry given up at close
            self._pool_in_use.set(self._pool.in_use)
            raise
        if batch.clock is not None:
            batch.clock.lap("decode")
        return DeviceJob(batch, slab, decoded)
