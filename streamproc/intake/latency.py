"""A pipeline's latency target: the batch waits and sizes that keep its P99 from consume to
produce under ``pipelines[].latency_target_ms``, and how far from it the pipeline is (pure, every
time passed in).

*Latency* here is one record's time from its consume (``Record.consumed_at_s``) to the broker's
acknowledgement of its result (the moment ``streamproc_messages_produced_total`` counts it): the
part of the end-to-end latency that this process, not the producer upstream, decides.

The budget (open loop), for a target ``T`` and a scale ``s`` (the feedback below; 1 at start):

* **wait**: no record waits after its consume longer than :data:`WAIT_SHARE` x ``T`` x ``s``
  (its class's ``max_wait_ms`` still applies where shorter);
* **batch cap**: the largest candidate size ``n`` (powers of two up to the devices' cap, and the
  cap) whose expected device time ``d(n)`` fits ``wait + IN_FLIGHT_BATCHES x d(n) <= T x s``
  (``wait``: the longest of the classes' waits, as any class may share the batch). A
  cut batch may queue behind one more on its device, so two batch times count (the bench's
  latency bound counts the same two). ``d(n)`` is the median of the size's recent batches; a
  size not measured is interpolated between the nearest measured sizes, or estimated linearly
  per row from the largest measured below it (an upper bound: a batch's fixed cost is shared), or,
  with none below, taken as the smallest measured above it (a smaller batch is no slower). The
  cap never goes below 1: a target that even one record cannot meet is missed, and said so.
* **capacity first**: nor below the smallest size whose expected throughput (``n / d(n)`` per
  device, times the lane's devices: each takes batches) carries :data:`CAPACITY_HEADROOM` x the
  rate of results (all of them, not only the latencies kept) measured over the last adjustment
  period. A cap the load does not fit in only grows a backlog, which misses the target by far
  more than a larger batch does.

The feedback (closed loop), at most once per :data:`ADJUST_EVERY_S` and only once
:data:`MIN_SAMPLES` results were acknowledged since the last adjustment, from the P99 of those
results (not of the whole window: the loop must see its own last step):

1. **saturated** (at least :data:`SATURATED_SHARE` of the cuts since the last adjustment left a
   full batch waiting behind them): the device, not the batcher, holds the records back, and a
   smaller batch would lower the lane's capacity and lengthen the queue; ``s`` grows
   x :data:`GROW` (up to :data:`MAX_SCALE`): capacity first;
2. else P99 over ``T``: ``s`` shrinks x :data:`SHRINK` (down to :data:`MIN_SCALE`);
3. else P99 under :data:`RELAX` x ``T`` and ``s < 1``: ``s`` grows x :data:`GROW`, back up to 1
   (never above it while the lane keeps up: 1 is the open-loop budget).

What it says (:class:`LatencyReading`, at most every :data:`READ_EVERY_S`): the P99 over the
last :data:`WINDOW_S` seconds of results (their newest :data:`MAX_SAMPLES` at most), the time
spent over the target since the previous reading, and whether it just started being over (at
most once per :data:`WARN_EVERY_S`: the caller logs a warning) or is back within it.

Not thread-safe on its own: the lane (:class:`streamproc.intake.lane.Lane`) serialises every
call under its lock, as for the rest of the batcher.
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass

import numpy as np

WAIT_SHARE = 0.25
"""The longest wait after consume, as a share of the target (times the scale)."""
IN_FLIGHT_BATCHES = 2
"""Batch device times a record may spend on its device: its own batch and one ahead of it."""
AFTER_CUT_WINDOW = 32
"""Batches (the newest) whose time from cut to acknowledgement
:meth:`LatencyTarget.after_cut_s` takes a quantile of."""
AFTER_CUT_MAX_AGE_S = 5.0
"""A time from cut to acknowledgement older than this many seconds no longer counts: a lead
raised by a stall must not outlive it where nothing else replaces it (a lane whose every record
now expires as a dead-letter record acknowledges no batch)."""
AFTER_CUT_QUANTILE = 0.9
"""The quantile of those times :meth:`LatencyTarget.after_cut_s` is (the lower one: the
``int(q x (n - 1))``-th of ``n`` sorted, the 28th of 32): 0.9 kept served results after the
target at 0.1-0.3 % under overload, the median at 0.2-1.8 % (docs/benchmarks.md,
"Predicted expiry")."""
WINDOW_S = 10.0
"""The P99 reported is of the results acknowledged in the last this many seconds."""
MAX_SAMPLES = 16_384
"""At most this many of the window's newest latencies are kept (at high rates the window is
shorter than :data:`WINDOW_S`)."""
READ_EVERY_S = 0.25
"""A reading (P99, time over target) at most this often."""
ADJUST_EVERY_S = 1.0
"""The scale moves at most this often."""
MIN_SAMPLES = 20
"""Results acknowledged since the last adjustment needed before the next one."""
SHRINK = 0.8
GROW = 1.25
RELAX = 0.8
"""Under target by this margin (P99 < RELAX x target) before the budget grows back."""
MIN_SCALE = 0.125
MAX_SCALE = 8.0
CAPACITY_HEADROOM = 1.25
"""The batch cap never falls below the smallest size whose expected throughput (size / device
time) carries this many times the lane's measured rate of results (the device at most 80 %
busy): a cap the load does not fit in grows a backlog, which misses the target by far more."""
SATURATED_SHARE = 0.5
"""A lane is saturated when at least this share of its cuts left a full batch waiting."""
WARN_EVERY_S = 60.0
"""At most one "over target" warning per lane in this many seconds."""
ESTIMATE_WINDOW = 8
"""Recent batches per size whose median is the size's expected device time."""


@dataclass(frozen=True, slots=True)
class LatencyReading:
    """How a lane stands against its target, read when results were acknowledged.

    Attributes:
        p99_s: P99 of consume -> acknowledgement over the window (seconds); None: no result in
            the window.
        over_target_s: seconds spent over the target since the previous reading (the time
            between two readings counts when the earlier one was over; at most
            :data:`WINDOW_S`).
        went_over: the lane just started being over its target (at most once per
            :data:`WARN_EVERY_S`): log a warning.
        back_within: the lane is within its target again after a warned episode.
        scale: the budget's scale now (1: the open-loop budget).
        batch_cap: the latency's batch cap for the devices' cap the batcher last asked about.
    """

    p99_s: float | None
    over_target_s: float
    went_over: bool
    back_within: bool
    scale: float
    batch_cap: int


def candidate_sizes(cap: int) -> list[int]:
    """Powers of two up to ``cap`` (>= 1), and ``cap``, increasing."""
    return sorted({*(2**i for i in range(int(math.log2(cap)) + 1)), cap})


class LatencyTarget:
    """One lane's latency target: its budget, its feedback and its readings.

    Args:
        target_s: the target P99 from consume to acknowledgement, in seconds (> 0).
        devices: the devices the lane's batches are placed on (each runs its own batches):
            the lane's capacity at a size is this many times one device's.

    Raises:
        ValueError: ``target_s`` not a positive finite number, or ``devices`` below 1.
    """

    def __init__(self, target_s: float, devices: int = 1) -> None:
        if not 0.0 < target_s < math.inf:
            raise ValueError(f"latency target must be > 0 seconds and finite, got {target_s}")
        if devices < 1:
            raise ValueError(f"a lane runs on at least one device, got {devices}")
        self.target_s = target_s
        self.devices = devices
        self.scale = 1.0
        self.version = 0
        """Bumped whenever the budget may have moved (scale, device times): callers cache."""
        self._service_s: dict[int, deque[float]] = {}
        self._median_s: dict[int, float] = {}  # per size, the median of its recent batches
        self._sizes: list[int] = []  # measured sizes, sorted
        # the window: per acknowledged batch (ack time, latencies), oldest first
        self._window: deque[tuple[float, np.ndarray]] = deque()
        self._samples = 0
        self._since_adjust: list[np.ndarray] = []  # latencies since the last adjustment
        self._since_samples = 0  # the latencies kept in _since_adjust (bounded)
        self._since_results = 0  # every result since the last adjustment (the rate's count)
        self._adjusted_s = -math.inf  # the first adjustment waits only for MIN_SAMPLES
        self._rate_msg_s = 0.0  # results per second over the last adjustment period (0: unknown)
        self._cuts = 0
        self._backlogged_cuts = 0
        self._read_s: float | None = None
        self._over = False
        self._warned_s = -math.inf
        self._warned_episode = False
        self._last_cap = 0
        # (acknowledged at, seconds from cut to acknowledgement), oldest first
        self._after_cut: deque[tuple[float, float]] = deque(maxlen=AFTER_CUT_WINDOW)
        self._served_cut_s = -math.inf  # the newest cut of a batch with records to run
        self._probe_cut_s: float | None = None  # a probe's cut, until it is acknowledged
        self._counted_from_s = -math.inf  # batches cut before: not counted (a probe)

    # -- what the batcher asks -------------------------------------------------------------
    def waits_s(self, configured_s: tuple[float, ...]) -> tuple[float, ...]:
        """Per class, the longest wait after consume now: the configured one, at most the
        target's wait share (seconds)."""
        budget_s = WAIT_SHARE * self.target_s * self.scale
        return tuple(min(wait_s, budget_s) for wait_s in configured_s)

    def batch_cap(self, cap: int, wait_s: float) -> int:
        """The largest candidate size up to ``cap`` whose expected device time fits the budget
        after waiting ``wait_s`` (see the module docstring); 1 when none does, ``cap`` while
        nothing was measured."""
        budget_s = self.target_s * self.scale
        sizes = candidate_sizes(max(1, cap))
        fitting = 1
        for size in sizes:
            service_s = self.service_s(size)
            if service_s is not None and wait_s + IN_FLIGHT_BATCHES * service_s > budget_s:
                break
            fitting = size
        needed_msg_s = CAPACITY_HEADROOM * self._rate_msg_s
        if needed_msg_s > 0.0 and not self._carries(fitting, needed_msg_s):
            # the load does not fit: capacity first
            larger = (size for size in sizes if size > fitting)
            fitting = next((s for s in larger if self._carries(s, needed_msg_s)), sizes[-1])
        self._last_cap = fitting
        return fitting

    def _carries(self, size: int, rate_msg_s: float) -> bool:
        """Batches of ``size`` on every device of the lane carry ``rate_msg_s`` by their
        expected device time (True while nothing was measured)."""
        service_s = self.service_s(size)
        return service_s is None or self.devices * size / service_s >= rate_msg_s

    def service_s(self, size: int) -> float | None:
        """Expected device seconds of a batch of ``size`` (see the module docstring); None
        while no batch was measured."""
        sizes = self._sizes
        if not sizes:
            return None
        at = bisect_left(sizes, size)
        if at < len(sizes) and sizes[at] == size:
            return self._median(size)
        if at == len(sizes):  # above every measured size: linear per row from the largest
            largest = sizes[-1]
            return self._median(largest) * size / largest
        above = sizes[at]
        if at == 0:  # below every measured size: no faster than the smallest
            return self._median(above)
        below = sizes[at - 1]
        low_s, high_s = self._median(below), self._median(above)
        return low_s + (high_s - low_s) * (size - below) / (above - below)

    def _median(self, size: int) -> float:
        return self._median_s[size]

    # -- what the lane feeds ---------------------------------------------------------------
    def observe(self, size: int, service_s: float) -> None:
        """A batch of ``size`` records took ``service_s`` seconds on its device (ignored
        unless both are positive and finite)."""
        if size < 1 or not 0.0 < service_s < math.inf:
            return
        recent = self._service_s.get(size)
        if recent is None:
            recent = self._service_s[size] = deque(maxlen=ESTIMATE_WINDOW)
            self._sizes = sorted(self._service_s)
        recent.append(service_s)
        self._median_s[size] = statistics.median(recent)
        self.version += 1

    def finished(self, cut_s: float, now_s: float) -> None:
        """A batch cut at ``cut_s`` had its results acknowledged at ``now_s`` (monotonic
        seconds; ignored unless the time between is finite and >= 0). The first batch cut at
        or after a pending probe's cut (:meth:`served`) drops the times measured before it;
        from then on a batch cut before that probe is not counted either."""
        after_cut_s = now_s - cut_s
        if 0.0 <= after_cut_s < math.inf:
            probe_s = self._probe_cut_s
            if probe_s is not None and cut_s >= probe_s:
                self._after_cut.clear()
                self._probe_cut_s = None
                self._counted_from_s = probe_s
            if cut_s >= self._counted_from_s:  # a batch cut before the last probe: stale
                self._after_cut.append((now_s, after_cut_s))
            self._served_cut_s = max(self._served_cut_s, cut_s)

    def after_cut_s(self, now_s: float) -> float | None:
        """The :data:`AFTER_CUT_QUANTILE` quantile of the seconds from cut to acknowledgement
        of the lane's last :data:`AFTER_CUT_WINDOW` batches, of those acknowledged in the last
        :data:`AFTER_CUT_MAX_AGE_S` before ``now_s`` (monotonic seconds); None when there are
        none."""
        since_s = now_s - AFTER_CUT_MAX_AGE_S
        recent = sorted(seconds for at_s, seconds in self._after_cut if at_s >= since_s)
        if not recent:
            return None
        return recent[int(AFTER_CUT_QUANTILE * (len(recent) - 1))]

    def expiry_lead_s(self, size: int, now_s: float) -> float:
        """How long after a cut at ``now_s`` (monotonic seconds) a batch of ``size`` records is
        expected to be acknowledged, in seconds (predicted expiry: a record due before then
        expires at the cut): :meth:`after_cut_s`; without a recent time,
        :data:`IN_FLIGHT_BATCHES` of the expected device times for the size (its own batch and
        one ahead of it on its device); 0.0 while nothing was measured."""
        after_cut_s = self.after_cut_s(now_s)
        if after_cut_s is not None:
            return after_cut_s
        service_s = self.service_s(size)
        return 0.0 if service_s is None else IN_FLIGHT_BATCHES * service_s

    def probe_due(self, lead_s: float, now_s: float) -> bool:
        """The lane served no batch in the last ``lead_s`` (the cut's :meth:`expiry_lead_s`,
        > 0) before ``now_s``: every batch served before is due to be done, and the lead,
        measured only by the batches served, is not being measured. A cut whose every record
        the lead would expire then serves one (a *probe*, ``streamproc.intake.lane``);
        otherwise a lead that expires every record would never be measured again."""
        return lead_s > 0.0 and now_s - self._served_cut_s > lead_s

    def served(self, cut_s: float, probe: bool = False) -> None:
        """A batch with records to run was cut at ``cut_s`` (monotonic seconds); ``probe``: as
        a probe (:meth:`probe_due`). The times from cut to acknowledgement measured before a
        probe stop counting once it (or a batch cut after it) is acknowledged
        (:meth:`finished`): they describe batches queued behind others that are done. A batch
        the lead let through is no probe, however long since the last one: the window keeps
        its times, so one slow batch of three still does not set the lead."""
        if probe and self._probe_cut_s is None:
            self._probe_cut_s = cut_s
        self._served_cut_s = max(self._served_cut_s, cut_s)

    def cut(self, backlog: bool) -> None:
        """A batch was cut; ``backlog``: a full batch more still waits behind it."""
        self._cuts += 1
        self._backlogged_cuts += backlog

    def acknowledged(self, latencies_s: np.ndarray, now_s: float) -> LatencyReading | None:
        """Results were acknowledged at ``now_s`` (monotonic seconds) with these latencies
        (consume to acknowledgement, seconds, shape ``(n,)``). Adjusts the scale when due;
        returns a reading at most every :data:`READ_EVERY_S`, else None."""
        if len(latencies_s):
            self._window.append((now_s, latencies_s))
            self._samples += len(latencies_s)
            since = self._since_adjust
            since.append(latencies_s)
            self._since_samples += len(latencies_s)
            self._since_results += len(latencies_s)
            while self._since_samples - len(since[0]) >= MAX_SAMPLES:  # bounded, newest kept
                self._since_samples -= len(since.pop(0))
        self._trim(now_s)
        if now_s - self._adjusted_s >= ADJUST_EVERY_S:
            self._adjust(now_s)
        if self._read_s is not None and now_s - self._read_s < READ_EVERY_S:
            return None
        return self._read(now_s)

    # -- internals -------------------------------------------------------------------------
    def _trim(self, now_s: float) -> None:
        window = self._window
        while window and (
            window[0][0] < now_s - WINDOW_S or self._samples - len(window[0][1]) >= MAX_SAMPLES
        ):
            self._samples -= len(window.popleft()[1])

    def _p99_s(self) -> float | None:
        if not self._window:
            return None
        latencies = np.concatenate([samples for _, samples in self._window])
        return float(np.percentile(latencies[-MAX_SAMPLES:], 99))

    def _adjust(self, now_s: float) -> None:
        recent = self._since_adjust
        if self._since_samples < MIN_SAMPLES:
            return
        p99_s = float(np.percentile(np.concatenate(recent), 99))
        if self._adjusted_s > -math.inf and now_s > self._adjusted_s:
            # every result counts, not only the latencies kept (at most MAX_SAMPLES): a lane
            # at 30,000 msg/s must not read as one at 16,384
            self._rate_msg_s = self._since_results / (now_s - self._adjusted_s)
            self.version += 1
        scale = self.scale
        if self._cuts and self._backlogged_cuts >= SATURATED_SHARE * self._cuts:
            scale = min(MAX_SCALE, scale * GROW)
        elif p99_s > self.target_s:
            scale = max(MIN_SCALE, scale * SHRINK)
        elif p99_s < RELAX * self.target_s and scale < 1.0:
            scale = min(1.0, scale * GROW)
        if scale != self.scale:
            self.scale = scale
            self.version += 1
        self._since_adjust = []
        self._since_samples = self._since_results = 0
        self._cuts = self._backlogged_cuts = 0
        self._adjusted_s = now_s

    def _read(self, now_s: float) -> LatencyReading:
        p99_s = self._p99_s()
        over_target_s = 0.0
        if self._over and self._read_s is not None:
            over_target_s = min(now_s - self._read_s, WINDOW_S)
        over = p99_s is not None and p99_s > self.target_s
        went_over = back_within = False
        if over and not self._over and now_s - self._warned_s >= WARN_EVERY_S:
            went_over = self._warned_episode = True
            self._warned_s = now_s
        elif not over and self._over and self._warned_episode:
            back_within = True
            self._warned_episode = False
        self._over = over
        self._read_s = now_s
        return LatencyReading(
            p99_s, over_target_s, went_over, back_within, self.scale, self._last_cap
        )
