"""The values crossing the device stage's boundary: a decoded batch in (:class:`DeviceJob`), its
host outputs out (:class:`DeviceResult`, with the :data:`Release` that gives their buffers back).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from streamproc.device.binding import ModelBinding, ShadowOutcome
from streamproc.device.staging import Slab
from streamproc.errors import ModelError, RecordError
from streamproc.records import Batch


@dataclass
class DeviceJob:
    """A decoded batch: rows ``0..len(batch)-1`` of ``slab`` hold the inputs.

    ``failed`` maps row index -> error for rows whose decode failed (their slab row holds
    whatever the slab held before; the model runs over it and those outputs are never encoded).
    ``binding`` is the model version the batch runs on (bound by the dispatcher at the cut;
    None: the worker's own model).
    """

    batch: Batch
    slab: Slab
    failed: dict[int, RecordError] = field(default_factory=dict)
    binding: ModelBinding | None = None


@dataclass
class DeviceResult:
    """Host outputs of one batch, handed to ``on_complete`` in submission order.

    ``outputs`` are numpy views (n, ...) of the worker's output buffer set, valid until the
    ``release`` handed over with them is called; ``failed`` maps row -> error for rows whose
    decode failed or that the model failed on alone (a :class:`ModelError`, stage ``model``);
    ``error`` is set when no row of the batch ran (then ``outputs`` is empty). ``model_calls``
    is the model calls the batch took (1 unless a call raised and it was re-run in parts; its
    ``inference_s`` then covers them all). ``inference_s`` is the batch's device time in
    seconds: copy in, model, copy out (between the backend's ``start`` and ``done`` events:
    timing events on its stream on CUDA, the synchronous call on CPU), not the time it then
    waited to be completed (that would bias the adaptive batch size towards large batches),
    nor a shadow candidate's call on it.
    """

    batch: Batch
    outputs: tuple[np.ndarray, ...]
    failed: dict[int, RecordError]
    error: ModelError | None
    inference_s: float
    model_calls: int = 1
    version: str = ""
    """The model version that made the outputs (the ``streamproc.model.version`` header)."""
    bound_version: str = ""
    """The version the batch was bound to at the cut (``version`` differs where it raised and
    its predecessor made the outputs)."""
    raised: bool = False
    """The bound version raised on the batch and its fallback (the predecessor in
    probation) made the outputs instead."""
    shadow: ShadowOutcome | None = None
    """The candidate's comparison on this batch (shadow scoring), None when not sampled."""


Release = Callable[[], None]
"""Gives a completed batch's output buffer set back to its worker (call once)."""
