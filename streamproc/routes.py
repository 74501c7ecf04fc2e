"""Choosing between two ways of doing the same work by their measured cost: a pure policy.

Two places in the core have a *simple* way (the work stays on the calling thread) and a
*parallel* way (the work is handed to other threads, which costs hand-offs but can overlap):

* a lane's decode: inline on its dispatcher thread, or on the decode threads
  (:class:`~streamproc.decode.route.DecodeRoutePolicy`);
* a lane on a CPU device: fused (one thread cuts, decodes, runs the model, encodes and
  produces) or staged (dispatcher, device and results threads;
  :class:`~streamproc.dispatch.fusion.LaneRoutePolicy`).

Which wins depends on the workload, the batch size and the free cores, so :class:`RoutePolicy`
measures both, per batch: the wall seconds per record (the caller's wait for the work, or the
lane's cycle) and the CPU seconds per record of the threads its owner counts (the decode:
every thread that decoded the batch; the lane: its own dispatcher, device and results
threads)::

    probe (both ways, until each has           per record, the median batch's wall and CPU of
      probe_batches (8) batches; in runs of     each way: the parallel way if its wall is
      ``stint`` batches each way)               shorter by margin (10 %: the overlap pays);
                                                else the simple way if its CPU is lower by the
                                                margin (the parallel way only adds hand-offs);
                                                else the current way
    settled (the chosen way only)              probe again after recheck_s (30 s, doubling after
                                               each probe that kept the way, at most 600 s;
                                               back to 30 s after a switch), or at once when
                                               the way's CPU per record reaches drift (2x)
                                               what it was when chosen (median of
                                               drift_batches, 64)

Why it does not flap: a switch needs the other way better by the margin over a whole probe,
and a tie keeps the current way; a way that keeps winning is probed ever less often (one probe
costs at most ``probe_batches`` batches the other way). ``stint`` is for ways whose switch has
a cost of its own (a staged lane drains before it runs fused): a probe then alternates in runs
of ``stint`` batches instead of batch by batch.

Measurements behind the decode defaults: ``docs/benchmarks-history.md``; behind the lane's:
``docs/benchmarks.md`` (issue 28).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from streamproc.logs import get_logger

log = get_logger(__name__)

W = TypeVar("W", bound=str)
"""The ways' names (a ``Literal`` of two strings)."""


@dataclass(frozen=True, slots=True)
class RouteChange(Generic[W]):
    """A decision: the work goes ``route`` from now on; ``reason`` says why (logged)."""

    route: W
    reason: str


@dataclass(slots=True)
class _Cost:
    """Per-record seconds of the batches done one way (one value per batch): wall and CPU;
    and the totals (seconds, records), and how many batches found a backlog."""

    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    wall_total_s: float = 0.0
    cpu_total_s: float = 0.0
    items: int = 0
    saturated: int = 0

    def add(self, items: int, wall_s: float, cpu_s: float, saturated: bool = True) -> None:
        self.wall_s.append(max(0.0, wall_s) / items)
        self.cpu_s.append(max(0.0, cpu_s) / items)
        self.wall_total_s += max(0.0, wall_s)
        self.cpu_total_s += max(0.0, cpu_s)
        self.items += items
        self.saturated += saturated

    def wall_per_item_s(self, pooled: bool) -> float:
        """Wall seconds per record: the median batch's, or (``pooled``) all seconds over all
        records (a lane's throughput: a median of per-batch ratios favours small batches)."""
        if pooled:
            return self.wall_total_s / self.items if self.items else math.inf
        return self.wall_median_s

    def cpu_per_item_s(self, pooled: bool) -> float:
        """CPU seconds per record, as :meth:`wall_per_item_s`."""
        if pooled:
            return self.cpu_total_s / self.items if self.items else math.inf
        return self.cpu_median_s

    @property
    def backlogged(self) -> bool:
        """At least half the batches found a backlog (cut full): the wall measures the work,
        not the arrival rate."""
        return 2 * self.saturated >= self.batches

    @property
    def batches(self) -> int:
        return len(self.cpu_s)

    @property
    def wall_median_s(self) -> float:
        """The median batch's wall seconds per record: a batch the OS preempted (several ms on
        a busy host) moves it far less than it moves a mean."""
        return statistics.median(self.wall_s) if self.wall_s else math.inf

    @property
    def cpu_median_s(self) -> float:
        """The median batch's CPU seconds per record."""
        return statistics.median(self.cpu_s) if self.cpu_s else math.inf


class RoutePolicy(Generic[W]):
    """Which of two ways a lane's work goes, by the measured wall and CPU seconds per record of
    each (see the module docstring).

    Not thread-safe: its one owner calls :meth:`route` before each batch and :meth:`observe`
    after it, on one thread.

    Args:
        simple: the way that keeps the work on the calling thread.
        parallel: the way that hands it to other threads.
        subject: what is routed, the first word of :attr:`last_probe` (``decode``, ``lane``).
        clock: monotonic seconds (injected; tests pass a
            :class:`~tests.support.kafka_fakes.FakeClock`).
        start: the way at start, kept until a probe shows the other better.
        probe_batches: batches each way per probe (>= 1).
        stint: batches in a row one way during a probe (1: alternate batch by batch).
        margin: how much cheaper (CPU) or faster (wall) per record, 0..1, a way must be to win.
        recheck_s, max_recheck_s: seconds between probes (doubling while the way holds).
        drift: probe at once when the settled way's CPU per record reaches this multiple
            (> 1) of what it was when chosen.
        drift_batches: batches over which that cost is measured (>= 1).
        probe_at_start: probe from the first batch (else the first probe comes after
            ``recheck_s``: a way that is right almost everywhere spares the start-up its
            probe).
        pooled: compare all seconds over all records of each way instead of the median
            batch's per-record seconds, and the walls only where both ways found a backlog in
            at least half their batches (``observe``'s ``saturated``): otherwise the arrival
            rate sets the wall, and only the CPU decides.

    Raises:
        ValueError: a non-positive count or period, a margin outside [0, 1), a drift <= 1, or
            ``start`` that is neither way.
    """

    def __init__(
        self,
        simple: W,
        parallel: W,
        subject: str,
        clock: Callable[[], float] = time.monotonic,
        *,
        start: W,
        probe_batches: int = 8,
        stint: int = 1,
        margin: float = 0.1,
        recheck_s: float = 30.0,
        max_recheck_s: float = 600.0,
        drift: float = 2.0,
        drift_batches: int = 64,
        probe_at_start: bool = True,
        pooled: bool = False,
    ) -> None:
        if probe_batches < 1 or drift_batches < 1 or stint < 1:
            raise ValueError("need probe_batches, drift_batches, stint >= 1")
        if not 0 < recheck_s <= max_recheck_s:
            raise ValueError("need 0 < recheck_s <= max_recheck_s")
        if not 0.0 <= margin < 1.0 or drift <= 1.0:
            raise ValueError("need 0 <= margin < 1 and drift > 1")
        if start not in (simple, parallel):
            raise ValueError(f"start {start!r} is neither {simple!r} nor {parallel!r}")
        self.simple, self.parallel, self.subject = simple, parallel, subject
        self._clock = clock
        self.probe_batches = probe_batches
        self.stint = stint
        self.margin = margin
        self.base_recheck_s = recheck_s
        self.max_recheck_s = max_recheck_s
        self.drift = drift
        self.drift_batches = drift_batches
        self.pooled = pooled
        self._settled: W = start
        self._probe: dict[W, _Cost] | None = self._fresh_probe() if probe_at_start else None
        self._last: W = start  # the way of the latest batch routed
        self._recheck_s = recheck_s
        self._next_probe_s = math.inf if probe_at_start else clock() + recheck_s
        self._chosen_at_s = math.inf  # the settled way's CPU per record at the last probe
        self._recent = _Cost()  # the settled way since the last drift check
        self.last_probe = ""  # the verdict of the latest probe, with both ways' costs

    def _fresh_probe(self) -> dict[W, _Cost]:
        return {self.simple: _Cost(), self.parallel: _Cost()}

    @property
    def settled(self) -> W:
        """The way the work goes outside probes."""
        return self._settled

    @property
    def probing(self) -> bool:
        return self._probe is not None

    def route(self, hold: bool = False) -> W:
        """The way of the next batch: the settled one, or during a probe the way with fewer
        batches so far (the settled one on a tie), so both see the same load; with a
        ``stint``, the way of the latest batch until it has a multiple of ``stint``.
        ``hold``: start no probe now, even if one is due (another policy of the same lane is
        probing, and the two would measure each other's mix)."""
        if self._probe is None:
            if hold or self._clock() < self._next_probe_s:
                self._last = self._settled
                return self._settled
            self._probe = self._fresh_probe()
        probe, last = self._probe, self._last
        if probe[last].batches % self.stint and probe[last].batches < self.probe_batches:
            return last
        other = self._other(self._settled)
        way = other if probe[other].batches < probe[self._settled].batches else self._settled
        self._last = way
        return way

    def _other(self, way: W) -> W:
        return self.parallel if way == self.simple else self.simple

    def observe(
        self, route: W, items: int, wall_s: float, cpu_s: float, saturated: bool = True
    ) -> RouteChange[W] | None:
        """Count one batch of ``items`` records done ``route``: ``wall_s`` its wall seconds,
        ``cpu_s`` the CPU seconds the owner counts for it (the same threads either way: see
        each owner). Returns a change of the settled way, or None."""
        if items < 1:
            return None
        if self._probe is None:
            if route == self._settled:
                self._recent.add(items, wall_s, cpu_s)
                if self._recent.batches >= self.drift_batches:
                    if self._recent.cpu_median_s >= self.drift * self._chosen_at_s:
                        self._next_probe_s = -math.inf  # probe from the next batch
                    self._recent = _Cost()
            return None
        self._probe[route].add(items, wall_s, cpu_s, saturated)
        if min(cost.batches for cost in self._probe.values()) < self.probe_batches:
            return None
        return self._end_probe(self._probe)

    def _end_probe(self, probe: dict[W, _Cost]) -> RouteChange[W] | None:
        self._probe = None
        self._recent = _Cost()
        simple, parallel = probe[self.simple], probe[self.parallel]
        pooled = self.pooled
        keep = 1.0 - self.margin
        walls = not pooled or (simple.backlogged and parallel.backlogged)
        simple_wall, parallel_wall = (
            simple.wall_per_item_s(pooled),
            parallel.wall_per_item_s(pooled),
        )
        simple_cpu, parallel_cpu = simple.cpu_per_item_s(pooled), parallel.cpu_per_item_s(pooled)
        if walls and parallel_wall <= simple_wall * keep:
            best = self.parallel  # the overlap shortens the wait: worth its CPU
        elif simple_cpu <= parallel_cpu * keep:
            best = self.simple  # the hand-offs cost CPU and are not faster
        else:
            best = self._settled  # within the margin both ways: keep
        switch = best != self._settled
        if switch:
            self._settled = best
            self._recheck_s = self.base_recheck_s
        self._chosen_at_s = probe[best].cpu_median_s
        self._next_probe_s = self._clock() + self._recheck_s
        measure = "all records" if pooled else "medians"
        unsaturated = "" if walls else "; walls set by the arrivals, not compared"
        self.last_probe = (
            f"{self.subject} {best}: per record {self.simple} {simple_cpu * 1e6:.2f} us CPU, "
            f"{simple_wall * 1e6:.2f} us wall; {self.parallel} {parallel_cpu * 1e6:.2f} us CPU, "
            f"{parallel_wall * 1e6:.2f} us wall ({measure} of {simple.batches} + "
            f"{parallel.batches} batches{unsaturated}; a way wins by {self.margin:.0%})"
        )
        if not switch:
            self._recheck_s = min(2.0 * self._recheck_s, self.max_recheck_s)
            return None
        return RouteChange(best, self.last_probe)


def observe_logged(
    policy: RoutePolicy[W],
    route: W,
    items: int,
    wall_s: float,
    cpu_s: float,
    *,
    topic: str,
    on_change: Callable[[W], None] | None = None,
    saturated: bool = True,
) -> None:
    """:meth:`RoutePolicy.observe`, then the owner's log lines (the policy itself does no I/O):
    ``<subject> route kept`` (debug) when a probe kept the way, ``<subject> route changed``
    (info, with both ways' costs) and ``on_change`` when it changed."""
    was_probing = policy.probing
    change = policy.observe(route, items, wall_s, cpu_s, saturated)
    if change is None:
        if was_probing and not policy.probing:
            log.debug(f"{policy.subject} route kept", topic=topic, reason=policy.last_probe)
        return
    log.info(f"{policy.subject} route changed", topic=topic, to=change.route, reason=change.reason)
    if on_change is not None:
        on_change(change.route)
