"""A batch held while the model is judged broken (``worker.on_model_failure: hold``).

A model that fails on every row is a fault of the system, not of the records: none of them is
dead-lettered. The device worker keeps the batch (its slab and output buffer set stay taken)
and tries it again with backoff, :data:`FIRST_DELAY_S` doubling up to :data:`MAX_DELAY_S`.
Before each try the batch is rebound to the version serving now (``rebind``: a rollback to the
last version that served well, reloaded from the model source, or a new version takes effect
on it at once). Meanwhile nothing behind it completes: the lane's in-flight bound stops the
dispatcher, the rings fill and flow control pauses the lane's partitions; no offset is
committed past the last result produced. The hold ends by itself on the first try that runs.

Who calls what: the launching thread of the held batch (the device thread, or the dispatcher
of a fused lane) calls every method; :attr:`ModelHold.held` is read by any thread (``/readyz``;
one reference, replaced whole).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from streamproc.device.jobs import DeviceJob
from streamproc.logs import get_logger

log = get_logger(__name__)

FIRST_DELAY_S = 0.1
"""Seconds before the first try again of a held batch (doubling on each failed try)."""

MAX_DELAY_S = 5.0
"""The longest wait between two tries of a held batch (seconds)."""


class HoldAbandoned(Exception):
    """The worker closes while a batch is held: the batch is neither produced nor
    dead-lettered (its offsets stay uncommitted), its buffers are back."""


def version_of(job: DeviceJob) -> str | None:
    """The version ``job`` is bound to (None: the worker's own model, ``builtin``)."""
    return None if job.binding is None else job.binding.version


class ModelHold:
    """One device worker's held batch, if any (see the module docstring).

    Args:
        label: the device's name (logs).
        on_held: called with the batch's version (None: the worker's own model) and the
            model's error when a hold begins (metrics, and the rollback request).
        on_resumed: called with the version that ran the batch and the seconds it was held.
        rebind: binds a held batch to the version serving now, before each try (None: an
            unversioned pipeline, the same model is tried again).
        first_delay_s, max_delay_s: the backoff between tries (seconds, > 0).

    Raises:
        ValueError: a delay is not positive, or the first exceeds the longest.
    """

    def __init__(
        self,
        label: str,
        on_held: Callable[[str | None, str], None] | None = None,
        on_resumed: Callable[[str | None, float], None] | None = None,
        rebind: Callable[[DeviceJob], None] | None = None,
        first_delay_s: float = FIRST_DELAY_S,
        max_delay_s: float = MAX_DELAY_S,
    ) -> None:
        if not 0 < first_delay_s <= max_delay_s:
            raise ValueError(f"0 < first_delay_s ({first_delay_s}) <= max_delay_s ({max_delay_s})")
        self.label = label
        self._on_held = on_held
        self._on_resumed = on_resumed
        self._rebind = rebind
        self._first_delay_s = first_delay_s
        self._max_delay_s = max_delay_s
        self._delay_s = first_delay_s
        self._since_s = 0.0
        self._tries = 0
        self.held: str | None = None
        """Why the worker holds a batch now (None: it does not)."""

    def failed(self, job: DeviceJob, error: str) -> float:
        """A try of ``job`` found the model broken (``error``: what it raised); returns the
        seconds to wait before the next try. The first failed try begins the hold (an error
        log, ``on_held``)."""
        version = version_of(job)
        self._tries += 1
        if self.held is None:
            self._since_s = time.monotonic()
            self._delay_s = self._first_delay_s
            self.held = f"model version {version or 'builtin'} fails on every row: {error}"
            log.error(
                "model judged broken: batch held, nothing dead-lettered; trying again with "
                "backoff (worker.on_model_failure: hold)",
                device=self.label,
                version=version or "builtin",
                batch=job.batch.batch_id,
                error=error,
            )
            if self._on_held is not None:
                self._on_held(version, error)
            return self._delay_s
        self._delay_s = min(self._max_delay_s, self._delay_s * 2)
        return self._delay_s

    def retry(self, job: DeviceJob) -> None:
        """Before the next try: bind ``job`` to the version serving now."""
        if self._rebind is not None:
            self._rebind(job)

    def ran(self, job: DeviceJob) -> None:
        """A try of ``job`` ran (some row succeeded): the hold, if any, ends."""
        if self.held is None:
            return
        held_s = time.monotonic() - self._since_s
        version = version_of(job)
        log.warning(
            "model works again: held batch ran, the lane resumes",
            device=self.label,
            version=version or "builtin",
            batch=job.batch.batch_id,
            held_s=round(held_s, 3),
            tries=self._tries,
        )
        self.held, self._tries = None, 0
        if self._on_resumed is not None:
            self._on_resumed(version, held_s)
