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
  row, until every row either ran inside a part that succeeded or failed alone; only the rows
  that failed alone are dead-lettered (stage ``model``). With ``k`` poison rows among ``n``
  at most ``2k`` parts fail per level of halving, so the extra calls are at most about
  ``2k * log2(n)``. A batch may spend at most ``POISON_ROWS * 2 * ceil(log2(n))`` extra calls
  on this (enough for :data:`POISON_ROWS` poison rows); the rows of parts still unresolved when
  that budget is spent are dead-lettered with their part's error (a batch where most rows fail is
  not bisected forever).

**Broken model.** When :attr:`PartRunner.broken_after_rows` rows in a row failed (across
batches, with no row succeeding in between: rows dead-lettered unresolved count too, unless a
call on some rows of their batch succeeded), the model is judged broken. A model that fails on
every row is a fault of the system, not of the records, so under the default policy ``hold``
no row of that batch is dead-lettered: :class:`ModelHeld` is raised and the device worker keeps
the batch and tries it again with backoff (rebound to the serving version first: a rollback,
or a new version, takes effect on it; :mod:`streamproc.device.hold`). Each try of a model
judged broken runs the batch whole, then its first and last rows alone; if all three fail the
batch is held again, else the model is no longer judged broken and the batch is narrowed down
as any other. Under ``dead_letter`` a later failing batch is not bisected either: the same
three calls, and if they fail the whole batch is dead-lettered (two poison rows at exactly
those places while the model is judged broken are the one way a valid row of that batch is
dead-lettered with them). Under ``stop`` the verdict raises :class:`BrokenModelError`: the
pipeline stops with a non-zero exit and the batch is neither produced nor dead-lettered (its
offsets stay uncommitted). Rows that failed before the verdict (fewer than
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
from typing import Literal

import torch

from streamproc.errors import FatalPipelineError

POISON_ROWS = 4
"""Poison rows a batch is guaranteed to have isolated (the per-batch budget of extra calls is
``POISON_ROWS * 2 * ceil(log2(n))``)."""

BROKEN_AFTER_ROWS = 16
"""Rows failing in a row (none succeeding in between) after which the model is judged broken
(under ``dead_letter`` and ``stop``: or the slab's rows, if fewer)."""

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


@dataclass
class Outcome:
    """What running one batch took.

    Attributes:
        failed: row -> the error it failed with (alone, or in its part when not isolated).
        calls: model calls made (1 when the batch ran whole).
        isolated: rows that failed alone.
        out_of_memory: out-of-memory errors met (each part re-run in pieces).
        ran: rows that ran in a call that succeeded.
        broken: the model was judged broken on this batch (policy ``dead_letter``; under
            ``hold`` such a batch raises :class:`ModelHeld` instead).
    """

    failed: dict[int, str] = field(default_factory=dict)
    calls: int = 0
    isolated: int = 0
    out_of_memory: int = 0
    ran: int = 0
    broken: bool = False


Call = Callable[[int, int], None]
"""``call(lo, hi)``: run the model on rows ``lo..hi-1`` and write their outputs in place;
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
        self._release_memory = release_memory
        self._on_cap = on_cap
        self._oom_tries = oom_tries
        self._clock = clock
        self._sleep = sleep
        self._label = label

    def run(self, n: int, call: Call) -> Outcome:
        """Run rows ``0..n-1`` (``n >= 1``) through ``call``; returns what failed.

        Raises:
            DeviceOutOfMemoryError: one row does not fit on the device.
            BrokenModelError: the model is judged broken and the policy is ``stop``.
            ModelHeld: the model is judged broken and the policy is ``hold`` (no row failed).
        """
        outcome = Outcome()
        failures = self._run_parts(0, n, call, outcome)
        if failures and self.broken:
            failures = self._probe(n, failures, call, outcome)
        self._narrow(n, failures, call, outcome)
        self._judge(n, outcome)
        if self.cap.quiet(self._clock()):
            self._on_cap(self.cap.limit)
        return outcome

    def _run_parts(self, lo: int, hi: int, call: Call, outcome: Outcome) -> list[Failure]:
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

    def _probe(
        self, n: int, failures: list[Failure], call: Call, outcome: Outcome
    ) -> list[Failure]:
        """The model is judged broken: run the first and last failing rows alone. Both fail:
        under ``hold`` :class:`ModelHeld` is raised, else every failing part is taken as
        failing whole (returned unchanged, not narrowed further). Else the model works again:
        the failing parts minus the probed rows that succeeded are returned for narrowing."""
        first, last = failures[0], failures[-1]
        rows = sorted({first.lo, last.hi - 1})
        probed = {row: self._run_parts(row, row + 1, call, outcome) for row in rows}
        if all(probed.values()):
            if self.on_model_failure == "hold":
                raise ModelHeld(n, last.error)
            outcome.broken = True
            for part in failures:
                for row in range(part.lo, part.hi):
                    outcome.failed[row] = part.error
            return []
        self.broken = False
        for row, failed in probed.items():
            for part in failed:  # the probed row failed alone
                outcome.failed[row] = part.error
                outcome.isolated += 1
        rest: list[Failure] = []
        for part in failures:  # the probed rows are resolved either way
            lo = part.lo + (part.lo in probed)
            hi = part.hi - (part.hi - 1 in probed and part.hi - 1 >= lo)
            if lo < hi:
                rest.append(Failure(lo, hi, part.error))
        return rest

    def _narrow(self, n: int, failures: list[Failure], call: Call, outcome: Outcome) -> None:
        """Halve failing parts (row by row from three rows down) until each row ran in a
        part that succeeded or failed alone, within the batch's budget of extra calls."""
        budget = POISON_ROWS * 2 * max(1, math.ceil(math.log2(max(n, 2))))
        spent_at = outcome.calls
        queue = deque(failures)
        while queue:
            part = queue.popleft()
            size = part.hi - part.lo
            if size == 1:
                outcome.failed[part.lo] = part.error
                outcome.isolated += 1
                continue
            if outcome.calls - spent_at + (size if size <= 3 else 2) > budget:
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

    def _judge(self, n: int, outcome: Outcome) -> None:
        """Count rows failing in a row; judge the model broken past ``broken_after_rows``."""
        failed = len(outcome.failed)
        if failed < n or outcome.ran:  # some row succeeded (its part, if unresolved, failed)
            self._failing_in_a_row = 0
            if not outcome.broken:
                self.broken = False
            return
        self._failing_in_a_row += failed
        if self._failing_in_a_row < self.broken_after_rows:
            return
        if self.on_model_failure == "stop":
            raise BrokenModelError(
                f"the model failed for every one of the last {self._failing_in_a_row} rows "
                f"on device {self._label} (last error: {next(iter(outcome.failed.values()))}); "
                "worker.on_model_failure is stop"
            )
        self.broken = True
        if self.on_model_failure == "hold":
            raise ModelHeld(n, next(iter(outcome.failed.values())))


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
