"""The model version a batch runs on, and what running it on that version tells.

The dispatcher binds each cut batch to a :class:`ModelBinding` (the pipeline's
:class:`~streamproc.models.versions.ModelVersions` decides which); the launcher runs it through
a :class:`BoundCall`:

* the bound version's batch function; where the binding has a ``fallback`` (the predecessor,
  still resident while the new version is in probation) and the bound version raises (or
  returns other than one tensor per output with the batch's rows), the fallback runs the same
  rows instead and the batch carries the fallback's version (a valid record never goes to the
  dead-letter topic for a new version's fault); once fallen back, the rest of the batch's calls
  (its parts) go to the fallback too. Where the fallback raises as well, the rows are at fault
  (poison rows), not the new version: the error goes to the part runner and the batch does
  not count as one the new version raised on. An out-of-memory error goes to the part runner
  at once (smaller parts, not another model);
* ``shadow`` (a candidate scoring this sampled batch): beside the serving call on the whole
  batch, on the same device and stream, the candidate runs on the same rows (before or after
  it, alternating batch by batch: the second call finds the rows in the caches); the rows
  whose outputs all agree (``torch.isclose``) are counted on the device; neither its outputs
  nor its errors reach the results.

Times are read once the batch is done (on CUDA from timing events recorded on the batch's
stream; on a CPU from the clock around the synchronous calls).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamproc.device.backend import Stopwatch
from streamproc.device.recovery import is_out_of_memory
from streamproc.errors import ModelError
from streamproc.workloads.base import ModelFn


@dataclass(frozen=True)
class ModelBinding:
    """One batch's model version.

    Attributes:
        version: the version's name (``streamproc.model.version`` header).
        fn: its batch function on the batch's device.
        fallback: the predecessor on the same device (a new version in probation), None
            otherwise.
        shadow: a candidate that also scores this batch (sampled), None otherwise.
        atol, rtol: a shadow row agrees when every output element is ``isclose`` with these.
        shadow_first: the candidate runs before the serving version on this batch (the
            binder alternates: the second call finds the rows in the caches).
    """

    version: str
    fn: ModelFn
    fallback: ModelBinding | None = None
    shadow: ModelBinding | None = None
    atol: float = 1e-4
    rtol: float = 1e-3
    shadow_first: bool = False


@dataclass(frozen=True)
class ShadowOutcome:
    """A candidate's comparison on one batch.

    Attributes:
        version: the candidate's version.
        rows: rows compared (the batch's size).
        agreed: rows whose outputs all agreed with the serving version's (0 when it raised).
        serving_s: seconds of the serving version's call on the batch.
        shadow_s: seconds of the candidate's call (0 when it raised).
        error: the candidate's exception text, None when it ran.
    """

    version: str
    rows: int
    agreed: int
    serving_s: float
    shadow_s: float
    error: str | None = None


@dataclass
class _Shadowed:
    """A shadowed call's record: its clock (marks 0, 1, 2 around the two calls), which ran
    first, and the agreeing-row count (a device tensor) or the candidate's error."""

    clock: Stopwatch
    shadow_first: bool
    agreed: torch.Tensor | None
    error: str | None


class BoundCall:
    """The batch function of one launch of a bound batch (the launching thread only).

    Args:
        binding: the batch's binding.
        rows: the batch's size (the shadow runs only on a call over all of them).
    """

    def __init__(self, binding: ModelBinding, rows: int) -> None:
        self._binding = binding
        self._rows = rows
        self.version = binding.version
        self.raised = False
        self._active: ModelBinding = binding
        self._shadowed: _Shadowed | None = None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        active = self._active
        shadow = active.shadow
        if shadow is not None and self._shadowed is None and x.shape[0] == self._rows:
            return self._with_shadow(active, shadow, x)
        try:
            return _checked(active.fn(x), x.shape[0])
        except Exception as exc:
            fallback = active.fallback
            if fallback is None or is_out_of_memory(exc):
                raise  # the part runner's: poison rows, or smaller parts for the memory
            try:
                outputs = _checked(fallback.fn(x), x.shape[0])
            except Exception:
                raise exc from None  # the predecessor fails on these rows too: the input's fault
            self.raised = True
            self._active = fallback  # this batch's later calls (its parts) too
            self.version = fallback.version
            return outputs

    def _with_shadow(
        self, serving: ModelBinding, shadow: ModelBinding, x: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """The serving call and the candidate's on the same rows, in the binding's order (the
        second call finds the rows in the caches: alternating keeps the latency ratio fair).
        A candidate is never in probation's company: no fallback here."""
        clock = Stopwatch(x.device)
        clock.mark()
        if serving.shadow_first:
            candidate, error = _run(shadow, x)
            clock.mark()
            outputs = _checked(serving.fn(x), x.shape[0])
        else:
            outputs = _checked(serving.fn(x), x.shape[0])
            clock.mark()
            candidate, error = _run(shadow, x)
        clock.mark()
        agreed = None
        if candidate is not None:
            agreed, error = _agreement(outputs, candidate, serving)
        self._shadowed = _Shadowed(clock, serving.shadow_first, agreed, error)
        return outputs

    @property
    def bound_version(self) -> str:
        """The version the batch was bound to (``version`` is the one that made it)."""
        return self._binding.version

    def shadow_outcome(self) -> ShadowOutcome | None:
        """The shadow's comparison, once the batch is done (None: not shadowed)."""
        record = self._shadowed
        if record is None:
            return None
        shadow = self._binding.shadow
        assert shadow is not None
        first, second = record.clock.seconds(0, 1), record.clock.seconds(1, 2)
        serving_s, shadow_s = (second, first) if record.shadow_first else (first, second)
        if record.error is not None or record.agreed is None:
            return ShadowOutcome(shadow.version, self._rows, 0, serving_s, 0.0, record.error)
        return ShadowOutcome(
            shadow.version, self._rows, int(record.agreed.item()), serving_s, shadow_s
        )


def _checked(outputs: tuple[torch.Tensor, ...], rows: int) -> tuple[torch.Tensor, ...]:
    """``outputs`` when each is a tensor of ``rows`` rows.

    Raises:
        ModelError: otherwise (a version that breaks the row contract on some batch sizes is
            caught here, where its predecessor can still run the batch).
    """
    if not all(isinstance(out, torch.Tensor) and out.shape[0] == rows for out in outputs):
        described = [
            tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__ for o in outputs
        ]
        raise ModelError(f"model returned {described} for {rows} rows")
    return outputs


def _run(
    shadow: ModelBinding, x: torch.Tensor
) -> tuple[tuple[torch.Tensor, ...] | None, str | None]:
    """The candidate's outputs on ``x``, or its error (which never reaches the results)."""
    try:
        return tuple(shadow.fn(x)), None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def _agreement(
    outputs: tuple[torch.Tensor, ...], candidate: tuple[torch.Tensor, ...], serving: ModelBinding
) -> tuple[torch.Tensor | None, str | None]:
    """The count of rows whose outputs all agree (``isclose`` with the binding's tolerances; a
    device tensor, read once the batch is done), or why they cannot be compared."""
    if len(candidate) != len(outputs):
        return None, f"{len(candidate)} outputs, serving has {len(outputs)}"
    n = outputs[0].shape[0] if outputs else 0
    agree = torch.ones(n, dtype=torch.bool, device=outputs[0].device if outputs else None)
    for mine, theirs in zip(outputs, candidate, strict=True):
        if not isinstance(theirs, torch.Tensor) or theirs.shape != mine.shape:
            shape = tuple(theirs.shape) if isinstance(theirs, torch.Tensor) else type(theirs)
            return None, f"output shape {shape}, serving {tuple(mine.shape)}"
        close = torch.isclose(theirs.float(), mine.float(), rtol=serving.rtol, atol=serving.atol)
        agree &= close.reshape(n, -1).all(dim=1)
    return agree.sum(), None
