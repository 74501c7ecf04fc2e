"""When to cut a batch: a pure policy over ring views and an injected clock.

The dispatcher asks :meth:`Batcher.decide` only when a device slot is free, so batches are cut
at dispatch time (never on a timer while the device is busy). A cut happens when

(a) the batch target is reached: ``target`` messages are waiting (``target`` comes from the
    :class:`AdaptiveBatchSize` model, at most ``max_batch_size``), or their bytes reach
    ``max_batch_bytes``;
(b) a waiting message reached its deadline: consume time + its priority class's max wait
    (``high`` waits least; latency-critical classes therefore cut early). Deadlines count from
    the consume time, never from when the device became free.

(c) no further message is expected before the earliest deadline: the lane's typical gap
    between consecutive messages (:class:`ArrivalGaps`, the median of the recent gaps between
    the consume times of the messages cut) is longer than the time left. Waiting would then add
    latency and no batching. The median, not the mean rate: a burst after an idle spell has a
    low mean rate but short gaps, and forms one batch (docs/benchmarks-history.md).

Every cut is at most the **batch cap**: the largest batch the lane's devices can run now
(:meth:`Batcher.set_cap`; the device workers lower it when a device runs out of memory and raise
it again after a quiet period, see :mod:`streamproc.device.recovery`). It bounds the target, and
the adaptive model explores and chooses only sizes up to it.

A **latency target** (``pipelines[].latency_target_ms``; :mod:`streamproc.intake.latency`)
bounds both more: the wait of (b) is at most a share of the target, and the batch cap is at most
the largest size whose expected device time fits the target after that wait; the P99 measured
from consume to acknowledgement (:meth:`Batcher.acknowledged`) shrinks or grows that budget.

Otherwise the answer is "wait until the earliest deadline". Records leave the rings
earliest-deadline-first across partitions (in offset order within one), so an old low-priority
record eventually outranks fresh high-priority ones: nothing starves. Batches are never empty.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

from streamproc.intake.latency import (
    LatencyReading,
    LatencyTarget,
    candidate_sizes,
)
from streamproc.intake.rings import RingView
from streamproc.records import Priority

NEAR_BEST = 0.95
"""The adaptive batch size's default latency tie-break: the smallest size within 5 % of the best
throughput (a fused lane aims for the best itself: :meth:`AdaptiveBatchSize.set_near_best`)."""


@dataclass(frozen=True, slots=True)
class Cut:
    """Take up to ``count`` messages now; ``reason`` is "size", "bytes", "deadline" or
    "sparse" (nothing more expected before the deadline)."""

    count: int
    reason: str


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to cut yet; ask again at ``until_s`` (monotonic seconds), or None: no messages."""

    until_s: float | None


@dataclass
class AdaptiveBatchSize:
    """Finds the throughput-optimal batch size for this device and model by measuring.

    Candidate sizes are powers of two up to the cap (plus the cap; ``max_batch_size`` unless
    :meth:`set_cap` lowered it). A
    size's service time is the fastest of its last ``window`` batches, trusted once it has
    ``min_observations`` of them; the target is the size with the best throughput (messages per
    second). Sizes are explored in increasing order; exploration stops once a size's throughput
    falls below ``give_up_below`` x the best so far (past the peak, bigger batches only get
    worse). Under light load the deadline cuts small batches and the target stays where latency
    is lowest anyway.

    The fastest of a window, not an average: on a shared CPU interference only ever adds time,
    and not in proportion to the work, so the fastest recent batch measures the device and
    model; the window (not all history) lets the estimate follow a real slowdown (a shared GPU,
    thermal limits) within ``window`` batches of that size.

    Sizes are compared on fresh measurements only: a size's throughput counts towards the
    target only from its batches among the last ``fresh_for`` observations (of any size), so the
    sizes compared were measured under the same conditions (a time from the idle calibration
    stops counting once ``fresh_for`` live batches ran); the best is the fastest of all fresh
    sizes (``give_up_below`` only stops *exploring* past the peak); and a size measured only long
    ago whose old rate would clearly win (beyond ``near_best``) is re-measured, one batch, before
    it is trusted, so a size that really got faster comes back after one fresh batch. The
    measurements behind both rules: docs/benchmarks-history.md.

    Args:
        max_batch_size: the largest size.
        cap: the largest size the devices can run now (:meth:`set_cap`; default
            ``max_batch_size``): candidates above it are left out until it rises.
        window: batches per size kept for the estimate.
        min_observations: batches of a size needed before its throughput is trusted.
        give_up_below: stop exploring larger sizes below this fraction of the best throughput.
        near_best: aim for the smallest size whose throughput is at least this fraction of the
            best (lower latency for the same work).
        explore_every: every this many observations, re-measure a neighbour of the best size
            (alternately the one below and the one above: the device or model may have warmed
            up, or be shared).
        fresh_for: a batch's time counts towards the target for this many observations (of
            any size) after it, then the size is stale: compared again only once re-measured.
    """

    max_batch_size: int
    cap: int = 0
    window: int = 8
    min_observations: int = 3
    give_up_below: float = 0.8
    near_best: float = NEAR_BEST
    explore_every: int = 50
    fresh_for: int = 16
    # per size: (observation number, seconds) of its last ``window`` batches
    _service_s: dict[int, deque[tuple[int, float]]] = field(default_factory=dict)
    _observations: int = 0
    _target: int | None = None  # target() until the next observation (decide() asks often)
    _candidates: tuple[int, list[int]] = (0, [])  # (cap, candidates): rebuilt when cap moves

    def __post_init__(self) -> None:
        self.cap = min(self.cap, self.max_batch_size) or self.max_batch_size
        if self.window < 1 or self.min_observations < 1 or self.fresh_for < 1:
            raise ValueError(
                f"window ({self.window}), min_observations ({self.min_observations}) and "
                f"fresh_for ({self.fresh_for}) must be >= 1"
            )

    @property
    def candidates(self) -> list[int]:
        """Powers of two up to the cap, and the cap (the same list until the cap moves: read
        it, never change it)."""
        cap, sizes = self._candidates
        if cap != self.cap:
            sizes = candidate_sizes(self.cap)
            self._candidates = (self.cap, sizes)
        return sizes

    def set_cap(self, cap: int) -> None:
        """The devices can run at most ``cap`` rows now (clamped to 1..``max_batch_size``)."""
        self.cap = max(1, min(cap, self.max_batch_size))
        self._target = None

    def set_near_best(self, near_best: float) -> None:
        """Aim for the smallest size within ``near_best`` (0 < x <= 1) of the best throughput
        from now on: 1.0 is the throughput-optimal size itself (a fused lane, where a batch's
        fixed costs are the lane thread's own, not hidden behind the device)."""
        if not 0.0 < near_best <= 1.0:
            raise ValueError(f"near_best must be in (0, 1], got {near_best}")
        self.near_best = near_best
        self._target = None

    def observe(self, size: int, service_s: float) -> None:
        """Record that a batch of ``size`` messages took ``service_s`` seconds on the device
        (ignored unless ``size`` is a candidate and ``service_s`` is positive and finite)."""
        if size not in self.candidates or not 0 < service_s < math.inf:
            return
        recent = self._service_s.get(size)
        if recent is None:
            recent = self._service_s[size] = deque(maxlen=self.window)
        recent.append((self._observations, service_s))
        self._observations += 1
        self._target = None

    def throughput(self, size: int) -> float | None:
        """Measured messages per second at ``size`` (its fastest batch in the window, fresh
        or not), or None if not measured enough yet."""
        recent = self._service_s.get(size)
        if recent is None or len(recent) < min(self.min_observations, self.window):
            return None
        return size / min(seconds for _, seconds in recent)

    def _fresh_throughput(self, size: int) -> float | None:
        """Messages per second at ``size`` from its batches among the last ``fresh_for``
        observations, or None (none of them, or ``size`` not measured enough yet)."""
        if self.throughput(size) is None:
            return None
        since = self._observations - self.fresh_for
        fresh = [seconds for seen, seconds in self._service_s[size] if seen >= since]
        return size / min(fresh) if fresh else None

    def unmeasured(self) -> int | None:
        """The size to measure next before the target is known (None: none left). Used to
        calibrate at start-up, before any message waits on the exploration.

        Sizes are measured round-robin (1, 2, 4, ..., then again), not ``min_observations``
        times each in turn, so that a drift of the machine's speed during calibration favours no
        size (docs/benchmarks-history.md). In play are the sizes up to the first never
        measured or past the peak by the fastest batch so far (the one past the peak gets its
        full ``min_observations`` too: one interfered batch does not end the exploration).
        """
        need = min(self.min_observations, self.window)
        in_play = [size for size, _ in self._scan()]
        counts = [len(self._service_s.get(size, ())) for size in in_play]
        fewest = min(counts)
        return in_play[counts.index(fewest)] if fewest < need else None

    def _scan(self) -> list[tuple[int, float | None]]:
        """Candidates in increasing order with the rate of their fastest batch in the window
        (None: never measured), up to the first never measured or the first past the peak
        (below ``give_up_below`` x the best before it), that one included."""
        scanned: list[tuple[int, float | None]] = []
        best_rate = 0.0
        for size in self.candidates:
            recent = self._service_s.get(size)
            rate = size / min(seconds for _, seconds in recent) if recent else None
            scanned.append((size, rate))
            if rate is None or rate < self.give_up_below * best_rate:
                break  # never measured, or past the peak as far as is known yet
            best_rate = max(best_rate, rate)
        return scanned

    def target(self) -> int:
        """The batch size to aim for now (changes only with :meth:`observe`)."""
        if self._target is None:
            self._target = self._choose()
        return self._target

    def _choose(self) -> int:
        need = min(self.min_observations, self.window)
        candidates = self.candidates
        # explore: the first size up to the peak not measured ``need`` times yet
        for size, _ in self._scan():
            if len(self._service_s.get(size, ())) < need:
                return size
        # the fastest size by fresh measurements only (all of them: an interfered small size
        # must not hide a larger one measured just as recently)
        fresh = {size: rate for size in candidates if (rate := self._fresh_throughput(size))}
        if not fresh:  # lately only sizes not measured enough (past the peak, cut by deadline)
            fresh = {size: rate for size in candidates if (rate := self.throughput(size))}
        best = max(fresh, key=fresh.__getitem__)
        best_rate = fresh[best]
        # a size measured only long ago that would clearly win: measure it again first
        stale = {
            size: rate
            for size in candidates
            if size not in fresh and (rate := self.throughput(size)) is not None
        }
        recheck = max(stale, key=stale.__getitem__, default=None)
        if recheck is not None and self.near_best * stale[recheck] > best_rate:
            return recheck
        # Latency tie-break: the smallest size within ``near_best`` of the best throughput.
        # On a CPU the curve is flat around its peak (EfficientNet-Lite0 here: 4, 8 and 16
        # within noise), and a batch twice the size makes every message in it wait twice as
        # long for its result.
        best = min(size for size, rate in fresh.items() if rate >= self.near_best * best_rate)
        if self.explore_every and self._observations % self.explore_every == 0:
            index = candidates.index(best)
            below = (self._observations // self.explore_every) % 2 == 1
            neighbour = index - 1 if below else index + 1
            if 0 <= neighbour < len(candidates):
                return candidates[neighbour]
        return best


@dataclass
class ArrivalGaps:
    """The typical gap between consecutive messages of a lane, from the messages cut.

    Fed with each cut's consume times; keeps the last ``window`` gaps between consecutive
    consume times (sorted within a cut, and from the newest consume time of the previous
    cut; never negative) and their median. A backlog fetched in one poll has (nearly) one
    consume time: the gaps are zero and the batcher keeps waiting for its target, as it should.

    Args:
        window: gaps kept (messages, not batches: a burst's gaps outnumber the idle gap
            before it, so the median is the gap inside bursts).
        min_gaps: gaps needed before :attr:`typical_s` is known.
    """

    window: int = 32
    min_gaps: int = 3
    _gaps_s: deque[float] = field(init=False)
    _newest_s: float | None = None
    _typical_s: float | None = None
    _stale: bool = False

    def __post_init__(self) -> None:
        self._gaps_s = deque(maxlen=self.window)

    @property
    def typical_s(self) -> float | None:
        """The median of the kept gaps (seconds); None until ``min_gaps`` are known. Computed
        when read, not per cut: the batcher reads it only when a batch below its target waits."""
        if self._stale:
            gaps = self._gaps_s
            self._typical_s = statistics.median(gaps) if len(gaps) >= self.min_gaps else None
            self._stale = False
        return self._typical_s

    def record(self, consumed_s: Sequence[float] | np.ndarray) -> None:
        """One batch was cut; ``consumed_s`` are its messages' consume times (monotonic s)."""
        window = self.window
        # sorted() of a few values beats numpy's per-call cost; a long cut keeps its newest
        times = sorted(consumed_s.tolist() if isinstance(consumed_s, np.ndarray) else consumed_s)
        if not times:
            return
        times = times[-(window + 1) :]
        newest_s = self._newest_s
        if newest_s is not None and len(times) <= window:
            # the gap from the previous cut's newest message (never negative: a record older
            # than it can be cut later, from another partition, earliest deadline first)
            first = min(newest_s, times[0])
            self._newest_s = max(newest_s, times[-1])
            times.insert(0, first)
        else:
            self._newest_s = times[-1]
        self._gaps_s.extend([b - a for a, b in pairwise(times)])
        self._stale = True


class Batcher:
    """Batch-cut policy.

    Args:
        max_batch_size: most messages per batch (>= 1).
        max_batch_bytes: most key+value bytes per batch (the first message is always taken).
        max_wait_s: per priority class, the longest a message may wait after it was consumed,
            in seconds, e.g. ``{Priority.HIGH: 0.002, Priority.NORMAL: 0.02}`` (a class left
            out waits as long as ``NORMAL``); a float applies to every class.
        adaptive: measure and aim for the throughput-optimal batch size (see
            :class:`AdaptiveBatchSize`); else always aim for ``max_batch_size`` (or the cap,
            while :meth:`set_cap` holds it lower).
        latency_target_s: the pipeline's latency target (P99 from consume to acknowledgement,
            seconds, > 0; see :class:`~streamproc.intake.latency.LatencyTarget`): waits and
            the batch cap are kept within its budget. None: no target (the configured waits
            and sizes only).
        devices: the devices the lane's batches are placed on (the latency target's capacity
            counts each).

    Raises:
        ValueError: ``max_batch_size`` below 1, ``latency_target_s`` not above 0, or
            ``devices`` below 1.
    """

    def __init__(
        self,
        max_batch_size: int,
        max_batch_bytes: int,
        max_wait_s: float | Mapping[Priority, float],
        adaptive: bool = False,
        latency_target_s: float | None = None,
        devices: int = 1,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.max_batch_bytes = max_batch_bytes
        waits = (
            max_wait_s if isinstance(max_wait_s, Mapping) else dict.fromkeys(Priority, max_wait_s)
        )
        normal = waits.get(Priority.NORMAL, 0.02)
        # indexed by Priority value (the rings' per-class tables use the same index)
        # (the take order's ages: records leave the rings by these, target or not)
        self.max_wait_s: tuple[float, ...] = tuple(waits.get(p, normal) for p in Priority)
        self.waits_s = self.max_wait_s
        """Per class, the longest wait after consume now (seconds): ``max_wait_s``, at most
        the latency target's wait share."""
        self.sizer = AdaptiveBatchSize(max_batch_size) if adaptive else None
        self.arrivals = ArrivalGaps()
        self.cap = max_batch_size
        self.latency = (
            None if latency_target_s is None else LatencyTarget(latency_target_s, devices)
        )
        self.latency_cap = max_batch_size
        """The largest batch the latency target allows now (``max_batch_size`` without one)."""
        self._latency_version = -1
        self._refresh()

    @property
    def target(self) -> int:
        """The batch size aimed for now (never above the cap nor the latency target's cap)."""
        if self.sizer is not None:
            return self.sizer.target()
        return min(self.cap, self.latency_cap)

    def set_cap(self, cap: int) -> None:
        """The lane's devices can run at most ``cap`` rows per batch now (clamped to
        1..``max_batch_size``): no cut is larger until the cap rises again."""
        self.cap = max(1, min(cap, self.max_batch_size))
        self._latency_version = -1
        self._refresh()

    def _refresh(self) -> None:
        """Follow the latency target's budget (when it moved): the waits, the latency cap and
        the adaptive model's cap (the smaller of the devices' and the latency's)."""
        latency = self.latency
        if latency is not None and latency.version != self._latency_version:
            self._latency_version = latency.version
            self.waits_s = latency.waits_s(self.max_wait_s)
            self.latency_cap = latency.batch_cap(self.cap, max(self.waits_s))
        if self.sizer is not None:
            allowed = min(self.cap, self.latency_cap)
            if self.sizer.cap != allowed:
                self.sizer.set_cap(allowed)

    def unmeasured(self) -> int | None:
        """Next batch size the adaptive model needs measured, or None (see
        :meth:`AdaptiveBatchSize.unmeasured`; always None without the adaptive model)."""
        return self.sizer.unmeasured() if self.sizer is not None else None

    def expiry_lead_s(self, size: int, now_s: float) -> float:
        """How long after a cut at ``now_s`` (monotonic seconds) a batch of ``size`` records is
        expected to be acknowledged, in seconds
        (:meth:`~streamproc.intake.latency.LatencyTarget.expiry_lead_s`: the lower 90th
        percentile of the lane's recent batches' times from cut to acknowledgement, else twice
        the expected device time). 0.0 without a latency target or while nothing was measured:
        then only a deadline already passed expires a record."""
        latency = self.latency
        return 0.0 if latency is None else latency.expiry_lead_s(size, now_s)

    def probe_due(self, lead_s: float, now_s: float) -> bool:
        """No batch was served in the last ``lead_s`` (the cut's :meth:`expiry_lead_s`) before
        ``now_s`` (:meth:`~streamproc.intake.latency.LatencyTarget.probe_due`)."""
        latency = self.latency
        return latency is not None and latency.probe_due(lead_s, now_s)

    def observe(self, size: int, service_s: float) -> None:
        """Feed back one batch's device time (used by the adaptive size model and the latency
        target's device time estimates)."""
        if self.sizer is not None:
            self.sizer.observe(size, service_s)
        if self.latency is not None:
            self.latency.observe(size, service_s)
            self._refresh()

    def acknowledged(
        self, consumed_s: np.ndarray, now_s: float, cut_s: float | None = None
    ) -> LatencyReading | None:
        """Results were acknowledged at ``now_s`` for records consumed at ``consumed_s``
        (monotonic seconds, shape ``(n,)``) and cut at ``cut_s`` (None: not known): the latency
        target's measurement. Returns its reading when one is due (None: not due, or no
        target)."""
        latency = self.latency
        if latency is None:
            return None
        if cut_s is not None:
            latency.finished(cut_s, now_s)
        reading = latency.acknowledged(np.maximum(0.0, now_s - consumed_s), now_s)
        self._refresh()
        return reading

    def served(self, cut_s: float, probe: bool = False) -> None:
        """A batch with records to run was cut at ``cut_s`` (monotonic seconds), ``probe``: as
        a probe; the lead of :meth:`expiry_lead_s` is being measured
        (:meth:`LatencyTarget.served`)."""
        if self.latency is not None:
            self.latency.served(cut_s, probe)

    def cut(self, consumed_s: Sequence[float] | np.ndarray) -> None:
        """Feed back one cut batch: its messages' consume times (monotonic seconds; the
        arrival gaps behind cut (c) of the module docstring)."""
        self.arrivals.record(consumed_s)

    def decide(self, views: Sequence[RingView], now_s: float) -> Cut | Wait:
        """Decide on the waiting messages described by ``views`` at time ``now_s``."""
        if not views:
            return Wait(None)
        target = self.target
        waiting = sum(v.size for v in views)
        if waiting >= target:
            return self._cut(target, "size", waiting)
        if sum(v.bytes for v in views) >= self.max_batch_bytes:
            return self._cut(target, "bytes", waiting)
        deadline_s = min(v.deadline_s(self.waits_s) for v in views)
        if now_s >= deadline_s:
            return self._cut(target, "deadline", waiting)
        gap_s = self.arrivals.typical_s
        if gap_s is not None and gap_s > deadline_s - now_s:
            return self._cut(target, "sparse", waiting)
        return Wait(deadline_s)

    def _cut(self, target: int, reason: str, waiting: int) -> Cut:
        if self.latency is not None:  # a full batch more waits behind this one: saturated
            self.latency.cut(waiting >= 2 * target)
        return Cut(target, reason)
