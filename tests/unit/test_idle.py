"""``run --exit-when-idle-s``: time with no partition assigned is never idle, nor is the time
before an assigned partition's first fetch (streamproc.idle), over the source and its rebalance
handler on the fake consumer and clock, and the lag monitor's measurement of
partitions with nothing to read; and that this member being idle is not enough: the group's
committed offsets of every input partition must reach their end offsets (issue 39, item 2).
The same on a real broker whose only node stops mid-stream, and with a second member that
stalls: tests/integration/test_idle_exit.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from confluent_kafka import TopicPartition as KafkaTopicPartition

from streamproc.idle import IdleDecision, IdleExit
from streamproc.kafka.lag import GroupOffsets, LagMonitor
from streamproc.metrics import Metrics
from streamproc.records import TopicPartition
from tests.unit.source_harness import TP, Harness

IDLE_S = 2.0
TIMEOUT_S = 30.0
OTHER = TopicPartition("in", 1)


BOTH = (TP, OTHER)  # the input's partitions


def _done(measured_s: float) -> GroupOffsets:
    """The group's committed offsets at the end offsets of both input partitions."""
    return GroupOffsets(measured_s, BOTH, {TP: 5, OTHER: 9}, {TP: 5, OTHER: 9})


def _check(
    h: Harness,
    watch: IdleExit,
    drained: bool = True,
    unfetched: tuple[TopicPartition, ...] = (),
    group: GroupOffsets | bool | None = True,
) -> IdleDecision:
    """``watch.check`` now; ``group`` True: a drained group measured now."""
    state = h.source.assignment
    return watch.check(
        h.clock(),
        state.unassigned,
        h.source.last_input_s,
        state.last_rebalance_s,
        unfetched,
        lambda: drained,
        _done(h.clock()) if group is True else group or None,
    )


def _assigned_and_quiet(messages: int = 0) -> tuple[Harness, IdleExit]:
    h = Harness(messages)
    watch = IdleExit(IDLE_S, TIMEOUT_S, started_s=h.clock())
    h.consumer.schedule_assign([TP])
    h.poll()
    h.clock.advance(IDLE_S)
    return h, watch


def test_assigned_quiet_and_drained_is_idle_and_work_or_a_recent_rebalance_is_not() -> None:
    h, watch = _assigned_and_quiet()
    assert _check(h, watch) is IdleDecision.IDLE
    assert _check(h, watch, drained=False) is IdleDecision.BUSY
    h.consumer.schedule_assign([OTHER])  # a rebalance restarts the quiet window
    h.poll()
    assert _check(h, watch) is IdleDecision.BUSY
    h.clock.advance(IDLE_S)
    assert _check(h, watch) is IdleDecision.IDLE


def test_waiting_for_the_first_assignment_is_not_idle_and_is_bounded() -> None:
    h = Harness(0)
    watch = IdleExit(IDLE_S, TIMEOUT_S, started_s=h.clock())
    h.consumer.schedule_assign([])  # cooperative rebalances also call on_assign with nothing
    h.poll()
    h.clock.advance(TIMEOUT_S - 0.1)
    assert _check(h, watch) is IdleDecision.UNASSIGNED
    h.clock.advance(0.1)
    assert _check(h, watch) is IdleDecision.UNASSIGNED_TOO_LONG
    unassigned = h.source.assignment.unassigned
    assert unassigned is not None and unassigned.cause == "start"
    message = str(watch.error(unassigned, "g", ["in"]))
    assert "no partition assigned within 30 s (kafka.assignment_timeout_s) of start" in message


def test_after_the_partitions_are_lost_the_unassigned_time_is_not_idle_and_is_bounded() -> None:
    # Issue 22, item 4: the only broker stopped, the session timed out ("partitions lost"),
    # and the wait for the rejoin counted as idle: exit 0 with most inputs never processed.
    h, watch = _assigned_and_quiet(messages=3)
    assert h.tracker.pending(TP) == 3  # consumed, not done: busy
    assert _check(h, watch, drained=h.tracker.total_pending() == 0) is IdleDecision.BUSY
    h.consumer.schedule_lost([TP])
    h.poll()
    assert h.tracker.total_pending() == 0  # lost: its records are dropped, uncommitted
    lost_at_s = h.clock()
    for _ in range(int(TIMEOUT_S / IDLE_S) - 1):  # quiet, drained, many idle windows long
        h.clock.advance(IDLE_S)
        assert _check(h, watch) is IdleDecision.UNASSIGNED
    h.clock.now_s = lost_at_s + TIMEOUT_S
    assert _check(h, watch) is IdleDecision.UNASSIGNED_TOO_LONG
    unassigned = h.source.assignment.unassigned
    assert unassigned is not None and unassigned == (lost_at_s, "lost")
    message = str(watch.error(unassigned, "g", ["in"]))
    assert "within 30 s (kafka.assignment_timeout_s) after the group lost its partitions" in message


def test_the_timeout_counts_from_the_loss_and_a_new_assignment_ends_the_stretch() -> None:
    h, watch = _assigned_and_quiet()
    h.clock.advance(TIMEOUT_S)  # a long assigned life before the loss does not count
    h.consumer.schedule_lost([TP])
    h.poll()
    h.clock.advance(TIMEOUT_S / 2)
    assert _check(h, watch) is IdleDecision.UNASSIGNED
    h.consumer.schedule_assign([TP])  # the rejoin
    h.poll()
    assert h.source.assignment.unassigned is None
    assert _check(h, watch) is IdleDecision.BUSY  # the assignment is a rebalance: window restarts
    h.clock.advance(IDLE_S)
    assert _check(h, watch) is IdleDecision.IDLE


def test_revoking_some_partitions_keeps_the_run_assigned_and_revoking_the_last_does_not() -> None:
    h, watch = _assigned_and_quiet()
    h.consumer.schedule_assign([OTHER])
    h.poll()
    h.consumer.schedule_revoke([OTHER])
    h.poll()
    assert h.source.assignment.unassigned is None
    h.clock.advance(IDLE_S)
    assert _check(h, watch) is IdleDecision.IDLE
    h.consumer.schedule_revoke([TP])
    h.poll()
    unassigned = h.source.assignment.unassigned
    assert unassigned is not None and unassigned.cause == "revoked"
    h.clock.advance(IDLE_S * 5)
    assert _check(h, watch) is IdleDecision.UNASSIGNED
    h.clock.advance(TIMEOUT_S)
    assert _check(h, watch) is IdleDecision.UNASSIGNED_TOO_LONG
    assert "after a rebalance revoked the last one" in str(watch.error(unassigned, "g", ["in"]))


def test_a_partition_that_delivered_nothing_holds_the_exit_until_measured_or_the_bound() -> None:
    # A loaded machine took over 2 s from the assignment to the first fetch: with nothing in
    # the rings the run exited 0 before its first record arrived.
    h, watch = _assigned_and_quiet()
    assert _check(h, watch, unfetched=(TP,)) is IdleDecision.UNFETCHED
    assert _check(h, watch, drained=False, unfetched=(TP,)) is IdleDecision.BUSY
    assert _check(h, watch) is IdleDecision.IDLE  # measured empty (or delivered): idle
    h.clock.advance(TIMEOUT_S)  # never measured: it stops holding the exit after the bound
    assert _check(h, watch, unfetched=(TP,)) is IdleDecision.IDLE


def test_an_idle_member_exits_0_only_once_the_group_measured_since_it_went_quiet_is_done() -> None:
    # Issue 39, item 2: a member whose own partitions were drained exited 0 while partitions of
    # the same input owned by a member that died or stalled were never processed.
    h, watch = _assigned_and_quiet()
    quiet_since_s = h.clock() - IDLE_S
    assert _check(h, watch, group=None) is IdleDecision.GROUP_BEHIND  # not measured yet
    before = GroupOffsets(quiet_since_s - 0.1, BOTH, {TP: 5, OTHER: 9}, {TP: 5, OTHER: 9})
    assert _check(h, watch, group=before) is IdleDecision.GROUP_BEHIND  # measured before the quiet
    behind = GroupOffsets(h.clock(), BOTH, {TP: 5, OTHER: 3}, {TP: 5, OTHER: 9})
    assert behind.behind() == {OTHER: 6}
    assert _check(h, watch, group=behind) is IdleDecision.GROUP_BEHIND
    unanswered = GroupOffsets(h.clock(), BOTH, {TP: 5}, {TP: 5, OTHER: 9})
    assert unanswered.behind() == {OTHER: None}  # an offset that did not answer is not done
    silent = GroupOffsets(h.clock(), BOTH, {TP: 5}, {TP: 5})
    assert silent.behind() == {OTHER: None}  # nor is a partition where neither answered
    assert _check(h, watch, group=unanswered) is IdleDecision.GROUP_BEHIND
    assert _check(h, watch, group=_done(quiet_since_s)) is IdleDecision.IDLE
    assert _check(h, watch, drained=False) is IdleDecision.BUSY  # the member's own work first


def test_a_group_behind_with_no_committed_offset_moving_is_bounded_and_named() -> None:
    h, watch = _assigned_and_quiet()
    stuck = {TP: 5, OTHER: 3}
    for step in range(int(TIMEOUT_S / IDLE_S)):  # measured again and again, nothing moves
        verdict = _check(h, watch, group=GroupOffsets(h.clock(), BOTH, stuck, {TP: 5, OTHER: 9}))
        assert verdict is IdleDecision.GROUP_BEHIND, step
        h.clock.advance(IDLE_S)
    verdict = _check(h, watch, group=GroupOffsets(h.clock(), BOTH, stuck, {TP: 5, OTHER: 9}))
    assert verdict is IdleDecision.GROUP_BEHIND_TOO_LONG
    message = str(watch.group_error("g"))
    assert "no committed offset moved within 30 s (kafka.assignment_timeout_s)" in message
    assert "partitions behind their end offset: in[1] lag 6 (committed 3, end 9)" in message
    assert "in[0]" not in message  # at its end


def test_a_peer_still_committing_is_progress_and_new_work_restarts_the_wait() -> None:
    h, watch = _assigned_and_quiet()
    ends = {TP: 5, OTHER: 90}
    for committed in range(10, 90, 10):  # a slower member moves its committed offset
        group = GroupOffsets(h.clock(), BOTH, {TP: 5, OTHER: committed}, ends)
        assert _check(h, watch, group=group) is IdleDecision.GROUP_BEHIND
        h.clock.advance(TIMEOUT_S - 1)  # longer in all than the bound, never without progress
    stuck = GroupOffsets(h.clock(), BOTH, {TP: 5, OTHER: 80}, ends)
    assert _check(h, watch, group=stuck) is IdleDecision.GROUP_BEHIND
    h.consumer.schedule_assign([OTHER])  # the peer's partition comes to this member: busy
    h.poll()
    assert _check(h, watch, group=stuck) is IdleDecision.BUSY
    h.clock.advance(IDLE_S)
    assert _check(h, watch, group=GroupOffsets(h.clock(), BOTH, {TP: 5, OTHER: 80}, ends)) is (
        IdleDecision.GROUP_BEHIND  # quiet again, still behind: the bound counts from here
    )
    h.clock.advance(TIMEOUT_S - 0.1)
    assert _check(h, watch, group=stuck) is IdleDecision.GROUP_BEHIND
    h.clock.advance(0.1)
    assert _check(h, watch, group=stuck) is IdleDecision.GROUP_BEHIND_TOO_LONG
    assert _check(h, watch, group=_done(h.clock())) is IdleDecision.IDLE  # done after all


def test_a_group_never_measured_is_bounded_too() -> None:
    h, watch = _assigned_and_quiet()
    assert _check(h, watch, group=None) is IdleDecision.GROUP_BEHIND
    h.clock.advance(TIMEOUT_S)
    assert _check(h, watch, group=None) is IdleDecision.GROUP_BEHIND_TOO_LONG
    assert "its committed offsets could not be read" in str(watch.group_error("g"))


class _Probe:
    """The lag monitor's probe consumer over fixed offsets: watermarks (earliest 0) and the
    group's committed offsets (-1001, librdkafka's "none", where the group has none); its
    metadata lists the partitions of ``ends``."""

    def __init__(self, ends: dict[TopicPartition, int], committed: dict[TopicPartition, int]):
        self.ends, self.committed_offsets = ends, committed

    def list_topics(self, topic: str, **_: Any) -> Any:
        partitions = {tp.partition: None for tp in self.ends if tp.topic == topic}
        found = SimpleNamespace(partitions=partitions, error=None)
        return SimpleNamespace(topics={topic: found})

    def get_watermark_offsets(self, ktp: KafkaTopicPartition, **_: Any) -> tuple[int, int]:
        end = self.ends[TopicPartition(ktp.topic, ktp.partition)]
        return min(end, 2), end

    def committed(self, asked: list[KafkaTopicPartition], **_: Any) -> list[KafkaTopicPartition]:
        return [
            KafkaTopicPartition(
                k.topic,
                k.partition,
                self.committed_offsets.get(TopicPartition(k.topic, k.partition), -1001),
            )
            for k in asked
        ]

    def close(self) -> None:
        pass


def test_the_lag_monitor_says_which_partitions_not_consumed_from_have_nothing_to_read() -> None:
    third = TopicPartition("in", 2)
    positions: dict[TopicPartition, int | None] = {TP: None, OTHER: None, third: 7}
    probe = _Probe({TP: 5, OTHER: 9, third: 9}, {TP: 5, OTHER: 3})
    now = [50.0]
    monitor = LagMonitor(
        {"bootstrap.servers": "fake:9092"},
        "g",
        positions.copy,
        Metrics(),
        clock=lambda: now[0],
        probe_factory=lambda _: probe,
    )
    assert monitor.refresh() == {TP: 0, OTHER: 6, third: 2}
    assert monitor.empty_at == {TP: 50.0}  # OTHER has 6 to read; third delivered already
    positions[TP] = 5
    now[0] = 60.0
    monitor.refresh()
    assert monitor.empty_at == {}  # only partitions that delivered nothing are listed


def test_the_lag_monitor_measures_the_groups_offsets_of_every_input_partition() -> None:
    # Partitions this member does not own count too; no committed offset: where the group
    # would start (auto.offset.reset), the earliest offset (2 here) or the end offset.
    third = TopicPartition("in", 2)
    positions: dict[TopicPartition, int | None] = {TP: 5}  # this member owns in[0] only
    probe = _Probe({TP: 5, OTHER: 9, third: 7}, {TP: 5, OTHER: 3})
    monitor = LagMonitor(
        {"bootstrap.servers": "fake:9092"},
        "g",
        positions.copy,
        Metrics(),
        clock=lambda: 50.0,
        probe_factory=lambda _: probe,
    )
    monitor.refresh()
    assert monitor.group is None  # not watched: no group requests
    monitor.watch_group(["in", "in"])
    monitor.refresh()
    assert monitor.group == GroupOffsets(
        50.0, (TP, OTHER, third), {TP: 5, OTHER: 3, third: 2}, {TP: 5, OTHER: 9, third: 7}
    )
    assert monitor.group.behind() == {OTHER: 6, third: 5}
    monitor.watch_group(["in"], reset="latest")
    monitor.refresh()
    assert monitor.group is not None and monitor.group.behind() == {OTHER: 6}
