from __future__ import annotations

import random
import threading

import pytest

from streamproc.offsets.tracker import OffsetTracker, PartitionTrack
from streamproc.records import Record, TopicPartition

A = TopicPartition("t", 0)
B = TopicPartition("t", 1)


def test_watermark_waits_for_gaps_with_out_of_order_completion() -> None:
    track = PartitionTrack(1)
    for offset in range(5):
        track.consumed(offset)
    assert track.watermark == 0
    track.done(2)
    track.done(1)
    assert track.watermark == 0  # offset 0 still in flight: never commit past a gap
    track.done(0)
    assert track.watermark == 3
    track.done(4)
    assert track.watermark == 3
    track.done(3)
    assert track.watermark == 5  # last consumed + 1
    assert track.pending == 0


def test_non_contiguous_offsets_are_tracked_as_consumed() -> None:
    track = PartitionTrack(1)
    for offset in (10, 11, 15, 20):  # holes from transaction markers / compaction
        track.consumed(offset)
    track.done(10)
    track.done(11)
    assert track.watermark == 15
    track.done(15)
    track.done(20)
    assert track.watermark == 21


def test_offsets_only_move_forward_within_an_assignment() -> None:
    track = PartitionTrack(1)
    track.consumed(5)
    with pytest.raises(ValueError):
        track.consumed(5)


def test_duplicate_acknowledgement_is_harmless() -> None:
    track = PartitionTrack(1)
    track.consumed(0)
    track.consumed(1)
    track.done(0)
    track.done(0)
    assert track.watermark == 1 and track.pending == 1


def test_late_results_for_revoked_partitions_are_counted_not_committed() -> None:
    tracker = OffsetTracker()
    gen = tracker.assign([A, B])
    tracker.consumed(A, 0)
    tracker.consumed(B, 0)
    tracker.revoke([A])
    assert tracker.done(A, 0, gen[A]) is False
    assert tracker.late_results == 1
    assert A not in tracker.commit_candidates()
    assert tracker.done(B, 0, gen[B]) is True
    assert tracker.commit_candidates() == {B: 1}


def test_reassigned_partition_gets_new_generation_and_ignores_old_results() -> None:
    tracker = OffsetTracker()
    old = tracker.assign([A])[A]
    tracker.consumed(A, 7)
    tracker.revoke([A])
    new = tracker.assign([A])[A]
    assert new != old
    tracker.consumed(A, 7)
    assert tracker.done(A, 7, old) is False
    assert tracker.watermarks([A]) == {A: 7}
    assert tracker.done(A, 7, new) is True
    assert tracker.watermarks([A]) == {A: 8}


def test_commit_candidates_only_report_moves() -> None:
    tracker = OffsetTracker()
    gen = tracker.assign([A])[A]
    tracker.consumed(A, 0)
    tracker.done(A, 0, gen)
    assert tracker.commit_candidates() == {A: 1}
    tracker.mark_committed({A: 1})
    assert tracker.commit_candidates() == {}
    tracker.forget_committed({A: 1})  # commit failed: offered again
    assert tracker.commit_candidates() == {A: 1}


def test_wait_until_returns_when_in_flight_drains() -> None:
    tracker = OffsetTracker()
    gen = tracker.assign([A])[A]
    for offset in range(3):
        tracker.consumed(A, offset)
    assert tracker.wait_until({A: 1}, timeout_s=0.01) is False
    worker = threading.Thread(target=lambda: [tracker.done(A, o, gen) for o in (0, 1)])
    worker.start()
    assert tracker.wait_until({A: 1}, timeout_s=10) is True  # offset 2 was dropped, not waited
    worker.join()
    assert tracker.watermarks([A]) == {A: 2}


def _records(tp: TopicPartition, offsets: range, generation: int) -> list[Record]:
    return [Record(tp, o, None, b"v", (), 0, 0.0, generation) for o in offsets]


def test_many_variants_match_single_calls_and_count_late_generations() -> None:
    tracker = OffsetTracker()
    generations = tracker.assign([A, B])
    a = _records(A, range(4), generations[A])
    b = _records(B, range(3), generations[B])
    tracker.consumed_many([*a, *b])
    assert tracker.done_many([a[1], a[0], b[2]]) == 3
    assert tracker.commit_candidates() == {A: 2, B: 0}
    stale = _records(B, range(2), generations[B] + 100)
    assert tracker.done_many(stale) == 0
    assert tracker.late_results == 2
    assert tracker.commit_candidates() == {A: 2, B: 0}  # stale acks moved nothing
    assert tracker.done_many([*a[2:], *b[:2]]) == 4
    assert tracker.commit_candidates() == {A: 4, B: 3}


@pytest.mark.parametrize("seed", range(60))
def test_done_many_matches_done_one_record_at_a_time(seed: int) -> None:
    """Batches of acknowledged records in runs per partition, interleaved across partitions:
    runs in order and out of order (a later run first: offsets done early), reversed, with a
    record acknowledged twice in place of one acknowledged later, and records of an old
    generation. The watermarks, pending counts, oldest timestamps and late counts of
    ``done_many`` are those of single ``done`` calls, after every batch."""
    rng = random.Random(seed)
    many, single = OffsetTracker(), OffsetTracker()
    generations = many.assign([A, B])
    assert single.assign([A, B]) == generations
    runs: list[list[Record]] = []
    for tp in (A, B):
        records = _stamped(tp, 60, generations[tp], rng)
        for tracker in (many, single):
            tracker.consumed_many(records)
        while records:
            runs.append(records[: rng.randint(1, 12)])
            del records[: len(runs[-1])]
    rng.shuffle(runs)
    runs.sort(key=lambda run: run[0].offset + rng.choice((0, 0, 0, 30)))  # mostly in order
    while runs:
        batch: list[Record] = []
        for _ in range(rng.randint(1, 4)):
            if not runs:
                break
            run = runs.pop(0)
            if len(run) > 2 and rng.random() < 0.3:
                i = rng.randrange(1, len(run) - 1)
                runs.append([run[i]])  # acknowledged later; a duplicate in its place
                run[i] = run[i - 1]
            if rng.random() < 0.3:
                run.reverse()
            if rng.random() < 0.2:
                tp = run[0].tp
                run.append(Record(tp, 999, None, b"v", (), 0, 0.0, generations[tp] - 1))
            batch.extend(run)
        assert many.done_many(batch) == sum(
            single.done(r.tp, r.offset, r.generation) for r in batch
        )
        assert many.commit_candidates() == single.commit_candidates()
        assert many.backlog() == single.backlog()
        assert many.late_results == single.late_results


def _stamped(tp: TopicPartition, count: int, generation: int, rng: random.Random) -> list[Record]:
    """``count`` records of ``tp`` at increasing offsets with gaps, each its own timestamp."""
    offsets = sorted(rng.sample(range(3 * count), count))
    return [Record(tp, o, None, b"v", (), 1000 + o, 0.0, generation) for o in offsets]


def test_consumed_many_rejects_offsets_going_backwards() -> None:
    tracker = OffsetTracker()
    generation = tracker.assign([A])[A]
    tracker.consumed_many(_records(A, range(5, 7), generation))
    with pytest.raises(ValueError):
        tracker.consumed_many(_records(A, range(6, 8), generation))


def test_passed_offsets_move_the_watermark_of_a_drained_partition_only() -> None:
    tracker = OffsetTracker()
    generation = tracker.assign([A])[A]
    tracker.consumed(A, 0, timestamp_ms=1_000)
    tracker.consumed(A, 1, timestamp_ms=2_000)
    tracker.passed({A: (generation, 3)})  # a marker at 2
    assert tracker.watermarks([A]) == {A: 0}  # 0 and 1 are not done
    assert tracker.backlog() == {A: (2, 1_000)}
    tracker.done(A, 0, generation)
    assert tracker.backlog() == {A: (1, 2_000)}
    tracker.done(A, 1, generation)
    assert tracker.watermarks([A]) == {A: 3} and tracker.backlog() == {A: (0, None)}
    tracker.passed({A: (generation + 1, 9)})  # another generation: ignored
    tracker.passed({A: (generation, 2)})  # never backwards
    assert tracker.watermarks([A]) == {A: 3}
    with pytest.raises(ValueError):
        tracker.consumed(A, 2)  # below the position passed


def test_consumed_runs_reject_a_run_out_of_order_and_track_none_of_it() -> None:
    tracker = OffsetTracker()
    generation = tracker.assign([A])[A]
    tracker.consumed_runs({A: _records(A, range(5, 7), generation)})
    with pytest.raises(ValueError, match="offset 6 consumed after 6"):
        tracker.consumed_runs({A: _records(A, range(6, 8), generation)})
    backwards = [*_records(A, range(8, 10), generation), *_records(A, range(9, 10), generation)]
    with pytest.raises(ValueError, match="offset 9 consumed after 9"):
        tracker.consumed_runs({A: backwards})
    assert tracker.backlog()[A][0] == 2  # 5 and 6 only
    tracker.consumed_runs({A: _records(A, range(7, 9), generation)})
    assert tracker.backlog()[A][0] == 4
