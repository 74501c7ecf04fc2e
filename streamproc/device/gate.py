"""What a device worker asks before each launch on a device shared by several lanes: the
:class:`LaunchGate` (made by :class:`streamproc.dispatch.admission.DeviceAdmission`, whose
module holds the rule) and what it decides for one launch, :class:`Admitted`.

Who calls what: the dispatcher thread announces a batch when it submits it; the launching
thread (the device thread, or a fused lane's dispatcher) asks ``admit`` before the model call
and ``finish`` after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from streamproc.records import Priority


@dataclass(frozen=True, slots=True)
class Admitted:
    """What :meth:`LaunchGate.admit` decided for one launch.

    Attributes:
        deferred_s: seconds the launch waited for more urgent batches (0: admitted at once).
        yield_threads: run this call with fewer intra-op threads (a more urgent class is
            active on the device).
    """

    deferred_s: float
    yield_threads: bool


class LaunchGate(Protocol):
    """One device worker's admission onto its shared device."""

    def announce(self, priority: Priority) -> None:
        """A batch whose most urgent record is of class ``priority`` was submitted."""

    def admit(self, priority: Priority) -> Admitted:
        """Before a launch: wait (bounded) while more urgent batches are pending here."""

    def finish(self, priority: Priority) -> None:
        """After the launch's model call returned (also when it raised)."""
