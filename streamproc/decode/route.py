"""Where each lane decodes: on the decode threads or inline on its dispatcher thread (a pure
policy per lane; ``worker.decode_mode: thread`` only).

:class:`DecodeRoutePolicy` is owned by the lane's :class:`~streamproc.decode.threads.ThreadDecoder`
on its dispatcher thread. The dispatcher waits for its batch's decode either way; the decode
threads cost a submit, a future and a wake-up per slice, and GIL contention between slices, and
pay only where splitting a batch shortens that wait (a decoder that releases the GIL, on free
cores). Which way wins depends on the decoder, the batch size and the free cores, so the policy
measures both, per batch, the dispatcher's wait (wall) and the CPU of every thread that
decoded::

    probe (both ways, alternating batch by     per record, the median batch's wall and CPU
      batch, until each way has                of each way: the pool if its wait is shorter by
      probe_batches (8) batches)               margin (10 %: the split pays); else inline if
                                               its CPU is lower by the margin (the pool only
                                               adds hand-offs); else the current way (the
                                               pool at start)
    settled (the chosen way only)              probe again after recheck_s (30 s, doubling after
                                               each probe that kept the way, at most 600 s;
                                               back to 30 s after a switch), or at once when
                                               the way's CPU per record reaches drift (2x)
                                               what it was when chosen (median of
                                               drift_batches, 64)

Why it does not flap: a switch needs the other way better by the margin over a whole probe,
and a tie keeps the current way; a lane that keeps its way is probed ever less often (one probe
costs at most ``probe_batches`` batches the other way). A lane whose decode turns expensive
(its CPU per record doubles) is probed at once and goes back to the pool where the split
shortens its wait; there the decode sizer can give it more workers.

Measurements behind these defaults: ``docs/benchmarks-history.md``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

Route = Literal["inline", "pool"]
"""Where a lane decodes a batch: on its dispatcher thread, or on the decode threads (``"pool"``,
the value the ``decode route changed`` log event carries)."""


@dataclass(frozen=True, slots=True)
class RouteChange:
    """A decision: the lane decodes ``route`` from now on; ``reason`` says why (logged)."""

    route: Route
    reason: str


@dataclass(slots=True)
class _Cost:
    """Per-record seconds of the batches decoded one way (one value per batch): the
    dispatcher's wall time and the CPU time of every thread that worked on the batch."""

    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)

    def add(self, items: int, wall_s: float, cpu_s: float) -> None:
        self.wall_s.append(max(0.0, wall_s) / items)
        self.cpu_s.append(max(0.0, cpu_s) / items)

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


class DecodeRoutePolicy:
    """Whether one lane decodes inline (on its dispatcher thread) or on the decode threads, by
    the measured CPU and wall seconds per record of each way (see the module docstring).

    Not thread-safe: its one owner (the lane's decoder, on the lane's dispatcher thread) calls
    :meth:`route` before each batch and :meth:`observe` after it.

    Args:
        clock: monotonic seconds (injected; tests pass a
            :class:`~streamproc.testing.FakeClock`).
        start: the way at start, kept until a probe shows the other better.
        probe_batches: batches each way per probe (>= 1).
        margin: how much cheaper (CPU) or faster (wall) per record, 0..1, a way must be to win.
        recheck_s, max_recheck_s: seconds between probes (doubling while the way holds).
        drift: probe at once when the settled way's CPU per record reaches this multiple
            (> 1) of what it was when chosen.
        drift_batches: batches over which that cost is measured (>= 1).

    Raises:
        ValueError: a non-positive count or period, a margin outside [0, 1) or a drift <= 1.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        start: Route = "pool",
        probe_batches: int = 8,
        margin: float = 0.1,
        recheck_s: float = 30.0,
        max_recheck_s: float = 600.0,
        drift: float = 2.0,
        drift_batches: int = 64,
    ) -> None:
        if probe_batches < 1 or drift_batches < 1 or not 0 < recheck_s <= max_recheck_s:
            raise ValueError("need probe_batches, drift_batches >= 1, 0 < recheck_s <= max")
        if not 0.0 <= margin < 1.0 or drift <= 1.0:
            raise ValueError("need 0 <= margin < 1 and drift > 1")
        self._clock = clock
        self.probe_batches = probe_batches
        self.margin = margin
        self.base_recheck_s = recheck_s
        self.max_recheck_s = max_recheck_s
        self.drift = drift
        self.drift_batches = drift_batches
        self._settled: Route = start
        self._probe: dict[Route, _Cost] | None = {"inline": _Cost(), "pool": _Cost()}
        self._recheck_s = recheck_s
        self._next_probe_s = math.inf
        self._chosen_at_s = math.inf  # the settled way's CPU per record at the last probe
        self._recent = _Cost()  # the settled way since the last drift check
        self.last_probe = ""  # the verdict of the latest probe, with both ways' costs

    @property
    def settled(self) -> Route:
        """The way the lane decodes outside probes."""
        return self._settled

    @property
    def probing(self) -> bool:
        return self._probe is not None

    def route(self) -> Route:
        """The way to decode the next batch: the settled one, or during a probe the way with
        fewer batches so far (the settled one on a tie), so both see the same load."""
        if self._probe is None:
            if self._clock() < self._next_probe_s:
                return self._settled
            self._probe = {"inline": _Cost(), "pool": _Cost()}
        other = _other(self._settled)
        if self._probe[other].batches < self._probe[self._settled].batches:
            return other
        return self._settled

    def observe(self, route: Route, items: int, wall_s: float, cpu_s: float) -> RouteChange | None:
        """Count one batch of ``items`` records decoded ``route``: ``wall_s`` the dispatcher
        waited for it, ``cpu_s`` the CPU seconds it took (the dispatcher's, plus the decode
        threads' on the pool). Returns a change of the settled way, or None."""
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
        self._probe[route].add(items, wall_s, cpu_s)
        if min(cost.batches for cost in self._probe.values()) < self.probe_batches:
            return None
        return self._end_probe(self._probe)

    def _end_probe(self, probe: dict[Route, _Cost]) -> RouteChange | None:
        self._probe = None
        self._recent = _Cost()
        inline, pool = probe["inline"], probe["pool"]
        keep = 1.0 - self.margin
        if pool.wall_median_s <= inline.wall_median_s * keep:
            best: Route = "pool"  # the split shortens the dispatcher's wait: worth its CPU
        elif inline.cpu_median_s <= pool.cpu_median_s * keep:
            best = "inline"  # the pool costs CPU and is not faster
        else:
            best = self._settled  # within the margin both ways: keep
        switch = best != self._settled
        if switch:
            self._settled = best
            self._recheck_s = self.base_recheck_s
        self._chosen_at_s = probe[best].cpu_median_s
        self._next_probe_s = self._clock() + self._recheck_s
        self.last_probe = (
            f"decode {best}: per record inline {inline.cpu_median_s * 1e6:.2f} us CPU, "
            f"{inline.wall_median_s * 1e6:.2f} us wait; pool {pool.cpu_median_s * 1e6:.2f} "
            f"us CPU, {pool.wall_median_s * 1e6:.2f} us wait (medians of {inline.batches} + "
            f"{pool.batches} batches; a way wins by {self.margin:.0%})"
        )
        if not switch:
            self._recheck_s = min(2.0 * self._recheck_s, self.max_recheck_s)
            return None
        return RouteChange(best, self.last_probe)


def _other(route: Route) -> Route:
    return "pool" if route == "inline" else "inline"
