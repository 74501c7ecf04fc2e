"""How many decode workers (threads, or processes with ``worker.decode_mode: process``): a pure
policy, and the ``decode-sizer`` thread that applies it.

The decode workers are shared by every pipeline of the process. Each decoder reports one
:class:`~streamproc.decode.protocol.DecodeSample` per batch decoded on them: how long its
dispatcher waited for that batch's decode, and with how many workers. Every ``window_s`` the
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
holds. Batches of one record (sparse traffic) never add a worker: one record is one slice.

:class:`DecodeSizingPolicy` is pure (no threads, no I/O, injected clock): unit tests drive it
with a fake clock and fake decode costs. :class:`DecodeSizer` owns one policy and runs it on the
``decode-sizer`` thread, which alone resizes the decode workers and sets the metrics
``streamproc_decode_workers`` and ``streamproc_decode_wait_ratio{topic}``. The sizer sees only
batches decoded on the decode workers (none decoded inline).
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from streamproc.decode.protocol import DecodeSample
from streamproc.logs import get_logger
from streamproc.metrics import Metrics

log = get_logger(__name__)


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
            :class:`~tests.support.kafka_fakes.FakeClock`).
        window_s: seconds per evaluation window.
        grow_share: share at or above which a lane is decode-bound.
        shrink_share: share expected after a shrink below which one worker is retired.
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
        """The decode workers now number ``workers``: what :meth:`decide` asked for, or fewer
        when a process failed to start (then growth backs off as after a failed trial). A new
        window starts at that count."""
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


class DecodeWorkers(Protocol):
    """What :class:`DecodeSizer` needs of the decode workers
    (:class:`~streamproc.decode.threads.DecodeThreads` or
    :class:`~streamproc.decode.processes.DecodeProcesses`)."""

    @property
    def workers(self) -> int:
        """The count running (or wanted) now."""
        ...

    def resize(self, workers: int) -> int:
        """Go to ``workers``; return the count reached."""
        ...


class DecodeSizer:
    """Owns a :class:`DecodeSizingPolicy` and applies it to the decode workers.

    Decoders call :meth:`observe` (any thread; one short lock, a leaf). The ``decode-sizer``
    thread wakes every ``policy.window_s``, asks the policy, resizes the workers outside the lock
    (starting a decode process takes seconds; dispatchers keep decoding with the workers they
    have meanwhile), then tells the policy the count reached. With ``minimum == maximum`` the
    count never changes and the thread only refreshes the gauges.

    Args:
        workers: the decode threads or processes.
        policy: the sizing policy (owned from now on).
        metrics: ``decode_workers`` and ``decode_wait_ratio`` are set here.
    """

    def __init__(
        self, workers: DecodeWorkers, policy: DecodeSizingPolicy, metrics: Metrics
    ) -> None:
        self._workers = workers
        self._policy = policy
        self._metrics = metrics
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decode-sizer", daemon=True)
        self.resizes: deque[Resize] = deque(maxlen=100)  # the latest, for tests and tools
        metrics.decode_workers.set(workers.workers)

    @property
    def workers(self) -> int:
        """The decode workers running now."""
        return self._workers.workers

    def observe(self, sample: DecodeSample) -> None:
        """Record one decoded batch (called by the decoders)."""
        with self._lock:
            self._policy.observe(sample)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (idempotent); the decode workers are closed by their owner."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(5.0)

    def step(self) -> Resize | None:
        """One evaluation: ask the policy, resize the decode workers, refresh the gauges."""
        with self._lock:
            decision = self._policy.decide()
            window = dict(self._policy.last_window)
        for lane, stats in window.items():
            self._metrics.decode_wait_ratio.labels(lane).set(stats.share)
        if decision is None:
            return None
        before = self._workers.workers
        try:
            reached = self._workers.resize(decision.workers)
        except Exception as exc:  # e.g. a decode process failed to start: keep what we have
            log.error("decode workers resize failed", to=decision.workers, error=repr(exc))
            reached = self._workers.workers
        with self._lock:
            self._policy.resized(reached)
        self._metrics.decode_workers.set(reached)
        self.resizes.append(decision)
        log.info("decode workers resized", before=before, after=reached, reason=decision.reason)
        return decision

    def _run(self) -> None:
        while not self._stop.wait(self._policy.window_s):  # a period, not synchronisation
            self.step()
