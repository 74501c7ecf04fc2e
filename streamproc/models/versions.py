"""One pipeline's resident versions and the switch between them at a batch boundary.

At most two versions are resident: the serving one, and one of: its predecessor (while the
serving one is in probation, the rollback target), a shadow candidate, or a version loaded and
waiting for the next batch boundary. Who calls what (one lock guards the state):

* the dispatcher (``dispatch-<topic>``): :meth:`ModelVersions.bind` per cut batch. A pending
  switch takes effect there, between two batches: every batch cut before it runs the old
  version, every batch after the new one; results go out in cut order, so per partition the
  version changes once;
* the results thread (``results-<topic>``): :meth:`ModelVersions.observe` per batch, before it
  is produced: counts, probation (an automatic rollback is a switch back at the next boundary),
  shadow records (a promotion on thresholds), the end of probation (the predecessor is let
  go), and under exactly-once a transaction boundary where the version changes (no
  transaction holds results of two versions of a pipeline);
* the ``models-<pipeline>`` thread (:mod:`streamproc.models.manager`): :meth:`offer` a loaded
  version, :meth:`use` for the operator, :meth:`state` for the admin endpoint;
* the launching thread of a batch held because the model was judged broken
  (:mod:`streamproc.device.hold`): :meth:`judged_broken` (the serving version is refused and the
  last version that served well named, for the model thread to reload from the source), and
  :meth:`rebind` before each try (a pending switch takes effect there, as at a cut).

A version *served well* once it produced a batch outside probation (the version serving at
start-up from its first batch, a new one once its probation passed); the names are kept in the
order they last served.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import numpy as np

from streamproc.config.sections import ModelConfig
from streamproc.device.binding import ModelBinding
from streamproc.device.jobs import DeviceJob, DeviceResult
from streamproc.logs import get_logger
from streamproc.metrics import Metrics
from streamproc.models.judgement import Probation, RecentTimes, ShadowRecord
from streamproc.models.loading import LoadedVersion, VersionRefused

log = get_logger(__name__)

SwitchReason = Literal["new", "promoted", "operator", "rollback"]
SERVED_WELL_KEPT = 8
"""Names of versions that served well kept (the newest; the rollback targets)."""


@dataclass(frozen=True)
class ModelEvent:
    """One thing that happened to a pipeline's versions (``GET /models``, the log).

    Attributes:
        at: wall-clock time, ISO 8601 in UTC (``2026-12-03T15:19:42.123Z``).
        kind: ``loaded``, ``refused``, ``switched``, ``rolled_back``, ``shadowing``,
            ``probation_passed``.
        version: the version it happened to.
        detail: why, in words.
    """

    at: str
    kind: str
    version: str
    detail: str


class ModelVersions:
    """The versions of one pipeline (see the module docstring for its callers).

    Args:
        topic: the pipeline's input topic (metric label).
        serving: the version serving at start-up.
        config: the pipeline's ``model`` section (None: an unversioned pipeline, which only
            stamps ``builtin``).
        metrics: process metrics.
        boundary: under exactly-once, called on the results thread before the first results
            of a new version are produced: returns once no open transaction holds results of
            the old one (None: at-least-once).
        rng: the shadow's sampler (tests pass a seeded one).
    """

    def __init__(
        self,
        topic: str,
        serving: LoadedVersion,
        config: ModelConfig | None,
        metrics: Metrics,
        boundary: Callable[[], None] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.topic = topic
        self._config = config
        self._metrics = metrics
        self._boundary = boundary
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._serving = serving
        self._previous: LoadedVersion | None = None  # resident while serving is in probation
        self._candidate: LoadedVersion | None = None  # shadow scoring
        self._pending: tuple[LoadedVersion, SwitchReason] | None = None
        self._probation: Probation | None = None
        self._shadow: ShadowRecord | None = None
        self._bindings = self._make_bindings()
        self._recent = self._new_recent()
        self._shadow_first = False  # the dispatcher's: which call runs first on the next shadow
        self.refused: set[str] = set()  # refused or rolled back: polling skips them
        self._served_well: deque[str] = deque(maxlen=SERVED_WELL_KEPT)  # oldest first
        self.events: deque[ModelEvent] = deque(maxlen=100)
        # written by the results thread (under the lock: state() reads them): the version of
        # the last batch produced and when; the gaps between batches (the switch's pause is
        # judged against them)
        self._last_version: str | None = None
        self._last_bound: str | None = None
        self._last_sent_s = 0.0
        self._gaps_s: deque[float] = deque(maxlen=1000)
        self.last_pause_s: float | None = None
        self._switched_at_s: float | None = None
        metrics.model_serving.labels(topic, serving.name).set(1)
        self._event("serving", serving.name, "at start-up")

    @property
    def serving(self) -> str:
        """The serving version's name."""
        return self._serving.name

    def serving_version(self) -> LoadedVersion:
        """The serving version (its output signature is the contract a new one must keep)."""
        with self._lock:
            return self._serving

    def resident(self) -> tuple[str, ...]:
        """The names of the resident versions (at most two)."""
        with self._lock:
            return tuple(
                v.name
                for v in (
                    self._serving,
                    self._previous,
                    self._candidate,
                    self._pending[0] if self._pending else None,
                )
                if v is not None
            )

    # -- the dispatcher ---------------------------------------------------------------------

    def bind(self, job: DeviceJob, device: int) -> None:
        """Bind ``job`` (going to device index ``device``) to the serving version, switching
        first if a switch is pending (this is the batch boundary)."""
        with self._lock:
            if self._pending is not None:
                self._switch(*self._pending)
            serving, shadow = self._bindings[device]
            sample = self._config.shadow.sample if self._config else 0.0
        if shadow is not None and self._rng.random() < sample:
            self._shadow_first = not self._shadow_first  # the dispatcher's own: no lock
            job.binding = ModelBinding(
                serving.version,
                serving.fn,
                serving.fallback,
                shadow,
                serving.atol,
                serving.rtol,
                self._shadow_first,
            )
        else:
            job.binding = serving

    def _switch(self, target: LoadedVersion, reason: SwitchReason) -> None:
        """Make ``target`` the serving version (the caller holds the lock)."""
        old = self._serving
        self._pending = None
        config = self._config
        if reason == "rollback":
            self._previous, self._probation = None, None
        else:
            self._previous = old
            if config is not None:
                baseline = self._recent.p99(config.rollback.latency_min_batches)
                self._probation = Probation(config.rollback, baseline)
        if self._candidate is target:
            self._candidate, self._shadow = None, None
        self._serving = target
        self._recent = self._new_recent()
        self._bindings = self._make_bindings()
        self._switched_at_s = time.monotonic()
        self._metrics.model_serving.labels(self.topic, old.name).set(0)
        self._metrics.model_serving.labels(self.topic, target.name).set(1)
        self._metrics.model_swaps.labels(self.topic, reason).inc()
        self._event("switched", target.name, f"{old.name} -> {target.name} ({reason})")

    def _new_recent(self) -> RecentTimes:
        """The serving version's recent batch times (as many as latency is judged on)."""
        config = self._config
        return RecentTimes(config.rollback.latency_min_batches if config else 1)

    def _make_bindings(self) -> list[tuple[ModelBinding, ModelBinding | None]]:
        """Per device, the serving binding (with its fallback in probation) and the shadow's
        (the caller holds the lock, or it is the constructor)."""
        config = self._config
        atol, rtol = (config.shadow.atol, config.shadow.rtol) if config else (1e-4, 1e-3)
        bindings = []
        for device, fn in enumerate(self._serving.fns):
            fallback = None
            if self._previous is not None:
                fallback = ModelBinding(self._previous.name, self._previous.fns[device])
            shadow = None
            if self._candidate is not None:
                shadow = ModelBinding(self._candidate.name, self._candidate.fns[device])
            bindings.append(
                (ModelBinding(self._serving.name, fn, fallback, None, atol, rtol), shadow)
            )
        return bindings

    # -- the results thread -----------------------------------------------------------------

    def observe(self, result: DeviceResult) -> str:
        """One batch about to be produced: its version's name (for the header), after the
        bookkeeping (see the module docstring)."""
        version = result.version or self._serving.name
        bound = result.bound_version or version
        topic, metrics = self.topic, self._metrics
        # under exactly-once every change of the results' version is a transaction boundary
        # (a probation batch its predecessor made too); a switch is a change of the bound one
        changed = self._last_version is not None and version != self._last_version
        if changed and self._boundary is not None:
            self._boundary()  # never under the lock: it waits for the source thread
        now_s = time.monotonic()
        metrics.child(metrics.model_batches, topic, version).inc()
        if result.raised:
            metrics.model_fallbacks.labels(topic, result.version).inc()
        with self._lock:
            if self._last_bound is not None and bound != self._last_bound:
                self.last_pause_s = now_s - self._last_sent_s
                metrics.model_swap_pause.labels(topic).observe(self.last_pause_s)
            elif self._last_bound is not None:
                self._gaps_s.append(now_s - self._last_sent_s)
            self._last_version, self._last_bound, self._last_sent_s = version, bound, now_s
            if self._config is not None:
                self._judge(result, bound)
        return version

    def _judge(self, result: DeviceResult, bound: str) -> None:
        """Probation, recent times, shadow record, promotion (the caller holds the lock).
        Only batches bound to the serving version count for it: a batch bound before the
        switch (still in flight) is its predecessor's; a batch that failed on both versions
        (poison rows) is the input's fault, not a raise of the new version."""
        serving = self._serving
        probation = self._probation
        # device time per row: batches cut in a catch-up burst are larger than in a quiet spell
        per_row_s = result.inference_s / max(1, len(result.batch))
        if bound == serving.name:
            if probation is not None:
                why = probation.observe(per_row_s, result.raised)
                if why is not None and self._previous is not None and self._pending is None:
                    self._roll_back(why, probation)
                elif probation.passed and self._pending is None:
                    self._end_probation()
            elif not result.raised and result.error is None:
                self._recent.add(per_row_s)
                if not self._served_well or self._served_well[-1] != bound:
                    if bound in self._served_well:
                        self._served_well.remove(bound)
                    self._served_well.append(bound)
        shadow = result.shadow
        candidate, record = self._candidate, self._shadow
        if (
            shadow is None
            or record is None
            or candidate is None
            or shadow.version != candidate.name
        ):
            return
        record.observe(
            shadow.rows, shadow.agreed, shadow.serving_s, shadow.shadow_s, shadow.error is not None
        )
        metrics, topic = self._metrics, self.topic
        metrics.shadow_batches.labels(topic, shadow.version).inc()
        if shadow.error is not None:
            metrics.shadow_errors.labels(topic, shadow.version).inc()
        metrics.shadow_agreement.labels(topic, shadow.version).set(record.agreement)
        metrics.shadow_latency_ratio.labels(topic, shadow.version).set(record.latency_ratio)
        if record.ready() and self._pending is None and self._previous is None:
            self._event("promoting", shadow.version, record.describe())
            self._pending = (candidate, "promoted")

    def _roll_back(self, why: str, probation: Probation) -> None:
        assert self._previous is not None
        failed = self._serving.name
        self.refused.add(failed)
        self._metrics.model_rollbacks.labels(self.topic, why).inc()
        detail = f"rolled back to {self._previous.name} ({why}): {probation.describe()}"
        log.warning(
            "model version rolled back", topic=self.topic, version=failed, reason=why, detail=detail
        )
        self._event("rolled_back", failed, detail)
        self._pending = (self._previous, "rollback")

    def _end_probation(self) -> None:
        assert self._probation is not None
        previous = self._previous
        self._event("probation_passed", self._serving.name, self._probation.describe())
        self._previous, self._probation = None, None
        self._bindings = self._make_bindings()  # the predecessor goes with its last binding
        if previous is not None:
            log.info(
                "model version passed probation",
                topic=self.topic,
                version=self._serving.name,
                released=previous.name,
            )

    # -- a held batch's launching thread ----------------------------------------------------

    def judged_broken(self, name: str) -> str | None:
        """The device worker judged version ``name`` broken (failing for every row) and holds
        its batch: when ``name`` serves, it is refused (polling never loads it again), counted
        (``streamproc_model_rollbacks_total{reason="broken"}``) and logged, and the newest
        other version that served well is returned, for the model thread to reload from the
        source and switch to. None: ``name`` does not serve, was judged broken before, a switch
        is pending already, or no other version served well; a predecessor still resident (in
        probation) is switched back to at once instead."""
        with self._lock:
            if name != self._serving.name or name in self.refused or self._pending is not None:
                return None  # not serving, told before, or a switch is on its way
            if self._previous is not None:  # in probation: its predecessor is resident
                target: str | None = self._previous.name
                self._pending = (self._previous, "rollback")
            else:
                good = [v for v in self._served_well if v != name and v not in self.refused]
                target = good[-1] if good else None
            if target is None:
                self._event("broken", name, "fails on every row; no other version served well")
                return None
            self.refused.add(name)
            self._metrics.model_rollbacks.labels(self.topic, "broken").inc()
            detail = f"rolled back to {target} (broken: it fails on every row)"
            log.warning(
                "model version rolled back",
                topic=self.topic,
                version=name,
                reason="broken",
                detail=detail,
            )
            self._event("rolled_back", name, detail)
            return None if self._pending is not None else target

    def rebind(self, job: DeviceJob, device: int) -> None:
        """Bind a held ``job`` (on device index ``device``) to the version serving now, a
        pending switch first (the batches cut after it are bound to the old version or to
        this one, never to an older one: per partition the version still changes once);
        never shadowed."""
        with self._lock:
            if self._pending is not None:
                self._switch(*self._pending)
            job.binding = self._bindings[device][0]

    # -- the models thread ------------------------------------------------------------------

    def offer(
        self, version: LoadedVersion, mode: Literal["swap", "shadow"], reason: SwitchReason
    ) -> None:
        """A loaded, warmed-up version: serve it from the next batch boundary (``swap``) or
        score it in shadow (``shadow``).

        Raises:
            VersionRefused: reason ``busy``: a second version is resident already (a
                predecessor in probation, a candidate, or a pending switch).
        """
        with self._lock:
            self._room_for(version.name)
            if mode == "shadow":
                assert self._config is not None
                self._candidate = version
                self._shadow = ShadowRecord(self._config.shadow)
                self._bindings = self._make_bindings()
                self._event(
                    "shadowing", version.name, f"scores {self._config.shadow.sample:.0%} of batches"
                )
            else:
                self._pending = (version, reason)
                self._event("loaded", version.name, f"switches at the next batch ({reason})")

    def check_room(self, name: str) -> None:
        """Refuse to load ``name`` while two versions are resident (checked before loading).

        Raises:
            VersionRefused: reason ``busy``.
        """
        with self._lock:
            self._room_for(name)

    def _room_for(self, name: str) -> None:
        busy = (
            ("waits for the next batch boundary", self._pending[0].name if self._pending else None),
            (
                "is in probation (its predecessor stays resident)",
                self._serving.name if self._previous else None,
            ),
            ("is scoring in shadow", self._candidate.name if self._candidate else None),
        )
        for why, holder in busy:
            if holder is not None:
                raise VersionRefused(
                    "busy", f"version {name}: at most two versions are resident; {holder} {why}"
                )

    def use(self, name: str) -> str | None:
        """The operator asks for version ``name``: switch to a resident one (the shadow
        candidate: promoted; the predecessor in probation: rolled back to). Returns what was
        done, or None when ``name`` is not resident (the caller loads it).

        Raises:
            VersionRefused: reason ``busy`` when it is not resident and no room is left.
        """
        with self._lock:
            if self._pending is not None and self._pending[0].name == name:
                return "pending"
            if self._serving.name == name:
                if self._pending is not None:  # the operator keeps it: no switch after all
                    self._event("cancelled", self._pending[0].name, f"the operator kept {name}")
                    self._pending = None
                return "serving"
            if (
                self._candidate is not None
                and self._candidate.name == name
                and self._previous is None
            ):
                self._pending = (self._candidate, "operator")
                return "promoted"
            if self._previous is not None and self._previous.name == name:
                self._metrics.model_rollbacks.labels(self.topic, "operator").inc()
                self.refused.add(self._serving.name)
                self._event("rolled_back", self._serving.name, f"operator asked for {name}")
                self._pending = (self._previous, "rollback")
                return "rolled_back"
            self._room_for(name)
            return None

    def drop_candidate(self, name: str) -> str | None:
        """Stop scoring ``name`` in shadow and let it go (polling does not load it again);
        its name, or None when it is not the candidate (nor waiting for its promotion)."""
        with self._lock:
            candidate = self._candidate
            if candidate is None or candidate.name != name:
                return None
            if self._pending is not None and self._pending[0] is candidate:
                self._pending = None
            self._candidate, self._shadow = None, None
            self._bindings = self._make_bindings()
            self.refused.add(name)
            self._event("dropped", name, "shadow scoring stopped by the operator")
            return name

    def refuse(self, name: str, error: VersionRefused, attempt: int = 1) -> None:
        """Version ``name`` could not be loaded on its ``attempt``-th try (1: the first):
        remembered (polling skips it until its files change), counted, logged."""
        with self._lock:
            self.refused.add(name)
            self._event("refused", name, f"{error.reason} (try {attempt}): {error}")
        tried = "first" if attempt == 1 else "retry"
        self._metrics.model_refused.labels(self.topic, error.reason, tried).inc()
        log.warning(
            "model version refused",
            topic=self.topic,
            version=name,
            reason=error.reason,
            attempt=attempt,
            error=str(error),
            serving=self._serving.name,
        )

    def state(self) -> dict[str, Any]:
        """What ``GET /models`` shows for the pipeline."""
        with self._lock:
            return {
                "serving": self._serving.name,
                "previous": self._previous.name if self._previous else None,
                "candidate": self._candidate.name if self._candidate else None,
                "pending": self._pending[0].name if self._pending else None,
                "probation": None if self._probation is None else self._probation.describe(),
                "shadow": None if self._shadow is None else self._shadow.describe(),
                "refused": sorted(self.refused),
                "last_switch_pause_ms": (
                    None if self.last_pause_s is None else round(self.last_pause_s * 1000, 3)
                ),
                "median_batch_gap_ms": (
                    round(float(np.median(self._gaps_s)) * 1000, 3) if self._gaps_s else None
                ),
                "events": [asdict(e) for e in self.events],
            }

    def _event(self, kind: str, version: str, detail: str) -> None:
        at = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        self.events.append(ModelEvent(at, kind, version, detail))
        log.info("model event", topic=self.topic, kind=kind, version=version, detail=detail)
