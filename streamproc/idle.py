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
* This member being idle is not enough: the *group's* work must be done. Exit 0 needs a
  measurement of the group (:class:`~streamproc.kafka.lag.GroupOffsets`, begun after the
  quiet window began) in which every partition of every input topic has the group's committed
  offset at its end offset, whichever member owns it. A batch job run as N members otherwise
  ended "successfully" while partitions of a member that died (held until the coordinator
  expires it after its ``session.timeout.ms``) or stalled (held until its
  ``max.poll.interval.ms``) were never processed. While the group is behind the run keeps
  running (new input or a rebalance that hands it those partitions makes it work again); once
  ``kafka.assignment_timeout_s`` passes with no committed offset of the group moving, it stops
  with exit 1 naming the partitions and their lag. A peer still committing is progress and
  restarts that stretch: members of one batch finish at different times. A drained input
  written in transactions reads as done: the commit passes the marker after the last record.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Mapping

from streamproc.errors import FatalPipelineError
from streamproc.intake.rebalance import Unassigned
from streamproc.kafka.lag import GroupOffsets
from streamproc.records import TopicPartition

_CAUSES = {
    "start": "of start",
    "revoked": "after a rebalance revoked the last one",
    "lost": (
        "after the group lost its partitions (its session timed out: the group coordinator "
        "was unreachable, or the poll loop stalled)"
    ),
}


class IdleDecision(enum.Enum):
    """What :meth:`IdleExit.check` decided."""

    BUSY = "busy"
    """Partitions are assigned and there was input, a rebalance or work within the window."""
    UNFETCHED = "unfetched"
    """Quiet and drained, but a partition has delivered nothing and has not been measured
    empty since the last rebalance: ask the lag monitor to measure, keep running."""
    UNASSIGNED = "unassigned"
    """No partition is assigned, within ``assignment_timeout_s``: not idle, keep running."""
    GROUP_BEHIND = "group behind"
    """This member is idle, but the group's committed offset of some input partition is short
    of its end offset, or the group was not measured since the quiet window began: ask the
    lag monitor to measure, keep running."""
    IDLE = "idle"
    """The run may stop with exit code 0."""
    UNASSIGNED_TOO_LONG = "unassigned too long"
    """No partition assigned for ``assignment_timeout_s``: stop with exit code 1
    (:meth:`IdleExit.error` says why)."""
    GROUP_BEHIND_TOO_LONG = "group behind too long"
    """The group stayed behind (or unmeasured) for ``assignment_timeout_s`` with no committed
    offset moving: stop with exit code 1 (:meth:`IdleExit.group_error` says where)."""


class IdleExit:
    """The ``--exit-when-idle-s`` decision, evaluated by the run loop with its own clock.

    Args:
        idle_s: S, the quiet window in seconds (> 0 makes sense; 0 exits at the first quiet
            check).
        assignment_timeout_s: the longest stretch with no partition assigned, in seconds
            (``kafka.assignment_timeout_s``).
        started_s: monotonic seconds when the run started (a stretch that began before it, as
            the wait for the first assignment does, is counted from here).
        whole_group: wait for the group's committed offsets to reach the end of every input
            partition (a consumer group); False: this member's idleness is enough (a share
            group: any member may take any record, so a member that found none to acquire for
            ``idle_s`` leaves the rest to the others, and a share group's progress is not
            readable through the Python admin client).
    """

    def __init__(
        self,
        idle_s: float,
        assignment_timeout_s: float,
        started_s: float,
        whole_group: bool = True,
    ) -> None:
        self.idle_s = idle_s
        self.assignment_timeout_s = assignment_timeout_s
        self.started_s = started_s
        self.whole_group = whole_group
        self._waiting_since_s: float | None = None  # group behind, no progress since
        self._seen: GroupOffsets | None = None  # the newest group measurement seen

    def check(
        self,
        now_s: float,
        unassigned: Unassigned | None,
        last_input_s: float,
        last_rebalance_s: float,
        unfetched: Collection[TopicPartition],
        drained: Callable[[], bool],
        group: GroupOffsets | None,
    ) -> IdleDecision:
        """Decide at ``now_s`` (monotonic seconds).

        Args:
            unassigned: :attr:`~streamproc.intake.rebalance.Assignment.unassigned` (one read).
            last_input_s: monotonic seconds of the last record taken in.
            last_rebalance_s: monotonic seconds of the last assign/revoke/lost/rewind.
            unfetched: assigned partitions that delivered no record and were not measured
                empty since ``last_rebalance_s``.
            drained: nothing waits in rings, nothing in flight, nothing awaits an
                acknowledgement (called only when the quiet window has passed).
            group: the lag monitor's latest :attr:`~streamproc.kafka.lag.LagMonitor.group`
                (one read; None before its first measurement).
        """
        quiet_since_s = max(last_input_s, last_rebalance_s)
        member = IdleDecision.IDLE  # this member alone: its own partitions are done
        if unassigned is not None:
            waited_s = now_s - max(unassigned.since_s, self.started_s)
            too_long = waited_s >= self.assignment_timeout_s
            member = IdleDecision.UNASSIGNED_TOO_LONG if too_long else IdleDecision.UNASSIGNED
        elif now_s - quiet_since_s < self.idle_s or not drained():
            member = IdleDecision.BUSY
        elif unfetched and now_s - last_rebalance_s < self.assignment_timeout_s:
            member = IdleDecision.UNFETCHED
        if member is not IdleDecision.IDLE or not self.whole_group:
            self._waiting_since_s = None  # working or unassigned: a later wait starts afresh
            return member
        progressed = group is not None and self._progressed(group)
        if group is not None and group.measured_s >= quiet_since_s and not group.behind():
            return IdleDecision.IDLE
        if self._waiting_since_s is None or progressed:
            self._waiting_since_s = now_s
        if now_s - self._waiting_since_s >= self.assignment_timeout_s:
            return IdleDecision.GROUP_BEHIND_TOO_LONG
        return IdleDecision.GROUP_BEHIND

    def _progressed(self, group: GroupOffsets) -> bool:
        """Whether ``group`` is a newer measurement than the last one seen in which some
        committed offset moved forward (remembers it)."""
        seen = self._seen
        if seen is not None and group.measured_s <= seen.measured_s:
            return False
        self._seen = group
        return seen is not None and any(
            offset > seen.committed.get(tp, offset) for tp, offset in group.committed.items()
        )

    def group_error(self, group_id: str) -> FatalPipelineError:
        """The exit-1 reason for :attr:`IdleDecision.GROUP_BEHIND_TOO_LONG`: the timeout, the group
        and each partition behind with its lag (end - committed offset), from the newest
        measurement seen."""
        seen = self._seen
        if seen is None:
            where = "its committed offsets could not be read"
        else:
            behind = seen.behind()
            parts = [
                f"{tp.topic}[{tp.partition}] lag {lag} (committed {seen.committed[tp]}, "
                f"end {seen.ends[tp]})"
                if lag is not None
                else f"{tp.topic}[{tp.partition}] lag unknown (its offsets did not answer)"
                for tp, lag in behind.items()
            ]
            where = f"partitions behind their end offset: {', '.join(parts)}"
            if not parts:
                where = "it was not measured since this member went quiet"
        return FatalPipelineError(
            f"the work of group {group_id!r} is not done and no committed offset moved within "
            f"{self.assignment_timeout_s:g} s (kafka.assignment_timeout_s): {where}. Another "
            "member may hold those partitions without processing them (stalled, or died and "
            "not yet expired after its session.timeout.ms), or the brokers may be unreachable; "
            "the next run processes what is left"
        )

    def error(self, unassigned: Unassigned, group_id: str, topics: list[str]) -> FatalPipelineError:
        """The exit-1 reason for :attr:`IdleDecision.UNASSIGNED_TOO_LONG`, naming the timeout, the
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
