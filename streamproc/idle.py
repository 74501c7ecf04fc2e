"""When ``run --exit-when-idle-s S`` may stop: a pure policy over what the source and the lag
monitor publish.

Idle means S seconds with no new input, no rebalance and nothing in flight, *while partitions
are assigned and each has been fetched*.

* Time with none assigned is never idle, whatever caused it: before the first assignment (a
  group that still holds a member killed with -9 assigns nothing until the coordinator expires
  it), after the group session ended ("partitions lost": the coordinator was unreachable for
  ``session.timeout.ms``, then the rejoin waits for the coordinator to expire the old member),
  or after a rebalance revoked the last partition. Such time is bounded by
  ``kafka.assignment_timeout_s``: past it the run stops with exit 1 and says why, never exit 0
  having left input behind.
* A partition that has delivered no record since it was assigned counts only once the lag
  monitor has measured it empty (its start offset equals its end offset) after that
  assignment: the first fetch after an assignment (committed offsets, then the fetch) can take
  seconds, and a run with nothing in its rings must not exit 0 before its first record
  arrives. This wait is bounded by ``kafka.assignment_timeout_s`` too, after which such a
  partition no longer holds the exit back (an input topic written in transactions ends in a
  commit marker, so its start offset never equals its end).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Mapping

from streamproc.errors import FatalPipelineError
from streamproc.intake.rebalance import Unassigned
from streamproc.records import TopicPartition

_CAUSES = {
    "start": "of start",
    "revoked": "after a rebalance revoked the last one",
    "lost": (
        "after the group lost its partitions (its session timed out: the group coordinator "
        "was unreachable, or the poll loop stalled)"
    ),
}


class Verdict(enum.Enum):
    """What :meth:`IdleExit.check` decided."""

    BUSY = "busy"
    """Partitions are assigned and there was input, a rebalance or work within the window."""
    UNFETCHED = "unfetched"
    """Quiet and drained, but a partition has delivered nothing and has not been measured
    empty since the last rebalance: ask the lag monitor to measure, keep running."""
    UNASSIGNED = "unassigned"
    """No partition is assigned, within ``assignment_timeout_s``: not idle, keep running."""
    IDLE = "idle"
    """The run may stop with exit code 0."""
    UNASSIGNED_TOO_LONG = "unassigned too long"
    """No partition assigned for ``assignment_timeout_s``: stop with exit code 1
    (:meth:`IdleExit.error` says why)."""


class IdleExit:
    """The ``--exit-when-idle-s`` decision, evaluated by the run loop with its own clock.

    Args:
        idle_s: S, the quiet window in seconds (> 0 makes sense; 0 exits at the first quiet
            check).
        assignment_timeout_s: the longest stretch with no partition assigned, in seconds
            (``kafka.assignment_timeout_s``).
        started_s: monotonic seconds when the run started (a stretch that began before it, as
            the wait for the first assignment does, is counted from here).
    """

    def __init__(self, idle_s: float, assignment_timeout_s: float, started_s: float) -> None:
        self.idle_s = idle_s
        self.assignment_timeout_s = assignment_timeout_s
        self.started_s = started_s

    def check(
        self,
        now_s: float,
        unassigned: Unassigned | None,
        last_input_s: float,
        last_rebalance_s: float,
        unfetched: Collection[TopicPartition],
        drained: Callable[[], bool],
    ) -> Verdict:
        """Decide at ``now_s`` (monotonic seconds).

        Args:
            unassigned: :attr:`~streamproc.intake.rebalance.Assignment.unassigned` (one read).
            last_input_s: monotonic seconds of the last record taken in.
            last_rebalance_s: monotonic seconds of the last assign/revoke/lost/rewind.
            unfetched: assigned partitions that delivered no record and were not measured
                empty since ``last_rebalance_s``.
            drained: nothing waits in rings, nothing in flight, nothing awaits an
                acknowledgement (called only when the quiet window has passed).
        """
        if unassigned is not None:
            waited_s = now_s - max(unassigned.since_s, self.started_s)
            if waited_s >= self.assignment_timeout_s:
                return Verdict.UNASSIGNED_TOO_LONG
            return Verdict.UNASSIGNED
        if now_s - max(last_input_s, last_rebalance_s) < self.idle_s or not drained():
            return Verdict.BUSY
        if unfetched and now_s - last_rebalance_s < self.assignment_timeout_s:
            return Verdict.UNFETCHED
        return Verdict.IDLE

    def error(self, unassigned: Unassigned, group_id: str, topics: list[str]) -> FatalPipelineError:
        """The exit-1 reason for :attr:`Verdict.UNASSIGNED_TOO_LONG`, naming the timeout, the
        group, the topics and what left the consumer without partitions."""
        return FatalPipelineError(
            f"no partition assigned within {self.assignment_timeout_s:g} s "
            f"(kafka.assignment_timeout_s) {_CAUSES[unassigned.cause]}, to group "
            f"{group_id!r} for topics {topics}: the group may still hold a member that died "
            "(it is expired after its session.timeout.ms), the brokers may be unreachable, or "
            "the group has more members than partitions"
        )


def not_yet_fetched(
    positions: Mapping[TopicPartition, int | None],
    empty_at: Mapping[TopicPartition, float],
    last_rebalance_s: float,
) -> list[TopicPartition]:
    """The ``unfetched`` argument of :meth:`IdleExit.check`: assigned partitions that delivered
    no record (position None) and that the lag monitor has not measured empty since
    ``last_rebalance_s`` (``empty_at``: monotonic seconds of each partition's last such
    measurement)."""
    return [
        tp
        for tp, position in positions.items()
        if position is None and empty_at.get(tp, -1.0) < last_rebalance_s
    ]
