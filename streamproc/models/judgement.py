"""The judgements on versions, pure (no threads, no clocks): a new version's probation
(rolled back on errors or on a slow P99 against its predecessor) and a shadow candidate's
record (promoted on agreement and latency thresholds).

Probation's times are device seconds per row of a batch (its device time over its rows): a
version that took over during a catch-up burst cuts larger batches than its predecessor did in
a quiet spell, and raw batch times would call it slow (seen in a trial: an identical copy of
the serving version rolled back for "latency", 9.3 ms against 2.8 ms per batch)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from streamproc.config.sections import RollbackConfig, ShadowConfig


def p99(values: Iterable[float]) -> float:
    """The 99th percentile (linear interpolation) of ``values``; 0.0 when empty."""
    data = np.fromiter(values, dtype=np.float64)
    return float(np.percentile(data, 99)) if data.size else 0.0


class RecentTimes:
    """The batch times (seconds) of the serving version's last ``size`` batches: its P99 is
    the baseline its successor is judged against."""

    def __init__(self, size: int) -> None:
        self._times: deque[float] = deque(maxlen=size)

    def add(self, seconds: float) -> None:
        self._times.append(seconds)

    def p99(self, at_least: int = 1) -> float:
        """The P99 of the kept times; 0.0 with fewer than ``at_least``."""
        return p99(self._times) if len(self._times) >= at_least else 0.0

    def __len__(self) -> int:
        return len(self._times)


@dataclass
class Probation:
    """A newly serving version's first ``window_batches`` batches.

    Attributes:
        rules: the pipeline's ``model.rollback``.
        baseline_p99_s: the predecessor's P99 batch time over its last batches (seconds; 0:
            fewer than ``latency_min_batches`` known, latency not judged).
        batches: batches the version served (or raised on) so far.
        errors: batches it raised on.
        times: batch times of the batches it ran.
    """

    rules: RollbackConfig
    baseline_p99_s: float
    batches: int = 0
    errors: int = 0
    times: list[float] = field(default_factory=list)

    def observe(self, seconds: float, raised: bool) -> str | None:
        """One batch: ``seconds`` of device time, ``raised`` when the version raised on it.

        Returns:
            ``errors`` or ``latency`` when the version must be rolled back now, else None.
        """
        self.batches += 1
        if raised:
            self.errors += 1
        else:
            self.times.append(seconds)
        rules = self.rules
        if self.batches < rules.min_batches:
            return None
        if self.errors / self.batches > rules.max_error_share:
            return "errors"
        if (
            self.baseline_p99_s > 0
            and len(self.times) >= rules.latency_min_batches
            and p99(self.times) > rules.max_p99_ratio * self.baseline_p99_s
        ):
            return "latency"
        return None

    @property
    def passed(self) -> bool:
        """The window is over without a rollback: the predecessor may go."""
        return self.batches >= self.rules.window_batches

    def describe(self) -> str:
        before = (
            f"against {self.baseline_p99_s * 1e6:.1f} us before"
            if self.baseline_p99_s > 0
            else "(the predecessor ran too few batches for a baseline: latency not judged)"
        )
        return (
            f"{self.errors} of {self.batches} batches raised; P99 "
            f"{p99(self.times) * 1e6:.1f} us per row {before}"
        )


@dataclass
class ShadowRecord:
    """What a shadow candidate did so far.

    Attributes:
        rules: the pipeline's ``model.shadow``.
        batches, errors, rows, agreed: shadowed batches, those it raised on, rows compared,
            rows that agreed.
        serving_s, shadow_s: per shadowed batch, the serving and the candidate call's seconds.
    """

    rules: ShadowConfig
    batches: int = 0
    errors: int = 0
    rows: int = 0
    agreed: int = 0
    serving_s: list[float] = field(default_factory=list)
    shadow_s: list[float] = field(default_factory=list)

    def observe(
        self, rows: int, agreed: int, serving_s: float, shadow_s: float, error: bool
    ) -> None:
        self.batches += 1
        self.rows += rows
        self.agreed += agreed
        if error:
            self.errors += 1
            return
        self.serving_s.append(serving_s)
        self.shadow_s.append(shadow_s)

    @property
    def agreement(self) -> float:
        """Share of compared rows that agreed (0.0 before any)."""
        return self.agreed / self.rows if self.rows else 0.0

    @property
    def latency_ratio(self) -> float:
        """The candidate's P99 call time over the serving version's (0.0 before any)."""
        serving = p99(self.serving_s)
        return p99(self.shadow_s) / serving if serving > 0 else 0.0

    def ready(self) -> bool:
        """The thresholds for an automatic promotion are met (never without
        ``promote_after_batches``)."""
        rules = self.rules
        if rules.promote_after_batches is None or self.batches < rules.promote_after_batches:
            return False
        return (
            self.errors == 0
            and self.agreement >= rules.promote_min_agreement
            and self.latency_ratio <= rules.promote_max_latency_ratio
        )

    def describe(self) -> str:
        return (
            f"{self.batches} batches, agreement {self.agreement:.4f}, latency ratio "
            f"{self.latency_ratio:.2f}, {self.errors} raised"
        )
