"""Self-sizing decode workers (a pure policy and the thread that applies it), and where each
lane decodes: on the pool or inline on its dispatcher thread (a pure policy per lane).

The decode workers (threads, or processes with ``worker.decode_mode: process``) are shared by
every pipeline of the process. Each decoder reports one :class:`DecodeSample` per batch: how long
its dispatcher waited for that batch's decode, and with how many workers. Every ``window_s`` the
policy looks at the window just closed, per pipeline (lane):

``share``
    seconds the lane's dispatcher spent waiting for decode / the window's seconds. Near 1:
    decode is the lane's bottleneck (the device and the input keep up, decode does not); near
    0: decode is idle, or the device or the input is the bottleneck.
``rate``
    items decoded per second.

and then (``w`` workers, the lane with the largest share decides)::

    trial open (w' -> w, judged over             kept if that lane's rate rose by half the
      trial_windows (2) windows at w)            ideal gain (ceil(n/w') / ceil(n/w) - 1; at
                                                 least min_gain, 10 %) over its mean rate in
                                                 the last 3 windows at w', or its share fell
                                                 below grow_share (then the rules below apply
                                                 at once); else back to w' and no growth for
                                                 backoff_s (30 s, doubling per failed trial, at
                                                 most 600 s; reset by a kept trial)
    share >= grow_share (0.5), w < max,          grow to the next count that shortens a batch
      not backing off                            (the smallest w'' > w with
                                                 ceil(n / w'') < ceil(n / w), n the lane's
                                                 median batch size) and open a trial
    share * w / (w - 1) < shrink_share (0.25)    (the share expected with one worker fewer)
      for idle_windows (3) windows in a row,     shrink by one
      w > min (an empty window has share 0)

Why it does not flap: a grow that does not pay (more workers than free cores, a decode that
holds the GIL) is undone after its trial (two windows) and not retried for the back-off, which
doubles, so a saturated host sees one probe after 30 s, then 60 s, ... at most every 10 min.
A noisy host (other jobs on the cores) rarely shows half the ideal gain by chance. A shrink happens
only when the share expected *after* it is below half the grow threshold, so it cannot make
the lane decode-bound again unless the load itself doubles. Between the thresholds the count
holds. Batches of one record (sparse traffic) never grow the pool: one record is one slice.

:class:`DecodeSizingPolicy` is pure (no threads, no I/O, injected clock): unit tests drive it
with a fake clock and fake decode costs. :class:`DecodeSizer` owns one policy and runs it on the
``decode-sizer`` thread, which alone resizes the pool and sets the metrics
``streamproc_decode_workers`` and ``streamproc_decode_wait_ratio{topic}``. The sizer sees only
batches decoded on the pool.

Inline or pool (:class:`DecodeRoutePolicy`, one per lane, owned by the lane's
:class:`~decode.decoders.ThreadDecoder` on its dispatcher thread). The dispatcher waits for
its batch's decode either way; the pool costs a submit, a future and a wake-up per slice, and
GIL contention between slices, and pays only where splitting a batch shortens that wait (a
decoder that releases the GIL, on free cores). Measured on this machine (decode only, 2
threads, per record): trades 2.15 us inline against 2.54 on the pool at batches of 256 and 6.2
against 22 at batches of 4; iot 18.9 against 24.3; video (JPEG + resize; Pillow releases the
GIL) 2.3 ms inline against 2.3 ms on the pool here, where the model holds the other core. Which
way wins depends on the decoder, the batch size and the free cores, so the policy measures
both, per batch, the dispatcher's wait (wall) and the CPU of every thread that decoded::

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
shortens its wait; there the sizer can give it more workers.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

from streamproc.logs import get_logger
from streamproc.metrics import Metrics

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class DecodeSample:
    """One decoded batch, as its decoder saw it.

    Attributes:
        lane: the pipeline's input topic.
        items: records in the batch (>= 1).
        decode_s: wall seconds the dispatcher waited for the batch's decode (every slice).
        workers: decode workers the pool had when the batch was split into slices.
    """

    lane: str
    items: int
    decode_s: float
    workers: int


@dataclass(frozen=True, slots=True)
class LaneWindow:
    """What one lane did in a closed window: ``share`` of the window's seconds spent waiting
    for decode (0..1), ``rate`` items decoded per second, ``batch_items`` median batch size."""

    share: float
    rate: float
    batch_items: int


@dataclass(frozen=True, slots=True)
class Resize:
    """A decision: go to ``workers``; ``reason`` says why (logged)."""

    workers: int
    reason: str


@dataclass(frozen=True, slots=True)
class _Trial:
    lane: str
    rate: float  # the lane's mean rate in its last windows before the trial
    from_workers: int
    gain: float  # the relative rate gain that keeps the new workers


class DecodeSizingPolicy:
    """When to grow or shrink the decode workers (see the module docstring for the rules).

    Not thread-safe: :class:`DecodeSizer` calls it under its lock.

    Args:
        minimum, maximum: bounds of the count (1 <= minimum <= maximum).
        start: the count at start (within the bounds).
        clock: monotonic seconds (injected; tests pass a
            :class:`~streamproc.testing.FakeClock`).
        window_s: seconds per evaluation window.
        grow_share: share at or above which a lane is decode-bound.
        shrink_share: share expected after a shrink below which the pool shrinks.
        min_gain: the least relative rate gain a trial must show to keep its workers (it must
            show half the ideal gain when that is more).
        trial_windows: windows a trial is measured over.
        idle_windows: consecutive quiet windows before a shrink.
        backoff_s, max_backoff_s: no growth for this long after a failed trial (doubling).

    Raises:
        ValueError: inconsistent bounds or thresholds.
    """

    def __init__(
        self,
        minimum: int,
        maximum: int,
        start: int,
        clock: Callable[[], float] = time.monotonic,
        *,
        window_s: float = 2.0,
        grow_share: float = 0.5,
        shrink_share: float = 0.25,
        min_gain: float = 0.1,
        trial_windows: int = 2,
        idle_windows: int = 3,
        backoff_s: float = 30.0,
        max_backoff_s: float = 600.0,
    ) -> None:
        if not 1 <= minimum <= start <= maximum:
            raise ValueError(
                f"need 1 <= minimum <= start <= maximum, got {minimum}, {start}, {maximum}"
            )
        if not 0.0 < shrink_share < grow_share <= 1.0:
            raise ValueError("need 0 < shrink_share < grow_share <= 1 (the hysteresis band)")
        self.minimum, self.maximum = minimum, maximum
        self._clock = clock
        self.window_s = window_s
        self.grow_share = grow_share
        self.shrink_share = shrink_share
        self.min_gain = min_gain
        self.trial_windows = trial_windows
        self.idle_windows = idle_windows
        self.base_backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._workers = start
        self._window_start_s = clock()
        self._decode_s: dict[str, float] = {}
        self._items: dict[str, int] = {}
        self._batch_items: dict[str, list[int]] = {}
        self._trial: _Trial | None = None
        self._rates: dict[str, deque[float]] = {}  # per lane, last windows' rates at this count
        self._quiet = 0
        self._backoff_s = backoff_s
        self._blocked_until_s = -math.inf
        self.last_window: Mapping[str, LaneWindow] = {}

    @property
    def workers(self) -> int:
        """The count the policy wants now."""
        return self._workers

    def observe(self, sample: DecodeSample) -> None:
        """Count one decoded batch in the open window; a batch split for another count than
        the current one (decoded just before a resize took effect) is ignored."""
        if sample.workers != self._workers or sample.items < 1:
            return
        lane = sample.lane
        self._decode_s[lane] = self._decode_s.get(lane, 0.0) + max(0.0, sample.decode_s)
        self._items[lane] = self._items.get(lane, 0) + sample.items
        self._batch_items.setdefault(lane, []).append(sample.items)

    def decide(self) -> Resize | None:
        """Close the window if ``window_s`` has passed and return a resize, or None."""
        now_s = self._clock()
        elapsed_s = now_s - self._window_start_s
        if elapsed_s < self.window_s * (1 if self._trial is None else self.trial_windows):
            return None
        lanes = {
            lane: LaneWindow(
                min(1.0, self._decode_s[lane] / elapsed_s),
                self._items[lane] / elapsed_s,
                int(statistics.median(self._batch_items[lane])),
            )
            for lane in self._decode_s
        }
        self.last_window = lanes
        self._reset_window(now_s)
        for lane, window in lanes.items():
            self._rates.setdefault(lane, deque(maxlen=3)).append(window.rate)
        if self._trial is not None and (reverted := self._end_trial(lanes, now_s)):
            return reverted
        top = max(lanes, key=lambda lane: lanes[lane].share, default=None)
        share = 0.0 if top is None else lanes[top].share
        if top is not None and share >= self.grow_share:
            self._quiet = 0
            return self._grow(top, lanes[top], now_s)
        after = share * self._workers / (self._workers - 1) if self._workers > 1 else math.inf
        self._quiet = (
            self._quiet + 1 if self._workers > self.minimum and after < self.shrink_share else 0
        )
        if self._quiet < self.idle_windows:
            return None
        self._quiet = 0
        self._workers -= 1
        self._rates.clear()
        where = "no decode" if top is None else f"{top} waited for decode {share:.0%} of the time"
        return Resize(self._workers, f"idle: {where} for {self.idle_windows} windows")

    def resized(self, workers: int) -> None:
        """The pool now has ``workers``: what :meth:`decide` asked for, or fewer when a process
        failed to start (then growth backs off as after a failed trial). A new window starts
        at that count."""
        now_s = self._clock()
        if workers < self._workers:
            self._blocked_until_s = now_s + self._backoff_s
            self._backoff_s = min(2.0 * self._backoff_s, self.max_backoff_s)
        if workers != self._workers:
            self._trial = None
            self._workers = max(self.minimum, min(self.maximum, workers))
        self._rates.clear()  # rates at another count
        self._reset_window(now_s)

    # -- rules -------------------------------------------------------------------------------
    def _grow(self, lane: str, window: LaneWindow, now_s: float) -> Resize | None:
        if self._workers >= self.maximum or now_s < self._blocked_until_s:
            return None
        target = _next_useful(self._workers, window.batch_items, self.maximum)
        if target is None:
            return None
        ideal = -(-window.batch_items // self._workers) / -(-window.batch_items // target) - 1.0
        rates = self._rates.get(lane) or deque([window.rate])
        self._trial = _Trial(
            lane, statistics.fmean(rates), self._workers, max(self.min_gain, ideal / 2)
        )
        self._workers = target
        self._rates.clear()
        return Resize(
            target,
            f"decode-bound: {lane} waited for decode {window.share:.0%} of the time "
            f"({window.rate:.1f} items/s, batches of {window.batch_items})",
        )

    def _end_trial(self, lanes: Mapping[str, LaneWindow], now_s: float) -> Resize | None:
        trial, self._trial = self._trial, None
        assert trial is not None
        window = lanes.get(trial.lane)
        if window is None:  # the lane went quiet: nothing to judge; idle windows decide next
            return None
        if window.rate >= trial.rate * (1.0 + trial.gain) or window.share < self.grow_share:
            self._backoff_s = self.base_backoff_s
            return None
        self._blocked_until_s = now_s + self._backoff_s
        self._backoff_s = min(2.0 * self._backoff_s, self.max_backoff_s)
        self._workers = trial.from_workers
        self._rates.clear()
        return Resize(
            trial.from_workers,
            f"no gain: {trial.lane} decoded {window.rate:.1f} items/s with more workers "
            f"against {trial.rate:.1f} (needed +{trial.gain:.0%}); no growth for "
            f"{self._blocked_until_s - now_s:.0f} s",
        )

    def _reset_window(self, now_s: float) -> None:
        self._window_start_s = now_s
        self._decode_s.clear()
        self._items.clear()
        self._batch_items.clear()


def _next_useful(workers: int, batch_items: int, maximum: int) -> int | None:
    """The smallest count above ``workers`` (at most ``maximum``) that splits a batch of
    ``batch_items`` into shorter slices, or None."""
    longest = -(-batch_items // workers)
    for candidate in range(workers + 1, maximum + 1):
        if -(-batch_items // candidate) < longest:
            return candidate
    return None


class ResizablePool(Protocol):
    """What :class:`DecodeSizer` needs of the decode pool (threads or processes)."""

    @property
    def workers(self) -> int: ...

    def resize(self, workers: int) -> int:
        """Go to ``workers``; return the count reached."""
        ...


class DecodeSizer:
    """Owns a :class:`DecodeSizingPolicy` and applies it to the decode pool.

    Decoders call :meth:`observe` (any thread; one short lock, a leaf). The ``decode-sizer``
    thread wakes every ``policy.window_s``, asks the policy, resizes the pool outside the lock
    (starting a decode process takes seconds; dispatchers keep decoding with the workers they
    have meanwhile), then tells the policy the count reached. With ``minimum == maximum`` the
    count never changes and the thread only refreshes the gauges.

    Args:
        pool: the decode threads or processes.
        policy: the sizing policy (owned from now on).
        metrics: ``decode_workers`` and ``decode_wait_ratio`` are set here.
    """

    def __init__(self, pool: ResizablePool, policy: DecodeSizingPolicy, metrics: Metrics) -> None:
        self._pool = pool
        self._policy = policy
        self._metrics = metrics
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decode-sizer", daemon=True)
        self.resizes: deque[Resize] = deque(maxlen=100)  # the latest, for tests and tools
        metrics.decode_workers.set(pool.workers)

    @property
    def workers(self) -> int:
        return self._pool.workers

    def observe(self, sample: DecodeSample) -> None:
        """Record one decoded batch (called by the decoders)."""
        with self._lock:
            self._policy.observe(sample)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (idempotent); the pool itself is closed by its owner."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(5.0)

    def step(self) -> Resize | None:
        """One evaluation: ask the policy, resize the pool, refresh the gauges."""
        with self._lock:
            decision = self._policy.decide()
            window = dict(self._policy.last_window)
        for lane, stats in window.items():
            self._metrics.decode_wait_ratio.labels(lane).set(stats.share)
        if decision is None:
            return None
        before = self._pool.workers
        try:
            reached = self._pool.resize(decision.workers)
        except Exception as exc:  # e.g. a decode process failed to start: keep what we have
            log.error("decode workers resize failed", to=decision.workers, error=repr(exc))
            reached = self._pool.workers
        with self._lock:
            self._policy.resized(reached)
        self._metrics.decode_workers.set(reached)
        self.resizes.append(decision)
        log.info("decode workers resized", before=before, after=reached, reason=decision.reason)
        return decision

    def _run(self) -> None:
        while not self._stop.wait(self._policy.window_s):  # a period, not synchronisation
            self.step()


Route = Literal["inline", "pool"]
"""Where a lane decodes a batch: on its dispatcher thread, or on the decode pool."""


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
    """Whether one lane decodes inline (on its dispatcher thread) or on the decode pool, by the
    measured CPU and wall seconds per record of each way (see the module docstring).

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
