"""A lane's two routes, one interface (:class:`LaneRun`): staged (:class:`StagedRun`: the
dispatcher, device and results threads) and fused on a CPU device (:class:`FusedRun`: one thread
cuts, decodes, runs the model, encodes and produces, with no hand-off between threads); and the
choice between them (:class:`LaneRouter`, :class:`LaneRoutePolicy`).

Pipelining a lane over threads (dispatcher -> device -> results) pays on a GPU, where the device
works while Python prepares the next batch. Where the device is the CPU the threads only compete
for the same cores and the GIL, and every batch pays the hand-offs (a queue, a condition and a
wake-up per stage) and the queueing between them. A fused lane does the same work on its
dispatcher thread, with the same rings, batcher, priorities, flow control, offset ledger,
part runner, result handler and guarantees::

    dispatch-<topic>: Lane.next_cut -> lease slab -> Decoder (inline, or its decode threads)
        -> DeviceWorker.run_here (admission, model, part runner; the slab back)
        -> Resequencer.hand_over_here -> ResultHandler (encode, Sink.send_results)
        -> output buffers back, DeviceLoad.released

Which route a lane takes (``worker.fused_lane``): ``never`` (staged), ``always`` (fused; a lane
on one CPU device only, else a start-up error), or ``auto``: where the lane runs on one CPU
device, :class:`LaneRoutePolicy` measures both routes on live batches and keeps the cheaper
(a :class:`~streamproc.routes.RoutePolicy`: staged where its overlap makes the lane faster per
record by a margin, else fused where it costs less CPU per record, else as it is); fused at
start, first probed after 30 s. A lane on a GPU, or on several devices, is always staged.

A switch happens at a batch boundary. From staged to fused the dispatcher waits until every
batch already cut was handed over (:meth:`Resequencer.caught_up`), so each partition's results
stay in offset order; from fused to staged nothing is in flight. The adaptive batch size learns
a fused batch's whole time on the lane's thread (decode, model, encode, produce), the cost a
batch size amortises there, instead of the model's time alone.

Ownership: while a lane runs fused its dispatcher thread owns what the device thread owns on the
staged route (the worker's part runner, batch cap and output set choice); the hand-over between
the two is ordered by the resequencer's condition (every staged batch handed over first).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Literal, Protocol

from streamproc.decode import Decoder
from streamproc.device.jobs import DeviceJob, DeviceResult
from streamproc.device.worker import DeviceWorker
from streamproc.dispatch.placement import DeviceLoad
from streamproc.output.resequencer import Resequencer
from streamproc.routes import RoutePolicy, observe_logged

LaneRoute = Literal["fused", "staged"]
"""How a lane runs its batches: on its dispatcher thread (``fused``) or over the dispatcher,
device and results threads (``staged``)."""

PROBE_BATCHES = 16
"""Batches each route runs in a probe, in one stint each (a switch to fused waits for the
staged batches in flight: alternating batch by batch would drain the lane every batch)."""


class LaneRoutePolicy(RoutePolicy[LaneRoute]):
    """Whether a lane on one CPU device runs fused or staged, by the measured wall and CPU
    seconds per record of each route (:class:`~streamproc.routes.RoutePolicy`: simple way
    ``fused``, parallel way ``staged``, probes in stints of :data:`PROBE_BATCHES`).

    Its one owner is the lane's dispatcher thread: :meth:`route` before each batch,
    :meth:`observe` after it with the batch's records, the wall seconds since the previous
    batch (the lane's cycle: its throughput under a backlog) and the CPU seconds of the lane's
    own threads over that time (dispatcher, device, results; not the decode threads, shared
    by the lanes, nor torch's intra-op threads: the model's work is the same either way). The
    CPU is counted per cycle, not per batch: on the staged route a batch's device and results
    work lands in later cycles, so the cycles right after a switch (the drain, the refill) are
    left out, and neither route's probe starts while the lane's decode route is probing (nor
    the other way round: each would measure the other's mix).

    Each route's cost is all its seconds over all its records (a median of per-batch ratios
    favours the route that cuts smaller batches), and the cycles are compared only where both
    routes found a backlog (batches cut full): at partial load the arrival rate sets the cycle
    and only the CPU decides.

    Starts settled on ``start`` and probes first after ``recheck_s`` (a probe at start-up
    would put its stint of staged batches, and the drain back, on the first messages' latency;
    the start route is the simpler one, not a measured winner: docs/benchmarks.md).

    Args:
        clock: monotonic seconds (injected for tests).
        start: the route at start (``fused``).
        recheck_s: seconds before the first probe (then doubling while the route holds).
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        start: LaneRoute = "fused",
        recheck_s: float = 30.0,
    ) -> None:
        super().__init__(
            "fused",
            "staged",
            "lane",
            clock,
            start=start,
            probe_batches=PROBE_BATCHES,
            stint=PROBE_BATCHES,
            recheck_s=recheck_s,
            probe_at_start=False,
            pooled=True,
        )


def threads_cpu_s(idents: Iterable[int | None]) -> float:
    """CPU seconds so far of the threads ``idents`` (``threading.get_ident`` values; None and
    threads that ended count 0): per-thread clocks, as ``/proc/<pid>/task/<tid>/stat`` has
    them."""
    total = 0.0
    for ident in idents:
        if ident is None:
            continue
        try:
            total += time.clock_gettime(time.pthread_getcpuclockid(ident))
        except (OSError, ProcessLookupError):
            continue  # ended
    return total


class LaneRun(Protocol):
    """One of a lane's two routes for a decoded, placed and bound batch: the dispatcher makes
    the same calls on either (:class:`StagedRun`, :class:`FusedRun`), the router picks which."""

    def ready(self, batch_id: int, stop: threading.Event) -> bool:
        """Before batch ``batch_id`` takes this route: wait until it may (False once ``stop``
        is set first)."""

    def run(self, job: DeviceJob, device: int, started_s: float) -> None:
        """Run ``job`` (cut at ``started_s``, monotonic seconds) on device ``device`` (the
        index :meth:`DeviceLoad.place` chose) and have its result handed over in order."""

    def pass_over(self, result: DeviceResult) -> None:
        """Hand over the result of a batch whose every record expired (no slab, no device),
        in batch-id order."""


class StagedRun:
    """The staged route: the batch goes to its device thread (:meth:`DeviceWorker.submit`);
    the device and results threads finish it.

    Args:
        workers: one device worker per device, in the order of the placement's labels.
        resequencer: the lane's resequencer (None: a batch whose every record expired raises;
            a lane built without deadlines never cuts one).
    """

    def __init__(self, workers: Sequence[DeviceWorker], resequencer: Resequencer | None) -> None:
        self._workers = tuple(workers)
        self._resequencer = resequencer

    def ready(self, batch_id: int, stop: threading.Event) -> bool:
        """Always: the device threads take batches in any order, the resequencer orders them."""
        return True

    def run(self, job: DeviceJob, device: int, started_s: float) -> None:
        """Queue ``job`` on device ``device``'s thread."""
        self._workers[device].submit(job)

    def pass_over(self, result: DeviceResult) -> None:
        """Queue ``result`` in the resequencer, behind the batches in flight.

        Raises:
            RuntimeError: the lane has no resequencer.
        """
        if self._resequencer is None:
            raise RuntimeError(
                f"batch {result.batch.batch_id}: every record expired, no resequencer"
            )
        self._resequencer.put(result, nothing_to_release)


class FusedRun:
    """The fused route: runs a lane's batch on the calling thread (the lane's dispatcher)
    through its one CPU device worker, and hands the result over there (the resequencer's own
    result handler).

    Args:
        worker: the lane's device worker (a synchronous backend).
        resequencer: the lane's resequencer (batch-id order across routes).
        load: the lane's placement state (busy gauge, in-flight accounting, as on the staged
            route).
        observe: the lane's adaptive batch size (``Lane.observe(rows, seconds, whole=True)``),
            given each batch whose model ran in one call with its whole time on this thread
            (the result handler reports the device time too; the lane keeps the kind its
            settled route learns).
    """

    def __init__(
        self,
        worker: DeviceWorker,
        resequencer: Resequencer,
        load: DeviceLoad,
        observe: Callable[[int, float], None],
    ) -> None:
        self._worker = worker
        self._resequencer = resequencer
        self._load = load
        self._observe = observe

    def thread_idents(self) -> tuple[int | None, ...]:
        """The staged route's other threads (device, results): their CPU counts for the lane."""
        return (*self._worker.thread_idents, self._resequencer.thread_ident)

    def ready(self, batch_id: int, stop: threading.Event) -> bool:
        """Wait until every batch before ``batch_id`` was handed over (see
        :meth:`Resequencer.caught_up`: after staged batches, those in flight go out first);
        False once ``stop`` is set."""
        return self._resequencer.caught_up(batch_id, stop)

    def run(self, job: DeviceJob, device: int, started_s: float) -> None:
        """Run ``job`` (cut and decoded on this thread since ``started_s``, monotonic
        seconds) through the model and hand its result over (``device``: 0, the one device).

        Raises:
            FatalPipelineError: the pipeline must stop (the batch is neither produced nor
                dead-lettered; its buffers are back).
            Exception: what the result handler raised.
        """
        batch = job.batch
        result, release = self._worker.run_here(job)
        self._load.completed(batch.batch_id, result.inference_s)
        handed = self._resequencer.hand_over_here(result, release)
        if handed and result.error is None and result.model_calls == 1:
            self._observe(len(batch), time.monotonic() - started_s)

    def pass_over(self, result: DeviceResult) -> None:
        """Hand ``result`` over on this thread (every earlier batch was handed over)."""
        self._resequencer.hand_over_here(result, nothing_to_release)


def nothing_to_release() -> None:
    """The release of a batch that ran on no device (no output buffers to give back)."""


class LaneRouter:
    """Which route each of a lane's batches takes, and what it cost (the lane's dispatcher
    thread only): a fixed route, or a :class:`LaneRoutePolicy` fed with each cycle's wall and
    the lane's own threads' CPU.

    Args:
        topic: the lane's input topic (logs).
        route: ``"staged"``, ``"fused"``, or a policy.
        decoder: the lane's decoder: one probe at a time per lane (the decode route's or this).
        lane_threads: the staged route's other threads (:meth:`FusedRun.thread_idents`).
        max_in_flight: staged batches in flight per device: the cycles after a switch that
            are left unmeasured (the drain, or the refill), plus one.
        on_route: called with the settled route, at start and after each change.
    """

    def __init__(
        self,
        topic: str,
        route: LaneRoute | LaneRoutePolicy,
        decoder: Decoder,
        lane_threads: Callable[[], tuple[int | None, ...]],
        max_in_flight: int,
        on_route: Callable[[LaneRoute], None],
    ) -> None:
        self._topic = topic
        self._policy = route if isinstance(route, LaneRoutePolicy) else None
        self._fixed: LaneRoute = route if isinstance(route, str) else route.settled
        self._decoder = decoder
        self._lane_threads = lane_threads
        self._threads: tuple[int | None, ...] = ()
        self._settle = max_in_flight + 1
        self._on_route = on_route
        self.previous: LaneRoute = self._fixed  # the route of the latest batch
        self._settling = 0
        self._cycle_s = time.monotonic()
        self._cpu_mark_s = 0.0
        on_route(self._fixed)

    @property
    def settled(self) -> LaneRoute:
        """The route the lane runs outside probes."""
        return self._fixed if self._policy is None else self._policy.settled

    @property
    def measuring(self) -> bool:
        return self._policy is not None

    def next_route(self) -> LaneRoute:
        """The next batch's route (a probe of the lane starts only while the decode route does
        not probe, and holds the decode route's probes while it runs)."""
        policy = self._policy
        if policy is None:
            return self._fixed
        route = policy.route(hold=self._decoder.probing)
        self._decoder.hold_probes = policy.probing
        if route != self.previous:
            self._settling = self._settle
        return route

    def done(self, route: LaneRoute, items: int, full: bool, now_s: float) -> None:
        """The batch of ``items`` records went ``route`` (cut full when ``full``) and was
        handed over (fused) or submitted (staged) at ``now_s``."""
        self.previous = route
        policy = self._policy
        if policy is not None:  # the lane's cycle and its threads' CPU since the last batch
            if not self._threads:
                self._threads = self._lane_threads()
            cpu_s = time.thread_time() + threads_cpu_s(self._threads)
            if self._cpu_mark_s and not self._settling:
                observe_logged(
                    policy, route, items, now_s - self._cycle_s, cpu_s - self._cpu_mark_s,
                    topic=self._topic, on_change=self._on_route, saturated=full,
                )  # fmt: skip
            self._settling = max(0, self._settling - 1)
            self._cpu_mark_s = cpu_s
        self._cycle_s = now_s
