"""When a model call raises: find the rows at fault, or make the batch fit in device memory.

The device thread runs each batch through a :class:`PartRunner`. A batch that runs whole costs
one model call and nothing else. When the call raises, the class of the error decides:

* **Out of memory** (``torch.OutOfMemoryError``; ``torch.cuda.OutOfMemoryError`` is the same
  class) is never the rows' fault. The device's cache is released (``torch.cuda.empty_cache()``
  where CUDA is present), the lane's :class:`BatchCap` falls to half the part that did not fit,
  and the part runs again in pieces of at most the cap, each written into its own rows of the
  output buffers. No row is dead-lettered for it. A single row that still does not fit after
  ``oom_tries`` tries (cache released, 50 ms doubling backoff between them) cannot run at all:
  :class:`DeviceOutOfMemoryError` stops the pipeline with a message naming the device.
* **Anything else** is a row the model cannot handle (a poison row) or a broken model. The
  failing part is split in halves, recursively, and parts of up to three rows are run row by
  row, until every row either ran inside a part that succeeded or failed alone; a row that
  failed alone is tried alone :data:`RETRIES_ALONE` more time (a model that fails now and then
  must not dead-letter a valid row), and only the rows that failed alone every time are
  dead-lettered (stage ``model``). With ``k`` poison rows among ``n`` at most ``2k`` parts
  fail per level of halving, so the extra calls are at most about ``2k * log2(n) + k``. A
  batch may spend at most ``POISON_ROWS * 2 * ceil(log2(n))`` extra calls on the halving
  (enough for :data:`POISON_ROWS` poison rows; the tries again of single rows are not charged
  to it); the rows of parts still unresolved when that budget is spent are dead-lettered with
  their part's error (a batch where most rows fail is not bisected forever).

**The canary.** A live batch is run with the launcher's canary (:class:`Canary`): after a
batch that ran, one of its rows that ran in a call that succeeded is copied into one staging
row of its own (at most once per :data:`CANARY_REFRESH_S`). It tells a broken model from
poison rows: when every call of a batch failed, the model runs the kept row alone. It runs:
the model works, the rows are poison and are dead-lettered (never held, however many). It
fails: the model is judged broken at once.

**Broken model.** Without a kept row (no row has run since start), the model is judged broken
when :attr:`PartRunner.broken_after_rows` rows in a row failed (across batches, with no row
succeeding in between: rows dead-lettered unresolved count too, unless a call on some rows of
their batch succeeded). A model that fails on every row is a fault of the system, not of the
records, so under the default policy ``hold`` no row of that batch is dead-lettered:
:class:`ModelHeld` is raised and the device worker keeps the batch and tries it again with
backoff (rebound to the serving version first: a rollback, or a new version, takes effect on
it; :mod:`streamproc.device.hold`). Each try of a model judged broken runs the batch whole;
if it fails, the canary runs (it fails: held again; two calls a try) and, when it runs, the
batch is narrowed down as any other. Without a canary the try runs the batch's first and last
rows alone and then narrows the batch in full (held again only if no call of it ran: poison
rows at both ends do not keep a batch held once the model works; when the model comes back
during that narrowing, the rows that failed before it did are narrowed again, so only rows
that fail once it works are failed). Under ``dead_letter`` a
later failing batch is not bisected either: the batch and the canary, or without one its
first and last rows, and if they fail the whole batch is dead-lettered (``RunOutcome.broken``).
Under ``stop`` the verdict raises :class:`BrokenModelError`: the pipeline stops with a
non-zero exit and the batch is neither produced nor dead-lettered (its offsets stay
uncommitted). Without a canary, rows that failed before the verdict (fewer than
``broken_after_rows``, in batches smaller than that) are poison rows as far as anyone can tell
then, and are dead-lettered under every policy.

Thread ownership: a :class:`PartRunner` and its :class:`BatchCap` belong to one device worker
and are used on its device thread only (warm-up and the start-up timings run there too).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from streamproc.errors import FatalPipelineError

POISON_ROWS = 4
"""Poison rows a batch is guaranteed to have isolated (the per-batch budget of extra calls is
``POISON_ROWS * 2 * ceil(log2(n))``)."""

BROKEN_AFTER_ROWS = 16
"""Rows failing in a row (none succeeding in between) after which the model is judged broken
(under ``dead_letter`` and ``stop``: or the slab's rows, if fewer)."""

CANARY_REFRESH_S = 60.0
"""Seconds between two refreshes of the kept known-good row (the canary): at most one row copy
per this period, on a batch that ran."""

RETRIES_ALONE = 1
"""Further tries of a row that failed alone before it is failed (a model failing now and
then must not dead-letter a valid row)."""

OnModelFailure = Literal["hold", "dead_letter", "stop"]
ON_MODEL_FAILURE: tuple[OnModelFailure, ...] = ("hold", "dead_letter", "stop")


class DeviceOutOfMemoryError(FatalPipelineError):
    """The device is out of memory for a batch of one row: the model cannot run there."""


class BrokenModelError(FatalPipelineError):
    """The model fails for every row and ``worker.on_model_failure`` is ``stop``."""


class ModelHeld(Exception):
    """The model is judged broken and ``worker.on_model_failure`` is ``hold``: no row of the
    batch is failed; the worker keeps the batch and tries it again (not an error of the
    pipeline: it never reaches ``on_fatal``).

    Attributes:
        rows: the batch's rows.
        error: the last error the model raised, as text.
    """

    def __init__(self, rows: int, error: str) -> None:
        super().__init__(f"the model failed for every row of a batch of {rows}: {error}")
        self.rows = rows
        self.error = error


def is_out_of_memory(exc: BaseException) -> bool:
    """True for a device out-of-memory error (``torch.OutOfMemoryError``, which
    ``torch.cuda.OutOfMemoryError`` is in the torch versions we support)."""
    return isinstance(exc, torch.OutOfMemoryError)


@dataclass
class BatchCap:
    """The largest batch a device may run now (rows), lowered by out-of-memory errors.

    ``ceiling`` is the largest batch that fitted at warm-up (the slab's rows when nothing
    failed); it stays for the process's life. ``limit`` starts there; an out-of-memory error on
    a part of ``size`` rows lowers it to ``max(1, size // 2)``; after ``recovery_s`` seconds
    without one it doubles (never above ``ceiling``), and again after each further
    ``recovery_s`` without one, until it is back at the ceiling.

    Args:
        ceiling: rows (>= 1).
        recovery_s: quiet seconds before each raise (> 0).
    """

    ceiling: int
    recovery_s: float
    limit: int = 0
    _quiet_since_s: float = field(default=-math.inf)

    def __post_init__(self) -> None:
        if self.ceiling < 1 or not self.recovery_s > 0:
            raise ValueError(f"ceiling ({self.ceiling}) must be >= 1, recovery_s > 0")
        self.limit = self.limit or self.ceiling

    def fit(self, rows: int) -> None:
        """Warm-up found ``rows`` the largest batch that fits: ceiling and limit move there."""
        self.ceiling = self.limit = max(1, rows)

    def out_of_memory(self, size: int, now_s: float) -> bool:
        """A part of ``size`` rows ran out of memory at ``now_s``; True if the limit fell."""
        self._quiet_since_s = now_s
        lowered = max(1, min(self.limit, size // 2))
        changed = lowered != self.limit
        self.limit = lowered
        return changed

    def quiet(self, now_s: float) -> bool:
        """Called after each batch; True if the limit rose (doubled, at most the ceiling)."""
        if self.limit >= self.ceiling or now_s - self._quiet_since_s < self.recovery_s:
            return False
        self.limit = min(self.ceiling, self.limit * 2)
        self._quiet_since_s = now_s
        return True


@dataclass(frozen=True, slots=True)
class Failure:
    """Rows ``lo..hi-1`` failed together (not yet narrowed down) with ``error`` (the repr of
    the exception: the traceback, and the tensors it holds, are not kept)."""

    lo: int
    hi: int
    error: str
    tries: int = 1
    """Tries of this part so far (a one-row part is tried ``1 + RETRIES_ALONE`` times)."""


@dataclass
class RunOutcome:
    """What running one batch took.

    Attributes:
        failed: row -> the error it failed with (alone, or in its part when not isolated).
        calls: model calls made (1 when the batch ran whole).
        isolated: rows that failed alone.
        out_of_memory: out-of-memory errors met (each part re-run in pieces).
        ran: rows that ran in a call that succeeded.
        broken: the model was judged broken on this batch (policy ``dead_letter``; under
            ``hold`` such a batch raises :class:`ModelHeld` instead).
        good: a row that ran in a call that succeeded (-1: none).
    """

    failed: dict[int, str] = field(default_factory=dict)
    calls: int = 0
    isolated: int = 0
    out_of_memory: int = 0
    ran: int = 0
    broken: bool = False
    good: int = -1


Call = Callable[[int, int], None]
"""``call(lo, hi)``: run the model on rows ``lo..hi-1`` and write their outputs in place;
raises what the model raised."""


class Canary(Protocol):
    """The known-good probe of a part runner: a copy of one input row the model ran on (one
    staging row, kept by the launcher; see :mod:`streamproc.device.launch`)."""

    def keep(self, row: int) -> None:
        """Copy row ``row`` of the batch running now (it ran in a call that succeeded)."""

    def run(self) -> None:
        """Run the model of the batch running now on the kept row alone (outputs discarded);
        raises what the model raised."""


class PartRunner:
    """Runs batches through the model, narrowing failures down (see the module docstring).

    Args:
        cap: the device's batch cap (lowered here on out-of-memory errors).
        rows: the staging slab's rows (the largest batch).
        on_model_failure: ``hold``, ``dead_letter`` or ``stop`` (``worker.on_model_failure``).
        release_memory: frees the device's cached memory before a re-run.
        on_cap: called with the new limit whenever the cap moves.
        oom_tries: tries of a one-row part before :class:`DeviceOutOfMemoryError`.
        clock: monotonic seconds; sleep: waits seconds (both injected for tests).
    """

    def __init__(
        self,
        cap: BatchCap,
        rows: int,
        on_model_failure: OnModelFailure = "hold",
        release_memory: Callable[[], None] = lambda: None,
        on_cap: Callable[[int], None] = lambda limit: None,
        oom_tries: int = 4,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        label: str = "device",
    ) -> None:
        if on_model_failure not in ON_MODEL_FAILURE:
            raise ValueError(f"on_model_failure must be one of {ON_MODEL_FAILURE}")
        self.cap = cap
        self.on_model_failure = on_model_failure
        # under hold a verdict holds the lane: never on fewer rows than BROKEN_AFTER_ROWS (a
        # lane of small batches would otherwise hold on one poison batch)
        small = rows if on_model_failure != "hold" else BROKEN_AFTER_ROWS
        self.broken_after_rows = max(1, min(BROKEN_AFTER_ROWS, small))
        self.broken = False
        self._failing_in_a_row = 0
        self._kept_at_s = -math.inf  # when the canary last kept a row (-inf: never)
        self._release_memory = release_memory
        self._on_cap = on_cap
        self._oom_tries = oom_tries
        self._clock = clock
        self._sleep = sleep
        self._label = label

    def run(self, n: int, call: Call, canary: Canary | None = None) -> RunOutcome:
        """Run rows ``0..n-1`` (``n >= 1``) through ``call``; returns what failed.

        ``canary`` (the launcher's, live batches only): after a batch that ran, a row of it is
        kept (at most once per :data:`CANARY_REFRESH_S`); when every call of a batch failed
        (or a try while judged broken failed), the model runs the kept row alone to tell a
        broken model from poison rows. Without one (warm-up and start-up timings), or before
        any row ran, the count of rows failing in a row decides.

        Raises:
            DeviceOutOfMemoryError: one row does not fit on the device.
            BrokenModelError: the model is judged broken and the policy is ``stop``.
            ModelHeld: the model is judged broken and the policy is ``hold`` (no row failed).
        """
        outcome = RunOutcome()
        kept = canary if canary is not None and self._kept_at_s > -math.inf else None
        works = False  # the canary ran on this batch: the model works
        narrowed_broken = False  # narrowed in full while judged broken (hold, no canary)
        failures = self._run_parts(0, n, call, outcome)
        if failures and self.broken and not outcome.ran:
            if kept is not None:
                failures = self._check(n, failures, kept, outcome)
                works = not outcome.broken
            else:
                failures = self._probe(failures, call, outcome)
                narrowed_broken = self.broken
        self._narrow(n, failures, call, outcome)
        if narrowed_broken and outcome.ran and outcome.failed:
            self._narrow_again(n, call, outcome)
        self._judge(n, outcome, kept, works)
        now_s = self._clock()
        if canary is not None and outcome.ran and now_s - self._kept_at_s >= CANARY_REFRESH_S:
            canary.keep(outcome.good)
            self._kept_at_s = now_s
        if self.cap.quiet(now_s):
            self._on_cap(self.cap.limit)
        return outcome

    def _run_parts(self, lo: int, hi: int, call: Call, outcome: RunOutcome) -> list[Failure]:
        """Run rows ``lo..hi-1`` in parts of at most the cap (re-running what ran out of
        memory in smaller parts); returns the parts that raised anything else."""
        failures: list[Failure] = []
        todo = [(lo, hi)]
        single_tries = 0
        while todo:
            a, b = todo.pop()
            limit = self.cap.limit
            if b - a > limit:
                todo.extend((s, min(s + limit, b)) for s in reversed(range(a, b, limit)))
                continue
            outcome.calls += 1
            error = _attempt(call, a, b)
            if error is None:
                outcome.ran += b - a
                outcome.good = a
                continue
            if not error.startswith(_OOM_PREFIX):
                failures.append(Failure(a, b, error))
                continue
            outcome.out_of_memory += 1
            self._release_memory()
            if b - a == 1:
                single_tries += 1
                if single_tries >= self._oom_tries:
                    raise DeviceOutOfMemoryError(
                        f"device {self._label} is out of memory for a batch of one row after "
                        f"{single_tries} tries (cache released between them): "
                        f"{error.removeprefix(_OOM_PREFIX)}"
                    )
                self._sleep(0.05 * 2 ** (single_tries - 1))
            elif self.cap.out_of_memory(b - a, self._clock()):
                self._on_cap(self.cap.limit)
            todo.append((a, b))
        failures.sort(key=lambda f: f.lo)
        return failures

    def _canary_error(self, canary: Canary, outcome: RunOutcome) -> str | None:
        """Run the kept row alone (one call); None if it ran, else the error as text."""
        outcome.calls += 1
        try:
            canary.run()
        except Exception as exc:
            return repr(exc)
        return None

    def _check(
        self, n: int, failures: list[Failure], canary: Canary, outcome: RunOutcome
    ) -> list[Failure]:
        """The model is judged broken and the batch failed whole: run the canary. It runs:
        the model works again, the failing parts are returned for narrowing. It fails: under
        ``hold`` :class:`ModelHeld` is raised, else every row is failed with its part's error
        (``outcome.broken``) and nothing is left to narrow."""
        error = self._canary_error(canary, outcome)
        if error is None:
            self.broken = False
            return failures
        return self._broken_batch(n, failures, error, outcome)

    def _broken_batch(
        self, n: int, failures: list[Failure], error: str, outcome: RunOutcome
    ) -> list[Failure]:
        """A batch of a model judged broken: held (``hold``: :class:`ModelHeld`), or every
        failing row failed with its part's error (``dead_letter``); returns no part."""
        if self.on_model_failure == "hold":
            raise ModelHeld(n, error)
        outcome.broken = True
        for part in failures:
            for row in range(part.lo, part.hi):
                outcome.failed[row] = part.error
        return []

    def _probe(self, failures: list[Failure], call: Call, outcome: RunOutcome) -> list[Failure]:
        """The model is judged broken and no canary is kept: run the first and last failing
        rows alone. Both fail: under ``dead_letter`` every failing part is taken as failing
        whole (nothing returned); under ``hold`` the rest is narrowed in full all the same
        (held again only if no call runs: poison rows at both ends do not keep it held).
        Else the model works again. The failing parts are returned for narrowing (a probed row
        that failed: a one-row part, tried once more there)."""
        first, last = failures[0], failures[-1]
        rows = sorted({first.lo, last.hi - 1})
        probed = {row: self._run_parts(row, row + 1, call, outcome) for row in rows}
        if all(probed.values()):
            if self.on_model_failure != "hold":
                return self._broken_batch(0, failures, last.error, outcome)
        else:
            self.broken = False
        rest: list[Failure] = [part for failed in probed.values() for part in failed]
        for part in failures:  # the probed rows are resolved either way
            lo = part.lo + (part.lo in probed)
            hi = part.hi - (part.hi - 1 in probed and part.hi - 1 >= lo)
            if lo < hi:
                rest.append(Failure(lo, hi, part.error))
        return rest

    def _narrow(self, n: int, failures: list[Failure], call: Call, outcome: RunOutcome) -> None:
        """Halve failing parts (row by row from three rows down) until each row ran in a
        part that succeeded or failed alone ``1 + RETRIES_ALONE`` times, within the batch's
        budget of extra calls (the tries again of single rows are not charged to it)."""
        budget = POISON_ROWS * 2 * max(1, math.ceil(math.log2(max(n, 2))))
        spent_at = outcome.calls
        retries = 0
        queue = deque(failures)
        while queue:
            part = queue.popleft()
            size = part.hi - part.lo
            if size == 1:
                if part.tries <= RETRIES_ALONE:  # a model failing now and then: once more
                    retries += 1
                    again = self._run_parts(part.lo, part.hi, call, outcome)
                    queue.extend(Failure(f.lo, f.hi, f.error, part.tries + 1) for f in again)
                    continue
                outcome.failed[part.lo] = part.error
                outcome.isolated += 1
                continue
            spent = outcome.calls - spent_at - retries
            if spent + (size if size <= 3 else 2) > budget:
                for row in range(part.lo, part.hi):  # budget spent: not narrowed further
                    outcome.failed[row] = part.error
                continue
            if size <= 3:
                pieces = [(row, row + 1) for row in range(part.lo, part.hi)]
            else:
                mid = (part.lo + part.hi) // 2
                pieces = [(part.lo, mid), (mid, part.hi)]
            for lo, hi in pieces:
                queue.extend(self._run_parts(lo, hi, call, outcome))

    def _narrow_again(self, n: int, call: Call, outcome: RunOutcome) -> None:
        """The model came back while a batch of a model judged broken was narrowed in full:
        the rows that failed before it did failed for the model, not for themselves. Every
        failed row is narrowed again (a fresh budget; runs of adjacent rows as one part), now
        that the model runs: only the rows that fail again are failed."""
        rows = sorted(outcome.failed)
        parts: list[Failure] = []
        for row in rows:
            if parts and parts[-1].hi == row:
                parts[-1] = Failure(parts[-1].lo, row + 1, parts[-1].error)
            else:
                parts.append(Failure(row, row + 1, outcome.failed[row]))
        outcome.failed.clear()
        outcome.isolated = 0
        self._narrow(n, parts, call, outcome)

    def _judge(self, n: int, outcome: RunOutcome, canary: Canary | None, works: bool) -> None:
        """After a batch where every call failed: the canary runs (the model works: the rows
        were poison; it fails: the model is judged broken at once), or without one, count
        rows failing in a row and judge the model broken past ``broken_after_rows``.
        ``works``: the canary ran on this batch already (the rows are poison)."""
        failed = len(outcome.failed)
        if failed < n or outcome.ran or works:  # some row (or the canary) succeeded
            self._failing_in_a_row = 0
            if not outcome.broken:
                self.broken = False
            return
        if outcome.broken:  # judged broken before this batch, and still
            return
        self._failing_in_a_row += failed
        error = next(iter(outcome.failed.values()))
        if canary is not None:
            canary_error = self._canary_error(canary, outcome)
            if canary_error is None:  # the model runs a row it ran before: poison rows
                self._failing_in_a_row = 0
                return
            error = canary_error
        elif self._failing_in_a_row < self.broken_after_rows:
            return
        if self.on_model_failure == "stop":
            raise BrokenModelError(
                f"the model failed for every one of the last {self._failing_in_a_row} rows "
                f"on device {self._label}"
                + (" and on a row it ran before" if canary is not None else "")
                + f" (last error: {error}); worker.on_model_failure is stop"
            )
        self.broken = True
        if self.on_model_failure == "hold":
            raise ModelHeld(n, error)


_OOM_PREFIX = "out of memory: "


def _attempt(call: Call, lo: int, hi: int) -> str | None:
    """``call(lo, hi)``; None if it returned, else the error as text (out-of-memory errors
    prefixed with :data:`_OOM_PREFIX`). The exception is dropped here, so its traceback (and
    the device memory its frames hold) is freed before any re-run."""
    try:
        call(lo, hi)
    except Exception as exc:
        text = repr(exc)
        return _OOM_PREFIX + text if is_out_of_memory(exc) else text
    return None
